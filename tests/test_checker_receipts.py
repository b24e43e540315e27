"""What the checkers' receipts must make visible: a checkpoint or a loss record compared with itself
(under any name) is refused, a check-ckpt mismatch in bits only says so, and a check-loss input of a
crashed run carries its failure record."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import numpy as np
import pytest

from paddleformers_glm.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
needs_fixture = pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")


def _run(capsys, *args):
    code = main([*map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# ---------------------------------------------------------------- check-ckpt: a checkpoint against itself
@needs_fixture
def test_check_ckpt_refuses_the_same_files_under_another_name(tmp_path, capsys):
    """A linked parent folder reaches the very same files; so does ``X X``. Either "matched" (exit 0)
    whatever the checkpoint held, since the link checks only look at the named files and folder."""
    real = tmp_path / "real" / "ckpt"
    shutil.copytree(FIXTURE, real)
    (tmp_path / "alias").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias" / "parent")
    alias = tmp_path / "alias" / "parent" / "ckpt"
    receipt = tmp_path / "r.json"
    for cand in (alias, real):
        code, out, err = _run(capsys, "check-ckpt", real, cand, "--quiet", "--json", receipt)
        assert code == 2 and out == "", (code, out, err)
        assert len(err.splitlines()) == 1 and "are the same files" in err, err
        assert str(real) in err and str(cand) in err, err
        r = json.loads(receipt.read_text())
        assert r["result"] == "unusable input"
        assert r["cand"]["path"] == str(cand) and r["cand"]["real_path"] == r["ref"]["real_path"] == str(real)
    # a shard of REF given as CAND: the same file, though the paths name other things
    shard = sorted(real.glob("*.safetensors"))[0]
    code, _, err = _run(capsys, "check-ckpt", real, shard, "--quiet")
    assert code == 2 and "same files" in err, err
    # a real copy still compares, and its receipt names the real paths
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    code, out, err = _run(capsys, "check-ckpt", real, copy, "--quiet", "--json", receipt)
    assert code == 0, (out, err)
    r = json.loads(receipt.read_text())
    assert r["ref"]["real_path"] == str(real) and r["cand"]["real_path"] == str(copy)


# ---------------------------------------------------------------- check-ckpt: bit-only differences
_FLOAT_BYTES = {"BF16": 2, "F16": 2, "F32": 4}  # dtype -> bytes of an element; the last holds the sign bit


def _set_first_zero(folder: pathlib.Path, negative: bool) -> str:
    """Write +0.0 (or -0.0) over the first element of the first floating-point tensor, in place;
    returns the tensor's name."""
    for p in sorted(folder.glob("*.safetensors")):
        b = bytearray(p.read_bytes())
        n = struct.unpack("<Q", b[:8])[0]
        for key, v in json.loads(b[8 : 8 + n]).items():
            size = _FLOAT_BYTES.get(v["dtype"]) if key != "__metadata__" else None
            if size:
                i = 8 + n + v["data_offsets"][0]
                b[i : i + size] = bytes(size - 1) + (b"\x80" if negative else b"\x00")
                p.write_bytes(bytes(b))
                return key
    raise AssertionError("no floating-point tensor in the fixture")


@needs_fixture
def test_check_ckpt_says_why_bytes_of_equal_values_mismatch(tmp_path, capsys):
    """-0.0 for +0.0 hashes apart (exit 1 stays right), but the entry read ``max_abs_diff 0,
    differing_elements 0``: a mismatch with nothing to act on."""
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    shutil.copytree(FIXTURE, ref)
    shutil.copytree(FIXTURE, cand)
    key = _set_first_zero(ref, negative=False)
    assert _set_first_zero(cand, negative=True) == key
    receipt = tmp_path / "r.json"
    code, out, err = _run(capsys, "check-ckpt", ref, cand, "--quiet", "--json", receipt)
    assert code == 1, (out, err)
    r = json.loads(receipt.read_text())
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == key and d["max_abs_diff"] == 0.0 and d["differing_elements"] == 0
    assert d["bits_only_elements"] == 1 and "sign of a zero" in d["reason"], d
    assert r["value_summary"]["bits_only"] == 1
    line = next(ln for ln in out.splitlines() if key in ln)
    assert "differing_elements=0" in line and "bits_only_elements=1" in line and "sign of a zero" in line, out


def test_diff_stats_counts_equal_values_in_other_bits_across_chunks():
    """Signed zeros and NaN payloads counted a chunk at a time, as the values are (memory bounded)."""
    from paddleformers_glm.parity import ckpt_check

    n = ckpt_check._DIFF_CHUNK * 2 + 5
    x, y = np.zeros(n, np.float32), np.zeros(n, np.float32)
    x[0] = y[0] = np.nan
    y.view(np.uint32)[0] |= 1  # another NaN payload
    y[ckpt_check._DIFF_CHUNK + 1] = -0.0
    y[-1] = -0.0
    y[7] = 2.0  # a real difference beside them
    mad, differing, bits_only = ckpt_check._diff_stats(x, "F32", y, "F32")
    assert (mad, differing, bits_only) == (2.0, 1, 3)
    bx = np.zeros(10, np.uint16)  # bf16 bits: 0x8000 is -0.0
    by = bx.copy()
    by[3] = 0x8000
    assert ckpt_check._diff_stats(bx, "BF16", by, "BF16") == (0.0, 0, 1)


# ---------------------------------------------------------------- check-loss: one file, crashed runs
def _run_folder(tmp_path, name, losses, failure: str | None = None) -> pathlib.Path:
    out = tmp_path / name
    out.mkdir()
    (out / "loss.json").write_text(json.dumps({"losses": losses, "steps": len(losses)}))
    if failure is not None:  # as glm52 train writes OUT/logs/failure.json when a run stops on an error
        (out / "logs").mkdir()
        (out / "logs" / "failure.json").write_text(json.dumps({"rank": 0, "cause": "error", "message": failure}))
    return out


def test_check_loss_refuses_a_file_compared_with_itself(tmp_path, capsys):
    """The same loss.json (by its run folder, a link) "passed" bit-exact, whatever it held."""
    run = _run_folder(tmp_path, "run", [1.0, 0.9])
    link = tmp_path / "link.json"
    os.symlink(run / "loss.json", link)
    receipt = tmp_path / "r.json"
    for a, b in ((run, run / "loss.json"), (run, link), (run / "loss.json", run / "loss.json")):
        code, out, err = _run(capsys, "check-loss", a, b, "--json", receipt)
        assert code == 2 and out == "", (a, b, out, err)
        assert len(err.splitlines()) == 1 and "are the same file" in err and str(run / "loss.json") in err, err
        r = json.loads(receipt.read_text())
        assert r["result"] == "unusable input" and r["a"]["real_path"] == r["b"]["real_path"]


def test_check_loss_receipt_shows_a_crashed_run(tmp_path, capsys):
    """Two runs that died at the same step agree on the steps they did: the verdict stands, but the
    receipt and the output say they failed (their OUT/logs/failure.json)."""
    a = _run_folder(tmp_path, "a", [1.0, 0.9], failure="RuntimeError: injected fault on rank 0 at step 2")
    b = _run_folder(tmp_path, "b", [1.0, 0.9], failure="RuntimeError: injected fault on rank 0 at step 2")
    receipt = tmp_path / "r.json"
    code, out, err = _run(capsys, "check-loss", a, b, "--json", receipt)
    assert code == 0 and out.startswith("check-loss: pass"), (out, err)
    r = json.loads(receipt.read_text())
    for side, folder in (("a", a), ("b", b)):
        assert r[side]["failed_run"] == {
            "file": str(folder / "logs" / "failure.json"),
            "message": "RuntimeError: injected fault on rank 0 at step 2",
        }
        assert r[side]["steps_done"] == 2
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "failed run" in warnings[0] and str(a / "logs" / "failure.json") in warnings[0]
    assert r["warnings"] and "failed run" in r["warnings"][0]
    # one crashed run against a full one, over the steps both did: named on its side only
    full = _run_folder(tmp_path, "full", [1.0, 0.9, 0.8])
    code, out, err = _run(capsys, "check-loss", a, full, "--steps", "2", "--json", receipt)
    r = json.loads(receipt.read_text())
    assert code == 0 and "failed_run" in r["a"] and "failed_run" not in r["b"], r
    assert r["b"]["steps_done"] == 3 and len([ln for ln in err.splitlines() if "warning" in ln]) == 1


def test_an_earlier_runs_failure_record_is_not_this_runs(tmp_path, capsys):
    """A multi-node job's ``logs/node1/failure.json`` stays when a later run into the same OUT logs in
    ``logs/`` (only the folder a run logs in has its record set aside): older than the later run's
    loss.json, it is an earlier run's, and the later run is not called failed."""
    run = _run_folder(tmp_path, "run", [1.0, 0.9])
    node = run / "logs" / "node1"
    node.mkdir(parents=True)
    (node / "failure.json").write_text(json.dumps({"rank": 1, "message": "an earlier job's fault"}))
    past = os.stat(run / "loss.json").st_mtime - 3600
    os.utime(node / "failure.json", (past, past))
    other = _run_folder(tmp_path, "other", [1.0, 0.9])
    receipt = tmp_path / "r.json"
    code, out, err = _run(capsys, "check-loss", run, other, "--json", receipt)
    r = json.loads(receipt.read_text())
    assert code == 0 and "failed_run" not in r["a"] and "warning" not in err, (r["a"], err)
    now = os.stat(run / "loss.json").st_mtime + 1  # the record of a run that failed after its last losses
    os.utime(node / "failure.json", (now, now))
    _run(capsys, "check-loss", run, other, "--json", receipt)
    assert json.loads(receipt.read_text())["a"]["failed_run"]["file"] == str(node / "failure.json")


def test_integers_past_two_to_the_53_are_compared_exactly():
    """int64 values 2**53 + 1 and 2**53 are one float64: counted equal (and then called a bits-only
    difference) before; integer tensors are compared as integers."""
    from paddleformers_glm.parity import ckpt_check

    x = np.array([2**53, 5, 7], np.int64)
    y = np.array([2**53 + 1, 5, 7], np.int64)
    mad, differing, bits_only = ckpt_check._diff_stats(x, "I64", y, "I64")
    assert (differing, bits_only) == (1, 0)
