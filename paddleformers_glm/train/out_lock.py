"""One ``glm52 train`` per output folder: a second command given the ``--out`` of a running job is
refused, naming the job that holds it (docs/failure-modes.md, "Signals and the launcher's lifetime").

Without it the second job ran to the end beside the first: it deleted the first job's status
records (its post-mortem), overwrote ``job.json``, ``loss.json`` and the step folders of the same
numbers, and moved ``checkpoints/latest`` back and forth between the two runs.  The lock is an
``flock`` on ``OUT/logs/train.lock`` held by the command for its life; the kernel drops it when the
process ends however it ends (SIGKILL included), so a killed job leaves no stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator

__all__ = ["OutInUse", "OutUnusable", "hold_out_folder"]

# flock's answers when another process holds the lock (any other error: a filesystem without locks)
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class OutInUse(ValueError):
    """The output folder is held by another running ``glm52 train``."""


class OutUnusable(ValueError):
    """The output folder's lock file cannot be made (``logs`` is a file, the place is read-only):
    the message names the lock file, relative to the folder, and the OS's words."""


def lock_path(out: str, node_rank: int | None = None) -> str:
    """The lock file of ``out`` (one per node of a multi-node job sharing a folder)."""
    name = "train.lock" if node_rank is None else f"train.node{node_rank}.lock"
    return os.path.join(out, "logs", name)


@contextlib.contextmanager
def hold_out_folder(
    out: str,
    node_rank: int | None = None,
    *,
    lock: str | None = None,
    refusal: str = "--out {out} is in use by a running glm52 train",
) -> Iterator[None]:
    """Hold ``out`` for the ``with`` block; raise :class:`OutInUse` naming the holder if another
    process holds it, or :class:`OutUnusable` when its lock file cannot be made.  A filesystem
    without locks (some network mounts) runs unguarded.  ``lock`` is another lock file than
    :func:`lock_path`'s (``glm52 generate``'s ``--log-dir``); ``refusal`` the refusal's opening words."""
    try:
        import fcntl
    except ImportError:  # not POSIX: unguarded
        yield
        return
    path = lock or lock_path(out, node_rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        folder = os.path.relpath(os.path.dirname(path), out)
        reason = f"{folder} is a file, not a folder" if isinstance(e, FileExistsError) else e.strerror or e
        raise OutUnusable(f"cannot make its lock file {os.path.relpath(path, out)}: {reason}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in _HELD:
                yield  # no locks on this filesystem (ENOLCK, EOPNOTSUPP): unguarded
                return
            raise _in_use(fd, path, out, refusal) from None
        if lock is None:  # a job of the other kind (one node / a node of several) holds its own lock file
            try:
                _refuse_if_held(_other_kind_locks(out, node_rank), out, refusal)
            except OutInUse:
                if created:  # refused: the running job's folder keeps no file of this command
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {stamp}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _other_kind_locks(out: str, node_rank: int | None) -> list[str]:
    """The lock files of ``out`` that jobs of the other kind hold: a one-node job's against every node's
    of a multi-node job, a node's against the one-node job's (the nodes of one job share ``out``)."""
    folder = os.path.join(out, "logs")
    if node_rank is not None:
        return [lock_path(out)]
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith("train.node") and n.endswith(".lock")]


def _refuse_if_held(paths: list[str], out: str, refusal: str) -> None:
    """:class:`OutInUse` naming the holder of the first of ``paths`` a live process holds (a shared
    lock taken and given back at once: it fails only beside a holder's exclusive one)."""
    import fcntl

    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone, or not readable: no holder to name
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in _HELD:
                    continue
                raise _in_use(fd, path, out, refusal) from None
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _in_use(fd: int, path: str, out: str, refusal: str) -> OutInUse:
    """The refusal naming the holder that wrote itself into the lock file ``path`` (open as ``fd``)."""
    holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
    flag = refusal.split(" ", 1)[0]
    return OutInUse(
        f"{refusal.format(out=out)} ({holder}; lock {path}): wait for it to end, stop it, or give another {flag}"
    )
