"""NaN/Inf that no loss or gradient shows, and NaN refusals reported across ranks.

Measured before these guards (docs/failure-modes.md, "Non-finite steps"): ``--lr 1e39`` (finite as a
Python float, infinite in the float32 update) passed the flag check and wrote NaN weights into the
step-1 checkpoint and the export with exit 0; ``--moe-bias-update-rate 1e39`` made every router bias
NaN/Inf while the losses stayed finite (exit 0, exported); an fp32-finite ``--lr 3e38`` overflowed in
Adam's bias-corrected step the same way; with ``--tp 2`` NaN weights in rank 1's slice, or a NaN
moment in a resume state, were reported with the worker's Python traceback (about 10 lines on
stderr, a full traceback on stdout) and the resume state's moment was called a "weight tensor"
with the FP8 ``scale_inv`` hint.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm.train.command import main as train_main
from paddleformers_glm.train.command import train_line_error
from tests.conftest import FIXTURES

TOY = ["--model", "toy", "--seq-len", "16", "--no-progress"]
TINY = ["--seq-len", "16", "--global-batch-size", "2", "--micro-batch-size", "1", "--no-progress"]


def strict(path):
    def refuse(token):
        raise ValueError(f"{path}: not strict JSON: {token}")

    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse)


# ---------------------------------------------------------------- F1 (a): flags infinite in float32
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--lr", "1e39"),
        ("--min-lr", "1e39"),
        ("--moe-bias-update-rate", "1e39"),
        ("--moe-bias-update-rate", "3.4028236e38"),  # just past float32's largest value (rounds to inf)
        ("--weight-decay", "1e39"),
        ("--clip-grad", "1e39"),
        ("--moe-aux-loss-coeff", "1e39"),
    ],
)
def test_a_float_flag_infinite_in_float32_is_refused_with_one_line(tmp_path, capsys, flag, value):
    assert train_main([*TOY, "--steps", "1", "--out", str(tmp_path / "o"), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # the flag, its value and float32's limit
    assert err.startswith(f"glm52 train: error: {flag} must be finite in float32"), err
    assert "3.4028235e+38" in err and f"got {float(value)!r}" in err, err
    assert not (tmp_path / "o" / "loss.json").exists()


def test_float32s_largest_value_itself_is_accepted_and_align_refuses_what_train_refuses():
    """The bound is float32's rounding: 3.4028235e38 is finite there; glm52 align checks the line it
    hands to glm52 train with train_line_error, so it refuses the same flag before any run."""
    from paddleformers_glm.train.settings import TrainConfig, check_numbers

    check_numbers(TrainConfig(model="toy", lr=3.4028235e38, min_lr=0.0, moe_bias_update_rate=3.4028235e38))
    with pytest.raises(ValueError, match=r"--adam-eps must be finite in float32"):
        check_numbers(TrainConfig(model="toy", adam_eps=1e39))
    bad = train_line_error(["--model", "toy", "--steps", "1", "--moe-bias-update-rate", "1e39"])
    assert bad and bad.startswith("--moe-bias-update-rate must be finite in float32"), bad


# ---------------------------------------------------------------- F1 (b): nothing non-finite is written
def test_an_update_that_overflows_float32_saves_no_checkpoint_and_names_the_tensor(tmp_path, capsys):
    """``--lr 3e38`` is finite in float32, but Adam's step-1 rate (lr x sqrt(1 - beta2) / (1 - beta1))
    is not: step 1's loss and gradients are finite, its update writes Inf/NaN weights. The step-1
    resume state is refused before anything is written, naming the tensor and the step; failure.json
    points at no checkpoint (before: step_00000001 held the NaN weights and was the 'last checkpoint')."""
    out = tmp_path / "o"
    args = ["--steps", "2", "--lr", "3e38", "--min-lr", "3e38", "--save-every", "1", "--export"]
    assert train_main([*TOY, *args, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "glm52 train: step 1: the resume state to be written holds NaN or Inf: weight model/" in err, err
    assert "not saved" in err and "last checkpoint: none saved" in err, err
    rec = strict(out / "logs" / "failure.json")
    assert (rec["cause"], rec["step"], rec["rank"], rec["last_checkpoint"]) == ("nonfinite", 1, 0, None), rec
    assert rec["tensor"].startswith("model/"), rec
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))
    assert not (out / "export").exists()


def test_an_export_of_nonfinite_weights_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    assert train_main([*TOY, "--steps", "1", "--lr", "3e38", "--min-lr", "3e38", "--export", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "step 1: the export to be written holds NaN or Inf: weight " in err and "no export written" in err, err
    assert not (out / "export").exists()
    assert strict(out / "logs" / "failure.json")["cause"] == "nonfinite"


def test_a_router_bias_overflow_stops_the_run_naming_step_flag_and_bias(tmp_path, capsys):
    """``--moe-bias-update-rate 3e38`` (finite in float32): step 1 moves the biases to +-3e38, step 2
    overflows those that move the same way again. The losses stay finite, so no other guard sees
    it (before: exit 0 and NaN/Inf biases exported). Stopped at step 2 before the biases are set;
    failure.json's last checkpoint is step 1's, whose biases are finite."""
    out = tmp_path / "o"
    model = ["--model", str(FIXTURES / "tiny" / "checkpoint")]
    args = ["--steps", "3", "--moe-bias-update-rate", "3e38", "--save-every", "1", "--export"]
    assert train_main([*model, *TINY, *args, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "glm52 train: step 2: --moe-bias-update-rate 3e+38 made the router bias of MoE layer(s) " in err, err
    assert ".e_score_correction_bias" in err and "last checkpoint: " in err, err
    rec = strict(out / "logs" / "failure.json")
    assert (rec["cause"], rec["step"], rec["quantity"], rec["flag"]) == (
        "nonfinite",
        2,
        "router bias",
        "--moe-bias-update-rate",
    ), rec
    assert rec["last_checkpoint"].endswith("step_00000001") and rec["tensor"].endswith("e_score_correction_bias")
    assert not (out / "export").exists() and not (out / "checkpoints" / "step_00000002").exists()
    from safetensors.numpy import load_file

    saved = load_file(str(out / "checkpoints" / "step_00000001" / "rank_00000.safetensors"))
    biases = [v for k, v in saved.items() if k.endswith("e_score_correction_bias")]
    assert biases and all(np.isfinite(b).all() for b in biases)
    assert max(float(np.abs(b).max()) for b in biases) > 1e38  # step 1 did move them


# ---------------------------------------------------------------- F4: the resume message, and one line per rank error
def _nan_in_rank_file(folder: Path, rank: int, key: str) -> None:
    f = folder / f"rank_{rank:05d}.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    begin = json.loads(data[8 : 8 + n])[key]["data_offsets"][0]
    data[8 + n + begin : 8 + n + begin + 4] = struct.pack("<f", float("nan"))
    f.write_bytes(bytes(data))


def test_a_nan_moment_in_a_resume_state_is_named_as_a_moment_of_its_rank_file(tmp_path, capsys):
    first = tmp_path / "first"
    assert train_main([*TOY, "--steps", "2", "--save-every", "1", "--out", str(first)]) == 0
    state = tmp_path / "state"
    shutil.copytree(first / "checkpoints" / "step_00000001", state)
    _nan_in_rank_file(state, 0, "optimizer/embed_tokens.weight/moment2")
    capsys.readouterr()
    args = ["--steps", "2", "--resume", str(state), "--out", str(tmp_path / "o")]
    assert train_main([*TOY, *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"{state / 'rank_00000.safetensors'} (the state of rank 0)" in err, err
    assert "optimizer/embed_tokens.weight/moment2 (1 values) [optimizer moment]" in err, err
    assert "weight tensor" not in err and "scale_inv" not in err, err


def test_the_launcher_reports_a_ranks_nonfinite_weights_in_one_line(tmp_path):
    """A worker's NonFiniteError (what worker.py records, then the launcher's diagnosis): the message
    names the rank, the file and the tensor, with no traceback; the tensor goes to failure.json."""
    from paddleformers_glm.checkpoint.finite import NonFiniteError
    from paddleformers_glm.train.job_status import diagnose, write_record
    from paddleformers_glm.train.worker import clean_detail

    e = NonFiniteError("1 weight tensor(s) loaded from /m hold NaN or Inf: lm_head.weight (64 values)", file="/m",
                       key="lm_head.weight")  # fmt: skip
    e.counts = {"lm_head.weight": 64}
    status = tmp_path / "status"
    status.mkdir()
    tail = 'Traceback (most recent call last):\n  File "loop.py", line 1\nNonFiniteError: ...'
    record = {"rank": 1, "time": 1.0, "type": "NonFiniteError", "message": str(e), "comm": False,
              "traceback_tail": tail, "detail": clean_detail(e, 1, str(e)), "peers": None}  # fmt: skip
    write_record(str(status), 1, "error.json", record)
    write_record(str(status), 0, "error.json", {**record, "rank": 0, "time": 2.0, "comm": True, "detail": None})
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "error"), d
    assert "\n" not in d.message and "Traceback" not in d.message, d.message
    assert d.message.startswith("rank 1 failed: NonFiniteError: 1 weight tensor(s) loaded from /m"), d.message
    assert (d.detail["tensor"], d.detail["file"]) == ("lm_head.weight", "/m")
    assert clean_detail(RuntimeError("x"), 1, "x") is None  # any other error keeps its traceback


@pytest.mark.slow
def test_tp2_nan_weights_in_rank_1s_slice_are_one_line_without_traceback(tmp_path):
    """``--tp 2`` with NaN only in rank 1's half of lm_head's rows: one line naming the rank, the
    checkpoint and the tensor, and the failure record's pointer; no traceback on stderr or stdout."""
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint
    from tests._dist.runner import run_train_cli

    model = tmp_path / "nan_lm"
    shutil.copytree(FIXTURES / "tiny" / "checkpoint", model)
    with Checkpoint(str(model)) as ckpt:
        info = ckpt.info("lm_head.weight")
    assert info.dtype == "BF16" and info.shape[0] == 256
    with open(info.file, "r+b") as f:  # row 200: tp rank 1 holds rows 128..255
        f.seek(info.begin + 200 * info.shape[1] * 2)
        f.write(b"\xc0\x7f")
    out = tmp_path / "o"
    p, _ = run_train_cli(["--model", str(model), "--tp", "2", "--steps", "1", *TINY, "--out", str(out)], timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "ccache" not in ln and "warn" not in ln.lower()]
    assert lines[0].startswith("glm52 train: rank 1 failed: NonFiniteError: ") and "lm_head.weight" in lines[0], lines
    assert str(model) in lines[0], lines
    assert lines[1:] == [f"(failure record: {out / 'logs' / 'failure.json'})"], lines
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, (p.stdout[-3000:], p.stderr[-3000:])
    rec = strict(out / "logs" / "failure.json")
    assert (rec["rank"], rec["cause"], rec["tensor"]) == (1, "error", "lm_head.weight"), rec


def test_an_accelerator_state_is_checked_with_one_host_read(monkeypatch):
    """Before a save the trainer counts the NaN/Inf of every tensor it writes.  A tensor that is not
    on the host (no numpy view of its memory: an accelerator's) was reduced and read one by one, a
    device sync per tensor per save (thousands on the 744B model); the flags are now read in one
    go, and the counts equal the host path's bit test."""
    import paddle

    from paddleformers_glm.checkpoint import engine
    from paddleformers_glm.checkpoint.finite import nonfinite_state_counts

    rng = np.random.default_rng(0)
    state = {f"w{i}": paddle.to_tensor(rng.standard_normal((5, 7)).astype("float32")) for i in range(6)}
    state["ids"] = paddle.arange(4)  # an integer tensor is not checked
    assert nonfinite_state_counts(state) == {}
    w1, w4 = state["w1"].numpy(), state["w4"].numpy()
    w1[0, :3], w4[2, 1], w4[3, 3] = np.nan, np.inf, -np.inf
    state["w1"], state["w4"] = paddle.to_tensor(w1), paddle.to_tensor(w4)
    on_host = nonfinite_state_counts(state)
    assert on_host == {"w1": 3, "w4": 2}

    monkeypatch.setattr(engine, "numpy_view", lambda t: None)  # every tensor takes the device path
    reads = []
    host_read = paddle.Tensor.numpy
    monkeypatch.setattr(paddle.Tensor, "numpy", lambda self, *a, **k: reads.append(1) or host_read(self, *a, **k))
    assert nonfinite_state_counts(state) == on_host
    reads.clear()
    finite = {k: v for k, v in state.items() if k not in ("w1", "w4")}
    assert nonfinite_state_counts(finite) == {} and len(reads) == 1


# ---------------------------------------------------------------- what the failure record says, and the norm's reach
def test_an_infinite_gradient_is_counted_and_named_as_a_nan_is():
    import paddle

    from paddleformers_glm.train.nonfinite import local_report

    grads = {"a": paddle.to_tensor([1.0, 2.0]), "b": paddle.to_tensor([1.0, float("inf")])}
    r = local_report(0, {"lm": 1.0}, grads, ["a", "b"])
    assert (r["first_nonfinite_grad"], r["nonfinite_grads"], r["losses"]) == ("b", 1, {}), r
    assert local_report(0, {"lm": float("-inf")}, {}, [])["losses"] == {"lm": "-inf"}  # not "inf"


def test_the_rank_whose_loss_is_not_finite_is_the_culprit_not_the_first_with_a_nan_gradient():
    """After the gradient sync every rank holds the NaN gradients; the last pipeline stage alone
    holds the loss that made them: the record blames it and still names rank 0's first gradient."""
    from paddleformers_glm.train.nonfinite import nonfinite_record

    reports = [
        {"rank": 0, "losses": {}, "first_nonfinite_grad": "embed.weight", "nonfinite_grads": 3},
        {"rank": 1, "losses": {"lm": "nan"}, "first_nonfinite_grad": "head.weight", "nonfinite_grads": 2},
    ]
    rec = nonfinite_record(5, float("nan"), reports)
    assert (rec["rank"], rec["quantity"], rec["value"]) == (1, "lm loss", "nan"), rec
    assert rec["first_nonfinite_grad"] == {"rank": 0, "name": "embed.weight"}, rec
    assert rec["message"].startswith("step 5: non-finite lm loss (nan) on rank 1; "), rec["message"]


def test_a_nonfinite_loss_term_with_finite_gradients_makes_the_norm_nan_and_the_clip_a_no_op():
    """Any of a rank's loss sums (the MTP term's too) NaN or infinite makes the global norm NaN
    though every gradient is finite, so the loop stops the step; the clip leaves gradients as they
    are for a non-finite norm (factor 1), never scaling them by NaN or 0."""
    import math

    import paddle

    from paddleformers_glm.parallel.grads import GradSynchronizer, clip_main_grads
    from paddleformers_glm.parallel.topology import get_topology, set_topology
    from paddleformers_glm.train.nonfinite import loss_flag

    set_topology(None)
    m = paddle.nn.Linear(3, 4)
    m(paddle.ones([2, 3])).sum().backward()
    sync = GradSynchronizer(m, get_topology())
    grads = sync.main_grads()[0]
    assert math.isfinite(sync.global_norm(grads, loss_flag([1.0, 2.0])))
    for sums in ([float("nan")], [1.0, float("inf")], [paddle.to_tensor([3.0]), paddle.to_tensor([float("-inf")])]):
        assert math.isnan(sync.global_norm(grads, loss_flag(sums))), sums
    before = {n: g.numpy().copy() for n, g in grads.items()}
    for bad in (float("nan"), float("inf")):
        assert clip_main_grads(grads, bad, 1.0) == 1.0
        assert all(np.array_equal(before[n], grads[n].numpy()) for n in grads)


@pytest.mark.slow
def test_a_router_bias_overflow_on_one_pipeline_stage_stops_both_with_the_named_record(tmp_path):
    """At ``--pp 2`` only stage 0's MoE layer 3 overflows (its bias starts at 3e38, the rate 1e38):
    both stages learn it in the same step and stop with the named record; a stage left out would
    run on into the next step's collectives while the other gathers its report."""
    import paddle

    from paddleformers_glm.checkpoint import save_pretrained_state
    from paddleformers_glm.tiny import init_state, tiny_config
    from tests._dist.runner import run_train_cli

    config = tiny_config()
    state = init_state(config)
    state["model.layers.3.mlp.gate.e_score_correction_bias"][:] = 3e38
    ckpt = tmp_path / "ckpt"
    save_pretrained_state({k: paddle.to_tensor(v) for k, v in state.items()}, config, ckpt, max_shard_size="1MB")
    out = tmp_path / "o"
    args = ["--model", str(ckpt), "--steps", "2", *TINY, "--moe-bias-update-rate", "1e38", "--pp", "2"]
    p, _ = run_train_cli([*args, "--job-timeout", "120", "--out", str(out)], timeout=240)
    assert p.returncode == 1, p.stderr[-3000:]
    want = "glm52 train: step 1: --moe-bias-update-rate 1e+38 made the router bias of MoE layer(s) 3 non-finite"
    assert want in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    rec = strict(out / "logs" / "failure.json")
    assert (rec["step"], rec["quantity"], rec["flag"]) == (1, "router bias", "--moe-bias-update-rate"), rec
