"""bench/bench_train_step.py runs end to end at a tiny size.

The Paddle side is always asserted. The HF side needs torch + transformers (the `reference` extra):
without them its test is skipped, explicitly, so a CI without torch never counts it as passed.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_train_step.py"


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--tiny", "--threads", "1", "--ckpt", str(tmp_path / "ckpt"), "--json", str(out)]
    proc = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| index_topk | S | ours tok/s" in proc.stdout
    return json.loads(out.read_text())


def _check_ours(res: dict) -> dict:
    (row,) = res["results"]
    ours = row["ours"]
    assert "error" not in ours, ours
    assert ours["step_s"] > 0 and ours["peak_gb"] > 0 and ours["loss"] > 0
    mods = row["modules"]
    assert mods and mods["step"] > 0 and mods["indexer fwd"] > 0 and mods["moe fwd"] > 0
    assert mods["attention core fwd"] > 0 and mods["attention core bwd"] > 0
    return row


HAVE_HF = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    """One run serves both tests: with the HF side when torch + transformers are installed (our
    side runs the same in both), else with --skip-hf."""
    return _run(tmp_path_factory.mktemp("bench"), *([] if HAVE_HF else ["--skip-hf"]))


def test_bench_paddle_side_runs(bench):
    row = _check_ours(bench)
    if not HAVE_HF:  # --skip-hf: no HF row
        assert row["hf"] is None


@pytest.mark.reference
@pytest.mark.skipif(
    not HAVE_HF, reason="HF comparison NOT run: torch/transformers (the `reference` extra) not installed"
)
def test_bench_hf_side_runs_and_matches_the_loss(bench):
    row = _check_ours(bench)
    hf = row["hf"]
    assert hf is not None and "error" not in hf, hf
    assert hf["step_s"] > 0 and hf["peak_gb"] > 0
    # same weights, same batch: the training loss agrees (fp32, different kernels)
    assert abs(hf["loss"] - row["ours"]["loss"]) < 1e-4


@pytest.mark.reference
@pytest.mark.skipif(not HAVE_HF, reason="HF comparison NOT run: torch/transformers not installed")
def test_bench_packed_rows_match_the_loss(tmp_path):
    """``--packed 4``: both sides train the row as 4 packed sequences (position_ids restarting,
    use_cache=False) and agree on the loss; it differs from the unpacked row's."""
    row = _check_ours(_run(tmp_path, "--packed", "4"))
    assert row["hf"] is not None and "error" not in row["hf"], row["hf"]
    assert abs(row["hf"]["loss"] - row["ours"]["loss"]) < 1e-4
    plain = _check_ours(_run(tmp_path / "plain", "--skip-hf"))
    assert abs(plain["ours"]["loss"] - row["ours"]["loss"]) > 1e-3


_HAVE_HF = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def _bench(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench" / script), *args, "--workdir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.reference
@pytest.mark.skipif(not _HAVE_HF, reason="the generate bench's checkpoint is made by transformers: not installed")
def test_generate_bench_runs_and_both_sides_decode_the_same_tokens(tmp_path):
    (row,) = _bench(
        tmp_path, "bench_generate.py", "--sizes", "small", "--prompt", "32", "--new-tokens", "4", "--runs", "1"
    )["rows"]
    assert row["tokens_equal"] is True and len(row["ours"]["tokens"]) == 4
    assert row["ours"]["ms_per_token"] > 0 and row["hf"]["ms_per_token"] > 0
    assert 0 < row["ours"]["ops_per_step"] < 400


@pytest.mark.reference
@pytest.mark.skipif(
    not _HAVE_HF or importlib.util.find_spec("accelerate") is None,
    reason="transformers' tensor parallel plan needs torch, transformers and accelerate (the `reference` extra)",
)
def test_generate_bench_split_over_two_ranks_decodes_transformers_tokens(tmp_path):
    """``--tp 2``: ours at TP2 x EP2 under Paddle's launcher, transformers' own ``tp_plan="auto"``
    under torchrun, both over gloo: the same greedy tokens, each side timed."""
    (row,) = _bench(
        tmp_path,
        "bench_generate.py",
        "--sizes",
        "small",
        "--prompt",
        "32",
        "--new-tokens",
        "4",
        "--runs",
        "1",
        "--tp",
        "2",
    )["rows"]
    assert row["tp"] == 2 and "error" not in row["ours"] and "error" not in row["hf"], row
    assert row["tokens_equal"] is True and len(row["ours"]["tokens"]) == 4
    assert row["ours"]["ms_per_token"] > 0 and row["hf"]["ms_per_token"] > 0


def test_realwidth_bench_paddle_side_runs(tmp_path):
    res = _bench(
        tmp_path,
        "bench_realwidth.py",
        "--preset",
        "small",
        "--seqlens",
        "64",
        "--layers",
        "2",
        "--train-layers",
        "1",
        "--skip-hf",
        "--threads",
        "1",
    )
    fwd, train = res["rows"]
    assert fwd["mode"] == "forward" and fwd["ours"]["seconds"] > 0 and fwd["ours"]["peak_gb"] > 0
    assert train["mode"] == "train" and 0 < train["ours"]["loss"] < 20


@pytest.mark.reference
@pytest.mark.skipif(not _HAVE_HF, reason="HF comparison NOT run: torch/transformers not installed")
def test_realwidth_bench_hf_side_agrees(tmp_path):
    res = _bench(
        tmp_path,
        "bench_realwidth.py",
        "--preset",
        "small",
        "--seqlens",
        "64",
        "--layers",
        "2",
        "--train-layers",
        "1",
        "--threads",
        "1",
    )
    fwd, train = res["rows"]
    assert fwd["compare"]["argmax_agree"] == 1.0 and fwd["compare"]["logits_max_diff"] < 1e-4
    assert fwd["hf"]["seconds"] > 0 and fwd["hf"]["peak_gb"] > 0
    # the train row compares the loss both sides backpropagated (its cells were nan)
    assert train["mode"] == "train" and train["compare"]["loss_abs_diff"] < 1e-4, train
