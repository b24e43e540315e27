"""MoE balancing during training: the expert-bias rule on hand-made counts, the sequence-wise balance
loss against its formula, training on the tiny checkpoint (biases move and the load evens out with
a rate, stay byte-identical without), and the biases after a few steps equal one process's bits
under data and tensor x expert parallel layouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import paddle
import pytest
from paddle import nn

from paddleformers_glm.configuration import GlmMoeDsaConfig
from paddleformers_glm.modeling.moe import TopkRouter, sequence_aux_loss
from paddleformers_glm.train.loop import TrainConfig, run_training
from paddleformers_glm.train.moe_balance import ExpertBalancer, load_stats
from tests._dist.runner import assert_clipped_by_true_norm, losses, run_train_cli, worker_logs
from tests._tiny import tiny_config

BIAS = "e_score_correction_bias"
DEAD = 5  # the expert of layer 4 that the skewed checkpoint's bias keeps every token from


def _routers(n_experts: int = 4, layers: tuple[int, ...] = (3, 5)) -> nn.Layer:
    cfg = tiny_config(n_routed_experts=n_experts, n_group=1, topk_group=1, num_experts_per_tok=2)
    m = nn.Layer()
    m.layers = nn.LayerDict({str(i): nn.LayerDict({"gate": TopkRouter(cfg)}) for i in layers})
    return m


def test_bias_rule_on_known_counts():
    from paddleformers_glm.parallel.topology import get_topology

    m = _routers()
    b = ExpertBalancer(m, get_topology(), bias_update_rate=0.25)
    r3, r5 = m.layers["3"]["gate"], m.layers["5"]["gate"]
    r3.balance.counts = paddle.to_tensor([6, 2, 4, 4], dtype="int64")  # mean 4
    r5.balance.counts = paddle.to_tensor([1, 1, 1, 9], dtype="int64")  # mean 3
    b.after_step(1)
    assert r3.e_score_correction_bias.numpy().tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert r5.e_score_correction_bias.numpy().tolist() == [0.25, 0.25, 0.25, -0.25]
    assert r3.balance.counts is None  # taken: the next step counts afresh
    rep = b.report()["expert_load"]
    assert rep["layers"] == [3, 5] and rep["steps"] == [1]
    assert rep["max_mean_ratio"] == [[1.5, 3.0]] and rep["unused_fraction"] == [[0.0, 0.0]]
    assert rep["load_last"] == [[6, 2, 4, 4], [1, 1, 1, 9]]
    # a second step adds to the first (float32 arithmetic)
    r3.balance.counts = paddle.to_tensor([6, 2, 4, 4], dtype="int64")
    r5.balance.counts = paddle.to_tensor([0, 4, 4, 4], dtype="int64")
    b.after_step(2)
    assert r3.e_score_correction_bias.numpy().tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert r5.e_score_correction_bias.numpy().tolist() == [0.5, 0.0, 0.0, -0.5]
    assert b.report()["expert_load"]["unused_fraction"][1] == [0.0, 0.25]


def test_a_moe_layer_that_routes_no_real_token_at_step_1_stays_in_the_record():
    """Every router's layer is a row of expert_load from step 1, as in the torch reference run (which
    lists such a layer's experts all idle at step 1). Measured before, with two MTP layers and padded
    data: the depth-2 MTP layer got no real token at step 1 and was left out of `layers` for the
    whole run; glm52 align then failed idle_experts while every loss and dump agreed."""
    from paddleformers_glm.parallel.topology import get_topology

    m = _routers()
    b = ExpertBalancer(m, get_topology(), bias_update_rate=0.0)
    m.layers["3"]["gate"].balance.counts = paddle.to_tensor([2, 2, 0, 0], dtype="int64")  # layer 5: none
    b.after_step(1)
    m.layers["5"]["gate"].balance.counts = paddle.to_tensor([0, 0, 0, 4], dtype="int64")
    b.after_step(2)
    rep = b.report()["expert_load"]
    assert rep["layers"] == [3, 5]
    assert rep["idle_experts"] == [{"3": [2, 3], "5": [0, 1, 2, 3]}, {"3": [0, 1, 2, 3], "5": [0, 1, 2]}]
    assert rep["load_total"] == [[2, 2, 0, 0], [0, 0, 0, 4]]


def test_rate_zero_leaves_the_bias_and_stats_still_count():
    from paddleformers_glm.parallel.topology import get_topology

    m = _routers()
    b = ExpertBalancer(m, get_topology(), bias_update_rate=0.0)
    for r in (m.layers["3"]["gate"], m.layers["5"]["gate"]):
        r.balance.counts = paddle.to_tensor([8, 0, 0, 0], dtype="int64")
    b.after_step(1)
    assert m.layers["3"]["gate"].e_score_correction_bias.numpy().tolist() == [0.0] * 4
    assert b.report()["expert_load"]["max_mean_ratio"] == [[4.0, 4.0]]
    assert load_stats(np.array([0, 0, 2, 2]))["unused_fraction"] == 0.5
    with pytest.raises(ValueError, match="--moe-bias-update-rate must be >= 0, got -1"):
        TrainConfig(model="toy", moe_bias_update_rate=-1).validate()
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff must be >= 0, got -1"):
        TrainConfig(model="toy", moe_aux_loss_coeff=-1).validate()


def test_router_counts_training_forwards_only():
    m = _routers()
    r = m.layers["3"]["gate"]
    x = paddle.randn([5, r.weight.shape[0]])
    r(x)
    assert int(r.balance.counts.sum()) == 5 * 2
    with paddle.no_grad():  # generation and evaluation do not count
        r(x)
    r.eval()
    r(x)
    assert int(r.balance.counts.sum()) == 5 * 2
    assert not any("balance" in k or "counts" in k for k in r.state_dict())


def _moe_step(m: nn.Layer, sync, opt, seed: int) -> dict[str, bool]:
    """Forward, backward, gradient sync and update of a one-layer MoE; returns the has-gradient flags."""
    x = paddle.to_tensor(np.random.default_rng(seed).standard_normal([2, 8, m.layers["3"].gate.weight.shape[0]]))
    (m.layers["3"](x.astype("float32")) ** 2).mean().backward()
    grads, has = sync.main_grads()
    opt.step(grads, has, 1e-2)
    sync.release()
    return has


def test_expert_without_routed_tokens_is_stepped_with_a_zero_gradient():
    """An expert no token reached in a step, though its layer routed tokens, is stepped with a zero
    gradient, as torch's AdamW steps the reference's fused expert tensors (HF's ``gate_up_proj`` /
    ``down_proj``; measured in tests/test_expert_update.py): its moments decay (x beta1, x beta2),
    the moment-driven update and the weight decay go on, and its bias-correction step count is the
    layer's (2 after two steps)."""
    from paddleformers_glm.modeling.moe import MoE
    from paddleformers_glm.parallel.grads import GradSynchronizer
    from paddleformers_glm.parallel.topology import get_topology, set_topology
    from paddleformers_glm.train.dump import adam_moments
    from paddleformers_glm.train.optim import AdamW

    set_topology(None)
    paddle.seed(0)
    cfg = tiny_config(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    m = nn.Layer()
    m.layers = nn.LayerDict({"3": MoE(cfg)})
    m.train()
    sync = GradSynchronizer(m, get_topology())
    opt = AdamW(sync.params, weight_decay=0.1)
    experts = [n for n, _ in sync.params if ".experts." in n]
    has = _moe_step(m, sync, opt, seed=1)
    assert all(has[n] for n in experts)  # 32 assignments over 4 experts: every one got tokens
    dead = [n for n in experts if ".experts.0." in n]
    assert dead
    bias = m.layers["3"].gate.e_score_correction_bias
    bias.set_value(paddle.to_tensor([-10.0, 0.0, 0.0, 0.0]))  # expert 0 can no longer be chosen
    params = dict(sync.params)

    def snapshot(names):
        out = {}
        for n in names:
            m1, m2 = adam_moments(opt, n, params[n])
            out[n] = [
                params[n].numpy().astype(np.float64),
                m1.numpy().astype(np.float64),
                m2.numpy().astype(np.float64),
            ]
        return out

    before = snapshot(dead)
    has = _moe_step(m, sync, opt, seed=2)  # lr 1e-2
    after = snapshot(dead)
    assert all(has[n] for n in dead)  # its layer routed tokens: stepped
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    for n in dead:
        w1, m1, v1 = before[n]
        m2, v2 = b1 * m1, b2 * v1
        w2 = w1 * (1 - lr * wd) - lr * (m2 / (1 - b1**2)) / (np.sqrt(v2 / (1 - b2**2)) + eps)
        np.testing.assert_allclose(after[n][1], m2, rtol=1e-6, atol=1e-12, err_msg=n)
        np.testing.assert_allclose(after[n][2], v2, rtol=1e-6, atol=1e-18, err_msg=n)
        np.testing.assert_allclose(after[n][0], w2, rtol=0, atol=1e-7, err_msg=n)
        assert np.abs(after[n][0] - w1).max() > 0.5 * lr, n  # a sizeable moment-driven step, not decay alone
        # Paddle's AdamW starts beta1_pow_acc at beta1 and multiplies it by beta1 after each update
        b1p = float(opt.state[n]["beta1_pow_acc"].numpy().reshape([-1])[0])
        assert round(math.log(b1p) / math.log(b1)) - 1 == 2, n


def _aux_reference(scores: np.ndarray, ids: np.ndarray, B: int, E: int, K: int) -> float:
    """The DeepSeek-V3 formula, written out per sequence."""
    T = scores.shape[0] // B
    total = 0.0
    for b in range(B):
        s = scores[b * T : (b + 1) * T]
        chosen = ids[b * T : (b + 1) * T]
        f = np.array([(chosen == i).any(-1).sum() for i in range(E)]) * E / (K * T)
        P = (s / s.sum(-1, keepdims=True)).mean(0)
        total += float((f * P).sum())
    return total


def test_sequence_aux_loss_matches_the_formula_and_reaches_the_router():
    rng = np.random.default_rng(0)
    B, T, E, K = 3, 5, 6, 2
    scores = rng.uniform(0.05, 0.95, size=(B * T, E)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(B * T)]).astype(np.int64)
    got = float(sequence_aux_loss(paddle.to_tensor(scores), paddle.to_tensor(ids), (B, T), E))
    assert abs(got - _aux_reference(scores, ids, B, E, K)) < 1e-5

    # through the router: the aux loss enters the router's gradient with coeff x scale
    cfg = tiny_config(n_routed_experts=E, n_group=1, topk_group=1, num_experts_per_tok=K)
    paddle.seed(0)
    r = TopkRouter(cfg)
    x = paddle.randn([B * T, cfg.hidden_size])

    def router_grad(coeff: float) -> np.ndarray:
        r.clear_gradients()
        r.balance.aux_loss_coeff, r.balance.aux_loss_scale = coeff, 0.5
        _, w, _ = r(x, (B, T))
        w.sum().backward()
        return r.weight.grad.numpy().copy()

    base, with_aux = router_grad(0.0), router_grad(0.3)
    r.clear_gradients()
    logits = paddle.matmul(x, r.weight)
    scores_t = nn.functional.sigmoid(logits)
    ids_t = r(x)[2]
    sequence_aux_loss(scores_t, ids_t, (B, T), E).backward()
    np.testing.assert_allclose(with_aux - base, 0.3 * 0.5 * r.weight.grad.numpy(), rtol=1e-4, atol=1e-7)
    assert np.abs(with_aux - base).max() > 0


# ---------------------------------------------------------------- training on the tiny checkpoint


@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory):
    """The tiny checkpoint (`glm52 make-tiny`'s weights) with router biases skewed from +0.08 to
    -0.08 over the experts, as after a shift in the data: the first experts take most tokens.
    Expert ``DEAD`` of layer 4 gets a bias no update rate here undoes: no token reaches it."""
    from paddleformers_glm.checkpoint import save_pretrained_state
    from paddleformers_glm.tiny import init_state
    from paddleformers_glm.tiny import tiny_config as official_tiny

    config = official_tiny()
    state = init_state(config)
    for k in state:
        if k.endswith(BIAS):
            state[k] = np.linspace(0.08, -0.08, state[k].shape[0]).astype(np.float32)
    state[f"model.layers.4.mlp.gate.{BIAS}"][DEAD] = -10.0
    out = tmp_path_factory.mktemp("skewed") / "ckpt"
    save_pretrained_state({k: paddle.to_tensor(v) for k, v in state.items()}, config, out, max_shard_size="1MB")
    return out


def _expert(folder: Path, expert: int) -> dict[str, np.ndarray]:
    """Layer 4 expert ``expert``'s tensors in a checkpoint or a step dump, as fp32."""
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

    ckpt = Checkpoint(str(folder))
    keys = [k for k in ckpt.keys() if f"layers.4.mlp.experts.{expert}." in k]
    return {k: ckpt.paddle(k).astype("float32").numpy() for k in keys}  # bf16 in the checkpoint


def _biases(folder: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                if k.endswith(BIAS):
                    t = h.get_tensor(k)
                    out[k] = t.dtype.str.encode() + t.tobytes()
    return out


def _train(ckpt: Path, out: Path, rate: float, steps: int = 20) -> dict:
    cfg = TrainConfig(
        model="glm", model_args={"model_dir": str(ckpt)}, steps=steps, seq_len=32, global_batch_size=2,
        micro_batch_size=2, out=str(out), progress=False, export=True, moe_bias_update_rate=rate,
    )  # fmt: skip
    return run_training(cfg)


def test_bias_updates_move_biases_and_even_the_load(skewed_ckpt, tmp_path):
    src = _biases(skewed_ckpt)
    assert len(src) == 6  # layers 3..7 and the MTP layer
    frozen = _train(skewed_ckpt, tmp_path / "r0", 0.0)
    moving = _train(skewed_ckpt, tmp_path / "r1", 0.01)
    assert _biases(tmp_path / "r0" / "export") == src  # rate 0: byte-identical
    moved = _biases(tmp_path / "r1" / "export")
    assert moved.keys() == src.keys() and all(moved[k] != src[k] for k in src)
    el0, el1 = frozen["expert_load"], moving["expert_load"]
    assert el1["layers"] == [3, 4, 5, 6, 7, 8] and len(el1["steps"]) == 20
    r0 = np.array(el0["max_mean_ratio"]).mean(1)
    r1 = np.array(el1["max_mean_ratio"]).mean(1)
    assert r0[0] == r1[0]  # the same first step: the update comes after it
    # the skew keeps the frozen run unbalanced; the updates bring the ratio down
    assert r1[-5:].mean() < 0.8 * r1[0] and r1[-5:].mean() < 0.8 * r0[-5:].mean(), (r0.tolist(), r1.tolist())
    written = json.loads((tmp_path / "r1" / "loss.json").read_text())["expert_load"]
    assert written["max_mean_ratio"] == el1["max_mean_ratio"]
    from paddleformers_glm.cli import main

    assert main(["plot-experts", str(tmp_path / "r1")]) == 0  # the measured curve, drawn
    assert (tmp_path / "r1" / "expert_load.png").stat().st_size > 10_000


PADDED = [16, 9, 13, 5, 16, 11, 7, 14, 10, 12]  # real tokens of the 10 samples (one epoch), padded to 16


@pytest.fixture(scope="module")
def padded_data(tmp_path_factory) -> Path:
    """Records of 5..16 real tokens right-padded to --seq-len 16: every layout counts only the real
    tokens (each rank its own rows of the mask: sequence and context parallel split the sequences)."""
    return _real_tokens(tmp_path_factory.mktemp("data") / "d.jsonl", PADDED)


def _run_cli(ckpt: Path, out: Path, data: Path, *layout: str) -> dict:
    args = ["--model", str(ckpt), "--steps", "5", "--seq-len", "16", "--global-batch-size", "2", "--data", str(data)]
    args += ["--micro-batch-size", "1", "--moe-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.1"]
    args += ["--dump-step", str(out / "dump"), "5"]  # fp32 weights and moments after the last update
    args += ["--dump-step", str(out / "dump1"), "1"]  # and after the first: the clip factor that ran
    p, _ = run_train_cli([*args, "--out", str(out), "--export", *layout], timeout=240)
    if p.returncode != 0:
        pytest.fail(f"{layout} failed:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


@pytest.fixture(scope="module")
def one_process(skewed_ckpt, padded_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return out, _run_cli(skewed_ckpt, out, padded_data)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("--dp", "2"),
        ("--tp", "2", "--ep", "2"),
        ("--tp", "2", "--sp"),
        ("--pp", "2"),
        ("--sharding", "2", "--sharding-stage", "2"),
    ],
    ids=["dp2", "tp2-ep2", "tp2-sp", "pp2", "sharding2-stage2"],
)
def test_bias_updates_equal_one_process_in_every_layout(skewed_ckpt, one_process, padded_data, tmp_path, layout):
    """Expert load, router biases, the never-routed expert's decay, aux losses and grad norms equal
    one process.  The step-1 dump also shows the clip factor that ran: clip / (true global norm +
    1e-6), 0.225191 for the norm 4.4407 of every layout here, as one process applies it.  Adam
    cancels a constant gradient scale, so the other numbers barely see a wrong factor: Fleet's clip
    counting the embedding on both pipeline stages that hold it (stage 0 and the MTP stage) applied
    0.216024 at pp2, and counting tensor-parallel slices as replicas 0.283208 at tp2-sp, while the
    first other number to leave its bound, the aux losses, differed from one process by only 2.4e-5
    and 1.9e-5 (bound 1e-5)."""
    one_dir, one = one_process
    got = _run_cli(skewed_ckpt, tmp_path, padded_data, *layout)
    # the clip factor applied at step 1 is clip / (true global norm + 1e-6), as in one process; at
    # pp2 (the MTP layer's embedding shared with stage 0) and tp2-sp it is Fleet's clip that ran
    if layout in (("--pp", "2"), ("--tp", "2", "--sp")):
        assert got["run"]["grad_clip"] == "HybridParallelClipGrad", got["run"]["grad_clip"]
    for run, rec in ((one_dir, one), (tmp_path, got)):
        assert_clipped_by_true_norm(run / "dump1", rec["grad_norms"][0], clip=1.0)
    assert got["expert_load"]["load_total"] == one["expert_load"]["load_total"]  # each token counted once
    assert sum(one["expert_load"]["load_total"][0]) == 2 * sum(PADDED)  # K = 2 per real token, no padding
    a, b = _biases(one_dir / "export"), _biases(tmp_path / "export")
    assert a == b and a != _biases(skewed_ckpt)  # the same bits, moved
    # the expert no token reached in any step is stepped as the reference steps its slice of the
    # fused expert tensors (tests/test_expert_update.py): a zero gradient every step, so its moments
    # stay zero and only the weight decay moves it, w0 x prod(1 - lr_t x 0.1); in one process and in
    # the layout, where its owner (expert, sharding) rank must update and broadcast it like the others
    start = _expert(skewed_ckpt, DEAD)
    assert start and got["expert_load"]["layers"][1] == 4 and got["expert_load"]["load_total"][1][DEAD] == 0
    decay = float(np.prod([1 - lr * 0.1 for lr in one["lrs"]]))
    assert got["lrs"] == one["lrs"] and decay < 1 - 5e-5  # 70x the rtol below
    for run in (one_dir, tmp_path):
        w, m = _expert(run / "dump" / "weights", DEAD), _expert(run / "dump" / "exp_avg", DEAD)
        assert w.keys() == start.keys(), run
        for k in start:
            np.testing.assert_allclose(
                w[k], start[k].astype(np.float64) * decay, rtol=1e-6, atol=0, err_msg=f"{run} {k}"
            )
        assert all(not v.any() for v in m.values()), run
        live = _expert(run / "dump" / "weights", 0)  # the most chosen expert: stepped
        assert live and not any(np.array_equal(v, _expert(skewed_ckpt, 0)[k]) for k, v in live.items()), run
    # the sequence aux loss (split over sequence slices under SP) and its gradient agree too
    diff = max(abs(x - y) for x, y in zip(one["expert_load"]["aux_losses"], got["expert_load"]["aux_losses"]))
    assert diff <= 1e-5, diff  # the layouts tolerance of the loss curves (tests/test_train_glm.py)
    # over the layout test's horizon of tests/test_train_glm.py (3 steps); later steps drift by
    # up to ~1e-4 under TP with or without the aux loss (rounding, amplified by Adam)
    assert max(abs(x - y) for x, y in zip(one["grad_norms"][:3], got["grad_norms"][:3])) <= 1e-5


def test_aux_loss_in_training_is_reported_and_trains_the_router(skewed_ckpt, tmp_path):
    def run(out: Path, coeff: float) -> dict:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(skewed_ckpt)}, steps=2, seq_len=16, global_batch_size=2,
            micro_batch_size=1, out=str(out), progress=False, export=True, moe_aux_loss_coeff=coeff,
        )  # fmt: skip
        return run_training(cfg)

    off, on = run(tmp_path / "off", 0.0), run(tmp_path / "on", 0.1)
    assert "aux_losses" not in off["expert_load"]
    aux = on["expert_load"]["aux_losses"]
    # sum_e f_e P_e: 1 at uniform counts, at most E / K = 4; the skewed biases make it exceed 1
    assert len(aux) == 2 and all(1.0 < a < 4.0 for a in aux), aux
    assert on["losses"][0] == off["losses"][0]  # the reported LM loss excludes it

    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

    a, b = Checkpoint(str(tmp_path / "off" / "export")), Checkpoint(str(tmp_path / "on" / "export"))
    for key in ("model.layers.3.mlp.gate.weight", "model.layers.3.self_attn.o_proj.weight"):
        # its gradient reached the router, and through the routing scores the hidden states
        assert bytes(a.raw(key)) != bytes(b.raw(key)), key


def test_the_reported_aux_loss_is_a_mean_over_the_global_batchs_sequences(skewed_ckpt, tmp_path):
    """Every record the same sequence: each sequence's balance loss is the same number, so the
    reported step value (a mean over the step's sequences, as the loss it adds is) does not depend
    on --global-batch-size; a sum would double from 2 to 4 sequences."""
    ids = np.random.default_rng(7).integers(5, 200, 16).tolist()
    data = tmp_path / "same.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for _ in range(8)), encoding="utf-8")

    def aux(gbs: int) -> float:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(skewed_ckpt)}, steps=1, seq_len=16, global_batch_size=gbs,
            micro_batch_size=1, out=str(tmp_path / f"g{gbs}"), progress=False, data=str(data), moe_aux_loss_coeff=0.1,
        )  # fmt: skip
        return run_training(cfg)["expert_load"]["aux_losses"][0]

    a, b = aux(2), aux(4)
    assert 1.0 < a < 4.0 and abs(a - b) <= 1e-6 * a, (a, b)


def test_a_skipped_step_leaves_no_router_counts_to_the_next_step(skewed_ckpt, tmp_path):
    """``--skip-nonfinite-steps``: a skipped step moves nothing, the router biases included, and
    its tokens do not count towards the next step's bias update either: step 3's load is step 3's
    own (B x S x K assignments per MoE layer), and its bias move is R x sign(mean - that load) on
    top of step 1's biases.  Measured before the fix: step 3's load per layer summed to 128 (the
    skipped step's 64 assignments included), the run's total to 192 over its two recorded steps,
    and the aux loss of step 3 held both steps' sums."""
    B, S, K, R = 2, 16, 2, 0.01

    def run(out: Path, **kw) -> dict:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(skewed_ckpt)}, seq_len=S, global_batch_size=B,
            micro_batch_size=1, out=str(out), progress=False, export=True, moe_bias_update_rate=R,
            moe_aux_loss_coeff=0.1, **kw,
        )  # fmt: skip
        return run_training(cfg)

    one = run(tmp_path / "one", steps=1)
    skip = run(tmp_path / "skip", steps=3, skip_nonfinite_steps=1, fault="rank=0,step=2,kind=nan")
    assert skip["skipped_steps"] == [2]
    el = skip["expert_load"]
    assert el["steps"] == [1, 3]
    # B x S x K per decoder layer; the MTP layer's last position is the window's end (not a real input)
    L = GlmMoeDsaConfig.from_pretrained(skewed_ckpt).num_hidden_layers
    want = [B * (S - (layer >= L)) * K for layer in el["layers"]]
    assert [sum(row) for row in el["load_last"]] == want
    assert [sum(row) for row in el["load_total"]] == [2 * w for w in want]
    # the aux loss of step 3 is a mean over its own sequences (at most E / K = 4)
    assert all(0.0 < a < 4.0 for a in el["aux_losses"]), el["aux_losses"]
    assert el["aux_losses"][0] == one["expert_load"]["aux_losses"][0]  # step 1 is the same in both runs
    # step 3's bias move: float32(bias_1 + float32(R) * sign(mean - load_3)), bias_1 from the 1-step run
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

    b1, b3 = Checkpoint(str(tmp_path / "one" / "export")), Checkpoint(str(tmp_path / "skip" / "export"))
    for layer, load in zip(el["layers"], el["load_last"]):
        key = f"model.layers.{layer}.mlp.gate.{BIAS}"
        load = np.asarray(load, dtype=np.float64)
        sign = np.sign(load.sum() / load.size - load).astype(np.float32)
        want = (b1.numpy(key).astype(np.float32) + np.float32(R) * sign).astype(np.float32)
        np.testing.assert_array_equal(b3.numpy(key), want, err_msg=key)


# ---------------------------------------------------------------- padding (docs/model.md, "MoE balancing")


def _padding_router(E: int = 6, K: int = 2) -> TopkRouter:
    cfg = tiny_config(n_routed_experts=E, n_group=1, topk_group=1, num_experts_per_tok=K)
    paddle.seed(0)
    return TopkRouter(cfg)


def test_padding_counts_in_neither_the_load_nor_the_balance_loss_yet_is_routed():
    """A token-validity mask (1 = real) keeps padding out of ``counts`` (the bias update's load and
    loss.json's) and out of the sequence-wise loss (T = the sequence's real tokens; a sequence of
    padding only adds 0, no NaN); ``routed`` (which experts the optimizer steps) still counts every
    row: torch steps an expert that computed a padding row, with a zero gradient."""
    E, K, B, S = 6, 2, 3, 6
    r = _padding_router(E, K)
    r.balance.aux_loss_coeff = 0.3
    x = paddle.randn([B * S, r.weight.shape[0]])
    lengths = [6, 4, 0]  # whole, right-padded, padding only
    valid = paddle.to_tensor([[1] * n + [0] * (S - n) for n in lengths], dtype="int64")
    _, _, ids = r(x, (B, S), valid)
    counts, aux = r.balance.take()
    routed = r.balance.take_routed()
    ids_np = ids.numpy()
    real = np.concatenate([np.arange(b * S, b * S + n) for b, n in enumerate(lengths)])
    np.testing.assert_array_equal(counts.numpy(), np.bincount(ids_np[real].reshape(-1), minlength=E))
    np.testing.assert_array_equal(routed.numpy(), np.bincount(ids_np.reshape(-1), minlength=E))
    assert int(counts.sum()) == 10 * K and int(routed.sum()) == B * S * K
    scores = nn.functional.sigmoid(paddle.matmul(x, r.weight)).numpy()
    want = sum(
        _aux_reference(scores[b * S : b * S + n], ids_np[b * S : b * S + n], 1, E, K)
        for b, n in enumerate(lengths)
        if n
    )
    assert math.isfinite(float(aux)) and abs(float(aux) - want) < 1e-5, (float(aux), want)

    # the loss's gradient never reaches a padding row; a mask of ones is the unmasked loss, bit for bit
    s = paddle.to_tensor(scores, stop_gradient=False)
    mask = valid.reshape([-1]).astype("bool")
    sequence_aux_loss(s, ids, (B, S), E, valid=mask).backward()
    assert np.abs(s.grad.numpy()[~mask.numpy()]).max() == 0 and np.abs(s.grad.numpy()[real]).max() > 0
    ones = paddle.ones([B * S], dtype="bool")
    s = paddle.to_tensor(scores)
    assert float(sequence_aux_loss(s, ids, (B, S), E, valid=ones)) == float(sequence_aux_loss(s, ids, (B, S), E))


def test_a_rank_takes_its_own_tokens_of_the_mask_under_context_and_sequence_parallel():
    """The mask is indexed by global position (as the key-padding mask): a cp rank takes its zigzag
    positions, a sequence-parallel tp rank then its equal slice of them -- the rows its router sees."""
    from types import SimpleNamespace

    from paddleformers_glm.modeling.moe import RouterBalance
    from paddleformers_glm.parallel.context import zigzag_positions

    B, S = 2, 16
    valid = paddle.to_tensor(np.random.default_rng(0).integers(0, 2, (B, S)), dtype="int64")
    for cp, cp_rank, tp, tp_rank in [(1, 0, 1, 0), (2, 1, 1, 0), (1, 0, 2, 1), (2, 1, 2, 0), (2, 0, 2, 1)]:
        topo = SimpleNamespace(
            sequence_parallel=tp > 1, tp_size=tp, tp_rank=tp_rank, tp_group=None, cp_size=cp, cp_rank=cp_rank
        )
        rows = np.asarray(valid.numpy())[:, zigzag_positions(S, cp, cp_rank)]
        rows = np.split(rows, tp, axis=1)[tp_rank]
        got = RouterBalance(topo).local_valid(valid, B * S // (cp * tp))
        np.testing.assert_array_equal(got.numpy(), rows.reshape(-1).astype(bool), err_msg=str((cp, tp)))
    with pytest.raises(ValueError, match="router has 5 rows"):
        RouterBalance().local_valid(valid, 5)


def test_the_mtp_layers_mask_follows_its_shifted_inputs():
    """MTP depth d at position i sees token i + d: real when both i and i + d are real tokens; past
    the window's end (the model's fill, its target ignored) it is not, so a window counts the same
    positions whether padding or the end of the window follows its last token."""
    from paddleformers_glm.modeling.mtp import mtp_token_valid

    m = paddle.to_tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], dtype="int64")
    assert mtp_token_valid(m, 1).numpy().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 0]]
    assert mtp_token_valid(m, 2).numpy().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]
    assert not mtp_token_valid(m, 4).numpy().any()


def _real_tokens(path: Path, lengths: list[int]) -> Path:
    rng = np.random.default_rng(7)
    path.write_text("".join(json.dumps({"input_ids": rng.integers(5, 200, n).tolist()}) + "\n" for n in lengths))
    return path


def test_padded_data_gives_the_load_bias_update_and_aux_loss_of_its_real_tokens(skewed_ckpt, tmp_path):
    """Two sequences of 16 real tokens, trained at --seq-len 16 (no padding) and right-padded to 64:
    the same expert load, router biases after the updates and aux losses. Measured before the fix
    (the plain tiny checkpoint, one step, rate 1e-3): every layer's load summed to 256 = 2 x 64 x
    K at seq-len 64 against 64 unpadded (224 of 256 assignments were padding; layer 3 [83, 61, 34,
    56, 6, 9, 3, 4] against [16, 16, 5, 5, 6, 9, 3, 4]) and the aux loss was 1.0732 against 1.0520."""
    data = _real_tokens(tmp_path / "d.jsonl", [16, 16])

    def run(S: int, name: str) -> dict:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(skewed_ckpt)}, steps=2, seq_len=S, global_batch_size=2,
            micro_batch_size=1, out=str(tmp_path / name), progress=False, export=True, data=str(data),
            moe_bias_update_rate=1e-2, moe_aux_loss_coeff=0.1,
        )  # fmt: skip
        return run_training(cfg)["expert_load"]

    whole, padded = run(16, "whole"), run(64, "padded")
    # the MTP layer (8): position 15's input token lies past the window (or is padding): not counted
    assert [sum(row) for row in padded["load_last"]] == [2 * 16 * 2] * 5 + [2 * 15 * 2]
    assert padded["load_total"] == whole["load_total"] and padded["load_last"] == whole["load_last"]
    assert _biases(tmp_path / "padded" / "export") == _biases(tmp_path / "whole" / "export")
    assert max(abs(a - b) for a, b in zip(padded["aux_losses"], whole["aux_losses"])) < 1e-6


@pytest.mark.slow
def test_padded_load_and_bias_updates_equal_one_process_under_context_parallel(skewed_ckpt, padded_data, tmp_path):
    """Context parallel gives each rank zigzag slices of every sequence: each takes its own rows of
    the padding mask, so padded data gives one process's expert load and biases (no balance loss:
    --cp refuses it; the other layouts: test_bias_updates_equal_one_process_in_every_layout).  At
    dp 2 x cp 2 an expert's gradient is summed over the data and the context ranks (its partial
    sums on the two cp ranks of a dp rank differ), and with ``--expert-update routed-only`` an
    expert that only one cp rank's half of a sequence routes to is stepped on both: the losses,
    MTP losses and grad norms equal one process too (the layer-4 expert the biases starve included)."""
    steps = 4  # a cp rank's expert left unstepped shows in the losses from step 3 on
    args = ["--model", str(skewed_ckpt), "--steps", str(steps), "--seq-len", "16", "--global-batch-size", "2"]
    args += ["--micro-batch-size", "1", "--moe-bias-update-rate", "0.01", "--data", str(padded_data), "--export"]
    args += ["--expert-update", "routed-only"]
    runs, recs = {}, {}
    for name, layout in (("one", []), ("dp2cp2", ["--dp", "2", "--cp", "2"])):
        p, _ = run_train_cli([*args, "--out", str(tmp_path / name), *layout], timeout=240)
        if p.returncode != 0:
            pytest.fail(f"{name} failed:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path / name)}")
        recs[name] = losses(tmp_path / name)
        runs[name] = recs[name]["expert_load"]["load_total"]
    one, got = recs["one"], recs["dp2cp2"]
    for key in ("losses", "mtp_losses"):
        assert max(abs(a - b) for a, b in zip(one[key], got[key])) <= 1e-6, (key, one[key], got[key])
    assert max(abs(a / b - 1) for a, b in zip(one["grad_norms"], got["grad_norms"])) <= 1e-5, (one, got)
    from paddleformers_glm.train.data import open_data

    data = open_data(str(padded_data), 16, GlmMoeDsaConfig.from_pretrained(skewed_ckpt).vocab_size, 1234)
    real = sum(int(data.global_batch(step, 2)["attention_mask"].sum()) for step in range(steps))
    assert real < steps * 2 * 16 and sum(runs["one"][0]) == 2 * real  # K = 2 per real token, none per pad
    assert runs["dp2cp2"] == runs["one"]
    assert _biases(tmp_path / "dp2cp2" / "export") == _biases(tmp_path / "one" / "export")
