"""Input checks of ``glm52 train`` and ``glm52 check-loss`` that each stand between a user and a
quietly wrong result, pinned one by one through the CLI entry point, in this process (no launch).

Without each check the command went on: a float ``.npy`` trained on truncated tokens (7.9 read as 7),
``check-loss A B --json A/loss.json`` written with relative paths replaced run A's losses by the
receipt, an attention mask of 2 trained, ``--steps 0`` "passed" having compared nothing,
``--bit-exact --rtol`` dropped the tolerance, an indivisible micro-batch failed only after the
model load, short jsonl labels died in a numpy broadcast naming no file, ``--save-every -1`` saved
every step, ``--job-timeout 0`` ran with no limit, and a file given as ``--model`` was called missing.
Each test asserts exit 2 and the one line main prints (the file or flag, what was expected, what
was found), and that the run itself was never started.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.train import command

V = 64  # the toy model's vocabulary
TOY = ["train", "--model", "toy", "--seq-len", "16", "--global-batch-size", "4", "--steps", "1", "--no-progress"]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "INFO" not in ln and "ccache" not in ln]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_run(monkeypatch):
    """The run itself (in process for world 1, else the launcher) replaced by a recorder: a refused
    line never gets there, and a line that wrongly passes its checks ends at once, counted."""
    started: list[object] = []

    def held(cfg, adapter, args, world, node_rank):
        started.append(cfg)
        return 0

    monkeypatch.setattr(command, "_run_held", held)
    return started


def _train_refused(tmp_path: Path, capsys, started: list, *args: str) -> str:
    out = tmp_path / "out"
    rc = main([*TOY, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not started, f"exit {rc}, run started: {bool(started)}; stderr: {err[-2000:]}"
    line = _one_line(err)
    assert line.startswith("glm52 train: error: "), line
    assert not out.exists()  # the folders made for the refused run go with it
    return line.removeprefix("glm52 train: error: ")


# ---------------------------------------------------------------- glm52 train --data
@pytest.mark.parametrize("values", [[7.9, 12.6, 3.999, 55.7], [7.0, 12.0, 3.0, 55.0]])
def test_float_npy_tokens_are_refused(tmp_path, capsys, no_run, values):
    """Token ids stored as floats (7.9 would be read as token 7, silently): refused by dtype, whole
    numbers included, naming the file, the expected kind and the dtype found."""
    data = tmp_path / "float.npy"
    np.save(data, np.resize(np.array(values, np.float32), 400))
    line = _train_refused(tmp_path, capsys, no_run, "--data", str(data))
    assert line == f"{data}: expected integer tokens, got dtype float32", line


def test_npz_attention_mask_other_than_0_and_1_is_refused(tmp_path, capsys, no_run):
    """A mask of 2 (a count, a segment id) is no attention mask; it trained before."""
    ids = np.arange(4 * 16).reshape(4, 16) % V
    mask = np.ones_like(ids)
    mask[:, 12:] = 2
    data = tmp_path / "mask2.npz"
    np.savez(data, input_ids=ids, labels=ids, attention_mask=mask)
    line = _train_refused(tmp_path, capsys, no_run, "--data", str(data))
    assert line == f"{data}: attention_mask holds values other than 0 and 1", line


def test_jsonl_labels_shorter_than_input_ids_are_refused_by_record(tmp_path, capsys, no_run):
    """Labels cut short on record 2 of a jsonl: named by file and line with both lengths, where
    the earlier failure was a numpy broadcast error naming neither."""
    rows = (np.arange(4 * 16).reshape(4, 16) % V).tolist()
    data = tmp_path / "short.jsonl"
    with data.open("w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"input_ids": r, "labels": r[:10] if i == 1 else r}) + "\n")
    line = _train_refused(tmp_path, capsys, no_run, "--data", str(data))
    assert line.startswith(f"{data}:2: labels has 10 entries, input_ids 16: one label per input token"), line


def test_data_dtype_without_a_bin_file_is_refused(tmp_path, capsys, no_run):
    """``--data-dtype`` is the width of a .bin's tokens (the file does not record it); given with a
    .npy, which records its own, it changed nothing and was accepted: a user who meant it for the
    file learned nothing.  With a .bin among --data / --eval-data it is that file's and is kept."""
    ids = (np.arange(400) % V).astype(np.int64)
    npy, bin_ = tmp_path / "t.npy", tmp_path / "t.bin"
    np.save(npy, ids)
    ids.astype("<u4").tofile(bin_)
    line = _train_refused(tmp_path, capsys, no_run, "--data", str(npy), "--data-dtype", "uint32")
    assert line == (
        f"--data-dtype uint32 is the token width of a .bin file, and this run reads none (--data {npy}): "
        ".npy and .npz record their dtype, a .jsonl holds numbers or text; leave --data-dtype out"
    ), line
    line = _train_refused(tmp_path, capsys, no_run, "--data-dtype", "uint32")
    assert "this run reads none (--data synthetic)" in line, line
    for data, held_out in ((bin_, npy), (npy, bin_)):  # the .bin as --data, or as --eval-data alone
        flags = ["--data", str(data), "--eval-data", str(held_out), "--data-dtype", "uint32"]
        assert main([*TOY, *flags, "--out", str(tmp_path / f"o{len(no_run)}")]) == 0
    assert len(no_run) == 2


# ---------------------------------------------------------------- glm52 train settings
@pytest.mark.parametrize(
    "flags, expected",
    [
        # the dp part of the division is tested elsewhere; this is the micro-batch part, which
        # otherwise failed only in the run, after the model load, with a failure record
        (
            ["--micro-batch-size", "3"],
            "--global-batch-size 4 must be divisible by dp 1 x sharding 1 x --micro-batch-size 3",
        ),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),  # else: a checkpoint every step
        (["--job-timeout", "0"], "--job-timeout must be a finite number of seconds > 0, got 0.0"),  # else: no limit
    ],
)
def test_train_settings_refused_before_the_run(tmp_path, capsys, no_run, flags, expected):
    assert _train_refused(tmp_path, capsys, no_run, *flags) == expected


def test_a_file_as_model_is_called_a_file(tmp_path, capsys, no_run, monkeypatch):
    """``--model toks.npy`` (a data file in the model's place): the file exists, so "no such folder"
    would send the user looking for a typo."""
    monkeypatch.chdir(tmp_path)
    np.save("toks.npy", np.arange(100, dtype=np.int32) % V)
    rc = main(["train", "--model", "toks.npy", "--out", "out"])
    err = capsys.readouterr().err
    assert rc == 2 and not no_run, f"exit {rc}, run started: {bool(no_run)}; stderr: {err[-2000:]}"
    line = _one_line(err)
    assert line.startswith("glm52 train: error: --model toks.npy: a file, not a checkpoint folder"), line


# ---------------------------------------------------------------- glm52 check-loss
def _run_folder(root: Path, name: str, losses: list[float]) -> Path:
    out = root / name
    out.mkdir()
    (out / "loss.json").write_text(json.dumps({"losses": losses, "steps": len(losses)}))
    return out


def test_check_loss_receipt_over_an_input_given_by_relative_paths(tmp_path, capsys, monkeypatch):
    """``check-loss run_a run_b --json run_a/loss.json`` as typed in a shell: the receipt would
    replace run A's losses. Refused, naming the flag and the input, and loss.json kept byte for byte."""
    monkeypatch.chdir(tmp_path)
    _run_folder(tmp_path, "run_a", [1.0, 0.9])
    _run_folder(tmp_path, "run_b", [1.0, 0.9])
    before = (tmp_path / "run_a" / "loss.json").read_bytes()
    for receipt in ("run_a/loss.json", "./run_a/../run_a/loss.json"):
        assert main(["check-loss", "run_a", "run_b", "--json", receipt]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"check-loss: --json {receipt}: this is an input of the command ("), line
        assert line.endswith("loss.json); writing there would replace it"), line
        assert (tmp_path / "run_a" / "loss.json").read_bytes() == before


@pytest.mark.parametrize(
    "flags, expected",
    [
        # a gate over no steps "passed" (steps_compared 0)
        (["--steps", "0"], "check-loss: --steps must be >= 1, got 0"),
        # the tolerance was dropped and the bit-exact verdict printed as if it were the asked check
        (["--bit-exact", "--rtol", "0.5"], "check-loss: --rtol cannot be combined with --bit-exact"),
    ],
)
def test_check_loss_refuses_flags_that_would_pass_vacuously(tmp_path, capsys, flags, expected):
    a = _run_folder(tmp_path, "a", [1.0, 0.9])
    b = _run_folder(tmp_path, "b", [1.0, 0.9])
    receipt = tmp_path / "r.json"
    rc = main(["check-loss", str(a), str(b), *flags, "--json", str(receipt)])
    captured = capsys.readouterr()
    assert rc == 2, (rc, captured.out, captured.err)
    assert expected in captured.err.splitlines(), captured.err
    assert "pass" not in captured.out, captured.out
