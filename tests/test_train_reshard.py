"""Resume across parallel layouts: a checkpoint saved at TP2 x PP2 (world 4) resumes at
DP2 x Sharding2 and at PP4 (world 4) and in one process, weights and optimizer state resharded by
Paddle's flex-checkpoint, and continues the uninterrupted TP2 x PP2 curve (losses, MTP losses,
grad norms within 1e-5 at lr 1e-4).  Also the probe of the CPU gap flex-checkpoint's stock load
has, and the refusal of a resume that changes the run's settings rather than its layout."""

from __future__ import annotations

import pytest

from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import losses, run_train_cli, worker_logs
from tests.test_resume_memory import assert_bounded, measure_resume

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, LR, TOL = 4, 2, 1e-4, 1e-5
COMMON = ["--model", "toy", "--steps", str(STEPS), "--seq-len", "16", "--global-batch-size", "4"]
COMMON += ["--micro-batch-size", "1", "--lr", str(LR), "--warmup-steps", "1", "--seed", "7"]


def _cli(out, *extra, timeout=200):
    p, secs = run_train_cli([*COMMON, "--out", str(out), *extra], timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"train {extra} failed (rc {p.returncode}) in {secs:.1f}s:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted TP2 x PP2 run; it saves its state after step 2."""
    out = tmp_path_factory.mktemp("tp2pp2")
    full = _cli(out, "--tp", "2", "--pp", "2", "--save-every", str(SAVE_AT))
    ckpt = out / "checkpoints" / f"step_{SAVE_AT:08d}"
    assert (ckpt / "flex").is_dir() and (ckpt / "meta.json").is_file(), sorted(p.name for p in ckpt.iterdir())
    assert full["run"]["grad_clip"] == "HybridParallelClipGrad", full["run"]  # Fleet's clip at TP2 x PP2
    return full, ckpt


def _assert_continues(full, r, what):
    assert r["run"]["resumed_from_step"] == SAVE_AT, r["run"]
    assert r["lrs"] == full["lrs"], (r["lrs"], full["lrs"])
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert len(r[key]) == STEPS, (key, r[key])
        d = max(abs(a - b) for a, b in zip(full[key][SAVE_AT:], r[key][SAVE_AT:]))
        assert d <= TOL, f"{what}: {key} after resume differ by {d} ({full[key]} vs {r[key]})"
    print(f"{what}: resumed losses {r['losses'][SAVE_AT:]} vs uninterrupted {full['losses'][SAVE_AT:]}")


@pytest.mark.parametrize(
    "layout",
    [
        ("--dp", "2", "--sharding", "2"),
        ("--pp", "4", "--pp-layout", "E,t|t*2|t*2|t,m,L"),
        ("--tp", "2", "--pp", "2", "--pp-layout", "E,t*2|t*4,m,L"),
    ],
    ids=["dp2sharding2", "pp4", "tp2pp2-another-split"],
)
def test_tp2pp2_checkpoint_resumes_at_another_world4_layout(saved, tmp_path, layout):
    """Another world-4 layout, or the same TP2 x PP2 with the layers split otherwise between the
    stages (each rank file then holds another stage's tensors: the state is resharded through
    flex/, not read by rank)."""
    full, ckpt = saved
    r = _cli(tmp_path / "resumed", *layout, "--resume", str(ckpt))
    assert r["profile"]["world"] == 4 and r["profile"]["tp"] == (2 if "--tp" in layout else 1)
    assert r["run"]["pp_layout"] != full["run"]["pp_layout"], (r["run"]["pp_layout"], full["run"]["pp_layout"])
    _assert_continues(full, r, " ".join(layout))
    if "--sharding" in layout:  # the optimizer state arrived split over the sharding ranks
        per_rank = r["optimizer_state_bytes"]
        assert len(per_rank) == 4 and max(per_rank) < 0.55 * sum(per_rank[:2]), per_rank


def test_tp2pp2_checkpoint_resumes_in_one_process(saved, tmp_path, monkeypatch):
    full, ckpt = saved
    cfg = TrainConfig(
        model="toy", steps=STEPS, seq_len=16, global_batch_size=4, micro_batch_size=1, lr=LR, warmup_steps=1,
        seed=7, out=str(tmp_path), progress=False, model_args={"seed": 7}, resume=str(ckpt),
    )  # fmt: skip
    seen = measure_resume(monkeypatch)  # the resharding load fills the live state in place
    r = run_training(cfg)
    _assert_continues(full, r, "world 1")
    assert_bounded(seen, "TP2 x PP2 -> world 1")


def test_resume_refuses_changed_run_settings(saved, tmp_path):
    _, ckpt = saved
    cfg = TrainConfig(
        model="toy", steps=STEPS, seq_len=32, global_batch_size=4, micro_batch_size=1, lr=LR, warmup_steps=1,
        seed=7, out=str(tmp_path), progress=False, model_args={"seed": 7}, resume=str(ckpt),
    )  # fmt: skip
    with pytest.raises(ValueError, match="a resume keeps these settings of the saved run: seq-len saved 16, now 32"):
        run_training(cfg)


def test_flex_checkpoint_stock_load_needs_the_cpu_shim(dist_save_and_flex_probe):
    """Paddle's resharding load moves every broadcast slice to a GPU; on a CPU build the stock call
    fails, and inside ``flex_checkpoint_on_cpu`` the same call reshards rows into columns exactly.
    (The probe runs at the end of a two-rank launch shared with another test: conftest.py.)"""
    p, logs = dist_save_and_flex_probe["proc"], dist_save_and_flex_probe["logs"]
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{logs[-4000:]}"
    assert logs.count("NO_SHIM ValueError: No available device found") == 2, logs[-3000:]
    assert logs.count("SHIM ok=True") == 2, logs[-3000:]
