"""Resume across layouts of one world size: a state saved at ``--sharding 2`` (world 2) resumed at
``--dp 2`` (world 2, the same tp, pp and world, another layout) continues the uninterrupted run.

Each rank's ``rank_N.safetensors`` of a sharding run holds the optimizer state of the parameters that
rank updates only, so a resume at another layout reads ``flex/`` whatever stays the same
(docs/parallel.md, "Checkpoints"); read as a same-layout state, the parameters of the other rank
would restart their moments from zero."""

from __future__ import annotations

import json

import pytest

from tests._dist.runner import losses, run_train_cli, worker_logs

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, TOL = 3, 1, 1e-5
COMMON = ["--model", "toy", "--steps", str(STEPS), "--seq-len", "16", "--global-batch-size", "4"]
COMMON += ["--micro-batch-size", "1", "--lr", "1e-3", "--warmup-steps", "1", "--seed", "7"]


def _cli(out, *extra, timeout=300):
    p, secs = run_train_cli([*COMMON, "--out", str(out), *extra], timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"train {extra} failed (rc {p.returncode}) in {secs:.1f}s:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


def test_a_sharding_state_resumes_at_dp_of_the_same_world_and_continues_the_run(tmp_path):
    """A resume whose layout differs from the saved one in any layout key (here ``sharding`` and
    ``dp`` at one tp, pp and world size) is resharded from ``flex/`` and continues the uninterrupted
    losses and gradient norms (docs/parallel.md, "Checkpoints"; docs/failure-modes.md, "Resume
    state")."""
    full = _cli(tmp_path / "sharding2", "--sharding", "2", "--save-every", str(SAVE_AT))
    ckpt = tmp_path / "sharding2" / "checkpoints" / f"step_{SAVE_AT:08d}"
    r = _cli(tmp_path / "dp2", "--dp", "2", "--resume", str(ckpt))
    saved = json.loads((ckpt / "meta.json").read_text())["profile"]
    assert (saved["sharding"], saved["dp"], saved["world"]) == (2, 1, 2), saved
    assert (r["profile"]["dp"], r["profile"]["world"]) == (2, 2), r["profile"]
    assert r["run"]["resumed_from_step"] == SAVE_AT, r["run"]
    for key in ("losses", "grad_norms"):
        assert len(r[key]) == STEPS, (key, r[key])
        d = max(abs(a - b) for a, b in zip(full[key][SAVE_AT:], r[key][SAVE_AT:]))
        assert d <= TOL, f"{key} after the resume differ by {d} ({full[key]} vs {r[key]})"


def test_a_warmup_state_at_sharding_resumes_in_the_sparse_stage_at_the_same_layout(tmp_path):
    """docs/indexer.md, "Resuming across stages": a warm-up checkpoint resumes in the sparse stage.
    Under ``--sharding 2`` Fleet splits the optimizer's parameter list among the sharding ranks, and
    the stage changes that list (the indexers only, then the whole model), so each rank file holds
    another split than the run's: read as a same-layout state, the workers refused it ("optimizer
    state for parameters this run does not update"). It is read through ``flex/`` as a layout change
    is, and the run equals the same resume at ``--dp 2`` (which went through ``flex/`` already)."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    base = ["--model", str(ckpt), "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "1"]
    sparse = [*base, "--steps", "2", "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.1", "--seed", "7"]

    def run(out, *extra):
        p, secs = run_train_cli([*extra, "--out", str(tmp_path / out)], timeout=300)
        if p.returncode != 0:
            pytest.fail(
                f"{out} failed (rc {p.returncode}) in {secs:.1f}s:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path / out)}"
            )
        return losses(tmp_path / out)

    run(
        "warm",
        *base,
        "--steps",
        "1",
        "--save-every",
        "1",
        "--sharding",
        "2",
        "--indexer-stage",
        "warmup",
        "--seed",
        "7",
    )
    state = tmp_path / "warm" / "checkpoints" / "step_00000001"
    a = run("sharding2", *sparse, "--sharding", "2", "--resume", str(state))
    b = run("dp2", *sparse, "--dp", "2", "--resume", str(state))
    assert len(a["losses"]) == len(b["losses"]) == 2
    d = max(abs(x - y) for x, y in zip(a["losses"][1:], b["losses"][1:]))
    assert d <= TOL, (a["losses"], b["losses"])
