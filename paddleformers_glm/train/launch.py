"""Start the local worker processes through ``python -m paddle.distributed.launch`` and turn a
failure into one line that names the rank that caused it.

Paddle's launcher, when one worker dies, reports whichever container it noticed first (often a
*survivor* that failed in communication afterwards).  So each worker records its own fate in
``LOG/status/``: ``rank<N>.error.json`` (exception, traceback, time, whether it looks like a
communication failure) or ``rank<N>.ok``.  After the launcher exits we pick the culprit:
the earliest non-communication error, else a rank the launcher saw frozen (process state T, e.g.
SIGSTOP), else a rank that left no record (killed by a signal or the OS), else the earliest
communication error.  Every failure also leaves ``LOG/failure.json`` (culprit, message, how the job
ended).  A watchdog stops the whole process group when a
rank has failed but the launcher has not exited ``grace_s`` later (default: past the 30 s gloo
timeout), or when a rank stays frozen that long (on NCCL its peers would otherwise wait for the
process-group timeout), and ``timeout_s`` (``--job-timeout``) bounds the whole job, so it never
hangs on a dead or frozen peer.

Multi-node: pass the launcher's own options (``--nnodes``, ``--master``, ``--rank``, ``--ips``)
through ``launcher_args``; every node runs the same command.

``python -m paddleformers_glm.train.launch ARGS`` is ``python -m paddle.distributed.launch ARGS``
(Paddle's own launcher, in this module's ``__main__``) that leaves through ``_exit.exit_now`` once
Paddle's launcher has joined its workers: the job ends without the launcher's interpreter teardown.
:func:`prestart_launcher` starts it before the command has validated its arguments: it imports
Paddle meanwhile (on another core) and starts no worker until :func:`launch_workers` lets it go.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._exit import exit_code, exit_now
from .._io import atomic_write_text
from ..cpu_env import apply_mkl_default
from .console import PaddleChatter

__all__ = [
    "LaunchError",
    "diagnose",
    "launch_workers",
    "launcher_command",
    "prestart_launcher",
    "rank_states",
    "run_paddle_launcher",
    "worker_env",
    "write_failure_record",
]

_COMM_MARKERS = (
    "gloo",
    "TIMEOUT",
    "Connection reset",
    "Connection closed",
    "Connection refused",
    "Broken pipe",
    "NCCL",
    "ProcessGroup",
    "socket",
    "peer",
)


@dataclass
class LaunchError(RuntimeError):
    """A distributed job failed; ``rank`` is the culprit (None when unknown)."""

    rank: int | None
    message: str
    returncode: int

    def __str__(self) -> str:
        return self.message


def is_comm_error(text: str) -> bool:
    return any(m.lower() in text.lower() for m in _COMM_MARKERS)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env(nproc_per_node: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the workers: our package importable, MKL fast path on AMD, one thread set per process."""
    env = dict(os.environ if base is None else base)
    apply_mkl_default(env)  # AMD only: Paddle's MKL picks a 2.5x slower path there without it
    cpus = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(1, nproc_per_node))))
    env.setdefault("GLOG_minloglevel", "2")
    env["PYTHONPATH"] = os.pathsep.join([_repo_root()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _tail(path: str, n: int = 12) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.rstrip() for ln in f.readlines() if ln.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _proc_state(pid: int) -> str | None:
    """One-letter Linux process state (R, S, D, T = stopped, t = traced, Z), or None when gone/unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def rank_states(log_dir: str) -> dict[int, str]:
    """Process state of every local rank that recorded its pid and is still alive."""
    out: dict[int, str] = {}
    for path in glob.glob(os.path.join(log_dir, "status", "rank*.pid")):
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        st = _proc_state(int(rec["pid"]))
        if st is not None and st != "Z":
            out[int(rec["rank"])] = st
    return out


def diagnose(
    log_dir: str, world_local: list[int], stopped: Sequence[int] = (), killed_by_us: bool = False
) -> tuple[int | None, str]:
    """(culprit rank, message) from the status files of the local ranks ``world_local``.

    ``stopped``: ranks the launcher saw frozen (process state T/t: SIGSTOP, a debugger) while the
    job was failing; such a rank outranks the peers that timed out waiting for it.
    ``killed_by_us``: the launcher stopped the job (job timeout), so a rank without a record is not
    a culprit by itself.
    """
    status = os.path.join(log_dir, "status")
    errors = []
    for path in glob.glob(os.path.join(status, "rank*.error.json")):
        try:
            with open(path, encoding="utf-8") as f:
                errors.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            continue
    ok = {int(os.path.basename(p)[4:-3]) for p in glob.glob(os.path.join(status, "rank*.ok"))}
    reported = {e["rank"] for e in errors} | ok
    silent = [r for r in world_local if r not in reported]
    errors.sort(key=lambda e: e["time"])
    primary = [e for e in errors if not e["comm"]]
    others = ""
    if primary:
        e = primary[0]
        rest = sorted({x["rank"] for x in errors if x is not e})
        if rest:
            others = f" (then rank(s) {', '.join(map(str, rest))} failed too)"
        return e["rank"], f"rank {e['rank']} failed: {e['type']}: {e['message']}{others}\n{e['traceback_tail']}"
    frozen = [r for r in stopped if r not in reported]
    if frozen:
        r = frozen[0]
        comm_ranks = sorted({x["rank"] for x in errors})
        if comm_ranks:
            others = f"; rank(s) {', '.join(map(str, comm_ranks))} then timed out waiting for it"
        return r, (
            f"rank {r} was stopped (process state T: SIGSTOP, a debugger or job control) and stopped answering{others}. "
            f"Last lines of {os.path.join(log_dir, f'workerlog.{r}')}:\n{_tail(os.path.join(log_dir, f'workerlog.{r}'), 6)}"
        )
    if silent and not killed_by_us:
        r = silent[0]
        tail = _tail(os.path.join(log_dir, f"workerlog.{r}"), 6)
        comm_ranks = sorted({x["rank"] for x in errors})
        if comm_ranks:
            others = f"; rank(s) {', '.join(map(str, comm_ranks))} then lost their peer"
        return r, (
            f"rank {r} died without a Python error (a signal, os._exit, or the OS killing it, e.g. out of memory){others}. "
            f"Last lines of {os.path.join(log_dir, f'workerlog.{r}')}:\n{tail}"
        )
    if errors:
        e = errors[0]
        return e[
            "rank"
        ], f"rank {e['rank']} failed in communication: {e['type']}: {e['message']}\n{e['traceback_tail']}"
    if killed_by_us:
        return None, "no rank reported an error or was seen stopped (a slow or hung job; see OUT/logs/workerlog.*)"
    return None, "the launcher failed before any worker reported (see the launcher output above)"


def launcher_command(nproc_per_node: int, log_dir: str, args: Sequence[str]) -> list[str]:
    """The command line of Paddle's launcher for ``nproc_per_node`` local processes logging to
    ``log_dir``; ``args`` are further launcher options, then the script and its arguments."""
    return [
        sys.executable,
        "-m",
        "paddleformers_glm.train.launch",
        "--nproc_per_node",
        str(nproc_per_node),
        "--log_dir",
        log_dir,
        *args,
    ]


_GATE = "--wait-for-go"  # first argument of a pre-started launcher: wait for "go" on stdin


def _launcher_process(
    worker_args: Sequence[str],
    nproc_per_node: int,
    log_dir: str,
    launcher_args: Sequence[str],
    extra_env: dict[str, str] | None,
    gated: bool,
) -> subprocess.Popen:
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    cmd = launcher_command(nproc_per_node, log_dir, [*launcher_args, worker, *worker_args])
    if gated:
        cmd.insert(3, _GATE)
    env = worker_env(nproc_per_node)
    env.update(extra_env or {})
    env["GLM52_STATUS_DIR"] = os.path.join(log_dir, "status")
    return subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE if gated else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        bufsize=1,
    )


class PendingLaunch:
    """Paddle's launcher started ahead (:func:`prestart_launcher`), waiting to start the workers."""

    def __init__(self, proc: subprocess.Popen, args: tuple) -> None:
        self.proc, self.args = proc, args

    def go(self) -> subprocess.Popen:
        """Let the launcher start the workers."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):  # it already ended: launch_workers reports its exit
            pass
        return self.proc

    def cancel(self) -> None:
        """The job will not run: stop the launcher, which has started nothing yet."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        _kill_group(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def prestart_launcher(
    worker_args: Sequence[str],
    nproc_per_node: int,
    log_dir: str,
    *,
    launcher_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> PendingLaunch:
    """Start Paddle's launcher for :func:`launch_workers` (same arguments) before the job is known
    to be valid: its Paddle import overlaps the caller's checks.  Pass the result to
    ``launch_workers(..., pending=...)``, or call ``cancel()`` on it."""
    log_dir = os.path.abspath(log_dir)
    args = (tuple(worker_args), nproc_per_node, log_dir, tuple(launcher_args), dict(extra_env or {}))
    return PendingLaunch(_launcher_process(*args, gated=True), args)


def launch_workers(
    worker_args: Sequence[str],
    nproc_per_node: int,
    log_dir: str,
    *,
    launcher_args: Sequence[str] = (),
    node_rank_offset: int = 0,
    grace_s: float = 45.0,
    timeout_s: float | None = None,
    quiet_launcher: bool = True,
    stream=None,
    extra_env: dict[str, str] | None = None,
    pending: PendingLaunch | None = None,
) -> None:
    """Run ``paddleformers_glm/train/worker.py worker_args`` on ``nproc_per_node`` local processes.

    Raises :class:`LaunchError` naming the failing rank; returns when every rank finished cleanly.
    ``node_rank_offset`` is this node's first global rank (multi-node diagnosis).  ``pending``: the
    launcher :func:`prestart_launcher` started with the same arguments.
    """
    stream = stream or sys.stdout
    log_dir = os.path.abspath(log_dir)
    os.makedirs(os.path.join(log_dir, "status"), exist_ok=True)
    for old in glob.glob(os.path.join(log_dir, "status", "rank*")):
        os.remove(old)
    args = (tuple(worker_args), nproc_per_node, log_dir, tuple(launcher_args), dict(extra_env or {}))
    if pending is not None:
        if pending.args != args:
            pending.cancel()
            raise ValueError(f"launch_workers{args} differs from the pre-started launcher's {pending.args}")
        proc = pending.go()
    else:
        proc = _launcher_process(*args, gated=False)

    chatter = PaddleChatter()  # Paddle's INFO records and flags banner: workerlog.* only, unless verbose

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if quiet_launcher and (line.startswith("LAUNCH INFO") or "UserWarning" in line or "warnings.warn" in line):
                continue
            if quiet_launcher and not chatter.keep(line):
                continue
            stream.write(line)
            stream.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t_start, first_failure, killed = time.monotonic(), None, None
    stopped_since: dict[int, float] = {}  # rank -> when first seen frozen
    last_poll = 0.0
    while proc.poll() is None:
        time.sleep(0.2)
        now = time.monotonic()
        if first_failure is None and glob.glob(os.path.join(log_dir, "status", "rank*.error.json")):
            first_failure = now
        if now - last_poll >= 1.0:  # a frozen rank hangs its peers (NCCL: up to the process-group timeout)
            last_poll = now
            states = rank_states(log_dir)
            for r, st in states.items():
                if st in ("T", "t"):
                    stopped_since.setdefault(r, now)
                else:
                    stopped_since.pop(r, None)
        frozen = [r for r, t0 in sorted(stopped_since.items(), key=lambda kv: kv[1]) if now - t0 > grace_s]
        if first_failure is not None and now - first_failure > grace_s:
            killed = f"ranks still running {grace_s:.0f} s after a failure; stopped the job"
        elif frozen:
            killed = f"rank {frozen[0]} stayed stopped for {grace_s:.0f} s; stopped the job"
        elif timeout_s is not None and now - t_start > timeout_s:
            killed = f"job exceeded --job-timeout {timeout_s:.0f} s; stopped"
        if killed:
            _kill_group(proc)
            break
    proc.wait()
    reader.join(timeout=5)
    local = list(range(node_rank_offset, node_rank_offset + nproc_per_node))
    if proc.returncode == 0 and not killed:
        return
    timed_out = bool(killed) and "--job-timeout" in killed
    rank, msg = diagnose(log_dir, local, stopped=sorted(stopped_since, key=stopped_since.get), killed_by_us=timed_out)
    if killed:
        msg = f"{msg}\n({killed})"
    err = LaunchError(rank, msg, proc.returncode if proc.returncode else 1)
    write_failure_record(log_dir, err, killed=killed, seconds=time.monotonic() - t_start)
    raise err


def write_failure_record(log_dir: str, err: LaunchError, *, killed: str | None, seconds: float) -> str:
    """``LOG/failure.json``: the culprit rank, the message and how the job ended (for schedulers and
    post-mortems; a job stopped by the watchdog or the job timeout leaves no other trace of why)."""
    path = os.path.join(log_dir, "failure.json")
    rec = {
        "rank": err.rank,
        "message": err.message,
        "returncode": err.returncode,
        "stopped_by_launcher": killed,
        "seconds": round(seconds, 3),
        "time": time.time(),
    }
    atomic_write_text(path, json.dumps(rec, indent=1))
    return path


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_paddle_launcher() -> None:
    """Paddle's ``python -m paddle.distributed.launch`` with this process's ``sys.argv``; its exit
    status (``sys.exit`` in its controller) becomes this process's, without the teardown."""
    from paddle.distributed.launch.main import launch

    if len(sys.argv) > 1 and sys.argv[1] == _GATE:  # pre-started: Paddle is loaded, now wait
        del sys.argv[1]
        if sys.stdin.readline().strip() != "go":  # cancelled (or the caller died): start nothing
            exit_now(0)
    try:
        launch()
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    exit_now(code)


if __name__ == "__main__":
    run_paddle_launcher()
