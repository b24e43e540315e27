"""Leave a finished command's process without the interpreter's teardown.

Once Paddle is loaded, a normal interpreter exit spends a second or more tearing down Paddle's
modules and C++ singletons after the work is done (``bench/bench_import.py`` measures it); a job
pays it in every process: the command, Paddle's launcher, each worker.  By the time a command
returns, what it wrote is already in place (atomic renames, closed files) and every child has
been waited for, so the process flushes its streams and log handlers and ends with ``os._exit``.
Only ``__main__`` entry points call this: a function called in-process returns normally.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_code", "exit_now"]


def exit_code(e: SystemExit) -> int:
    """The process exit status ``sys.exit(e.code)`` would give (None: 0, an int: itself, else 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message") prints it and exits with 1
    return 1


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process with ``code`` at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to deliver
            pass
    os._exit(code)
