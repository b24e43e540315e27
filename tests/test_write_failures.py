"""Writes that fail (a full disk: ``write`` / ``fsync`` raise ENOSPC) and output folders shared by two
commands: every failure is one line naming the file and what was being written, the errno is kept
(a caller can tell a full disk), failure.json names the file, and nothing half-written is left:
the ``--out`` a refused ``glm52 train`` made, a save's ``step_N.tmp``. A second ``glm52 align`` on
the OUT of a running one is refused before it clears anything there.

A full disk is simulated in this process: ``os.fsync`` (or a write) raises ``OSError(ENOSPC)`` with
no file name, as the kernel reports it."""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm._io import atomic_write_text, dumps_json, read_json
from paddleformers_glm.cli import main

TINY = str(Path(__file__).parent / "fixtures" / "tiny" / "checkpoint")
TOY = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "4", "--no-progress"]
ENOSPC_TEXT = os.strerror(errno.ENOSPC)


def _full_disk(monkeypatch, when=lambda path: True):
    """``os.fsync`` raises ENOSPC (no file name, as the kernel's) for the files ``when`` picks (by path)."""
    real = os.fsync

    def fsync(fd):
        if when(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------- where the bytes are written
def test_an_atomic_write_on_a_full_disk_names_its_file_and_keeps_the_errno(tmp_path, monkeypatch):
    """``[Errno 28] No space left on device`` named no file; now the destination (not the temporary
    name), the errno still ENOSPC, and nothing left beside it."""
    from paddleformers_glm._io import WriteError

    target = tmp_path / "record.json"
    target.write_text("old\n")
    _full_disk(monkeypatch)
    with pytest.raises(OSError) as info:
        atomic_write_text(target, "new\n")
    e = info.value
    assert e.errno == errno.ENOSPC and isinstance(e, WriteError)
    assert e.filename == str(target) and str(target) in str(e) and ENOSPC_TEXT in str(e)
    assert target.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["record.json"]


def test_a_full_disk_while_a_file_is_copied_into_place_names_the_destination(tmp_path, monkeypatch):
    """``shutil.copyfile`` into ``atomic_path``'s temporary file (glm52 train --dump-step copies the
    model's config.json so) reports a full disk naming its source first and the temporary file
    second: the error names the destination, never the source, an input that is not written."""
    from paddleformers_glm._io import WriteError, atomic_path

    src, dst = tmp_path / "model_config.json", tmp_path / "dump" / "config.json"
    src.write_text('{"a": 1}\n')

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", full)
    with pytest.raises(WriteError) as info:
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)
    assert info.value.filename == str(dst) and info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(dst.parent)) == []  # the temporary file removed
    # an error about another file (the source cannot be read) is raised as it came
    with pytest.raises(FileNotFoundError) as info:
        with atomic_path(dst) as tmp:
            shutil.copyfile(tmp_path / "missing.json", tmp)
    assert info.value.filename == str(tmp_path / "missing.json")


def test_an_atomic_write_keeps_an_error_class_callers_catch(tmp_path):
    """An error that names its file already (here: the folder cannot be listed as a file) keeps its class."""
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path / "d", "x")


def test_the_safetensors_writer_names_its_file_on_a_full_disk(tmp_path, monkeypatch):
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsWriter

    file = str(tmp_path / "a.safetensors")
    w = SafetensorsWriter(file, [("x", "F32", [4])])
    w.write("x", np.zeros(4, np.float32), "F32")
    _full_disk(monkeypatch)
    with pytest.raises(OSError) as info:
        w.close()
    assert info.value.errno == errno.ENOSPC and info.value.filename == file and file in str(info.value)
    assert w._f.closed


def test_a_failed_tensor_write_names_the_file(tmp_path, monkeypatch):
    from paddleformers_glm.checkpoint import safetensors_io

    file = str(tmp_path / "b.safetensors")
    w = safetensors_io.SafetensorsWriter(file, [("x", "F32", [4])])

    class Full:  # the file object's write fails as a full disk's does
        def __init__(self, f):
            self.f = f

        def seek(self, n):
            return self.f.seek(n)

        def write(self, _data):
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)

    w._f = Full(w._f)
    with pytest.raises(OSError) as info:
        w.write("x", np.zeros(4, np.float32), "F32")
    assert info.value.errno == errno.ENOSPC and info.value.filename == file and file in str(info.value)
    w._f.f.close()


# ---------------------------------------------------------------- glm52 train: tokenizing --data
def test_a_full_disk_while_text_data_is_tokenized_is_one_line_exit_2_and_no_out(tmp_path, monkeypatch, capsys):
    """51 lines of three chained tracebacks, exit 1, and the new --out left behind; now the refusal
    of a bad input: one line naming the .npz and the OS's words, exit 2, the --out it made removed."""
    from paddleformers_glm.tiny import make_tiny_tokenizer

    tok = tmp_path / "tok"
    make_tiny_tokenizer().save_pretrained(str(tok))
    data = tmp_path / "text.jsonl"
    data.write_text("".join(dumps_json({"text": "hello world " * 8}, indent=None) + "\n" for _ in range(8)))
    out = tmp_path / "run"
    _full_disk(monkeypatch)
    rc = main(
        ["train", "--model", TINY, "--seq-len", "8", "--global-batch-size", "4", "--steps", "1", "--no-progress"]
        + ["--data", str(data), "--tokenizer", str(tok), "--out", str(out)]
    )
    line = _one_line(capsys)
    assert rc == 2, line
    npz = out / "data" / "train-text.seq8.npz"
    assert line.startswith("glm52 train: error: ") and str(npz) in line and ENOSPC_TEXT in line, line
    assert not out.exists()


# ---------------------------------------------------------------- glm52 train: checkpoints
def _train_toy(out, *more):
    return main([*TOY, "--steps", "2", "--lr", "1e-3", "--seed", "1", *more, "--out", str(out)])


def test_a_full_disk_during_a_checkpoint_names_file_and_step_and_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    """``glm52 train: error: OSError: [Errno 27] File too large`` and failure.json without a file; now
    the file, "the resume state of step N" and the errno, and no ``step_N.tmp`` left behind."""
    out = tmp_path / "run"
    _full_disk(monkeypatch, lambda path: "step_00000002" in path)
    rc = _train_toy(out, "--save-every", "1")
    line = _one_line(capsys)
    assert rc == 1, line
    rank_file = out / "checkpoints" / "step_00000002.tmp" / "rank_00000.safetensors"
    assert f"{rank_file}: cannot write the resume state of step 2: {ENOSPC_TEXT}" in line, line
    record = read_json(out / "logs" / "failure.json", "the failure record")
    assert record["file"] == str(rank_file) and record["errno"] == "ENOSPC", record
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_00000001"]


def test_a_stopped_save_removes_its_own_tmp(tmp_path, monkeypatch, capsys):
    """A save stopped by a signal (here: KeyboardInterrupt, SIGINT's) left ``step_N.tmp``."""
    # only the name the save calls: a patch of state_files' own would be taken into resume's names when
    # resume is first imported under it, and teardown would then put the patched function back there
    from paddleformers_glm.train import resume

    real = resume.write_rank_state

    def interrupted(folder, *a, **kw):
        real(folder, *a, **kw)
        if "step_00000002" in folder:
            raise KeyboardInterrupt

    monkeypatch.setattr(resume, "write_rank_state", interrupted)
    out = tmp_path / "run"
    assert _train_toy(out, "--save-every", "1") == 130
    capsys.readouterr()
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_00000001"]


# put on the workers' path (sitecustomize): rank 0's rename of a step_N.tmp into place first tells the test
# and then waits, a stand-in for a save that takes long (a whole optimizer state on a slow filesystem)
_SLOW_SAVE = """
import os, re, time
_replace = os.replace
def _slow(src, dst, *a, **kw):
    if re.search(r"step_\\d{8}\\.tmp$", os.fspath(src)) and not os.fspath(dst).endswith(".tmp"):
        open(os.environ["GLM52_TEST_SAVING"], "w").close()
        time.sleep(120)
    return _replace(src, dst, *a, **kw)
if os.environ.get("GLM52_TEST_SAVING"):
    os.replace = _slow
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_save_stopped_by_a_signal_to_glm52_train_leaves_no_tmp(tmp_path, sig):
    """SIGTERM / SIGINT to ``glm52 train`` (as a user or a scheduler sends it) while the ranks of a
    launched job save: every rank wrote its files into ``step_N.tmp``, rank 0 is about to rename it.
    Each worker's stop handler ends it with ``os._exit``, so the save's own clean-up never runs; the
    launcher removes what it left once every process of the job has ended. Measured before: 5 of 5
    such stops left ``checkpoints/step_00000001.tmp``, with rank files and a half-written
    ``.meta.json`` in it (the in-process test above raises KeyboardInterrupt in the run's own
    thread, where the clean-up runs, so it passed all the same)."""
    import signal
    import subprocess
    import sys
    import time

    from tests._dist.runner import env

    (tmp_path / "sitecustomize.py").write_text(_SLOW_SAVE)
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([e["PYTHONPATH"], str(tmp_path)])
    e["GLM52_TEST_SAVING"] = str(tmp_path / "saving")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "paddleformers_glm.train", *TOY[1:], "--steps", "2", "--dp", "2"]
    cmd += ["--micro-batch-size", "1", "--save-every", "1", "--out", str(out)]
    p = subprocess.Popen(cmd, env=e, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "saving").exists() and p.poll() is None and time.monotonic() - t0 < 240:
            time.sleep(0.05)
        assert (tmp_path / "saving").exists(), p.communicate(timeout=60)
        ckpt = out / "checkpoints"
        assert sorted(os.listdir(ckpt / "step_00000001.tmp")) != [], os.listdir(ckpt)  # the save's files are there
        p.send_signal(getattr(signal, sig))
        stdout, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + getattr(signal, sig), (p.returncode, stderr[-3000:])
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"glm52 train: stopped by {sig} to the launcher"), stderr[-3000:]
    assert "every process of the job ended" in line, line
    assert sorted(os.listdir(ckpt)) == [], os.listdir(ckpt)  # no step_00000001.tmp, and no latest


def test_a_save_stopped_at_its_rename_leaves_latest_on_the_previous_step(tmp_path, monkeypatch, capsys):
    """``latest`` names a step folder only once that folder is in place under its final name
    (docs/parallel.md, "Checkpoints"): a save stopped at the rename of its ``step_N.tmp`` (here a
    KeyboardInterrupt, SIGINT's, raised by that rename) leaves ``latest`` on the previous whole step,
    which ``--resume OUT`` then finds and can read."""
    from paddleformers_glm.train.state_files import check_resume_state, resolve_resume_state

    real = os.replace

    def stopped(src, dst, *a, **kw):
        if str(src).endswith("step_00000002.tmp"):
            raise KeyboardInterrupt
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", stopped)
    out = tmp_path / "run"
    assert _train_toy(out, "--save-every", "1") == 130
    capsys.readouterr()
    monkeypatch.setattr(os, "replace", real)
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_00000001\n"
    assert resolve_resume_state(str(out)) == str(ckpt / "step_00000001")
    assert check_resume_state(str(out))[1]["step"] == 1


def test_a_save_sweeps_what_earlier_saves_left(tmp_path, capsys):
    """A killed save's ``step_N.tmp`` stayed until step N was saved again; now the next save removes
    it, and a ``step_N.old`` whose ``step_N`` is there. A ``step_N.old`` without its ``step_N`` (a
    save killed between its two renames: the only copy of that step) stays."""
    ckpt = tmp_path / "run" / "checkpoints"
    for name in ("step_00000007.tmp", "step_00000005", "step_00000005.old", "step_00000006.old", "step_x.tmp"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "rank_00000.safetensors").write_bytes(b"part")
    assert _train_toy(tmp_path / "run", "--save-every", "1") == 0
    capsys.readouterr()
    left = sorted(os.listdir(ckpt))
    assert left == ["latest", "step_00000001", "step_00000002", "step_00000005", "step_00000006.old", "step_x.tmp"]


def test_a_full_disk_during_the_export_names_it(tmp_path, monkeypatch, capsys):
    """The export's failure named neither the file nor that it was the export."""
    out = tmp_path / "run"
    export_tmp = re.compile(r"\.export\.tmp-\d+-export")  # the export's temporary folder (rank 0's pid)
    _full_disk(monkeypatch, lambda path: export_tmp.search(path) is not None and path.endswith(".safetensors"))
    rc = main(
        ["train", "--model", TINY, "--steps", "1", "--seq-len", "16", "--global-batch-size", "2", "--no-progress"]
        + ["--export", "--out", str(out)]
    )
    line = _one_line(capsys)
    assert rc == 1, line
    assert f"cannot write the export to {out / 'export'}: {ENOSPC_TEXT}" in line, line
    record = read_json(out / "logs" / "failure.json", "the failure record")
    assert export_tmp.search(record["file"]) and record["errno"] == "ENOSPC", record
    assert not (out / "export").exists() and sorted(os.listdir(out)) == ["logs", "loss.json"], os.listdir(out)


def test_the_failure_detail_of_a_write_error_names_the_file_and_what_it_held(tmp_path):
    from paddleformers_glm._io import WriteError
    from paddleformers_glm.train.command import write_failure_detail

    file = str(tmp_path / "model.safetensors")
    err = WriteError(errno.ENOSPC, ENOSPC_TEXT, file)
    err.what = "the export to OUT/export"
    message, detail = write_failure_detail(err)
    assert message == f"{file}: cannot write the export to OUT/export: {ENOSPC_TEXT}"
    assert detail["file"] == file and detail["errno"] == "ENOSPC"
    assert write_failure_detail(ValueError("x")) == ("ValueError: x", {})


# ---------------------------------------------------------------- glm52 make-tiny
def test_make_tiny_on_a_full_disk_names_out(tmp_path, monkeypatch, capsys):
    """``make-tiny: [Errno 28] No space left on device`` named no path."""
    out = tmp_path / "tiny"
    _full_disk(monkeypatch)
    assert main(["make-tiny", str(out)]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"make-tiny: cannot write {out}: {ENOSPC_TEXT}"), line


# ---------------------------------------------------------------- glm52 align: one run per OUT
def test_a_second_align_on_a_held_out_is_refused_touching_nothing(tmp_path, capsys):
    """align cleared OUT/receipt, OUT/reference and OUT/paddle before its glm52 train took a lock (on
    OUT/paddle), so a second align given the OUT of a running one deleted that run's work. It now
    holds OUT first (glm52 train's --out lock): the second is refused in one line, exit 2."""
    from paddleformers_glm.train.out_lock import hold_out_folder

    out = tmp_path / "align"
    for d in ("receipt", "reference", "paddle"):
        (out / d).mkdir(parents=True)
        (out / d / "work").write_text("running\n")
    reference = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    with hold_out_folder(str(out)):  # the running align's
        before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}
        for extra in ([], ["--no-run"]) if reference else (["--no-run"],):
            rc = main(["align", "--model", TINY, "--out", str(out), "--steps", "2", *extra])
            line = _one_line(capsys)
            assert rc == 2, line
            assert line.startswith(f"glm52 align: error: --out {out} is in use by a running glm52 align"), line
            assert f"pid {os.getpid()}" in line, line
        assert {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_an_align_out_whose_lock_cannot_be_made_is_one_line(tmp_path, capsys):
    """An --out whose logs/ is a file (so its lock file cannot be made) ended align in a traceback."""
    out = tmp_path / "align"
    out.mkdir()
    (out / "logs").write_text("a file where the folder goes\n")
    rc = main(["align", "--model", TINY, "--out", str(out), "--steps", "2", "--no-run"])
    line = _one_line(capsys)
    assert rc == 2 and line.startswith(f"glm52 align: error: --out {out}: cannot make its lock file"), line


def test_an_earlier_in_process_jobs_stop_is_not_the_next_ones(tmp_path, monkeypatch, capsys):
    """In a process that goes on after its jobs, the stop-signal listener can stay running (a
    launch, ``glm52 generate --tp 2`` in-process, left it so): a job stopped by SIGINT recorded the
    stop, and the next job's failure (a full disk in its export) was then reported as that SIGINT,
    exit 130 (seen in the suite, where one test worker runs such jobs one after another)."""
    from paddleformers_glm.train import stop_signals

    listener = stop_signals.listen()  # what a launch leaves: listening, polled, not closed
    listener.polled = True
    try:
        test_a_stopped_save_removes_its_own_tmp(tmp_path / "first", monkeypatch, capsys)
        monkeypatch.undo()
        test_a_full_disk_during_the_export_names_it(tmp_path / "second", monkeypatch, capsys)  # exit 1, its line
    finally:
        stop_signals._close()
