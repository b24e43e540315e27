"""Start the local worker processes through ``python -m paddle.distributed.launch``, keep the
job's lifetime the launcher's, and turn a failure into one line that names the rank that caused it.

Paddle's launcher, when one worker dies, reports whichever container it noticed first (often a
*survivor* that failed in communication afterwards), so the culprit is read from the workers' own
records in ``LOG/status/`` (job_status.py); every failure also leaves ``LOG/failure.json``.  The
job's lifetime: docs/failure-modes.md.  Multi-node: pass the launcher's own options (``--nnodes``,
``--master``, ``--rank``, ``--ips``) through ``launcher_args``; every node runs the same command.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io import write_json_atomic
from ..cpu_env import apply_mkl_default
from .console import PaddleChatter
from .job_status import (
    ENV_DEADLINE,
    ENV_JOB_ID,
    ENV_LAUNCHER_PID,
    ENV_STATUS_DIR,
    LAUNCHER_LOG,
    Diagnosis,
    diagnose,
    is_comm_error,
    proc_state,
    read_records,
    snapshot,
    still_connecting,
    worker_logs,
    workers_started,
)
from .stop_signals import listen

__all__ = [
    "LaunchError",
    "diagnose",
    "is_comm_error",
    "job_processes",
    "launch_workers",
    "launcher_command",
    "listen_port_range",
    "option_overrides",
    "rendezvous_of",
    "set_aside_failure_record",
    "waiting_line",
    "worker_env",
    "write_failure_record",
]

TERM_WAIT_S = 3.0  # SIGTERM, then SIGKILL this much later
LATE_SIGNAL_S = 1.0  # how long a job whose rank was signalled from outside waits for the launcher's own signal
GRACE_S = 45.0  # a job still running this long after a failure, or with a rank stopped this long, is stopped
WAITING_EVERY_S = 30.0  # a node whose workers have not started says every this many seconds what it waits for


@dataclass
class LaunchError(RuntimeError):
    """A distributed job failed; ``rank`` is the culprit (None when unknown or a user stopped it)."""

    rank: int | None
    message: str
    returncode: int
    cause: str = "error"

    def __str__(self) -> str:
        return self.message


# the variables Paddle's launcher takes over its own command-line options, by option (its context's
# env_args_mapping; PADDLE_TRAINER_ID also over --rank): a PADDLE_NNODES left in a shell or set by a
# cluster would outvote the --nnodes the launcher is given
PADDLE_OPTION_ENVS: dict[str, tuple[str, ...]] = {
    "--master": ("PADDLE_MASTER",),
    "--rank": ("PADDLE_RANK", "PADDLE_TRAINER_ID"),
    "--log_level": ("PADDLE_LOG_LEVEL",),
    "--log_overwrite": ("PADDLE_LOG_OVERWRITE",),
    "--sort_ip": ("PADDLE_SORT_IP",),
    # Paddle's collective_compatible plugin sets nnodes and master from these too
    "--nnodes": ("PADDLE_NNODES", "PADDLE_TRAINER_ENDPOINTS", "DISTRIBUTED_TRAINER_ENDPOINTS"),
    "--nproc_per_node": ("PADDLE_NPROC_PER_NODE",),
    "--log_dir": ("PADDLE_LOG_DIR",),
    "--run_mode": ("PADDLE_RUN_MODE",),
    "--job_id": ("PADDLE_JOB_ID",),
    "--devices": ("PADDLE_DEVICES",),
    "--gpus": ("PADDLE_DEVICES",),
    "--npus": ("PADDLE_DEVICES",),
    "--xpus": ("PADDLE_DEVICES",),
    "--host": ("POD_IP",),
    "--ips": ("PADDLE_IPS",),
    "--start_port": ("PADDLE_START_PORT",),
    "--auto_parallel_config": ("PADDLE_AUTO_PARALLEL_CONFIG",),
    "--auto_cluster_config": ("PADDLE_AUTO_CLUSTER",),
    "--servers": ("PADDLE_SERVERS_ENDPOINTS",),
    "--trainers": ("PADDLE_TRAINERS_ENDPOINTS",),
    "--trainer_num": ("PADDLE_TRAINER_NUM",),
    "--server_num": ("PADDLE_SERVER_NUM",),
    "--gloo_port": ("PADDLE_GLOO_PORT",),
    "--with_gloo": ("PADDLE_WITH_GLOO",),
    "--max_restart": ("PADDLE_MAX_RESTART",),
    "--elastic_level": ("PADDLE_ELASTIC_LEVEL",),
    "--elastic_timeout": ("PADDLE_ELASTIC_TIMEOUT",),
}


def option_overrides(options: Sequence[str], env: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """What in ``env`` Paddle's launcher would take over the options ``options`` (its command line
    before the script, ``--name value`` or ``--name=value``): (variable, its value, option, the
    option's value) for each, in the order of ``options``."""
    found = []
    for i, tok in enumerate(options):
        name, eq, value = tok.partition("=")
        if not eq:
            value = options[i + 1] if i + 1 < len(options) else ""
        found += [(var, env[var], name, value) for var in PADDLE_OPTION_ENVS.get(name, ()) if var in env]
    return list(dict.fromkeys(found))


def worker_env(nproc_per_node: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the workers: our package importable, MKL fast path on AMD, one thread set per process."""
    env = dict(os.environ if base is None else base)
    apply_mkl_default(env)  # AMD only: Paddle's MKL picks a 2.5x slower path there without it
    cpus = os.cpu_count() or 1
    if not env.get("OMP_NUM_THREADS", "").strip():  # unset or empty (an unset shell variable exported)
        env["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, nproc_per_node)))
    env.setdefault("GLOG_minloglevel", "2")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package's parent
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    ports = listen_port_range()
    if ports:
        env.setdefault("PORT_RANGE", ports)
    return env


def listen_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> str | None:
    """``PORT_RANGE`` for Paddle's launcher: ports below the kernel's ephemeral range, or None.

    The launcher probes a free port at random in 35100-64000 and the workers bind it seconds
    later; Linux hands out 32768-60999 to every outgoing connection, so any process's gloo or
    store connection could take it first (rank 0 then aborts creating the TCPStore).
    """
    try:
        low = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return f"10000:{low - 1}" if low - 1 - 10000 >= 2000 else None


def job_processes(job_id: str) -> list[int]:
    """Pids of every live process whose environment carries ``GLM52_JOB_ID=job_id`` (Linux /proc;
    an empty list elsewhere): Paddle's launcher, the workers and anything they started."""
    needle = f"{ENV_JOB_ID}={job_id}".encode()
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        pid = int(os.path.basename(d))
        if pid == os.getpid():
            continue
        try:
            env = Path(d, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and not _gone(pid):
            out.append(pid)
    return sorted(out)


def _gone(pid: int) -> bool:
    return proc_state(pid) in (None, "Z")


def stop_job(proc: subprocess.Popen, job_id: str, status_dir: str) -> None:
    """End every process of the job: SIGTERM, then SIGKILL to what is left ``TERM_WAIT_S`` later.
    The workers are found by the job id in their environment and by their pid records (each is
    started with setsid, out of reach of a group signal)."""

    def targets() -> list[int]:
        pids = set(job_processes(job_id))
        for rec in read_records(status_dir).values():
            pid = (rec.get("pid") or {}).get("pid")
            if pid and rec["pid"].get("job") == job_id and not _gone(int(pid)):
                pids.add(int(pid))
        return sorted(pids)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = targets()
        if proc.poll() is not None and not pids:
            break
        # Paddle's launcher and anything left in its group, then each worker
        for kill, pid in [(os.killpg, proc.pid), *((os.kill, p) for p in pids)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, sig)
        t0 = time.monotonic()
        while time.monotonic() - t0 < TERM_WAIT_S:
            if proc.poll() is not None and all(_gone(p) for p in pids):
                break
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=TERM_WAIT_S)


def _trouble(snap: dict[str, Any]) -> list[str]:
    """What in a snapshot is a sign of trouble: a record of failure, a stopped or vanished rank."""
    signs = []
    for r, s in snap["ranks"].items():
        if s["record"] in ("error", "signal"):
            signs.append(f"rank {r} {s['record']}")
        elif s["state"] in ("T", "t"):
            signs.append(f"rank {r} stopped")
        elif s["state"] == "gone" and s["record"] is None:
            signs.append(f"rank {r} gone")
    return signs


def launcher_command(nproc_per_node: int, log_dir: str, args: Sequence[str]) -> list[str]:
    """The command line of Paddle's launcher (``python -m paddle.distributed.launch``, through
    lifeline.py) for ``nproc_per_node`` local processes logging to ``log_dir``; ``args`` are further
    launcher options, then the script and its arguments."""
    lifeline = [sys.executable, "-m", "paddleformers_glm.train.lifeline", "paddle.distributed.launch"]
    return [*lifeline, "--nproc_per_node", str(nproc_per_node), "--log_dir", log_dir, *args]


def rendezvous_of(options: Sequence[str]) -> dict[str, Any] | None:
    """``{"nnodes", "master", "rank"}`` from the launcher's options (``--name value`` or
    ``--name=value``; the last one given wins), None for a one-node job."""
    found: dict[str, str] = {}
    for i, tok in enumerate(options):
        name, eq, value = tok.partition("=")
        if name in ("--nnodes", "--master", "--rank"):
            found[name[2:]] = value if eq else (options[i + 1] if i + 1 < len(options) else "")
    try:
        nnodes = int(found.get("nnodes", "1"))
    except ValueError:  # an elastic range such as 2:4: Paddle's launcher's own business
        return None
    if nnodes <= 1:
        return None
    rank = found.get("rank")
    return {"nnodes": nnodes, "master": found.get("master"), "rank": int(rank) if rank and rank.isdigit() else None}


def waiting_line(rdv: dict[str, Any], seconds: float) -> str:
    """What a node whose workers have not started after ``seconds`` says: Paddle's launcher waits
    at the master, silently and without a limit, for every node of the job to join."""
    n, master, rank = rdv["nnodes"], rdv.get("master") or "the master", rdv.get("rank")
    this = f" (this node: {rank})" if rank is not None else ""
    return (
        f"[glm52] waiting for the other {n - 1} node(s) to join at {master} ({seconds:.0f} s): start the same "
        f"command on every node with --node-rank 0..{n - 1}{this}, and --master an address of node 0 every node reaches"
    )


def connecting_line(rdv: dict[str, Any], ranks: Sequence[int], seconds: float) -> str:
    """What a node says while its started workers still wait for the job's other ranks to connect
    (their heartbeat at ``connect``: at the job's default group): a node started with another ``--nnodes`` met this one at
    the master and then waits for a job of its own size, and this node's workers wait in the
    process-group setup for ranks that never come, silently and without a limit."""
    n = rdv["nnodes"]
    return (
        f"[glm52] rank(s) {', '.join(map(str, ranks))} of this node still wait for the job's other ranks to connect "
        f"({seconds:.0f} s after they started): a node not started, started with another --nnodes than {n}, or "
        "whose ranks failed before they connected; run the same command on every node"
    )


def launch_workers(
    worker_args: Sequence[str],
    nproc_per_node: int,
    log_dir: str,
    *,
    launcher_args: Sequence[str] = (),
    node_rank_offset: int = 0,
    timeout_s: float | None = None,
    rendezvous_timeout_s: float | None = None,
    quiet_launcher: bool = True,
    extra_env: dict[str, str] | None = None,
    world_size: int | None = None,
) -> None:
    """Run ``paddleformers_glm/train/worker.py worker_args`` on ``nproc_per_node`` local processes.

    Raises :class:`LaunchError` naming the failing rank; returns when every rank finished cleanly.
    ``node_rank_offset`` is this node's first global rank and ``world_size`` the job's (multi-node diagnosis).
    ``timeout_s`` bounds the whole job (``--job-timeout``); ``rendezvous_timeout_s`` (``--rendezvous-timeout``;
    None: no limit) a multi-node job's waits for its other nodes, each as long: for the nodes to meet at the
    master (no worker of this node started since the launch), and for every rank of the job to connect
    (every local rank held at the job's default group since it got there); Paddle's launcher waits at the
    master, and the ranks at the default group, without a limit.  Either stops the job with exit 124.  Call
    it from the main thread: the parent-death signal of Paddle's launcher follows the thread that started it.
    """
    log_dir = os.path.abspath(log_dir)
    status_dir = os.path.join(log_dir, "status")
    os.makedirs(status_dir, exist_ok=True)
    for old in glob.glob(os.path.join(status_dir, "rank*")) + glob.glob(os.path.join(status_dir, "launcher.json")):
        os.remove(old)
    job_id = uuid.uuid4().hex
    t_wall = time.time()
    deadline = t_wall + timeout_s if timeout_s is not None else None
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    options = list(launcher_args)
    if not any(tok.partition("=")[0] == "--nnodes" for tok in options):  # one node, said: see option_overrides
        options = ["--nnodes", "1", *options]
    cmd = launcher_command(nproc_per_node, log_dir, [*options, worker, *worker_args])
    env = worker_env(nproc_per_node) | (extra_env or {})
    env.update({ENV_STATUS_DIR: status_dir, ENV_JOB_ID: job_id, ENV_LAUNCHER_PID: str(os.getpid())})
    if deadline is not None:
        env[ENV_DEADLINE] = repr(deadline)
    else:  # a deadline inherited from the caller's environment is not this job's
        env.pop(ENV_DEADLINE, None)
    launcher_options = cmd[: len(cmd) - 1 - len(worker_args)]  # what Paddle's launcher is given, before the worker
    for var, value, option, given in option_overrides(launcher_options, env):  # options win
        if env.pop(var, None) is not None:
            print(f"[glm52] ignoring {var}={value} from the environment: Paddle's launcher is given {option} {given}")
    job = {"job_id": job_id, "launcher_pid": os.getpid(), "started": t_wall, "deadline": deadline}
    job["worker_logs_before"] = worker_logs(log_dir)  # an earlier run's, which Paddle's launcher appends to
    write_json_atomic(os.path.join(log_dir, "job.json"), job, indent=1, sort_keys=False)
    local = list(range(node_rank_offset, node_rank_offset + nproc_per_node))
    rdv = rendezvous_of(launcher_options)
    t_start, first_failure = time.monotonic(), None
    next_waiting, started, t_up = t_start + WAITING_EVERY_S, False, t_start
    t_held: float | None = None  # since when every local rank has waited at the job's default group
    rdv_limit = rendezvous_timeout_s if rdv and rendezvous_timeout_s else None
    stopped_by: dict[str, Any] | None = None
    snapshots: list[dict[str, Any]] = []
    seen_signs: set[str] = set()
    stopped_since: dict[str, float] = {}  # rank -> when first seen frozen
    signals = listen()
    signals.polled = True  # and stays so: the launcher is ending the job and then itself
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True, bufsize=1
    )

    chatter = PaddleChatter()  # Paddle's INFO records and flags banner: workerlog.* only, unless verbose
    # what Paddle's launcher says before its workers start (why it failed, if it does); from then on it
    # copies workerlog.0 to its output, which workerlog.0 already keeps: not written twice
    workers_up = threading.Event()
    stopping = threading.Event()  # set when this launcher stops the job (a signal, --job-timeout, a failure)
    try:
        launcher_log: Any = open(os.path.join(log_dir, LAUNCHER_LOG), "w", encoding="utf-8", buffering=1)  # noqa: SIM115
    except OSError:
        launcher_log = None

    def pump() -> None:
        assert proc.stdout is not None
        said = {"up": False, "stopping": False}  # the marker lines launcher.log got

        def to_log(line: str) -> None:
            if launcher_log is None:
                return
            with contextlib.suppress(OSError, ValueError):  # a full disk: the console still gets it
                if stopping.is_set() and not said["stopping"]:
                    said["stopping"] = True
                    launcher_log.write("(the job is being stopped: what Paddle's launcher printed since)\n")
                elif workers_up.is_set() and not stopping.is_set():
                    if not said["up"]:
                        said["up"] = True
                        launcher_log.write(line + "(the workers started: the rest is in workerlog.*)\n")
                    return
                launcher_log.write(line)

        for line in proc.stdout:
            to_log(line)
            if stopping.is_set() and quiet_launcher:  # the teardown's traceback (e.g. "No container in the
                continue  # pod" at the rendezvous) is no cause and came before the reason; launcher.log keeps it
            noise = line.startswith("LAUNCH INFO") or "UserWarning" in line or "warnings.warn" in line
            if quiet_launcher and (noise or not chatter.keep(line)):
                continue
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            try:  # a stop signal: the listener's (with the sender), or SIGINT's KeyboardInterrupt without one
                time.sleep(0.2)
            except KeyboardInterrupt as e:
                signals.interrupted(e)
            if signals.caught:
                stopped_by = signals.caught
                break
            now = time.monotonic()
            if not started and workers_started(log_dir, status_dir, before=job["worker_logs_before"]):
                started, t_up = True, now
                next_waiting = now + WAITING_EVERY_S
                workers_up.set()
            snap = snapshot(status_dir, by="launcher")
            connecting = still_connecting(snap, local) if rdv and started else []
            t_held = (now if t_held is None else t_held) if connecting else None
            if rdv and now >= next_waiting:
                if not started:
                    print(waiting_line(rdv, now - t_start), flush=True)
                elif connecting:
                    print(connecting_line(rdv, connecting, now - t_up), flush=True)
                next_waiting = now + WAITING_EVERY_S  # after a stall: one line, not one for each period missed
            signs = [x for x in _trouble(snap) if x not in seen_signs]
            if signs:  # evidence, taken before the launcher kills anything
                seen_signs.update(signs)
                snapshots.append({**snap, "by": f"launcher (saw {', '.join(signs)})"})
            if first_failure is None and any(s["record"] == "error" for s in snap["ranks"].values()):
                first_failure = now
            # a rank's records stay once written, so every rank seen before is in this snapshot too
            stopped_since = {r: stopped_since.get(r, now) for r, s in snap["ranks"].items() if s["state"] in ("T", "t")}
            frozen = [r for r, t0 in sorted(stopped_since.items(), key=lambda kv: kv[1]) if now - t0 > GRACE_S]
            if first_failure is not None and now - first_failure > GRACE_S:
                text = f"ranks still running {GRACE_S:.0f} s after a failure; stopped the job"
                stopped_by = {"kind": "grace", "text": text}
            elif frozen:
                text = f"rank {frozen[0]} stayed stopped for {GRACE_S:.0f} s; stopped the job"
                stopped_by = {"kind": "frozen", "text": text}
            elif timeout_s is not None and now - t_start > timeout_s:
                stopped_by = {"kind": "timeout", "text": f"job exceeded --job-timeout {timeout_s:g} s; stopped"}
            elif (
                rdv_limit is not None and (not started or t_held is not None) and now - (t_held or t_start) > rdv_limit
            ):
                # what --job-timeout does, sooner: waited since the launch (no worker started) or since every
                # local rank reached the job's default group
                what = (
                    f"the {rdv['nnodes']} nodes did not meet" if not started else "the job's ranks did not all connect"
                )
                stopped_by = {"kind": "timeout", "text": f"{what} within --rendezvous-timeout {rdv_limit:g} s; stopped"}
            if stopped_by:
                break
    finally:
        if stopped_by is not None:
            stopping.set()
            stopped_by = {**stopped_by, "time": time.time()}  # what ranks see after this is our teardown
            snapshots.append(snapshot(status_dir, by=f"launcher (before stopping: {stopped_by['kind']})"))
        stop_job(proc, job_id, status_dir)  # also the stragglers of a job that ended by itself
        reader.join(timeout=5)
        with contextlib.suppress(OSError, AttributeError):
            launcher_log.close()
    write_json_atomic(os.path.join(status_dir, "launcher.json"), {"snapshots": snapshots}, indent=1, sort_keys=False)
    if proc.returncode == 0 and stopped_by is None:
        records = read_records(status_dir)  # success is every local rank's completion record, not status 0 alone
        if all((records.get(r) or {}).get("ok") for r in local):
            return
    if stopped_by is None and signals.caught is None and _signalled_from_outside(status_dir):
        # a scheduler cancelling the job signals every process at once, this one not necessarily first
        t_wait = time.monotonic()
        while signals.caught is None and time.monotonic() - t_wait < LATE_SIGNAL_S:
            time.sleep(0.05)
    late = signals.caught if stopped_by is None else None  # a stop signal that came after the job had ended
    diag = diagnose(
        log_dir,
        local,
        stopped_by=stopped_by,
        launcher_snapshots=snapshots,
        paddle_launcher=(proc.pid, proc.returncode),
        late_signal=late,
        world_size=world_size,
        rendezvous=rdv,
    )
    kind = stopped_by["kind"] if stopped_by else None
    msg = diag.message if kind in (None, "signal") else f"{diag.message}\n({stopped_by['text']})"
    # a failed job exits 1: Paddle's launcher passes on the status of its lowest local rank that
    # exited non-zero, which may be the teardown's (143: SIGTERMed), not the fault's; 124 and 128 + a
    # signal are kept for --job-timeout and a stop signal, and a status of Paddle's launcher's own failure
    rc = 124 if kind == "timeout" else 1
    if kind is None and diag.cause == "launcher" and proc.returncode:
        if proc.returncode < 0 or diag.detail.get("launcher_signal"):  # a signal to Paddle's launcher: 128 + it
            rc = 128 + abs(proc.returncode)
        elif diag.rank is None and proc.returncode > 0:  # it failed before any worker reported
            rc = proc.returncode
    if kind == "signal":
        rc = 128 + int(signal.Signals[stopped_by["signal"]])
    elif late and diag.cause == "signal" and diag.rank is None:  # the job stopped by the sender of this signal
        rc = 128 + int(signal.Signals[late["signal"]])
        stopped_by = late
    err = LaunchError(diag.rank, msg, rc, diag.cause)
    write_failure_record(
        log_dir, err, stopped_by=stopped_by, seconds=time.monotonic() - t_start, diagnosis=diag, job_id=job_id
    )
    raise err


def _signalled_from_outside(status_dir: str) -> bool:
    """Whether a rank recorded a stop signal from a process outside the job (worker.py)."""
    recs = read_records(status_dir).values()
    return any(isinstance(r.get("signal"), dict) and r["signal"].get("sender_in_job") is False for r in recs)


def set_aside_failure_record(log_dir: str) -> str | None:
    """Move an earlier job's ``LOG/failure.json`` to ``LOG/failure.prev.json`` (one rename, replacing
    an older one), so that a job's failure.json is only ever its own: a job that succeeds leaves none.
    Returns the new path, or None when there was no record; an OSError of the rename is raised."""
    path = os.path.join(log_dir, "failure.json")
    prev = os.path.join(log_dir, "failure.prev.json")
    try:
        os.replace(path, prev)
    except FileNotFoundError:
        return None
    return prev


def write_failure_record(
    log_dir: str,
    err: LaunchError,
    *,
    stopped_by: dict[str, Any] | None,
    seconds: float,
    diagnosis: Diagnosis | None = None,
    job_id: str | None = None,
) -> str:
    """``LOG/failure.json``: the culprit rank, the cause, the message and how the job ended (for
    schedulers and post-mortems; a job stopped by the watchdog, the job timeout or a signal leaves
    no other trace of why).  A non-finite step adds its step, quantity and first non-finite
    gradient (train/nonfinite.py)."""
    path = os.path.join(log_dir, "failure.json")
    rec: dict[str, Any] = {
        "rank": err.rank,
        "cause": err.cause,
        "message": err.message,
        "returncode": err.returncode,
        "stopped_by": stopped_by,
        "stopped_by_launcher": stopped_by["text"] if stopped_by else None,
        "seconds": round(seconds, 3),
        "time": time.time(),
        "job_id": job_id,
    }
    for k, v in ((diagnosis.detail if diagnosis else None) or {}).items():
        rec.setdefault(k, v)
    write_json_atomic(path, rec, indent=1, sort_keys=False)
    return path
