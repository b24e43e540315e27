"""Entry point of one launched process: ``worker.py --config RUN.json`` (training) or
``worker.py --generate RUN.json`` (``glm52 generate --tp``, generation/launched.py).

Records its own life for the launcher (job_status.py) and leaves with ``os._exit`` so no
gloo/NCCL destructor can hang the process after a peer died.  Its lifetime is the job's: the
parent-death signal, the watchdog and the stop-signal thread (``sigwaitinfo``, so the record names
the sender even while the main thread waits in a collective) of docs/failure-modes.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from paddleformers_glm._io import read_json
from paddleformers_glm.train.job_status import (
    ENV_DEADLINE,
    ENV_JOB_ID,
    ENV_LAUNCHER_PID,
    ENV_STATUS_DIR,
    TELL_PEERS,
    beat,
    is_comm_error,
    proc_state,
    snapshot,
    write_record,
)
from paddleformers_glm.train.lifeline import tie_to_parent
from paddleformers_glm.train.stop_signals import STOP_SIGNALS, process_name, shorten

# past the job deadline the launcher stops the job itself; the worker acts only if it did not
DEADLINE_GRACE_S = 15.0
# after a communication error, how long the peers' snapshot waits for a dying peer to show as exited
# (Paddle's launcher kills the survivors >= 3.6 s after it sees a worker exit)
PEER_SETTLE_S = 2.0


def job_deadline() -> float | None:
    """The job deadline the launcher set (``GLM52_JOB_DEADLINE``, seconds since the epoch; unset or
    empty: None); a value that is not a finite number is a ValueError naming the variable."""
    raw = os.environ.get(ENV_DEADLINE, "").strip()
    if not raw:
        return None
    try:
        deadline = float(raw)
    except ValueError:
        deadline = math.nan
    if not math.isfinite(deadline):
        raise ValueError(f"{ENV_DEADLINE} must be a time in seconds since the epoch, got {raw!r}")
    return deadline


class WorkerLife:
    """The worker's end, whichever comes first: its own outcome, a stop signal, the launcher's
    death, the job deadline.  Only one of them writes a record (``_lock``)."""

    def __init__(self, rank: int, status_dir: str | None) -> None:
        self.rank, self.status_dir = rank, status_dir
        self._lock = threading.Lock()
        launcher = os.environ.get(ENV_LAUNCHER_PID)
        self.launcher_pid = int(launcher) if launcher else None
        self.launcher_start = proc_state(self.launcher_pid, 19) if self.launcher_pid else None
        self.deadline: float | None = None
        self.deadline_error: ValueError | None = None  # raised where the worker records its errors (main)
        try:
            self.deadline = job_deadline()
        except ValueError as e:
            self.deadline_error = e

    def start(self) -> None:
        """Before anything else (Paddle's threads inherit the blocked signals)."""
        if os.getppid() == 1:  # Paddle's launcher died before this process got here
            os._exit(1)
        tie_to_parent()
        if hasattr(signal, "sigwaitinfo") and threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            threading.Thread(target=self._wait_signals, name="glm52-signals", daemon=True).start()
        else:  # no sigwaitinfo: the main thread's handler (runs between bytecodes)
            for s in STOP_SIGNALS:
                signal.signal(s, lambda num, _frame: self.end({"signal": signal.Signals(num).name}, 128 + num))
        if self.launcher_pid is not None or self.deadline is not None:
            threading.Thread(target=self._watch, name="glm52-watchdog", daemon=True).start()

    def _wait_signals(self) -> None:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        sender = int(info.si_pid)
        in_job = self._in_job(sender)  # first: a sender that exits leaves nothing to read
        reason = {"signal": signal.Signals(info.si_signo).name, "sender_pid": sender, "sender": process_name(sender)}
        self.end({**reason, "sender_in_job": in_job}, 128 + int(info.si_signo))

    def _in_job(self, pid: int) -> bool:
        """Whether a signal's sender is part of this job (the glm52 launcher, Paddle's launcher,
        this worker, any process carrying the job id): then the signal is the job's own teardown;
        otherwise someone outside stopped this rank, and the diagnosis names it for that."""
        if pid in (os.getpid(), os.getppid(), self.launcher_pid):
            return True
        job = os.environ.get(ENV_JOB_ID)
        if not job or pid <= 0:  # 0: the kernel
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"{ENV_JOB_ID}={job}".encode() in f.read().split(b"\0")
        except OSError:  # gone already (a `kill` command), or another user's
            return False

    def _launcher_gone(self) -> bool:
        pid = self.launcher_pid
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or alive but another user's: a reused pid
            return True
        # a zombie, or a new process under the old pid (another start time)
        return proc_state(pid) == "Z" or (
            self.launcher_start is not None and proc_state(pid, 19) != self.launcher_start
        )

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self._launcher_gone():
                self.end({"watchdog": f"the glm52 launcher (pid {self.launcher_pid}) is gone"}, 1)
            if self.deadline is not None and time.time() > self.deadline + DEADLINE_GRACE_S:
                self.end({"watchdog": "the job deadline (--job-timeout) passed and the launcher did not stop it"}, 124)

    def end(self, reason: dict, code: int) -> None:
        """Record why this worker ends (``rank<N>.signal.json``) and leave now."""
        if not self._lock.acquire(timeout=5.0):  # the main thread is writing its own record
            os._exit(code)
        record = {"rank": self.rank, "time": time.time(), **reason}
        try:
            record["peers"] = self._peers()
        finally:  # leave even if the snapshot fails: a worker that outlives its signal is an orphan
            self.leave("signal.json", record, code)

    def leave(self, suffix: str, record: dict | None, code: int, text: str = "", then: Any = None) -> None:
        """Write ``rank<N>.<suffix>``, then ``text`` to stderr, run ``then`` (recorded first: it may
        wait), and leave with ``code`` whatever happens (``os._exit``: no teardown)."""
        try:
            write_record(self.status_dir, self.rank, suffix, record)
        finally:
            sys.stderr.write(text)
            sys.stdout.flush()
            sys.stderr.flush()
            if then is not None:
                with contextlib.suppress(BaseException):
                    then()
            os._exit(code)

    def _peers(self, settle_s: float = 0.0) -> dict | None:
        """Every local rank as it is now.  With ``settle_s`` (after a communication error) the
        snapshot is retaken until a peer without a record shows as gone or stopped, for at most
        that long: a peer killed a moment ago has closed its sockets (hence the error here) some
        milliseconds before the kernel shows it as exited."""
        if not self.status_dir:
            return None
        t_end = time.monotonic() + settle_s
        while True:
            try:
                snap = snapshot(self.status_dir, by=f"rank {self.rank}")
            except Exception:  # noqa: BLE001 - the record matters more than the snapshot
                return None
            peers = [v for k, v in snap["ranks"].items() if k != str(self.rank) and v["record"] is None]
            if time.monotonic() >= t_end or any(v["state"] in ("gone", "T", "t") for v in peers):
                return snap
            time.sleep(0.05)

    def failed(self, e: BaseException) -> None:
        """Record the exception (with the peers as they are now), print it, leave with 1."""
        self._lock.acquire(timeout=5.0)
        tb = traceback.format_exc()
        text = shorten(" | ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip()))
        comm = is_comm_error(f"{type(e).__name__} {e} {tb}")  # the whole text: gloo puts TIMEOUT first
        record = {
            "rank": self.rank,
            "time": time.time(),
            "type": type(e).__name__,
            "message": text,
            "comm": comm,
            "traceback_tail": "\n".join(tb.strip().splitlines()[-8:]),
            "detail": getattr(e, "record", None) or clean_detail(e, self.rank, text),
            "peers": self._peers(settle_s=PEER_SETTLE_S if comm else 0.0),
        }
        # a non-finite step, or non-finite weights: not a bug, its message says all (the traceback is
        # noise, kept in error.json's traceback_tail; Paddle's launcher prints the end of this log)
        text_out = f"{type(e).__name__}: {text}\n" if record["detail"] else tb
        self.leave("error.json", record, 1, text_out, then=getattr(e, TELL_PEERS, None))


def clean_detail(e: BaseException, rank: int, text: str) -> dict | None:
    """The launcher's record (failure.json) of an error whose message names everything, reported in one
    line without a traceback as in one process: NaN/Inf weights or resume state (``NonFiniteError``,
    naming the file and the tensor); None for any other error (reported with its traceback)."""
    try:  # the record matters more than its detail: never fail here
        from paddleformers_glm.checkpoint.finite import NonFiniteError

        if not isinstance(e, NonFiniteError):
            return None
        return {
            "kind": "error",
            "rank": rank,
            "message": f"rank {rank} failed: {type(e).__name__}: {text}",
            "file": e.file,
            "tensor": e.key,
            "nonfinite_tensors": dict(list(e.counts.items())[:20]),
        }
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="glm52 training worker (started by the launcher)")
    job = ap.add_mutually_exclusive_group(required=True)
    job.add_argument("--config", help="TrainConfig as JSON")
    job.add_argument("--generate", help="a glm52 generate --tp run as JSON (generation/launched.py)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)
    status_dir = os.environ.get(ENV_STATUS_DIR)
    life = WorkerLife(rank, status_dir)
    life.start()
    pid = {"rank": rank, "pid": os.getpid(), "job": os.environ.get(ENV_JOB_ID), "time": time.time()}
    write_record(status_dir, rank, "pid", pid)
    beat(0, "start")
    try:
        if life.deadline_error is not None:
            raise life.deadline_error
        if args.generate:
            from paddleformers_glm.generation.launched import generate_on_rank

            generate_on_rank(read_json(args.generate, "the generate run"))
        else:
            from paddleformers_glm.train.loop import TrainConfig, run_training

            run_training(TrainConfig.from_dict(read_json(args.config, "the run config")))
    except BaseException as e:  # noqa: BLE001 - every failure must be reported, then the process ends
        life.failed(e)
    life.leave("ok", None, 0)


if __name__ == "__main__":
    main()
