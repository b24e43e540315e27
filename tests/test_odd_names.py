"""Names at the file system's limits: a ``glm52 train --out`` that cannot be made is one line naming
the path as given, exit 2, nothing left; a legal file name of up to 255 bytes is written atomically
(the temporary name beside it is bounded); a text ``--data`` whose tokenized copy's name would pass
255 bytes gets a shorter one, and a write error there names ``--data``."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from paddleformers_glm._io import atomic_path, dumps_json, write_json_atomic
from paddleformers_glm.cli import main

TINY = str(pathlib.Path(__file__).parent / "fixtures" / "tiny" / "checkpoint")
TOY = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "1", "--steps", "1", "--no-progress"]


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "ccache" not in ln]
    assert len(err) == 1, err
    return err[0]


def _listing(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---------------------------------------------------------------- glm52 train --out
@pytest.mark.parametrize(
    "out, words",
    [
        ("new/" + "L" * 256, "File name too long"),  # `new` made on the way: removed again
        ("a_file/sub", "a_file is a file, not a folder"),
    ],
)
def test_train_out_that_cannot_be_made_is_one_line_exit_2(tmp_path, monkeypatch, capsys, out, words):
    """A component over 255 bytes: a traceback from os.makedirs, exit 1, and the parent it made left
    behind; a file in the way named the absolute path. Now one line naming --out as given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("keep")
    before = _listing(tmp_path)
    assert main([*TOY, "--out", out]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"glm52 train: error: --out {out}: ") and words in line, line
    assert _listing(tmp_path) == before and (tmp_path / "a_file").read_text() == "keep"


def test_train_out_whose_lock_file_cannot_be_made_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """``OUT/logs`` a file: os.makedirs of the lock's folder raised FileExistsError, a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "logs").write_text("mine")
    assert main([*TOY, "--out", "run"]) == 2
    line = _one_line(capsys)
    assert (
        line == "glm52 train: error: --out run: cannot make its lock file logs/train.lock: logs is a file, not a folder"
    )
    assert _listing(tmp_path) == ["run", "run/logs"] and (tmp_path / "run" / "logs").read_text() == "mine"


def test_a_refused_run_removes_its_out_and_only_the_empty_parents_it_made(tmp_path, monkeypatch, capsys):
    """A refused input (found after --out and its new parents were made) removes --out and the
    parents it made while they are empty: by then another run may keep its output beside, in a
    parent this command made, and it stays."""
    from paddleformers_glm.train import command

    def refused(cfg, *_a, **_k):  # another run's output appears beside, then the input is refused
        (tmp_path / "new" / "other_run").mkdir()
        raise ValueError("--data x: refused")

    monkeypatch.setattr(command, "check_inputs_before_launch", refused)
    monkeypatch.chdir(tmp_path)
    assert main([*TOY, "--out", "new/deeper/run"]) == 2
    assert "--data x: refused" in _one_line(capsys)
    assert _listing(tmp_path) == ["new", "new/other_run"]
    monkeypatch.setattr(command, "check_inputs_before_launch", lambda *a, **k: (_ for _ in ()).throw(ValueError("no")))
    assert main([*TOY, "--out", "alone/run"]) == 2  # nothing beside: every folder it made goes
    capsys.readouterr()
    assert _listing(tmp_path) == ["new", "new/other_run"]


# ---------------------------------------------------------------- the atomic writer's temporary name
def test_plan_json_that_cannot_be_written_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """``glm52 plan --json`` a name over 255 bytes (as a read-only place): the plan was printed, then a
    traceback from the write, exit 1. Now the plan, then one line naming --json as given, exit 2."""
    monkeypatch.chdir(tmp_path)
    name = "p" * 256 + ".json"
    assert main(["plan", "--model", TINY, "--json", name]) == 2
    out, err = capsys.readouterr()
    assert "max per rank" in out
    err = [ln for ln in err.splitlines() if ln.strip() and "ccache" not in ln]
    assert err == [f"glm52 plan: error: --json {name}: cannot write the plan: File name too long"], err
    assert _listing(tmp_path) == []


def test_demo_out_that_cannot_be_made_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """``glm52 demo --out`` that cannot be made (a name over 255 bytes, a read-only place): a traceback
    from mkdir after the start, exit 1. Now one line before the work, exit 2, the parent it made removed."""
    monkeypatch.chdir(tmp_path)
    out = "new/" + "d" * 256
    assert main(["demo", "--out", out]) == 2
    assert _one_line(capsys) == f"glm52 demo: error: --out {out}: File name too long"
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("name", ["j" * 250 + ".json", "模" * 83 + ".json"])  # 255 and 254 bytes
def test_a_file_name_up_to_255_bytes_is_written_atomically(tmp_path, name):
    """The temporary name ``.NAME.PID.HEX8.tmp`` was 22 bytes longer than NAME: File name too long."""
    target = tmp_path / name
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})  # over it
    assert json.loads(target.read_text()) == {"a": 2} and os.listdir(tmp_path) == [name]


def test_the_temporary_name_is_bounded_and_starts_with_the_name(tmp_path):
    from paddleformers_glm._io import TEMP_NAME_BYTES

    name = "模" * 83 + ".json"
    with atomic_path(tmp_path / name) as tmp:
        base = os.path.basename(tmp)
        pathlib.Path(tmp).write_text("x")
    cut = os.fsencode(base)[1:].split(b".")[0]
    assert base.startswith(".模") and base.endswith(".tmp") and len(os.fsencode(base)) <= TEMP_NAME_BYTES + 30
    assert len(cut) <= TEMP_NAME_BYTES and os.fsencode(name).startswith(cut)  # whole characters
    assert f".{os.getpid()}." in base and os.listdir(tmp_path) == [name]
    with atomic_path(tmp_path / "short.json") as tmp:  # a short name is carried whole
        assert os.path.basename(tmp).startswith(f".short.json.{os.getpid()}.")
        pathlib.Path(tmp).write_text("y")


def test_check_loss_json_of_a_250_byte_name(tmp_path, capsys):
    """``check-loss --json <250-byte name>``: "cannot write the receipt: File name too long", exit 2."""
    loss, again = tmp_path / "loss.json", tmp_path / "again.json"
    loss.write_text(dumps_json({"losses": [1.0, 0.9]}))
    again.write_text(dumps_json({"losses": [1.0, 0.9]}))
    receipt = tmp_path / ("j" * 245 + ".json")
    assert main(["check-loss", str(loss), str(again), "--json", str(receipt)]) == 0, capsys.readouterr().err
    assert json.loads(receipt.read_text())["exit_code"] == 0
    assert sorted(os.listdir(tmp_path)) == sorted(["again.json", "loss.json", receipt.name])


# ---------------------------------------------------------------- a text --data's tokenized copy
def test_the_tokenized_copy_of_a_long_data_name_is_short_and_stable():
    from paddleformers_glm.train.command import tokens_file_name

    assert tokens_file_name("/d/text.jsonl", "train-", 16) == "train-text.seq16.npz"
    long = "/d/" + "d" * 240 + ".jsonl"
    name = tokens_file_name(long, "train-", 16)
    assert len(os.fsencode(name)) <= 255 and name.startswith("train-ddd") and name.endswith(".seq16.npz")
    assert name == tokens_file_name(long, "train-", 16)  # the same data, the same file
    assert name != tokens_file_name(long.replace("d.jsonl", "e.jsonl"), "train-", 16)
    assert tokens_file_name(long, "eval-", 16).startswith("eval-")
    wide = tokens_file_name("/d/" + "模" * 84 + ".jsonl", "train-", 16)  # 252 bytes of stem, cut at characters
    assert len(os.fsencode(wide)) <= 255 and wide.startswith("train-模")


def _text_data(tmp_path: pathlib.Path, stem: str) -> list[str]:
    """``--data`` (a text jsonl named ``stem``) and ``--tokenizer`` flags."""
    from paddleformers_glm.tiny import make_tiny_tokenizer

    tok = tmp_path / "tok"
    make_tiny_tokenizer().save_pretrained(str(tok))
    data = tmp_path / f"{stem}.jsonl"
    data.write_text("".join(dumps_json({"text": f"hello world number {i}"}, indent=None) + "\n" for i in range(8)))
    return ["--data", str(data), "--tokenizer", str(tok)]


@pytest.mark.skipif(not os.path.isdir(TINY), reason="the tiny checkpoint fixture")
def test_text_data_with_a_240_byte_stem_trains(tmp_path, capsys):
    """``OUT/data/train-<240 d>.seq8.npz`` passed 255 bytes: refused, naming the temporary file."""
    data = _text_data(tmp_path, "d" * 240)
    out = tmp_path / "run"
    cmd = ["train", "--model", TINY, "--seq-len", "8", "--global-batch-size", "1", "--steps", "1", "--no-progress"]
    assert main([*cmd, *data, "--out", str(out)]) == 0, capsys.readouterr().err
    (npz,) = os.listdir(out / "data")
    assert npz.startswith("train-ddd") and npz.endswith(".seq8.npz") and len(os.fsencode(npz)) <= 255


@pytest.mark.skipif(not os.path.isdir(TINY), reason="the tiny checkpoint fixture")
def test_a_write_error_while_tokenizing_names_data(tmp_path, capsys):
    """``OUT/data`` a file: the line named only ``OUT/data`` ("File exists"), not the flag."""
    data = _text_data(tmp_path, "text")
    out = tmp_path / "run"
    out.mkdir()
    (out / "data").write_text("mine")
    cmd = ["train", "--model", TINY, "--seq-len", "8", "--global-batch-size", "1", "--steps", "1", "--no-progress"]
    assert main([*cmd, *data, "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert line == f"glm52 train: error: --data {data[1]}: {out / 'data'}: Not a directory", line
    assert (out / "data").read_text() == "mine"
