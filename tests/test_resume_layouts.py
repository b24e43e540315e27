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
