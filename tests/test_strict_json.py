"""Every JSON record the project writes is strict JSON (no NaN / Infinity tokens, which strict
parsers refuse): a non-finite number is written as null and listed under "nonfinite".  Checked
with a parser that refuses the tokens, on the writer itself and on the records of the commands
(check-loss, check-ckpt, plan; loss.json and failure.json in test_nonfinite.py, the launcher's
records in test_train_dist.py), and by a scan that finds no other JSON writer in the package."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm._io import dumps_json, write_json_atomic
from paddleformers_glm.cli import main as cli_main

from .conftest import ROOT, TINY_CONFIG


def strict_load(path):
    def refuse(token):
        raise ValueError(f"{path}: not strict JSON: {token}")

    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse)


def test_nonfinite_numbers_become_null_and_are_listed(tmp_path):
    rec = {
        "losses": [1.5, float("nan"), 2.0],
        "memory": {"peak": float("inf"), "ranks": [{"bytes": 3, "ratio": -math.inf}]},
        "np": np.float32("nan"),
        "ok": np.float64(0.25),
        "count": np.int64(7),
        "flag": True,
    }
    write_json_atomic(tmp_path / "r.json", rec, indent=None, sort_keys=False)
    got = strict_load(tmp_path / "r.json")
    assert got["losses"] == [1.5, None, 2.0] and got["memory"]["peak"] is None and got["np"] is None
    assert got["memory"]["ranks"] == [{"bytes": 3, "ratio": None}]
    assert (got["ok"], got["count"], got["flag"]) == (0.25, 7, True)
    assert got["nonfinite"] == ["losses[1]", "memory.peak", "memory.ranks[0].ratio", "np"]
    assert rec["losses"][1] != rec["losses"][1]  # the caller's object is left as it was


def test_finite_records_are_written_as_before():
    rec = {"b": [0.1, 1e-30, -2.5e300], "a": {"x": None, "y": "s"}}
    assert dumps_json(rec, indent=1) == json.dumps(rec, indent=1, sort_keys=True)


def test_a_nonfinite_number_that_cannot_be_flagged_is_refused():
    with pytest.raises(ValueError, match=r"non-finite numbers at \['\[0\]'\]"):
        dumps_json([float("nan")])
    with pytest.raises(ValueError, match="without a 'nonfinite' key"):
        dumps_json({"nonfinite": 1, "x": float("inf")})


def test_check_loss_receipt_with_an_infinite_jump_ratio(tmp_path, capsys):
    """A first divergence after bit-identical steps has ratio inf; written as null, flagged."""
    (tmp_path / "a.json").write_text('{"losses": [1.0, 2.0, 3.0]}')
    (tmp_path / "b.json").write_text('{"losses": [1.0, 2.0, 3.5]}')
    assert (
        cli_main(["check-loss", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "r.json")])
        == 1
    )
    r = strict_load(tmp_path / "r.json")
    assert r["jumps"][0]["ratio"] is None and r["nonfinite"] == ["jumps[0].ratio"]


def test_check_ckpt_receipt_with_nan_weights(tmp_path, capsys):
    """Two checkpoint files whose tensor holds NaN / inf on one side: refused by default (exit 2,
    the tensor named), compared with --allow-nonfinite, whose diffs are non-finite; both receipts
    are strict JSON."""
    from safetensors.numpy import save_file

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    bad = w.copy()
    bad[0, 0], bad[1, 1] = np.nan, np.inf
    save_file({"model.w": w}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    save_file({"model.w": bad}, str(tmp_path / "cand.safetensors"), metadata={"format": "pt"})
    args = ["check-ckpt", str(tmp_path / "ref.safetensors"), str(tmp_path / "cand.safetensors"), "--quiet"]
    assert cli_main([*args, "--json", str(tmp_path / "refused.json")]) == 2
    assert strict_load(tmp_path / "refused.json")["exit_code"] == 2
    assert cli_main([*args, "--allow-nonfinite", "--json", str(tmp_path / "r.json")]) == 1
    r = strict_load(tmp_path / "r.json")
    assert r["exit_code"] == 1 and r.get("nonfinite"), r


def test_plan_record_is_strict(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), "--tp", "2", "--json", str(out)]) == 0
    assert strict_load(out)["ranks"]


# JSON writers that do not go through _io (each writes no computed number)
ALLOWED = {
    "paddleformers_glm/tokenizer.py": "tokenizer_config.json (strings) and the chat template's tojson filter",
    "paddleformers_glm/ops/kernels.py": "the kernel build's cache key",
    "paddleformers_glm/configuration.py": "config.json in the HF format (its floats are checked on load)",
    "paddleformers_glm/parallel/export.py": "the safetensors index (names and byte sizes)",
    "paddleformers_glm/checkpoint/saver.py": "the safetensors index and config.json",
    "paddleformers_glm/checkpoint/safetensors_io.py": "the safetensors header (dtypes, shapes, offsets)",
    "paddleformers_glm/testing/toy.py": "the toy model's config",
    "paddleformers_glm/testing/checkpoints.py": "test checkpoints' index",
}


def test_no_other_json_writer_in_the_package():
    pattern = re.compile(r"\bjson\.dumps?\(")
    found = {}
    for path in sorted((ROOT / "paddleformers_glm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "paddleformers_glm/_io.py":
            continue
        hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
        if hits and rel not in ALLOWED:
            found[rel] = hits
    assert not found, f"JSON written around _io.dumps_json / write_json_atomic (not strict): {found}"
