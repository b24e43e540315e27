"""Single-process tests of the trainer: schedule, AdamW (+ fp32 master weights for bf16 params),
data sources, the toy model's stage split, launcher diagnosis, CLI validation, and world-1 runs
(loss.json schema, bitwise repeat, bitwise resume)."""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleformers_glm.parallel.pipeline import StageSpec, split_stages
from paddleformers_glm.parallel.topology import get_topology
from paddleformers_glm.train.adapter import LossSpec, token_count
from paddleformers_glm.train.command import main as train_main
from paddleformers_glm.train.data import micro_batches, open_data
from paddleformers_glm.train.launch import listen_port_range, worker_env
from paddleformers_glm.train.loop import TrainConfig, run_training
from paddleformers_glm.train.optim import AdamW, lr_at, make_lr_scheduler
from paddleformers_glm.train.toy_adapter import ToyAdapter, ToyConfig


# ------------------------------------------------------------------ schedule and optimizer
def test_lr_warmup_then_cosine_to_min():
    lrs = [lr_at(s, 1.0, 0.1, 2, 10) for s in range(1, 11)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] == pytest.approx(0.1)
    assert lr_at(6, 1.0, 0.1, 2, 10) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, 1.0, 0.1, 0, 10)


def _np_adamw(w, grads, lr, wd, b1=0.9, b2=0.95, eps=1e-8):
    m = v = np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        w = w * (1 - lr * wd)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - (lr / (1 - b1**t)) * (m / (np.sqrt(v) / math.sqrt(1 - b2**t) + eps))
    return w


def test_adamw_matches_reference_decays_matrices_only_and_skips_params_without_grad():
    lin = nn.Linear(3, 2)
    w0, b0 = lin.weight.numpy().copy(), lin.bias.numpy().copy()
    opt = AdamW(list(lin.named_parameters()), weight_decay=0.1)
    rng = np.random.default_rng(0)
    gw = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(3)]
    for g in gw:
        opt.step({"weight": paddle.to_tensor(g), "bias": paddle.zeros([2])}, {"weight": True, "bias": False}, lr=0.01)
    assert np.abs(lin.weight.numpy() - _np_adamw(w0.astype(np.float64), gw, 0.01, 0.1)).max() < 1e-6
    assert np.array_equal(lin.bias.numpy(), b0) and "bias" not in opt.state  # no gradient: untouched, like torch
    b = nn.Linear(3, 2).bias
    assert not AdamW([("bias", b)], weight_decay=0.1).decay["bias"]


def test_adamw_state_roundtrip_continues_identically():
    def make():
        paddle.seed(3)
        lin = nn.Linear(4, 4)
        return lin, AdamW(list(lin.named_parameters()), weight_decay=0.05)

    g = {n: paddle.full(p.shape, 0.3) for n, p in nn.Linear(4, 4).named_parameters()}
    has = dict.fromkeys(g, True)
    a, oa = make()
    for _ in range(3):
        oa.step(g, has, 1e-2)
    b, ob = make()
    ob.step(g, has, 1e-2)
    sd = {
        n: {k: (v.clone() if isinstance(v, paddle.Tensor) else v) for k, v in st.items()}
        for n, st in ob.state_dict().items()
    }
    c, oc = make()
    c.set_state_dict(b.state_dict())
    oc.set_state_dict(sd)
    for _ in range(2):
        oc.step(g, has, 1e-2)
    assert all(np.array_equal(p.numpy(), q.numpy()) for p, q in zip(a.parameters(), c.parameters()))


def test_bf16_params_get_fp32_master_weights():
    lin = nn.Linear(4, 4)
    lin.to(dtype="bfloat16")  # bf16 storage works on CPU; only bf16 arithmetic lacks kernels
    opt = AdamW(list(lin.named_parameters()), weight_decay=0.0)
    opt.prepare_state()
    assert set(opt.master) == {"weight", "bias"} and opt.master["weight"].dtype == paddle.float32
    assert np.array_equal(opt.master["weight"].numpy(), lin.weight.astype("float32").numpy())
    fp32 = nn.Linear(2, 2)
    o32 = AdamW(list(fp32.named_parameters()))
    o32.prepare_state()
    assert o32.master == {}  # an fp32 parameter is its own master


def test_bf16_params_update_through_fp32_master_weights():
    # on a CPU build the bf16 adamw comes from ops/cpu_bf16 (installed by a bf16 model); on a GPU
    # build Paddle's own kernel runs
    from paddleformers_glm.ops import cpu_bf16

    cpu_bf16.install()
    lin = nn.Linear(4, 4)
    lin.to(dtype="bfloat16")
    opt = AdamW(list(lin.named_parameters()), weight_decay=0.0)
    opt.prepare_state()
    before = opt.master["weight"].numpy().copy()
    g = {n: paddle.full(p.shape, 1e-3, dtype="float32") for n, p in lin.named_parameters()}
    for _ in range(5):
        opt.step(g, dict.fromkeys(g, True), lr=1e-4)  # each step is far below bf16 resolution of the weight
    master = opt.master["weight"].numpy()
    assert np.abs(master - (before - 5e-4)).max() < 1e-6  # fp32 master keeps every small step
    assert np.array_equal(
        lin.weight.astype("float32").numpy(), paddle.to_tensor(master).astype("bfloat16").astype("float32").numpy()
    )
    assert "master" in opt.state_dict()["weight"]


def test_bf16_params_update_from_the_unrounded_fp32_gradients():
    """A bf16 parameter's update runs on its fp32 master from the fp32 gradient as given (train/optim.py:
    rounding it to bf16 first moves each element by up to 2^-8 of the gradient).  Five steps with random
    per-step fp32 gradients: the masters equal AdamW in float64 (numpy, decoupled decay on the matrix
    only) on the same gradients, within fp32 rounding (measured 5.6e-8).  The constant gradient of the
    test above cannot see the rounding (Adam's m / sqrt(v) is 1 whatever it is); gradients cast to
    bf16 before the update would leave the master 7.7e-5 off after 5 steps at lr 1e-2."""
    from paddleformers_glm.ops import cpu_bf16

    cpu_bf16.install()
    paddle.seed(0)
    lin = nn.Linear(16, 16)
    lin.to(dtype="bfloat16")
    lr, wd = 1e-2, 0.1
    opt = AdamW(list(lin.named_parameters()), weight_decay=wd)
    opt.prepare_state()
    start = {n: opt.master[n].numpy().astype(np.float64) for n in ("weight", "bias")}
    rng = np.random.default_rng(0)
    grads = {n: [(rng.standard_normal(p.shape) * 1e-3).astype(np.float32) for _ in range(5)] for n, p in start.items()}
    for t in range(5):
        g = {n: paddle.to_tensor(grads[n][t]) for n in grads}
        opt.step(g, dict.fromkeys(g, True), lr=lr)
    for n, decay in (("weight", wd), ("bias", 0.0)):
        want = _np_adamw(start[n], [g.astype(np.float64) for g in grads[n]], lr, decay)
        err = np.abs(opt.master[n].numpy() - want).max()
        assert err <= 1e-6, (n, err)
        assert np.abs(want - start[n]).max() > 1e-2  # five steps of about lr each
    assert np.array_equal(
        lin.weight.astype("float32").numpy(),
        paddle.to_tensor(opt.master["weight"].numpy()).astype("bfloat16").astype("float32").numpy(),
    )


def test_optimizer_and_schedule_come_from_paddle():
    lin = nn.Linear(3, 3)
    opt = AdamW(list(lin.named_parameters()), weight_decay=0.1)
    assert isinstance(opt.opt, paddle.optimizer.AdamW) and opt.opt._multi_precision
    sched = make_lr_scheduler(1.0, 0.1, 2, 10)
    assert isinstance(sched, paddle.optimizer.lr.LinearWarmup)
    g = {"weight": paddle.ones([3, 3]), "bias": paddle.ones([3])}
    opt.step(g, {"weight": True, "bias": True}, lr=0.01)
    # moments (2 x 3x3 + 2 x 3) and the beta powers (4 scalars), all fp32
    assert opt.state_bytes() == 4 * (2 * 9 + 2 * 3 + 4)


# ------------------------------------------------------------------ data
def test_synthetic_data_is_deterministic_and_layout_independent():
    d = open_data(None, 16, 64, seed=5)
    a, b = d.global_batch(3, 8), open_data(None, 16, 64, seed=5).global_batch(3, 8)
    assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], a["input_ids"])
    assert not np.array_equal(a["input_ids"], d.global_batch(4, 8)["input_ids"])
    for dp, mbs in ((1, 8), (2, 1), (4, 2)):
        rows = [mb["input_ids"] for r in range(dp) for mb in micro_batches(a, r, dp, mbs)]
        assert np.array_equal(np.concatenate(rows), a["input_ids"])
    with pytest.raises(ValueError, match="not divisible by dp 3"):
        micro_batches(a, 0, 3, 1)


def test_token_files_npy_bin_jsonl(tmp_path):
    toks = np.arange(100, dtype=np.int64) % 50
    np.save(tmp_path / "t.npy", toks)
    toks.astype("<u2").tofile(tmp_path / "t.bin")
    d_npy, d_bin = open_data(str(tmp_path / "t.npy"), 10, 50, 0), open_data(str(tmp_path / "t.bin"), 10, 50, 0)
    assert d_npy.num_samples == 10 and "uint16" in d_bin.describe
    assert np.array_equal(d_npy.global_batch(0, 4)["input_ids"], d_bin.global_batch(0, 4)["input_ids"])
    epoch = np.concatenate([d_npy.global_batch(s, 5)["input_ids"] for s in range(2)])
    assert sorted(epoch[:, 0].tolist()) == sorted((np.arange(10) * 10 % 50).tolist())  # one epoch = every sample once
    with open(tmp_path / "d.jsonl", "w") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n\n" + json.dumps({"input_ids": list(range(1, 20))}) + "\n")
    dj = open_data(str(tmp_path / "d.jsonl"), 8, 50, 0, pad_id=0)
    rows = {int(r["attention_mask"].sum()): r for r in (dj.sample(0), dj.sample(1))}
    assert rows[3]["labels"].tolist() == [1, 2, 3] + [-100] * 5 and rows[3]["input_ids"][3:].tolist() == [0] * 5
    assert rows[8]["input_ids"].tolist() == list(range(1, 9))
    assert token_count(np.stack([rows[3]["labels"]]), 1) == 2


def test_bad_data_is_named(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 2, 99, 4] * 8))
    with pytest.raises(ValueError, match="token 99 .* outside the vocabulary \\[0, 50\\)"):
        open_data(str(tmp_path / "big.npy"), 4, 50, 0).global_batch(0, 8)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown format"):
        open_data(str(tmp_path / "x.txt"), 4, 50, 0)
    (tmp_path / "bad.jsonl").write_text('{"text": "no ids"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected an object with a non-empty list `input_ids`"):
        open_data(str(tmp_path / "bad.jsonl"), 4, 50, 0)


# ------------------------------------------------------------------ toy model split
def test_toy_stage_params_are_named_like_the_full_model():
    cfg = ToyConfig()
    ad = ToyAdapter(cfg)
    full = ad.full_state()  # the whole model's names
    specs = split_stages(cfg.num_layers, 3, layout="E,t*2|t*2|t*2,m,L", has_mtp=True)
    names = [set(ad.build_stage(s, get_topology()).state_dict()) for s in specs]
    assert set().union(*names) == set(full)
    assert "embed_tokens.weight" in names[0] and "embed_tokens.weight" in names[2]  # MTP reuses the embedding
    assert all(n.startswith(("layers.2.", "layers.3.")) for n in names[1])
    assert not any(
        "indexer" in n for n in full if n.startswith(("layers.2.", "layers.3.", "layers.5."))
    )  # shared layers
    assert ad.loss_specs() == {
        "lm": LossSpec("tokens", 1, 1.0, "losses"),
        "mtp_1": LossSpec("tokens", 2, 0.3, "mtp_losses"),
    }


# ------------------------------------------------------------------ launcher (diagnosis: test_job_lifetime.py)
def test_worker_env_sets_mkl_fast_path_on_amd_only_unless_user_did(monkeypatch, tmp_path):
    from paddleformers_glm import cpu_env

    assert cpu_env.cpu_vendor(str(tmp_path / "absent")) == "unknown"
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        info = tmp_path / f"{vendor}.cpuinfo"
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: x\n")
        assert cpu_env.cpu_vendor(str(info)) == vendor
    for vendor, expect in [("AuthenticAMD", "5"), ("GenuineIntel", None)]:
        monkeypatch.setattr(cpu_env, "cpu_vendor", lambda v=vendor: v)
        env = worker_env(4, base={"PATH": "/bin"})
        assert env.get("MKL_DEBUG_CPU_TYPE") == expect, vendor
        assert env["OMP_NUM_THREADS"] >= "1" and env["PYTHONPATH"]
        assert worker_env(4, base={"MKL_DEBUG_CPU_TYPE": "2"})["MKL_DEBUG_CPU_TYPE"] == "2"


def test_launcher_ports_stay_out_of_the_kernels_ephemeral_range(tmp_path):
    """A CI run aborted rank 0 creating the TCPStore: the port Paddle's launcher had probed (random in
    35100-64000) was taken before the worker bound it, and Linux gives 32768-60999 to every outgoing
    connection.  So the workers get a PORT_RANGE below the ephemeral range, unless the user set one."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert listen_port_range(str(ranges)) == "10000:32767"
    ranges.write_text("11000 60999\n")  # too few ports below: leave Paddle's default
    assert listen_port_range(str(ranges)) is None
    assert listen_port_range(str(tmp_path / "absent")) is None
    kernel = listen_port_range()
    if kernel is not None:  # Linux: the live range, and the workers' environment carries it
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        assert int(kernel.split(":")[1]) < low
        assert worker_env(2, base={})["PORT_RANGE"] == kernel
    assert worker_env(2, base={"PORT_RANGE": "40000:41000"})["PORT_RANGE"] == "40000:41000"


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--tp", "3"], "tp 3 does not divide num_attention_heads 4"),
        (["--tp", "2", "--ep", "3"], "ep 3 x etp 1 = 3 must divide tp 2 x dp 1 = 2"),
        (["--dp", "2", "--ep", "2", "--model-config", '{"num_experts": 5}'], "ep 2 does not divide n_routed_experts 5"),
        (["--pp", "2", "--pp-layout", "E,t*2|t*3,m,L"], "places 5 decoder layers"),
        (["--sp"], "needs tp > 1"),
        # Fleet's sequence-parallel ops cut equal slices: refused here, not by the workers' first embedding
        (["--tp", "2", "--sp", "--seq-len", "9"], "--seq-len 9 must be divisible by tp 2 under --sp"),
        (["--tp", "4", "--cp", "2", "--sp", "--seq-len", "12"], "--seq-len 12 / cp 2 = 6 tokens per cp rank must be"),
        (["--global-batch-size", "3", "--dp", "2"], "must be divisible by dp 2"),
        (["--vpp", "2"], "needs --pp >= 2"),
        (["--pp", "2", "--vpp", "2", "--pp-layout", "E,t*3|t*3,m,L"], "lists --pp 2 x --vpp 2 chunks"),
        (["--pp", "2", "--vpp", "2", "--global-batch-size", "1"], "need exactly --pp 2 or at least 2 x --pp = 4"),
        (["--pp", "3", "--vpp", "2", "--global-batch-size", "4"], "need exactly --pp 3 or at least 2 x --pp = 6"),
    ],
)
def test_cli_rejects_bad_layouts_before_launching(tmp_path, capsys, args, msg):
    assert train_main(["--model", "toy", *args, "--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, msg",
    [
        # a floor above the peak: trained at lr 0.5 then 1.0 for --lr 3e-4 --min-lr 1, exit 0
        (["--lr", "3e-4", "--min-lr", "1"], "--min-lr 1.0 is above --lr 0.0003"),
        (["--warmup-steps", "-5"], "--warmup-steps must be >= 0, got -5"),  # was taken: lr 2.8e-4 at step 1, not 3e-5
        # the toy model's config: TypeError tracebacks before
        (["--model-config", '{"bogus": 1}'], "--model-config: unknown key 'bogus'; the toy model's keys: vocab_size,"),
        (["--model-config", "[1]"], "--model-config must be a JSON object of the toy model's keys, got list"),
        (["--model-config", '{"vocab_size": "x"}'], "--model-config: vocab_size must be an integer, got 'x' (str)"),
        (["--model-config", '{"mtp": 1}'], "--model-config: mtp must be true or false, got 1 (int)"),
        # a repeat no stage can hold: was a MemoryError traceback (t*9999999 took seconds and 80 MB)
        (["--pp", "2", "--pp-layout", "E,t*99999999999|t*3,m,L"], "stage 0: t*99999999999 is more units than a stage"),
    ],
)
def test_cli_refuses_bad_settings_before_launching(tmp_path, capsys, args, msg):
    assert train_main(["--model", "toy", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def test_cli_requires_a_model(tmp_path, capsys):
    """`glm52 train` has no default model: a checkpoint folder or `toy` must be named."""
    with pytest.raises(SystemExit) as e:
        train_main(["--steps", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err
    assert not (tmp_path / "loss.json").exists()


# ------------------------------------------------------------------ world-1 runs
def _cfg(out, **kw):
    base = dict(
        model="toy",
        steps=4,
        seq_len=16,
        global_batch_size=4,
        micro_batch_size=2,
        lr=2e-3,
        seed=11,
        progress=False,
        out=str(out),
    )
    return TrainConfig(**{**base, **kw})


def test_world1_loss_json_schema_repeat_and_resume(tmp_path):
    a = run_training(_cfg(tmp_path / "a", save_every=2))
    on_disk = json.loads((tmp_path / "a" / "loss.json").read_text())
    assert on_disk == json.loads(json.dumps(a))
    assert set(a) >= {"losses", "mtp_losses", "steps", "profile", "weights_loaded", "checkpoint", "seed", "versions"}
    assert set(a["profile"]) == {
        "tp",
        "pp",
        "ep",
        "etp",
        "sp",
        "dp",
        "cp",
        "world",
        "micro_batch_size",
        "global_batch_size",
        "seq_len",
        "dtype",
    }
    assert (
        a["steps"] == 4
        and len(a["losses"]) == len(a["mtp_losses"]) == 4
        and a["versions"]["paddle"] == paddle.__version__
    )
    b = run_training(_cfg(tmp_path / "b"))
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]  # bitwise repeat
    c = run_training(_cfg(tmp_path / "c", resume=str(tmp_path / "a" / "checkpoints")))  # root -> latest (step 4)
    assert c["losses"] == a["losses"]
    d = run_training(_cfg(tmp_path / "d", resume=str(tmp_path / "a" / "checkpoints" / "step_00000002")))
    assert d["losses"] == a["losses"] and d["mtp_losses"] == a["mtp_losses"] and d["run"]["resumed_from_step"] == 2
    with pytest.raises(ValueError, match="micro-batch-size saved 2, now 1"):
        run_training(_cfg(tmp_path / "e", micro_batch_size=1, resume=str(tmp_path / "a" / "checkpoints")))


def test_micro_batching_does_not_change_the_loss(tmp_path):
    a = run_training(_cfg(tmp_path / "a", steps=2))
    b = run_training(_cfg(tmp_path / "b", steps=2, micro_batch_size=1))
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5


def test_a_zero_learning_rate_with_a_warm_up_trains_and_leaves_the_weights(tmp_path):
    """``--lr 0 --warmup-steps 2`` (a frozen-weights run; the torch reference trains it): Paddle's
    LinearWarmup asserted "end_lr 0.0 must be greater than start_lr 0.0" in the worker, exit 1."""
    from paddleformers_glm.parity.reference.train import lr_at as reference_lr_at

    assert [lr_at(s, 0.0, 0.0, 2, 4) for s in range(1, 5)] == [reference_lr_at(s, 0.0, 0.0, 2, 4) for s in range(1, 5)]
    frozen = run_training(_cfg(tmp_path / "a", lr=0.0, min_lr=0.0, warmup_steps=2, steps=3))
    assert frozen["lrs"] == [0.0, 0.0, 0.0]
    # the weights stay: the losses are those of the run without warm-up, whose rate is 0 from step 1,
    # and step 2 on differ from a run that moves them
    assert frozen["losses"] == run_training(_cfg(tmp_path / "b", lr=0.0, min_lr=0.0, warmup_steps=0, steps=3))["losses"]
    moved = run_training(_cfg(tmp_path / "c", steps=3))
    assert moved["losses"][0] == frozen["losses"][0] and moved["losses"][1] != frozen["losses"][1]


def test_bf16_trains_on_cpu(tmp_path):
    """--dtype bfloat16 runs on a CPU build (ops/cpu_bf16): bf16 parameters, fp32 master weights,
    losses close to the fp32 run's and falling."""
    a = run_training(_cfg(tmp_path / "a", dtype="bfloat16"))
    b = run_training(_cfg(tmp_path / "b"))
    assert all(np.isfinite(a["losses"])) and a["losses"] != b["losses"]  # really another dtype
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 0.05  # measured 0.032
    assert a["optimizer_state_bytes"] > b["optimizer_state_bytes"]  # + the fp32 master weights


def test_single_stage_spec_runs_everything():
    spec = StageSpec.whole(6, True)
    assert spec.stage == 0 and spec.is_last and spec.layers == tuple(range(6)) and spec.has_mtp


def test_worker_keeps_the_head_of_a_long_error_message():
    from paddleformers_glm.train.stop_signals import shorten

    text = "[gloo/transport/tcp/pair.cc:584] TIMEOUT waiting for peer " + "x" * 3000 + " last frame"
    short = shorten(text)
    assert len(short) < 900 and "TIMEOUT" in short and short.endswith("last frame")


def test_resume_refuses_steps_below_the_state_and_carries_the_skipped_steps(tmp_path):
    """``--steps`` below the resume state's step: refused by name (before, the run trained nothing,
    exited 0 and wrote a loss.json saying ``steps: 2`` over 4 losses; --steps is the run's total).
    The steps skipped before the resume stay in loss.json's ``skipped_steps`` (before, a resumed
    run listed none while its grad_norms kept the skipped step's null); the allowance restarts."""
    a = run_training(_cfg(tmp_path / "a", save_every=2, skip_nonfinite_steps=1, fault="rank=0,step=1,kind=nan"))
    assert a["skipped_steps"] == [1] and a["grad_norms"][0] != a["grad_norms"][0]  # NaN
    with pytest.raises(ValueError, match=r"--steps 3: the resume state .*step_00000004 is at step 4 already"):
        run_training(_cfg(tmp_path / "b", steps=3, resume=str(tmp_path / "a" / "checkpoints")))
    c = run_training(
        _cfg(tmp_path / "c", skip_nonfinite_steps=1, resume=str(tmp_path / "a" / "checkpoints" / "step_00000002"))
    )
    assert c["losses"] == a["losses"] and c["skipped_steps"] == [1]
    d = run_training(_cfg(tmp_path / "d", steps=6, skip_nonfinite_steps=1, fault="rank=0,step=5,kind=nan", resume_override=["steps"],
                          resume=str(tmp_path / "a" / "checkpoints")))  # fmt: skip
    assert d["skipped_steps"] == [1, 5] and len(d["losses"]) == 6  # one more skip allowed after the resume


def test_resaving_a_step_killed_while_deleting_the_old_state_keeps_a_resumable_state(tmp_path, monkeypatch):
    """A run resumed from step 2 into its own OUT saves step 4 again, replacing the old step_00000004
    that ``latest`` names.  Killed while that old state is being deleted (a large state takes long):
    before, the delete came first, so ``latest`` named a half-deleted folder (here its meta.json
    gone) and the new state sat unnamed in step_00000004.tmp; now the old one is moved aside, the
    new one named, and only then is the old deleted."""
    from paddleformers_glm.train import resume as resume_mod
    from paddleformers_glm.train.state_files import check_resume_state

    out = tmp_path / "a"
    run_training(_cfg(out, save_every=2))
    real_rmtree = resume_mod.shutil.rmtree

    def killed_while_deleting(path, *a, **k):
        if os.path.isfile(os.path.join(path, "meta.json")):  # a real state, not a leftover
            os.remove(os.path.join(path, "meta.json"))
            raise KeyboardInterrupt("killed while deleting")
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(resume_mod.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(out, save_every=2, resume=str(out / "checkpoints" / "step_00000002")))
    monkeypatch.setattr(resume_mod.shutil, "rmtree", real_rmtree)
    folder, meta = check_resume_state(str(out / "checkpoints"))
    assert os.path.basename(folder) == "step_00000004" and meta["step"] == 4


def test_resume_refuses_changed_run_settings_unless_overridden(tmp_path):
    """A resume continues the saved run: another --lr, --seed or data (each would change the
    continuation: the lr schedule, the data order, the samples) is refused naming saved and new
    values (before: taken silently, so a "resumed" curve was another run's); ``--resume-override``
    names the ones changed on purpose, and the run then uses them."""
    a = run_training(_cfg(tmp_path / "a", save_every=2))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    with pytest.raises(ValueError, match=r"lr saved 0\.002, now 0\.001; min-lr saved 0\.0002, now 0\.0001.*"
                       r"--resume-override lr,min-lr\)"):  # fmt: skip
        run_training(_cfg(tmp_path / "b", lr=1e-3, resume=ckpt))
    with pytest.raises(ValueError, match=r"seed saved 11, now 12"):
        run_training(_cfg(tmp_path / "b", seed=12, resume=ckpt))
    tokens = np.random.default_rng(0).integers(0, 64, size=16 * 8)
    np.save(tmp_path / "tokens.npy", tokens)
    with pytest.raises(ValueError, match=r"data saved 'other samples'"):
        run_training(_cfg(tmp_path / "b", data=str(tmp_path / "tokens.npy"), resume=ckpt))
    with pytest.raises(ValueError, match=r"--resume-override wamup: not a run setting"):
        run_training(_cfg(tmp_path / "b", lr=1e-3, resume=ckpt, resume_override=["wamup"]))
    b = run_training(_cfg(tmp_path / "b", lr=1e-3, resume=ckpt, resume_override=["lr", "min-lr"]))
    assert b["losses"][:2] == a["losses"][:2] and b["losses"][2:] != a["losses"][2:]
    assert b["lrs"][2] < a["lrs"][2]  # the new schedule from the resumed step on


def test_glm52_train_refuses_a_changed_setting_before_launch_and_reads_resume_override(tmp_path, capsys):
    """The command line: a resume with another --lr is refused before any process starts (exit 2,
    one line); ``--resume-override lr`` lets --lr change but not the floor it moves with (--min-lr
    unset is lr / 10), which the refusal then names alone."""
    from paddleformers_glm.cli import main

    run_training(_cfg(tmp_path / "a", save_every=2))
    base = ["train", "--model", "toy", "--out", str(tmp_path / "b"), "--steps", "4", "--seq-len", "16"]
    base += ["--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "11", "--lr", "0.001"]
    base += ["--resume", str(tmp_path / "a" / "checkpoints")]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "lr saved 0.002, now 0.001; min-lr saved 0.0002" in err and len(err.strip().splitlines()) == 1, err
    assert main([*base, "--resume-override", "lr"]) == 2
    err = capsys.readouterr().err
    assert "settings differ from the saved run's: min-lr saved" in err and "--resume-override min-lr)" in err, err
    # another sequence length, batch or dtype: measured before, refused only in the workers (exit 1
    # and a failure record blaming rank 0); now before launch, naming each
    same = [*base[:-2], "--lr", "0.002", *base[-2:]]  # the saved --lr (the later flag wins)
    for flags, says in (
        (["--seq-len", "32"], "seq-len saved 16, now 32"),
        (["--global-batch-size", "8"], "global-batch-size saved 4, now 8"),
        (["--dtype", "bfloat16"], "dtype saved 'float32', now 'bfloat16'"),
    ):
        assert main([*same, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert "a resume keeps these settings of the saved run: " + says in err, err
        assert not (tmp_path / "b" / "logs" / "failure.json").exists()


def test_a_save_starts_from_an_empty_folder_whatever_a_killed_save_left(tmp_path):
    """A save of step N killed before its rename leaves ``step_N.tmp`` (here with a rank file of a
    larger world and a stray flex file); the next save of step N must not carry them into the
    state it names (before: written into the same folder, so the stale files were renamed along)."""
    stale = tmp_path / "a" / "checkpoints" / "step_00000002.tmp"
    (stale / "flex").mkdir(parents=True)
    (stale / "rank_00003.safetensors").write_bytes(b"stale")
    (stale / "flex" / "3_0.distcp").write_bytes(b"stale")
    run_training(_cfg(tmp_path / "a", save_every=2))
    final = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert not (final / "rank_00003.safetensors").exists() and not (final / "flex" / "3_0.distcp").exists()
    assert not stale.exists()


def test_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    """Measured before: ``--resume-override`` without ``--resume`` and ``--model-config`` with a checkpoint
    model were taken and ignored (the run trained without what they said)."""
    tiny = str(pathlib.Path(__file__).parent / "fixtures" / "tiny" / "checkpoint")
    for args, msg in (
        (["--model", "toy", "--resume-override", "lr"], "--resume-override names what a --resume may change"),
        (["--model", tiny, "--model-config", '{"vocab_size": 8}'], "--model-config sets the toy model's config"),
    ):
        assert train_main([*args, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_loss_json_is_rewritten_at_most_every_few_seconds_and_holds_every_finished_step(tmp_path, monkeypatch, capsys):
    """loss.json holds the whole history (every step's losses, per-layer expert loads), and rank 0
    rewrote all of it after every step: O(steps^2) over a run (49 ms a rewrite at 1,500 steps of
    the tiny model; seconds at the official width's 75 MoE layers).  It is rewritten at most every
    ``LOSS_JSON_SECONDS`` now, and at checkpoints and the last step; a run stopped between
    rewrites still leaves every step it finished in loss.json."""
    from paddleformers_glm.train import loop

    monkeypatch.setattr(loop, "LOSS_JSON_SECONDS", 1e9)  # time never makes a rewrite due
    writes = []
    real = loop.write_record
    monkeypatch.setattr(loop, "write_record", lambda path, *a, **k: (writes.append(path), real(path, *a, **k))[1])
    toy = ["--model", "toy", "--seq-len", "8", "--global-batch-size", "4", "--no-progress", "--lr", "1e-3"]
    assert train_main([*toy, "--steps", "12", "--save-every", "5", "--out", str(tmp_path / "a")]) == 0
    rewrites = [w for w in writes if w.endswith("loss.json")]
    assert len(rewrites) == 5, rewrites  # steps 1 (the first), 5 and 10 (checkpoints), 12 (the last), the final record
    doc = json.loads((tmp_path / "a" / "loss.json").read_text())
    assert len(doc["losses"]) == 12

    # a failure at step 7 (no checkpoint since step 5, time not due): steps 1-6 are in loss.json
    writes.clear()
    out = tmp_path / "b"
    rc = train_main(
        [*toy, "--steps", "12", "--save-every", "5", "--fault", "rank=0,step=7,kind=raise", "--out", str(out)]
    )
    capsys.readouterr()
    assert rc == 1
    assert len(json.loads((out / "loss.json").read_text())["losses"]) == 6
