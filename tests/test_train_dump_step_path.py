"""``glm52 train --dump-step DIR K`` with a DIR that cannot be made or written into: one line naming
``--dump-step`` as given, exit 2, before the run, nothing left behind (docs/failure-modes.md,
"Output paths").  Before, only a DIR that is a file (or under one) was refused: the run trained up
to step K, then failed at the dump (exit 1, a failure record)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from paddleformers_glm.cli import main

TINY = str(Path(__file__).parent / "fixtures" / "tiny" / "checkpoint")
LINE = ["train", "--model", TINY, "--steps", "1", "--seq-len", "16", "--global-batch-size", "1", "--no-progress"]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "ccache" not in ln]
    assert len(lines) == 1, lines
    return lines[0]


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_dump_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """A component over 255 bytes (made nowhere, as root too): the folders made on the way are removed."""
    monkeypatch.chdir(tmp_path)
    dump = "new/" + "L" * 256
    assert main([*LINE, "--dump-step", dump, "1", "--out", "run"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"glm52 train: error: --dump-step {dump}: cannot make the folder"), line
    assert "File name too long" in line, line
    assert _listing(tmp_path) == []


def _immutable(path: Path) -> bool:
    chattr = shutil.which("chattr")
    return bool(chattr) and subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("where", ["under", "itself"])
def test_a_dump_folder_in_a_read_only_place_is_refused_before_the_run(tmp_path, capsys, monkeypatch, where):
    """A read-only folder (``chattr +i``: root writes through permission bits): DIR inside it cannot
    be made, or DIR is that folder and cannot be written into."""
    monkeypatch.chdir(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _immutable(ro):
        pytest.skip("chattr +i is not available here (needs root and a filesystem that keeps the flag)")
    try:
        dump = "ro/dump" if where == "under" else "ro"
        assert main([*LINE, "--dump-step", dump, "1", "--out", "run"]) == 2
        line = _one_line(capsys.readouterr().err)
        words = "cannot make the folder" if where == "under" else "cannot write into the folder"
        assert line.startswith(f"glm52 train: error: --dump-step {dump}: {words}"), line
        assert "Operation not permitted" in line, line
        assert _listing(tmp_path) == ["ro"]
    finally:
        subprocess.run(["chattr", "-i", str(ro)], check=False)
