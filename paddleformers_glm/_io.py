"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never a part.

Each write goes to a uniquely named temporary file in the destination's folder (same filesystem,
so the rename is atomic), is flushed to disk, and then renamed over the destination; on any error
the temporary file is removed and the destination is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any


def _temp_beside(path: str) -> str:
    """A unique temporary name in `path`'s folder (made if missing): same filesystem, atomic rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
    """A temporary path beside `path` that replaces it when the block ends cleanly and is removed
    when it raises (the caller has made its bytes durable)."""
    tmp = _temp_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside `path` for writers that take only a file name (``paddle.save``):
    on a clean exit the file written there is flushed to disk and replaces `path`."""
    path = os.fspath(path)
    with _replacing(path) as tmp:
        yield tmp
        if not os.path.isfile(tmp):
            raise FileNotFoundError(f"atomic_path({path!r}): nothing was written to the temporary file {tmp}")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`.
    `mode` is "w" (text) or "wb"; missing parent folders are created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    with _replacing(os.fspath(path)) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with open(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` atomically."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def write_json_atomic(
    path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True, default: Any = str
) -> None:
    """`obj` as JSON (plus a final newline) to `path` atomically; values JSON does not know are
    written with `default` (str)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n")
