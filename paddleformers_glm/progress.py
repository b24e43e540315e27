"""Progress of long operations (load, save, convert, export, check-ckpt): what a user sees while a
1.5 TB checkpoint streams (docs/checkpoints.md, "Progress"); the checkpoint engine reports per tensor
through :func:`start`, callers need no other hook.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from ._io import env_flag

__all__ = ["Progress", "human_bytes", "itemsize", "on_terminal", "set_quiet", "shared", "start"]

_QUIET: bool | None = None


def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype name or Paddle / numpy dtype: the bit width in its name over 8
    (``bfloat16`` 2, ``float8_e4m3fn`` 1), 1 for ``bool``, 2 for a name without one."""
    name = str(dtype).replace("paddle.", "").replace("torch.", "")
    bits = re.search(r"\d+", name)
    return int(bits[0]) // 8 if bits else 1 if name == "bool" else 2


def set_quiet(quiet: bool | None = True) -> bool | None:
    """Silence (True) or allow (False) progress output in this process; None: back to the env
    default.  Returns the previous setting (to restore it)."""
    global _QUIET
    prev, _QUIET = _QUIET, quiet
    return prev


def _quiet() -> bool:
    return _QUIET if _QUIET is not None else env_flag("GLM52_QUIET", False, strict=False)


def _rank_prefix() -> str:
    raw = os.environ.get("PADDLE_TRAINERS_NUM", "").strip()
    world = int(raw) if raw.isdigit() else 1  # a malformed value is named by the run (parallel/topology.py)
    return f"rank {os.environ.get('PADDLE_TRAINER_ID', '0')}: " if world > 1 else ""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


def _human_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


class Progress:
    """One operation's progress: ``update(nbytes, tensors)`` per tensor, ``close()`` at the end
    (also when the totals are reached).  Output goes to ``stream`` (stderr by default)."""

    def __init__(
        self,
        desc: str,
        total_bytes: int | None = None,
        total_tensors: int | None = None,
        unit: str = "tensors",
        stream: TextIO | None = None,
        quiet: bool | None = None,
    ) -> None:
        self.desc, self.unit = desc, unit
        self.total_bytes, self.total_tensors = total_bytes, total_tensors
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = _quiet() if quiet is None else quiet
        self.bytes = self.tensors = 0
        self.t0 = self.last = time.monotonic()
        try:  # seconds between lines; a malformed value keeps the default
            self.interval = max(0.0, float(os.environ.get("GLM52_PROGRESS_INTERVAL", "5")))
        except ValueError:
            self.interval = 5.0
        self.lines = 0
        self.closed = False
        self.bar = None
        if not self.quiet and on_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes,
                desc=f"{_rank_prefix()}{desc}",
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=self.stream,
                ncols=_size(self.stream)[0],
                nrows=_size(self.stream)[1],
                leave=False,
                postfix=self._postfix(),
            )

    def _postfix(self) -> str:
        total = f"/{self.total_tensors}" if self.total_tensors is not None else ""
        return f"{self.unit}={self.tensors}{total}"

    def update(self, nbytes: int = 0, tensors: int = 1) -> None:
        if self.closed:
            return
        self.bytes += int(nbytes)
        self.tensors += int(tensors)
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(int(nbytes))
        elif not self.quiet and (now := time.monotonic()) - self.last >= self.interval:
            self.last = now
            self._line()
        if self.total_tensors is not None and self.tensors >= self.total_tensors:
            self.close()

    def line(self) -> str:
        """The structured log line for the current state."""
        el = time.monotonic() - self.t0
        rate = self.bytes / el if el > 0 else 0.0
        total = f"/{human_bytes(self.total_bytes)}" if self.total_bytes else ""
        parts = [self._postfix(), f"bytes={human_bytes(self.bytes)}{total}"]
        parts += [f"rate={human_bytes(rate)}/s", f"elapsed={_human_seconds(el)}"]
        if self.total_bytes and rate > 0 and not self.closed:
            parts.append(f"eta={_human_seconds((self.total_bytes - self.bytes) / rate)}")
        if self.closed:
            parts.append("done")
        return f"[glm52 {self.desc}] {_rank_prefix()}" + " ".join(parts)

    def _line(self) -> None:
        self.lines += 1
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif not self.quiet and (self.lines or time.monotonic() - self.t0 >= self.interval):
            self._line()  # the final line, when the operation was long enough to report

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _size(stream: TextIO) -> tuple[int, int]:
    """The terminal's (columns, rows); a terminal that reports none (a fresh pseudo-terminal, where
    tqdm would draw nothing) gets 100 x 20."""
    try:
        cols, rows = os.get_terminal_size(stream.fileno())  # (columns, lines)
    except (AttributeError, ValueError, OSError):
        cols = rows = 0
    return cols or 100, rows or 20


def on_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal, where a redrawn bar belongs (a log file or a pipe gets lines)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


_SHARED: dict[str, Progress] = {}


class _Part:
    """One piece of an operation run in pieces (:func:`shared`): reports to the operation's bar."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar

    def update(self, nbytes: int = 0, tensors: int = 1) -> None:
        self.bar.update(nbytes, tensors)

    def close(self) -> None:
        pass  # the operation's bar closes at its totals or when :func:`shared` ends


@contextlib.contextmanager
def shared(**totals: tuple[int, int]) -> Iterator[dict[str, Progress]]:
    """Within: every :func:`start` of a description named here, ``desc=(total bytes, total tensors)``,
    reports to one bar of those totals, closed on exit -- ``convert``, which loads and saves a layer at
    a time, shows one load and one save bar, as a whole-model pass does."""
    bars = {desc: Progress(desc, b, n) for desc, (b, n) in totals.items()}
    prev = dict(_SHARED)
    _SHARED.update(bars)
    try:
        yield bars
    finally:
        _SHARED.clear()
        _SHARED.update(prev)
        for bar in bars.values():
            bar.close()


def start(desc: str, *args: Any, **kwargs: Any) -> Progress | _Part:
    """The engine's one hook: a bar on stderr with this process's quiet setting (Progress's
    defaults), or a piece of the operation's bar within :func:`shared`."""
    if desc in _SHARED:
        return _Part(_SHARED[desc])
    return Progress(desc, *args, **kwargs)
