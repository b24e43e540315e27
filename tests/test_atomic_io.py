"""The one atomic-write helper: whole new file or the old one, never a part, no temp left; and the one
JSON reader, whose every error names the file, what it holds and the problem."""

import json
import os
import pathlib
import re
import stat

import pytest

from paddleformers_glm._io import atomic_open, atomic_path, read_json, write_json_atomic

from .conftest import ROOT


def test_json_is_written_whole_and_replaces_the_old_file(tmp_path):
    path = tmp_path / "sub" / "report.json"  # missing folders are made
    write_json_atomic(path, {"b": 1, "a": [1.5, None]})
    write_json_atomic(path, {"z": pathlib.PurePosixPath("a/b")})  # str() for what JSON lacks
    assert path.read_text() == '{\n  "z": "a/b"\n}\n'
    assert os.listdir(path.parent) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "data.bin"
    with atomic_open(path, "wb") as f:
        f.write(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(path, "wb") as f:
            f.write(b"half of the new")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]
    with pytest.raises(TypeError):  # not JSON: nothing written either
        write_json_atomic(path, {"x": object()}, default=None)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["data.bin"]


def test_files_get_the_usual_permissions_not_a_temp_files(tmp_path):
    """A temp-file helper would leave 0600; a config others read must get the umask's mode."""
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "config.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "config.json").st_mode) == 0o644
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}


def test_only_whole_file_modes():
    with pytest.raises(ValueError, match="mode 'w' or 'wb', got 'a'"):
        with atomic_open("x", "a"):
            pass


def test_atomic_path_serves_writers_that_take_a_file_name(tmp_path):
    """``paddle.save`` and ``shutil.copyfile`` write to a name: the name is a temp beside the target."""
    path = tmp_path / "state.bin"
    path.write_bytes(b"old")
    with atomic_path(path) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and not os.path.exists(tmp)
        pathlib.Path(tmp).write_bytes(b"new")
        assert path.read_bytes() == b"old"  # replaced only on a clean exit
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["state.bin"]
    with pytest.raises(RuntimeError, match="crashed"):
        with atomic_path(path) as tmp:
            pathlib.Path(tmp).write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["state.bin"]
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with atomic_path(path):
            pass  # a writer that silently wrote nothing must not pass for one that did
    assert path.read_bytes() == b"new"


class _Refused(ValueError):
    pass


@pytest.mark.parametrize(
    "raw, problem",
    [
        (None, "cannot read the thing: No such file or directory"),
        (b"", "the thing is empty (0 bytes)"),
        (b'{"a":\n "\xff"}', "the thing is not UTF-8 text (line 2, byte 8)"),
        (
            b'{"a": 1,}',
            "the thing is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 9)",
        ),
        (b"[1, 2]", "the thing must be a JSON object, got a list"),
        # valid JSON nested past Python's recursion limit: was a RecursionError traceback (check-loss,
        # check-ckpt's config.json, a resume's meta.json)
        (b"[" * 100_000 + b"]" * 100_000, "the thing is not readable JSON (nested too deeply)"),
        # an integer past Python's 4300-digit limit: json raised a plain ValueError naming no file
        (
            b"[" + b"9" * 5000 + b"]",
            "the thing is not readable JSON (Exceeds the limit (4300 digits) for integer string conversion: "
            "value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)",
        ),
    ],
)
def test_read_json_names_file_what_and_problem(tmp_path, raw, problem):
    path = tmp_path / "x.json"
    if raw is not None:
        path.write_bytes(raw)
    with pytest.raises(_Refused) as e:
        read_json(path, "the thing", error=_Refused)
    assert str(e.value) == f"{path}: {problem}"


def test_read_json_reads_bytes_given_and_any_type_when_asked(tmp_path):
    assert read_json(tmp_path / "x", "the thing", list, data=b"[1, 2.5]") == [1, 2.5]
    assert read_json(tmp_path / "x", "the thing", None, data=b'"s"') == "s"


def test_no_other_json_file_reader_in_the_package():
    """JSON files are read through _io.read_json (one message form); these parse JSON that is no file."""
    allowed = {
        "ops/kernels.py": "the build script's argv",
        "train/nonfinite.py": "records gathered from the ranks",
        "train/loop.py": "the run settings gathered from the ranks (check_same_run)",
        "train/data.py": "jsonl, line by line (errors name file:line)",
        "train/command.py": "--model-config's text",
    }
    pkg = ROOT / "paddleformers_glm"
    found = {
        p.relative_to(pkg).as_posix()
        for p in pkg.rglob("*.py")
        if re.search(r"\bjson\.loads?\(", p.read_text(encoding="utf-8")) and p.name != "_io.py"
    }
    assert found == set(allowed), f"JSON read around _io.read_json: {sorted(found - set(allowed))}"
