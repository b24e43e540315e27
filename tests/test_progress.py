"""Progress of long operations: `glm52 convert` of a multi-shard checkpoint draws bars under a
pseudo-terminal and writes structured, rank-prefixed log lines without one; --quiet silences it;
check-ckpt reports its hashing."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paddleformers_glm.progress import Progress
from tests._dist.runner import env as base_env

CLI = [sys.executable, "-m", "paddleformers_glm.cli"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    out = Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))
    assert len(list(out.glob("*.safetensors"))) >= 2  # a multi-shard checkpoint
    return out


@pytest.fixture(scope="module")
def tiny_copy(tiny_ckpt, tmp_path_factory):
    """Another copy of the same checkpoint: check-ckpt refuses a checkpoint given as both sides."""
    import shutil

    return Path(shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("copy") / "ckpt"))


def _env(**extra: str) -> dict[str, str]:
    e = base_env()
    for k in ("GLM52_QUIET", "GLM52_PROGRESS_INTERVAL", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID"):
        e.pop(k, None)
    e.update(extra)
    return e


def _run_in_pty(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace")


def test_convert_under_a_terminal_draws_bars(tiny_ckpt, tmp_path):
    rc, out = _run_in_pty([*CLI, "convert", str(tiny_ckpt), str(tmp_path / "out")], _env())
    assert rc == 0, out
    for what in ("load", "save"):  # the bar: description, bytes, tensor count, rate
        assert re.search(rf"\r{what}: +\d+%\|.*B/s, tensors=\d+/239\]", out), out[-2000:]
    assert "convert: wrote 239 tensors" in out


def test_convert_without_a_terminal_logs_structured_lines(tiny_ckpt, tmp_path):
    env = _env(GLM52_PROGRESS_INTERVAL="0", PADDLE_TRAINERS_NUM="2", PADDLE_TRAINER_ID="1")
    p = subprocess.run(
        [*CLI, "convert", str(tiny_ckpt), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=180
    )
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr  # no bar without a terminal
    line = re.compile(
        r"^\[glm52 (load|save)\] rank 1: tensors=(\d+)/239 bytes=[\d.]+[KMG]?B/[\d.]+MB rate=[\d.]+[KMG]?B/s "
        r"elapsed=\d+s (eta=\d+s|done)$"
    )
    lines = [m for m in map(line.match, p.stderr.splitlines()) if m]
    for what in ("load", "save"):
        counts = [int(m.group(2)) for m in lines if m.group(1) == what]
        assert counts[0] >= 1 and counts[-1] == 239 and counts == sorted(counts), (what, counts)
    assert [m.group(0).endswith("done") for m in lines].count(True) == 2


def test_quiet_silences_progress(tiny_ckpt, tmp_path):
    p = subprocess.run(
        [*CLI, "convert", str(tiny_ckpt), str(tmp_path / "out"), "--quiet"],
        env=_env(GLM52_PROGRESS_INTERVAL="0"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0 and "[glm52" not in p.stderr, p.stderr
    rc, out = _run_in_pty([*CLI, "convert", str(tiny_ckpt), str(tmp_path / "out2"), "--quiet"], _env())
    assert rc == 0 and "tensors=" not in out, out


def test_check_ckpt_reports_hashing(tiny_ckpt, tiny_copy):
    p = subprocess.run(
        [*CLI, "check-ckpt", str(tiny_ckpt), str(tiny_copy)],
        env=_env(GLM52_PROGRESS_INTERVAL="0"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\[glm52 check-ckpt files\] files=\d+/\d+ .* done$", p.stderr, re.M), p.stderr[-2000:]
    assert re.search(r"^\[glm52 check-ckpt hash\] tensors=(\d+)/\1 .* done$", p.stderr, re.M), p.stderr[-2000:]


def test_short_operations_print_nothing_without_a_terminal(monkeypatch):
    monkeypatch.delenv("GLM52_QUIET", raising=False)
    monkeypatch.setenv("GLM52_PROGRESS_INTERVAL", "60")
    buf = io.StringIO()
    with Progress("load", total_bytes=100, total_tensors=2, stream=buf) as p:
        p.update(50)
        p.update(50)
    assert buf.getvalue() == ""
    monkeypatch.setenv("GLM52_PROGRESS_INTERVAL", "0")
    p = Progress("save", total_bytes=4_000_000, total_tensors=2, stream=buf)
    p.update(2_000_000)
    assert buf.getvalue().startswith("[glm52 save] tensors=1/2 bytes=2.0MB/4.0MB ") and "eta=" in buf.getvalue()


def test_itemsize_reads_the_bit_width_of_every_dtype_spelling():
    import numpy as np
    import paddle

    from paddleformers_glm.progress import itemsize

    for dtype, n in (("float64", 8), (paddle.int64, 8), (np.float32, 4), ("paddle.bfloat16", 2), (paddle.float16, 2)):
        assert itemsize(dtype) == n, dtype
    assert [itemsize(d) for d in ("uint16", "float8_e4m3fn", "float8_e5m2", "uint8", "bool", "?")] == [2, 1, 1, 1, 1, 2]


def test_a_quiet_subcommand_leaves_the_process_as_it_found_it(monkeypatch, tiny_ckpt, tiny_copy, capsys):
    """`glm52 check-ckpt --quiet` called in-process (cli.main) once left every later Progress of the
    process silent: the flag must last as long as its command, whatever the command returns."""
    from paddleformers_glm import cli, progress

    monkeypatch.delenv("GLM52_QUIET", raising=False)
    monkeypatch.setenv("GLM52_PROGRESS_INTERVAL", "0")
    assert cli.main(["check-ckpt", str(tiny_ckpt), str(tiny_copy), "--quiet"]) == 0
    assert cli.main(["check-ckpt", str(tiny_ckpt), str(tiny_ckpt / "missing"), "--quiet"]) != 0
    capsys.readouterr()
    buf = io.StringIO()
    progress.Progress("save", total_bytes=10, total_tensors=1, stream=buf).update(10)
    assert buf.getvalue().startswith("[glm52 save] tensors=1/1"), buf.getvalue()
