"""The job's status folder (``OUT/logs/status``): what every worker records about itself while it
runs, and the diagnosis of a failed job from those records alone.

Why records and not the launcher's own sampling: Paddle's launcher tears the whole job down as
soon as one worker exits, so whatever the launcher samples afterwards (which processes are
alive, which one is frozen) depends on who was faster.  A record written *before* the teardown
does not: the first worker to fail looks at its peers while nothing has been killed yet.  The
files (``rank<N>.pid``, ``.beat``, ``.error.json``, ``.signal.json``, ``.ok``, ``launcher.json``):
docs/failure-modes.md, "Stopped, hung and killed ranks".
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._io import proc_stat_field, read_json, write_json_atomic

__all__ = [
    "ENV_DEADLINE",
    "ENV_JOB_ID",
    "ENV_LAUNCHER_PID",
    "ENV_STATUS_DIR",
    "TELL_PEERS",
    "LAUNCHER_LOG",
    "PHASES",
    "Diagnosis",
    "beat",
    "diagnose",
    "is_comm_error",
    "proc_state",
    "read_records",
    "snapshot",
    "worker_logs",
    "workers_started",
    "write_record",
]

ENV_STATUS_DIR = "GLM52_STATUS_DIR"  # the status folder, set by the launcher for its workers
ENV_JOB_ID = "GLM52_JOB_ID"  # one id per job: every process of the job carries it in its environment
ENV_LAUNCHER_PID = "GLM52_LAUNCHER_PID"  # the glm52 launcher: workers end when it is gone
ENV_DEADLINE = "GLM52_JOB_DEADLINE"  # --job-timeout as an absolute time (seconds since the epoch)
# an exception's attribute: what its worker runs once the error is recorded (train/loop.py: a rank that
# failed before the job's default group tells the ranks waiting there)
TELL_PEERS = "glm52_tell_peers"
LAUNCHER_LOG = "launcher.log"  # in the log folder: everything Paddle's launcher printed, unfiltered

# the phases of a step, in order: a rank's progress is (step, index of its last phase)
PHASES = ("start", "connect", "setup", "data", "forward", "update", "done", "eval", "save", "finish")

_COMM_MARKERS = re.compile(
    r"gloo|timeout|connection (reset|closed|refused)|broken pipe|nccl|processgroup|socket|peer", re.I
)


def is_comm_error(text: str) -> bool:
    """Whether an exception's text looks like a failed collective (a peer gone or too slow)."""
    return _COMM_MARKERS.search(text) is not None


def proc_state(pid: int, field: int = 0) -> str | None:
    """One-letter Linux process state (R, S, D, T = stopped, t = traced, Z = zombie), or None when
    the process is gone or the state is unknown (no /proc); ``field`` 19: its start time in clock
    ticks (tells a reused pid apart)."""
    return proc_stat_field(pid, field)


def write_record(status_dir: str | None, rank: int, suffix: str, payload: dict | None = None) -> None:
    """``rank<N>.<suffix>`` in `status_dir` (no-op without one): strict JSON, atomic."""
    if status_dir:
        path = os.path.join(status_dir, f"rank{rank}.{suffix}")
        write_json_atomic(path, payload or {}, indent=None, sort_keys=False, default=str)


_BEAT: dict[str, Any] = {}
_BEAT_WIDTH = 160  # bytes: every heartbeat overwrites the same bytes of the file


def beat(step: int, phase: str) -> None:
    """Record this worker's progress (``rank<N>.beat``); a no-op outside a launched job.

    One ``pwrite`` of a space-padded record into a file kept open (a few microseconds; creating
    and renaming a file per heartbeat cost milliseconds on a busy machine).  A reader racing the
    write may see a torn record (it then counts as no heartbeat): the diagnosis reads the
    heartbeats after the job has ended."""
    if "fd" not in _BEAT:
        d = os.environ.get(ENV_STATUS_DIR)
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)
        fd = None
        if d:
            with contextlib.suppress(OSError):  # no heartbeat: the diagnosis then knows less, training goes on
                fd = os.open(os.path.join(d, f"rank{rank}.beat"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _BEAT.update(fd=fd, rank=rank)
    fd = _BEAT["fd"]
    if fd is None:
        return
    if phase not in PHASES:
        raise ValueError(f"heartbeat phase must be one of {PHASES}, got {phase!r}")
    rank, pid, t = _BEAT["rank"], os.getpid(), time.time()
    text = f'{{"rank": {rank}, "pid": {pid}, "step": {int(step)}, "phase": "{phase}", "time": {t:.6f}}}'
    data = text.ljust(_BEAT_WIDTH).encode()
    with contextlib.suppress(OSError):
        os.pwrite(fd, data, 0)
        if len(data) > _BEAT_WIDTH:
            os.ftruncate(fd, len(data))


_RECORD_FILE = re.compile(r"rank(\d+)\.(pid|beat|ok|error\.json|signal\.json)")


def read_records(status_dir: str) -> dict[int, dict[str, Any]]:
    """Every rank's records: ``{rank: {"pid", "beat", "error", "signal", "ok"}}`` (absent: None)."""
    out: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(status_dir, "rank*.*")):
        m = _RECORD_FILE.fullmatch(os.path.basename(path))
        if m is None:
            continue
        rec = out.setdefault(int(m[1]), {"pid": None, "beat": None, "error": None, "signal": None, "ok": False})
        kind = m[2].split(".")[0]  # error.json -> error
        try:
            rec[kind] = True if kind == "ok" else read_json(path, "the status record", None)
        except ValueError:  # unreadable, or a heartbeat torn by a racing write
            rec[kind] = None
    return out


def worker_logs(log_dir: str) -> dict[str, list[int]]:
    """``{name: [inode, size]}`` of the ``workerlog.*`` files in ``log_dir`` now (job.json keeps them
    as the job starts: an earlier run's, to which Paddle's launcher appends)."""
    out = {}
    for path in glob.glob(os.path.join(log_dir, "workerlog.*")):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            out[os.path.basename(path)] = [st.st_ino, st.st_size]
    return out


def workers_started(log_dir: str, status_dir: str | None = None, before: dict[str, list[int]] | None = None) -> bool:
    """Whether a worker of this node has started: Paddle's launcher opens ``workerlog.N`` as it
    starts worker N (in a multi-node job only after every node met at the master), and a worker
    records its pid first thing.  ``before``: the worker logs as the job started (default:
    ``job.json``'s ``worker_logs_before``); one new or grown since is this job's. Sizes, not file
    times: a cluster filesystem's clock is not the launcher's, and an appended file keeps its time
    until written."""
    status_dir = status_dir or os.path.join(log_dir, "status")
    if read_records(status_dir):
        return True
    if before is None:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            before = (read_json(os.path.join(log_dir, "job.json"), "the job record", None) or {}).get(
                "worker_logs_before"
            )
    before = before if isinstance(before, dict) else {}
    for name, (ino, size) in worker_logs(log_dir).items():
        old = before.get(name)
        if not (isinstance(old, list) and len(old) == 2 and old[0] == ino and size <= old[1]):
            return True  # a new file, another file under the name, or grown
    return False


def _record_kind(rec: dict[str, Any]) -> str | None:
    return next((kind for kind in ("error", "signal", "ok") if rec.get(kind)), None)


def snapshot(status_dir: str, by: str) -> dict[str, Any]:
    """What is known now of every rank that recorded its pid: process state ("gone" when it has
    exited), the record it left (error / signal / ok / None) and its last heartbeat."""
    ranks: dict[str, Any] = {}
    for r, rec in sorted(read_records(status_dir).items()):
        pid = (rec.get("pid") or {}).get("pid")
        st = proc_state(int(pid)) if pid else None
        b = rec.get("beat") or {}
        ranks[str(r)] = {
            "state": "gone" if st in (None, "Z") and pid else (st or "unknown"),
            "record": _record_kind(rec),
            "beat": [b.get("step"), b.get("phase")] if b else None,
        }
    return {"by": by, "time": time.time(), "ranks": ranks}


def still_connecting(snap: dict[str, Any], local_ranks: Sequence[int]) -> list[int]:
    """``local_ranks`` when every one of them is alive at heartbeat ``connect`` (it reached the
    job's default group, where every rank of the job must arrive before any goes on), else [].
    A rank held there waits for ranks of the job that never connect."""
    ranks = snap["ranks"]
    for r in local_ranks:
        s = ranks.get(str(r)) or {}
        if s.get("record") or s.get("state") == "gone" or s.get("beat") != [0, "connect"]:
            return []
    return list(local_ranks)


# ---------------------------------------------------------------- diagnosis


@dataclass
class Diagnosis:
    """The culprit rank (None when there is none, e.g. a user stopped the job), a one-paragraph
    message, the cause (error, nonfinite, stopped, died, hung, comm, signal, timeout, launcher)
    and structured details for failure.json."""

    rank: int | None
    message: str
    cause: str
    detail: dict[str, Any] = field(default_factory=dict)


def _progress(b: dict | None) -> tuple[int, int]:
    if not b:
        return (-1, -1)
    phase = b.get("phase")
    return (int(b.get("step") or 0), PHASES.index(phase) if phase in PHASES else -1)


def _beat_text(b: dict | None) -> str:
    return f"last heartbeat step {b.get('step')} phase {b.get('phase')!r}" if b else "no heartbeat"


_STOPPED = "was stopped (process state T: SIGSTOP, a debugger or job control) and stopped answering"
_DIED = "died without a Python error (a signal, os._exit, or the OS killing it, e.g. out of memory"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _error_text(e: dict[str, Any], others: str = "") -> str:
    """A worker's error record: its type and message (``others``: who failed after it), its traceback's tail."""
    return f"{e.get('type')}: {e.get('message')}{others}\n{e.get('traceback_tail', '')}"


def _signal_name(num: int) -> str | None:
    """SIGTERM for 15; None when the number is no signal."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return None


def _t(rec: dict[str, Any]) -> float:
    return float(rec.get("time") or 0)


def _observations(records: dict[int, dict], launcher: Sequence[dict]) -> list[dict]:
    """Every snapshot taken while the job was failing, oldest first: the peers a failing worker
    saw (its own record time), the launcher's."""
    obs = []
    for r, rec in records.items():
        for kind in ("error", "signal"):
            e = rec.get(kind)
            if e and isinstance(e.get("peers"), dict):
                obs.append({"by": f"rank {r}", "time": float(e.get("time") or 0), "ranks": e["peers"].get("ranks", {})})
    obs += [o for o in launcher if isinstance(o, dict) and isinstance(o.get("ranks"), dict)]
    return sorted(obs, key=lambda o: float(o.get("time") or 0))


_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(: .*)?")


def _launcher_said(log_dir: str) -> tuple[str, str | None]:
    """(the path of Paddle's launcher's output, its last exception line, else its last line; None
    when it printed nothing): what a launcher that failed before any worker started left."""
    path = os.path.join(log_dir, LAUNCHER_LOG)
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        lines = []
    lines = [ln for ln in lines if ln]
    exc = [ln for ln in lines if _EXCEPTION_LINE.fullmatch(ln)]
    return path, (exc or lines or [None])[-1]


def _before_workers(log_dir: str, stopped_by: dict[str, Any] | None, rendezvous: dict[str, Any] | None) -> Diagnosis:
    """No worker of this node started: Paddle's launcher failed before it started any, or a job of
    several nodes was stopped while it waited for them at the master; there is no rank to blame
    and no worker log to read."""
    path, said = _launcher_said(log_dir)
    detail: dict[str, Any] = {"workers_started": False, "launcher_log": path, "launcher_said": said}
    if rendezvous:
        detail["rendezvous"] = dict(rendezvous)
    if not stopped_by:
        text = f"the launcher failed before any worker started: {said or 'it printed nothing'} (its output: {path}"
        if rendezvous:  # measured: two nodes given one --node-rank -> TypeError in Paddle's _build_pod_with_master
            text += f"; every node needs its own --node-rank 0..{rendezvous['nnodes'] - 1} and the same --master"
        return Diagnosis(None, text + ")", "launcher", detail)
    assert rendezvous is not None  # diagnose calls this for a stopped job of several nodes only
    detail["rendezvous"]["met"] = False
    return Diagnosis(None, _never_met(rendezvous, path), str(stopped_by.get("kind")), detail)


def _after_launch(log_dir: str, stopped_by: dict[str, Any]) -> str:
    """`` N s after the launch``: from job.json's start to when the launcher began stopping the job
    ('' when either is unknown)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
        job = read_json(os.path.join(log_dir, "job.json"), "the job record", None) or {}
        return f" {float(stopped_by['time']) - float(job['started']):.0f} s after the launch"
    return ""


def _never_met(rendezvous: dict[str, Any], launcher_log: str) -> str:
    """Why no worker of a stopped node of several started: its nodes never met at the master."""
    n, master, rank = rendezvous["nnodes"], rendezvous.get("master"), rendezvous.get("rank")
    return (
        f"no worker of this node started: the {n} nodes never met at the master {master} (--nnodes {n}, "
        f"--master {master}, --node-rank {rank}): a node not started, or started with another --nnodes or "
        f"--master, or a --master that is not node 0's address or that a node cannot reach (Paddle's "
        f"launcher's output: {launcher_log})"
    )


def _never_connected(log_dir: str, local_ranks: Sequence[int], beat: dict | None, rendezvous: dict[str, Any]) -> str:
    """Why a stopped node of several whose ranks all waited at the job's default group went no further:
    ranks of the job that never connected (not a rank behind its peers, which all did the same)."""
    return (
        f"rank(s) {_ranks(local_ranks)} of this node never finished connecting to the job's other ranks "
        f"({_beat_text(beat)}): a node not started, started with another --nnodes "
        f"than {rendezvous['nnodes']}, or whose ranks failed before they connected (its failure.json: "
        f"{os.path.join(os.path.dirname(log_dir), 'node<R>', 'failure.json')}); run the same command on every node"
    )


def diagnose(
    log_dir: str,
    local_ranks: Sequence[int],
    *,
    stopped_by: dict[str, Any] | None = None,
    launcher_snapshots: Sequence[dict] = (),
    paddle_launcher: tuple[int, int | None] | None = None,
    late_signal: dict[str, Any] | None = None,
    world_size: int | None = None,
    rendezvous: dict[str, Any] | None = None,
) -> Diagnosis:
    """The culprit of a failed job from its status records, first rule that applies (the rules and
    why each: docs/failure-modes.md, "Stopped, hung and killed ranks").

    ``stopped_by``: why the launcher stopped the job itself (``{"kind": "timeout" | "signal" |
    "grace" | "frozen", "time": when it began stopping, ...}``), None when the job ended by itself;
    what the ranks saw after ``time`` is the launcher's teardown and is not evidence of a fault.
    ``paddle_launcher``: (pid, exit status) of Paddle's launcher (negative: the signal that killed
    it), for a job that Paddle's launcher ended by itself on a signal to it.  ``late_signal``: a
    stop signal to the launcher that arrived after the job had already ended (what a scheduler
    cancelling a job does: every process signalled at once, the launcher not necessarily first).
    ``world_size``: the job's, when it has ranks on other nodes than ``local_ranks``' (whose
    records are in their own node's folder): a communication failure then names them as suspects.
    ``rendezvous``: ``{"nnodes", "master", "rank"}`` of a multi-node job (``launch.rendezvous_of``),
    named when no worker of this node started before the job was stopped, or when every rank of this
    node still waited at the job's default group (a timeout, or a stop signal: said after its sender).
    """
    records = read_records(os.path.join(log_dir, "status"))
    errors = sorted(
        ((r, rec["error"]) for r, rec in records.items() if rec.get("error")),
        key=lambda x: float(x[1].get("time") or 0),
    )
    obs = _observations(records, launcher_snapshots)
    # when the launcher began stopping the job: what a rank saw or received after it (a peer gone, a
    # signal) is the launcher's own teardown, not a fault
    t_stop = float(stopped_by["time"]) if stopped_by and stopped_by.get("time") is not None else None

    def after_the_stop(signal_record: dict) -> bool:
        return t_stop is not None and _t(signal_record) > t_stop

    if t_stop is not None:
        obs = [o for o in obs if not o["by"].startswith("rank") or float(o.get("time") or 0) <= t_stop]
    beats = {r: rec.get("beat") for r, rec in records.items()}
    # a rank ended by a stop signal from outside the job (its own record names the sender), before
    # the launcher began stopping the job: the cause, though its peers only see a lost connection
    outside = sorted(
        (
            (r, rec["signal"])
            for r, rec in records.items()
            if isinstance(rec.get("signal"), dict)
            and rec["signal"].get("sender_in_job") is False
            and not after_the_stop(rec["signal"])
        ),
        key=lambda x: _t(x[1]),
    )

    def log_tail(r: int) -> str:  # Paddle's launcher names a worker's log by its rank on the node
        p = os.path.join(log_dir, f"workerlog.{list(local_ranks).index(r) if r in local_ranks else r}")
        try:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        return f"Last lines of {p}:\n" + "\n".join([ln.rstrip() for ln in text.splitlines() if ln.strip()][-6:])

    comm_ranks = sorted({r for r, e in errors if e.get("comm")})
    own_record = {r for r, rec in records.items() if rec.get("error") or rec.get("ok")}
    stopped: dict[int, str] = {}  # rank -> who saw it stopped
    died: dict[int, str] = {}  # rank -> who saw it gone without a record while others ran
    for o in obs:
        for key, s in o["ranks"].items():
            r = int(key)
            if r in own_record or not isinstance(s, dict):
                continue
            if s.get("state") in ("T", "t"):
                stopped.setdefault(r, o["by"])
            elif s.get("state") == "gone" and s.get("record") is None:
                running = any(
                    k != key and isinstance(v, dict) and v.get("state") != "gone" for k, v in o["ranks"].items()
                )
                if running or o["by"].startswith("rank"):
                    died.setdefault(r, o["by"])
    primary = [(r, e) for r, e in errors if not e.get("comm")]
    if primary:  # the earliest error, unless its own snapshot shows a peer already stopped or dead
        r, e = primary[0]
        seen = (e.get("peers") or {}).get("ranks", {})
        earlier = [int(k) for k, v in seen.items() if isinstance(v, dict) and int(k) in set(stopped) | set(died)]
        earlier += [x for x, sig in outside if x != r and _t(sig) <= _t(e)]
        if not earlier:
            detail = e.get("detail") or {}
            if detail.get("message"):
                rank = int(detail["rank"]) if detail.get("rank") is not None else r
                return Diagnosis(rank, str(detail["message"]), str(detail.get("kind") or "error"), detail)
            rest = sorted({x for x, _ in errors} - {r})
            others = f" (then rank(s) {_ranks(rest)} failed too)" if rest else ""
            return Diagnosis(r, f"rank {r} failed: {_error_text(e, others)}", "error")
    senders = {sig.get("sender_pid") for _, sig in outside}
    if outside and late_signal and late_signal.get("sender_pid") in senders:  # one sender stopped the whole job
        return Diagnosis(None, f"stopped by {late_signal.get('text')} (and its ranks, by the same sender)", "signal")
    if outside and not (stopped_by and stopped_by.get("kind") == "signal"):  # not the launcher's own stop signal
        r, sig = outside[0]
        sender = f"pid {sig.get('sender_pid')}" + (f" ({sig['sender']})" if sig.get("sender") else "")
        if sig.get("sender_pid") == 0:
            sender = "the kernel"
        tail = f"; rank(s) {_ranks(comm_ranks)} then lost their peer" if comm_ranks else ""
        text = f"rank {r} was ended by {sig.get('signal')} from {sender}, outside this job ({_beat_text(beats.get(r))}){tail}"
        detail = {"signal": sig.get("signal"), "sender_pid": sig.get("sender_pid"), "sender": sig.get("sender")}
        return Diagnosis(r, text, "signal", detail)
    paddle_pid, paddle_rc = paddle_launcher or (None, None)
    if paddle_pid is not None and stopped_by is None and paddle_rc is not None and paddle_rc < 0:
        name = _signal_name(-paddle_rc)
        return Diagnosis(
            None,
            f"Paddle's launcher (pid {paddle_pid}) was killed by {name}; every worker died with it "
            "(the parent-death signal): no rank failed",
            "launcher",
        )
    lost_rules = (  # a rank seen stopped, then one seen gone: named with who saw it and what its peers did
        (stopped, "stopped", f"{_STOPPED} (seen by", "timed out waiting for it"),
        # Paddle's launcher exits 0 only when every worker did: a rank seen gone first then left by
        # os._exit(0) or a library, not a signal or the OS (the silent-rank rule below names it)
        ({} if paddle_rc == 0 else died, "died", f"{_DIED}; seen gone by", "lost their peer"),
    )
    for lost, kind, what, peers_then in lost_rules:
        if lost:
            r = min(lost)
            tail = f"; rank(s) {_ranks(comm_ranks)} then {peers_then}" if comm_ranks else ""
            return Diagnosis(r, f"rank {r} {what} {lost[r]}; {_beat_text(beats.get(r))}){tail}. {log_tail(r)}", kind)

    # every rank of this node alive at the job's default group, none further, when the launcher began stopping
    # the job (the signal record of its teardown does not count, unlike still_connecting's, which reads a
    # running job): they waited for ranks of the job
    def ended_before_the_stop(r: int) -> bool:
        rec = records.get(r, {})
        sig = rec.get("signal")
        teardown = isinstance(sig, dict) and after_the_stop(sig)
        return bool(rec.get("error") or rec.get("ok") or (sig and not teardown))

    connecting = (0, PHASES.index("connect"))
    held = bool(local_ranks) and all(
        _progress(beats.get(r)) == connecting and not ended_before_the_stop(r) for r in local_ranks
    )
    if stopped_by and stopped_by.get("kind") == "signal":  # a signal to the launcher
        text = f"stopped by {stopped_by.get('text', 'a signal')}"
        if not rendezvous:
            return Diagnosis(None, text, "signal")
        # a node of several stopped (a scheduler's walltime) while it waited for the others: why it waited
        if not workers_started(log_dir):
            waited = _before_workers(log_dir, stopped_by, rendezvous)
            why, detail = waited.message, waited.detail
        elif held:
            why, detail = _never_connected(log_dir, local_ranks, beats.get(local_ranks[0]), rendezvous), {}
        else:
            return Diagnosis(None, text, "signal")
        return Diagnosis(None, f"{text}{_after_launch(log_dir, stopped_by)}; {why}", "signal", detail)
    if (not stopped_by or rendezvous) and not workers_started(log_dir):  # before the rules that read a
        # rank's log: none was written (one node stopped early keeps the timeout's own words below)
        return _before_workers(log_dir, stopped_by, rendezvous)
    if paddle_pid is not None and stopped_by is None and all(_record_kind(records.get(r, {})) for r in local_ranks):
        # Paddle's launcher stopped the workers before any of them failed: it got a stop signal
        # (its handler stops the workers, then exits with the signal's number)
        first = sorted(
            ((r, k, rec[k]) for r, rec in records.items() for k in ("error", "signal") if isinstance(rec.get(k), dict)),
            key=lambda x: _t(x[2]),
        )
        if first and first[0][1] == "signal" and first[0][2].get("sender_pid") == paddle_pid:
            r, _, sig = first[0]
            name = _signal_name(paddle_rc) if paddle_rc else None
            why = f"exited with {paddle_rc}" + (f", its status after a {name} to it" if name else "")
            return Diagnosis(
                None,
                f"Paddle's launcher (pid {paddle_pid}) stopped the workers before any of them failed "
                f"({sig.get('signal')} to rank {r}, {_beat_text(beats.get(r))}) and {why}: no rank failed",
                "launcher",
                {"launcher_signal": name},
            )
    # a multi-node job stopped by --job-timeout or --rendezvous-timeout while every rank of this node waited at
    # the default group: they waited for ranks of the job that never connected
    if stopped_by and stopped_by.get("kind") == "timeout" and rendezvous and held:
        return Diagnosis(None, _never_connected(log_dir, local_ranks, beats.get(local_ranks[0]), rendezvous), "timeout")
    progress = {r: _progress(beats.get(r)) for r in local_ranks}
    if progress and (comm_ranks or stopped_by) and len(set(progress.values())) > 1:  # a rank behind: hung
        low = min(progress.values())
        r = min(r for r, p in progress.items() if p == low)
        ahead = sorted(r2 for r2, p in progress.items() if p != low)
        waited = "timed out waiting for it" if comm_ranks else "waited for it"
        return Diagnosis(
            r,
            f"rank {r} made no progress ({_beat_text(beats.get(r))}, behind rank(s) {_ranks(ahead)}: "
            f"hung, or far slower than its peers); rank(s) {_ranks(ahead)} {waited}. {log_tail(r)}",
            "hung",
        )
    silent = [r for r in local_ranks if not _record_kind(records.get(r, {}))]
    if silent and not stopped_by:  # a rank that left no record
        r = silent[0]
        tail = f"; rank(s) {_ranks(comm_ranks)} then lost their peer" if comm_ranks else ""
        if paddle_rc == 0:  # every worker exited 0, and this one never finished its run
            text = (
                f"rank(s) {_ranks(silent)} exited with status 0 before finishing the run (no completion record; "
                f"{_beat_text(beats.get(r))}: os._exit or a library ending the process)"
            )
            return Diagnosis(r, f"{text}{tail}. {log_tail(r)}", "died")
        return Diagnosis(r, f"rank {r} {_DIED}){tail}. {log_tail(r)}", "died")
    if errors:  # the earliest communication failure
        r, e = errors[0]
        text = f"rank {r} failed in communication: {_error_text(e)}"
        if world_size and world_size > len(local_ranks):  # measured: node 1's worker killed, or node 1
            # SIGTERMed; node 0 said only that its rank 0 failed in communication
            text += (
                f"\n(ranks {min(local_ranks)}..{max(local_ranks)} of {world_size} run on this node: a rank of another "
                "node that failed or was stopped first ends them in communication errors; see the other nodes' "
                f"{os.path.join(os.path.dirname(log_dir), 'node<R>', 'failure.json')})"
            )
        return Diagnosis(r, text, "comm")
    if stopped_by:
        return Diagnosis(
            None,
            "no rank reported an error, was seen stopped or fell behind (a slow or hung job; see "
            f"{os.path.join(log_dir, 'workerlog.*')})",
            str(stopped_by.get("kind")),
        )
    return Diagnosis(None, "the launcher failed before any worker reported (see the launcher output above)", "launcher")
