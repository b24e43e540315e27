"""Atomic file writes and the project's one JSON reader and writer.

A write goes to a unique temporary file in the destination's folder (same filesystem, so the rename is
atomic), is flushed to disk and renamed over the destination (on an error the temporary file is removed
and the destination left as it was): a reader, or a crash, sees the old file or the new one, never a part.
:func:`read_json` (text: :func:`read_text`) gives one error, naming the file, what it holds and the
problem. :func:`dumps_json` (:func:`write_json_atomic`) writes strict JSON: Python's ``json`` would write
bare ``NaN`` / ``Infinity``, which strict parsers (browsers, ``jq``, Go, Rust) refuse, so a non-finite
number is written as ``null`` and listed under ``"nonfinite"`` (e.g. ``["losses[3]", "memory.peak"]``)
of the record: a reader can tell a missing value from a NaN (docs/failure-modes.md, "Strict JSON").
A write that fails without naming a file (a full disk or quota reports ENOSPC / EDQUOT / EFBIG at
``write`` or ``fsync``, with no file name) is re-raised as :class:`WriteError`, which names it.
The temporary file is ``.<name>.<pid>.<hex>.tmp`` with the name cut to :data:`TEMP_NAME_BYTES`
bytes, so a destination name up to the filesystem's 255 bytes can be written. :func:`env_flag`
reads the package's on/off environment variables (``GLM52_QUIET``, ``GLM52_CPU_KERNELS``, ...).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import numbers
import os
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def new_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under the process umask (0644 under 022)."""
    try:  # Linux >= 4.7: read it without setting it (os.umask would, for a moment, for every thread)
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class WriteError(OSError):
    """A failed write of ``filename``: the ``errno`` and ``strerror`` of the OS's error, kept (a caller
    can still tell a full disk, ENOSPC, from another failure), with the file and what it holds
    (``what``, e.g. "the resume state of step 3") named. ``write`` and ``fsync`` report a full disk
    with no file name, so without it a run's one line was ``OSError: [Errno 28] No space left on
    device`` and failure.json named no file."""

    what: str | None = None

    @property
    def file(self) -> str:
        """The file, under the name other errors of the package carry it (``CheckpointError.file``)."""
        return self.filename

    @property
    def record(self) -> dict[str, Any]:
        """failure.json's detail of the run this error stopped (the worker and the one-process run
        take an error's ``record``): the message and the file, as a non-finite step names its tensor."""
        code = errno.errorcode.get(self.errno, str(self.errno)) if self.errno is not None else None
        return {"kind": "error", "message": str(self), "file": self.filename, "errno": code}

    def __str__(self) -> str:
        reason = self.strerror or os.strerror(self.errno or 0)
        if self.what:
            return f"{self.filename}: cannot write {self.what}: {reason}"
        return f"cannot write {self.filename}: {reason}"


def write_error(e: OSError, file: str | os.PathLike | None = None, what: str | None = None) -> OSError:
    """``e`` as a :class:`WriteError` (raise it ``from e``) naming `file` (None: the one ``e`` names)
    and `what` it holds (None: what ``e`` said, if it is one). Returned as it is: an error without an
    errno or without a file to name, and a subclass such as PermissionError, which callers may catch
    by its class."""
    if e.errno is None or not (type(e) is OSError or isinstance(e, WriteError)):
        return e
    name = e.filename if file is None else os.fspath(file)
    if name is None:
        return e
    err = WriteError(e.errno, e.strerror, name)
    err.what = what or getattr(e, "what", None)
    return err


@contextlib.contextmanager
def naming_write_errors(
    file: str | os.PathLike,
    what: str | None = None,
    instead_of: tuple[Any, ...] | None = (None,),
    others: bool = True,
) -> Iterator[None]:
    """An OSError of the block re-raised as :func:`write_error` makes it: naming ``file`` where it
    names no file or names one of ``instead_of`` (a temporary copy; None: whatever it names) as the
    file or as the second file (``shutil.copyfile`` names its source first, the destination second),
    and ``what`` it holds. One naming another file keeps that name (``others``) or is re-raised as it
    is (``others=False``). A full disk fails ``write`` / ``fsync`` with no file name."""
    try:
        yield
    except OSError as e:
        second = getattr(e, "filename2", None)
        ours = instead_of is None or e.filename in instead_of or (second is not None and second in instead_of)
        if not ours and not others:
            raise
        err = write_error(e, file if ours else None, what)
        if err is e:
            raise
        raise err from e


def proc_stat_field(pid: int, field: int = 0) -> str | None:
    """A field of Linux's ``/proc/<pid>/stat`` after the command name (0: the one-letter state, R, S,
    D, T = stopped, Z = zombie; 19: the start time in clock ticks, which tells a reused pid apart),
    or None when the process is gone or there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()[field]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process of id ``pid`` runs (another user's too): what tells a killed writer's
    leftovers (a save's temporary folder, a tokenizer save's journal) from a live one's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    except OSError:
        return False
    return True


# the destination's name as a temporary name carries it: a name of up to 255 bytes (NAME_MAX) plus
# "." and ".<pid>.<hex8>.tmp" would pass the limit; cut to this, the temporary name stays under 160 bytes
TEMP_NAME_BYTES = 128


def short_name(name: str, limit: int = TEMP_NAME_BYTES) -> str:
    """``name`` cut to at most ``limit`` bytes of its file-system encoding, at a character boundary."""
    while len(os.fsencode(name)) > limit:
        name = name[:-1]
    return name


def temp_path(path: str | os.PathLike) -> str:
    """A unique temporary name beside ``path``: ``.<name>.<pid>.<hex8>.tmp``, the name cut to
    :data:`TEMP_NAME_BYTES` bytes (the pid says which process left it)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.join(folder, f".{short_name(os.path.basename(path))}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A unique temporary path beside `path` (its folder made if missing: same filesystem, atomic rename)
    for writers that take only a file name (``paddle.save``, ``safetensors``' ``save_file``): on a clean
    exit the file written there gets the mode a plain write would give it (safetensors >= 0.8 writes
    through a temporary file of its own and leaves 0600), is flushed to disk and replaces `path`; when
    the block raises it is removed."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError as e:  # a file where the folder must be: said so, not "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), e.filename) from e
    tmp = temp_path(path)
    try:
        with naming_write_errors(path, instead_of=(None, tmp), others=False):  # a writer names the temporary file
            yield tmp
            if not os.path.isfile(tmp):
                raise FileNotFoundError(f"atomic_path({path!r}): nothing was written to the temporary file {tmp}")
            os.chmod(tmp, new_file_mode())
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the error raised is the one to report, not the cleanup's
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`.
    `mode` is "w" (text) or "wb"; missing parent folders are created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    # "x": the temporary name is created, never opened through something already there
    with atomic_path(path) as tmp, open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:
        yield f


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` atomically."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


NONFINITE_KEY = "nonfinite"


def strict_json_value(obj: Any, default: Any, path: str, found: list[str]) -> Any:
    """`obj` with every non-finite number replaced by None (and numpy scalars by Python numbers);
    the path of each replaced number (`path` is obj's) is appended to `found`. Values JSON does not
    know go through `default` (None: left for ``json`` to refuse)."""
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        f = float(obj)
        if math.isfinite(f):
            return f
        found.append(path or "$")
        return None
    if isinstance(obj, dict):
        return {k: strict_json_value(v, default, f"{path}.{k}" if path else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json_value(v, default, f"{path}[{i}]", found) for i, v in enumerate(obj)]
    if default is not None:
        return strict_json_value(default(obj), None, path, found)
    return obj


def dumps_json(obj: Any, *, indent: int | None = 2, sort_keys: bool = True, default: Any = None) -> str:
    """`obj` as strict JSON: a non-finite number becomes ``null`` and its path is listed under
    ``"nonfinite"`` of the top-level object (an object that already has that key, or a non-finite
    number outside any object, is refused: the flag would be lost)."""
    found: list[str] = []
    clean = strict_json_value(obj, default, "", found)
    if found:
        if not isinstance(clean, dict) or NONFINITE_KEY in clean:
            raise ValueError(
                f"non-finite numbers at {found[:5]} cannot be flagged: the record must be a JSON object "
                f"without a {NONFINITE_KEY!r} key"
            )
        clean[NONFINITE_KEY] = found
    return json.dumps(clean, indent=indent, sort_keys=sort_keys, allow_nan=False)


def write_json_atomic(
    path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True, default: Any = str
) -> None:
    """`obj` as strict JSON (:func:`dumps_json`, plus a final newline) to `path` atomically;
    values JSON does not know are written with `default` (str)."""
    atomic_write_text(path, dumps_json(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n")


def write_record(path: str | os.PathLike, obj: Any) -> None:
    """A run record (loss.json, meta.json, run.json, plan.json, per-rank state and load logs): one-space
    indent, keys in the order the writer built them, and a value JSON does not know is an error rather
    than a string, so a record never holds something a reader cannot load back as it was."""
    write_json_atomic(path, obj, indent=1, sort_keys=False, default=None)


def is_int(x: Any) -> bool:
    """A Python int and not a bool: a parsed record's integer field (``true`` parses to a bool, an int subclass)."""
    return isinstance(x, int) and not isinstance(x, bool)


def read_text(
    file: str | os.PathLike, what: str, error: Callable[[str], Exception] = ValueError, data: bytes | None = None
) -> str:
    """`file`'s text (or that of `data`, bytes read from it), which must be UTF-8; a file that cannot be
    read or decoded raises ``error(message)``, the message naming the file, `what` it holds and the problem."""
    try:
        raw = Path(file).read_bytes() if data is None else data
    except OSError as e:
        raise error(f"{file}: cannot read {what}: {e.strerror or e}") from e
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(f"{file}: {what} is not UTF-8 text (line {line}, byte {e.start})") from e


class _DuplicateKey(Exception):
    """A JSON object's key seen twice (``read_json(unique_keys=True)``)."""


def read_json(
    file: str | os.PathLike,
    what: str,
    expect: type | None = dict,
    error: Callable[[str], Exception] = ValueError,
    *,
    data: bytes | None = None,
    hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    unique_keys: bool = False,
) -> Any:
    """The JSON value of `file` (or of `data`, bytes read from it), of type `expect` (None: any); it is
    only parsed, never unpickled or evaluated. Any failure raises ``error(message)`` as :func:`read_text`
    does, e.g. ``"out/meta.json: the resume metadata is not valid JSON (Expecting value at line 1 column 9)"``.
    `hook` is ``json``'s ``object_pairs_hook``; `unique_keys` refuses an object holding a key twice (which
    ``json`` reads as its last value: a record whose two values disagree would be judged on one)."""
    text = read_text(file, what, error, data)
    if unique_keys:

        def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in pairs:
                if k in out:
                    raise _DuplicateKey(k)
                out[k] = v
            return out

    try:
        value = json.loads(text, object_pairs_hook=hook)
    except _DuplicateKey as e:
        raise error(f"{file}: {what} holds the key {e.args[0]!r} twice") from None
    except json.JSONDecodeError as e:
        problem = f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})" if text else "is empty (0 bytes)"
        raise error(f"{file}: {what} {problem}") from e
    except RecursionError as e:  # valid JSON nested deeper than Python's recursion limit ([[[...]]])
        raise error(f"{file}: {what} is not readable JSON (nested too deeply)") from e
    except ValueError as e:  # an integer past Python's digit limit for int(str) (4300)
        raise error(f"{file}: {what} is not readable JSON ({e})") from e
    if expect is not None and not isinstance(value, expect):
        name = {dict: "object", list: "array"}.get(expect, expect.__name__)
        raise error(f"{file}: {what} must be a JSON {name}, got a {type(value).__name__}")
    return value


FLAG_TRUE = ("1", "true", "on", "yes", "y")
FLAG_FALSE = ("0", "false", "off", "no", "n")
# the package's on/off environment variables and their defaults
ENV_FLAGS = {
    "GLM52_QUIET": False,
    "GLM52_CPU_KERNELS": True,
    "GLM52_CPU_BF16": True,
    "GLM52_FAST_COPY": True,
    "GLM52_EMULATE_COLLECTIVES": False,
}


class EnvFlagError(ValueError):
    """An on/off environment variable set to something that is neither."""


def env_flag_problem(name: str, raw: str | None) -> str | None:
    """Why ``raw``, the value of the on/off variable ``name``, is neither on nor off, else None."""
    v = "" if raw is None else raw.strip().lower()
    if v in ("", *FLAG_TRUE, *FLAG_FALSE) or v.isdigit():  # a whole number: on unless 0
        return None
    return f"{name}={raw!r} is not an on/off setting: use 1, true, on, yes or 0, false, off, no (empty: the default)"


def env_flag(name: str, default: bool, *, value: str | None = None, strict: bool = True) -> bool:
    """The on/off environment variable ``name`` (``value``: its value, read elsewhere; None: read
    here): 1/true/on/yes/y (or any whole number but 0) or 0/false/off/no/n in any case, spaces around
    ignored; unset or empty is
    ``default``. Anything else raises :class:`EnvFlagError` naming the variable and the value, or,
    with ``strict=False`` (a variable read deep inside a run, where an error would end it), warns
    (RuntimeWarning) and returns ``default``."""
    raw = os.environ.get(name) if value is None else value
    problem = env_flag_problem(name, raw)
    if problem is not None:
        if strict:
            raise EnvFlagError(problem)
        warnings.warn(f"{problem}; using the default ({'on' if default else 'off'})", RuntimeWarning, stacklevel=2)
        return default
    v = (raw or "").strip().lower()
    return default if v == "" else v in FLAG_TRUE or (v.isdigit() and int(v) != 0)


def env_flags_error(names: Iterable[str] | None = None) -> str | None:
    """The first problem of the on/off variables ``names`` (None: every one of :data:`ENV_FLAGS`)
    as one line naming the variable and its value, else None: a command checks them before it
    works, so a typo is refused at once rather than warned about inside the run."""
    for name in ENV_FLAGS if names is None else names:
        if (problem := env_flag_problem(name, os.environ.get(name))) is not None:
            return problem
    return None
