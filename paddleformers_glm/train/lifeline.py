"""Tie a process's life to its parent's, so that no part of a training job outlives its launcher:
each process of the job is started with setsid, so killing the top reaches nobody below it by
itself (the process tree: docs/failure-modes.md, "Signals and the launcher's lifetime").

``python -m paddleformers_glm.train.lifeline MODULE ARGS...`` ties itself to its parent and then runs
``python -m MODULE ARGS...`` in the same process (the launcher starts Paddle's launcher this way),
then leaves with the module's exit status without the interpreter's teardown (``_exit.exit_now``).
Any other exception out of the module is printed and ends the process with status 1 the same way:
the interpreter's teardown waits on every non-daemon thread, and Paddle's launcher, raising before
any worker started (two nodes claiming one node rank, a master port another process holds), leaves
its key-value server's thread running, so the process never ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import traceback

__all__ = ["tie_to_parent"]

_PR_SET_PDEATHSIG = 1


def tie_to_parent(parent_pid: int | None = None) -> bool:
    """Ask for SIGKILL when the parent (the thread that started this process) exits; if the
    parent is already gone (it is not `parent_pid`, or this process was re-parented), exit now.
    Returns whether the kernel took the request (Linux only)."""
    tied = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)  # the loaded libc (find_library would spawn ldconfig)
            tied = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before the request
        os._exit(1)
    return tied


def main() -> None:
    import runpy

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m paddleformers_glm.train.lifeline MODULE [ARGS...]")
    from .._exit import exit_code, exit_now
    from .job_status import ENV_LAUNCHER_PID
    from .stop_signals import unblock

    unblock()  # the glm52 launcher blocks its stop signals (stop_signals.py); this process must get them
    expected = os.environ.get(ENV_LAUNCHER_PID)
    tie_to_parent(int(expected) if expected else None)
    sys.argv = sys.argv[1:]  # MODULE ARGS..., as ``python -m MODULE ARGS...`` would see them
    try:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # Paddle's launcher ends with sys.exit(status)
        code = exit_code(e)
    except BaseException as e:  # whatever it is, the process must end (see the module's docstring)
        traceback.print_exc()
        code = 128 + int(signal.SIGINT) if isinstance(e, KeyboardInterrupt) else 1
    exit_now(code)  # its workers are joined: skip the interpreter's teardown of Paddle


if __name__ == "__main__":
    main()
