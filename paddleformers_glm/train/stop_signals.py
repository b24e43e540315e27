"""SIGTERM, SIGINT and SIGHUP to a ``glm52 train`` process, with the process that sent them.

A Python signal handler never learns the sender, and ``sigtimedwait`` in the main thread misses
a signal the kernel hands to another thread (Paddle starts one at import, with no signal blocked).
So :func:`listen` blocks the three signals before any other thread exists and one listener thread
takes them with ``sigwaitinfo`` (docs/failure-modes.md, "Signals and the launcher's lifetime").
Children inherit the blocked mask across exec: lifeline.py unblocks it.  Where ``sigwaitinfo`` is
missing, or the process already has other threads, the plain handlers are kept (no sender then).
A main thread inside one long system call (a ``sleep``) notices the interruption when it returns.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["STOP_SIGNALS", "StopListener", "listen", "listening", "process_name", "shorten", "stop_text"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def process_name(pid: int) -> str:
    """A process's command line (shortened), or '' when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return shorten(text, 120, 60)


def shorten(text: str, head: int = 300, tail: int = 500) -> str:
    """Head and tail of a long text (a message: the head names the failing op, the tail the last frames)."""
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


def stop_text(signum: int, sender: int | None, target: str) -> str:
    """'SIGTERM to <target> from pid N (its command line)' (sender 0: the kernel, e.g. a terminal's Ctrl-C)."""
    name = signal.Signals(signum).name
    if sender is None:
        return f"{name} to {target}"
    if sender == 0:
        return f"{name} to {target} from the kernel (a terminal's Ctrl-C or hang-up)"
    who = process_name(sender)
    return f"{name} to {target} from pid {sender}" + (f" ({who})" if who else "")


class StopListener:
    """The first stop signal this process received (``caught``), and whether a loop polls for it."""

    def __init__(self) -> None:
        self.caught: dict[str, Any] | None = None
        self.polled = False  # True: a launch loop reads `caught`; the main thread is not interrupted
        self.active = False
        self._thread: threading.Thread | None = None
        self._closing = False
        self._undo: tuple[set[int] | None, dict[int, Any]] = (None, {})  # mask and handlers before listen()

    def note(self, signum: int, sender: int | None) -> None:
        if self.caught is None:
            self.caught = {
                "kind": "signal",
                "signal": signal.Signals(signum).name,
                "sender_pid": sender,
                "text": stop_text(signum, sender, f"the launcher (pid {os.getpid()})"),
            }

    def interrupted(self, e: KeyboardInterrupt) -> dict[str, Any]:
        """The stop signal behind ``e``: the listener's record (with the sender), else the signal a
        plain handler named (SIGINT when none)."""
        name = str(e.args[0]) if e.args and str(e.args[0]).startswith("SIG") else "SIGINT"
        self.note(int(signal.Signals[name]), None)
        return self.caught

    def _listen(self) -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if self._closing:  # _close()'s own SIGHUP to this thread
                return
            self.note(int(info.si_signo), int(info.si_pid))
            if not self.polled:
                _thread.interrupt_main(int(info.si_signo))


_LISTENER = StopListener()


def _raise_interrupt(signum: int, _frame: Any) -> None:
    _LISTENER.note(signum, None)  # kept if the interrupt comes back as another exception (inside Paddle)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def listen() -> StopListener:
    """Start the listener once per process (from the main thread, before Paddle is imported);
    returns it.  SIGTERM and SIGHUP then interrupt the main thread like SIGINT does."""
    if _LISTENER.active or threading.current_thread() is not threading.main_thread():
        return _LISTENER
    handlers = {int(s): signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in (signal.SIGTERM, signal.SIGHUP):  # what interrupt_main(signum) runs in the main thread
        signal.signal(s, _raise_interrupt)
    mask = None
    if hasattr(signal, "sigwaitinfo") and threading.active_count() == 1 and _only_thread():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        _LISTENER._closing = False
        _LISTENER._thread = threading.Thread(target=_LISTENER._listen, name="glm52-stop-signals", daemon=True)
        _LISTENER._thread.start()
    _LISTENER._undo = (mask, handlers)
    _LISTENER.active = True
    return _LISTENER


def _close() -> None:
    """Undo :func:`listen` in a process that goes on after its job (a Python caller of ``glm52
    train``'s ``main``, a test): the listener thread ends, the main thread's signal mask and
    handlers are what they were, and the record is cleared (a next job starts unsignalled).  The
    mask matters most: every process started later inherits it, and one started with SIGTERM and
    SIGINT blocked ignores them."""
    if not _LISTENER.active or threading.current_thread() is not threading.main_thread():
        return
    mask, handlers = _LISTENER._undo
    t = _LISTENER._thread
    if t is not None and t.is_alive():
        _LISTENER._closing = True
        signal.pthread_kill(t.ident, signal.SIGHUP)  # to that thread alone: its sigwaitinfo returns
        t.join(timeout=5.0)
    for s, h in handlers.items():
        signal.signal(s, h)
    if mask is not None:  # a stop signal still pending now comes as to any process (the job has ended)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _LISTENER.caught, _LISTENER.polled, _LISTENER.active = None, False, False
    _LISTENER._thread, _LISTENER._undo = None, (None, {})


@contextlib.contextmanager
def listening() -> Iterator[StopListener]:
    """:func:`listen` for the time of the block, undone after it unless it was listening already."""
    fresh = not _LISTENER.active
    listener = listen()
    try:
        yield listener
    finally:
        if fresh:
            _close()


def _only_thread() -> bool:
    """No native thread either (a library's worker pool would take signals the mask cannot block)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


def unblock() -> None:
    """Undo an inherited block of the stop signals (a child of a listening process)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
