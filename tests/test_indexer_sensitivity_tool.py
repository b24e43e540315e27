"""tools/indexer_target_sensitivity.py (docs/indexer.md): its nudge is the only thing that separates
the two runs it compares: with 0 ulps the two reference runs end bit-identical, with one ulp in the
warm-up's KL target the indexers' last weights move, and only theirs (the backbone is frozen)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._reference import missing_reference_extra

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp: Path, ckpt: Path, ulps: str) -> tuple[str, list[dict]]:
    out = tmp / f"ulps{ulps}"
    cmd = [sys.executable, str(ROOT / "tools" / "indexer_target_sensitivity.py"), str(out), "--steps", "4"]
    cmd += ["--ulps", ulps, "--", "--model", str(ckpt), "--seq-len", "32", "--global-batch-size", "2"]
    cmd += ["--lr", "1e-3", "--warmup-steps", "1", "--indexer-stage", "warmup"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    return p.stdout.strip().splitlines()[-1], report["differences"]


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_one_ulp_in_the_target_moves_only_the_indexers_and_zero_moves_nothing(tmp_path):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = Path(make_tiny_checkpoint(tmp_path / "ckpt", seed=0))
    line, diffs = _run(tmp_path, ckpt, "0")
    assert diffs == [] and line.endswith("last weights identical"), (line, diffs[:3])
    line, diffs = _run(tmp_path, ckpt, "1")
    moved = {d["key"] for d in diffs}
    assert moved and all(".indexer." in k for k in moved), sorted(moved)[:5]
    worst = max(d["max_abs_diff"] for d in diffs)
    assert 0 < worst and f"{worst:.3g}" in line, (line, worst)
