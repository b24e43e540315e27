"""A training job's life and its post-mortem, without launching one: the diagnosis read from the
status records (the same answer whatever the process table shows afterwards), the worker's
watchdog and stop signals, the parent-death tie, the job's processes found by its id."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from paddleformers_glm.train.job_status import diagnose, is_comm_error, snapshot
from paddleformers_glm.train.launch import LaunchError, job_processes, write_failure_record
from tests._dist.runner import ROOT, env

NO_PID = 2**22 + 12345  # beyond the kernel's pid_max: never a live process


def _rec(d, r, suffix, payload=None):
    os.makedirs(d / "status", exist_ok=True)
    (d / "status" / f"rank{r}.{suffix}").write_text("" if payload is None else json.dumps(payload))


def _err(d, r, t, message, comm, peers=None, **extra):
    _rec(
        d,
        r,
        "error.json",
        {"rank": r, "time": t, "type": "RuntimeError", "message": message, "comm": comm, "traceback_tail": "tb",
         "peers": peers, **extra},
    )  # fmt: skip


def _peers(by, t, **ranks):
    """A snapshot as a worker takes it: rank -> (state, record, beat)."""
    return {
        "by": by,
        "time": t,
        "ranks": {k[1:]: {"state": s, "record": rec, "beat": b} for k, (s, rec, b) in ranks.items()},
    }


def _beats(d, **progress):
    for k, (step, phase) in progress.items():
        _rec(d, int(k[1:]), "beat", {"rank": int(k[1:]), "pid": NO_PID, "step": step, "phase": phase, "time": 1.0})


TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:80] TIMEOUT"


def test_first_python_error_is_the_culprit_not_the_peer_that_lost_it(tmp_path):
    t = time.time()
    _err(tmp_path, 0, t + 1, TIMEOUT, True)
    _err(tmp_path, 1, t + 2, "bad shape", False)
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "error") and d.message.startswith("rank 1 failed: RuntimeError: bad shape")
    assert "(then rank(s) 0 failed too)" in d.message
    assert is_comm_error("RuntimeError [gloo/transport/tcp/pair.cc:584] TIMEOUT") and not is_comm_error("bad shape")


def test_stopped_rank_is_read_from_the_peers_snapshot_not_the_process_table(tmp_path):
    """SIGSTOP on rank 1: rank 0 times out and records rank 1 in state T before anything is
    killed; by the time of the diagnosis rank 1 is long gone and left no record itself."""
    t = time.time()
    _err(
        tmp_path, 0, t, TIMEOUT, True, _peers("rank 0", t, r0=("R", None, [2, "forward"]), r1=("T", None, [1, "done"]))
    )
    _rec(tmp_path, 1, "pid", {"rank": 1, "pid": NO_PID})
    (tmp_path / "workerlog.1").write_text("step 1\n")
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "stopped"), d
    assert d.message.startswith("rank 1 was stopped") and "rank(s) 0 then timed out waiting for it" in d.message


def test_killed_rank_seen_gone_by_its_peer(tmp_path):
    t = time.time()
    _err(
        tmp_path,
        0,
        t,
        "Connection reset by peer",
        True,
        _peers("rank 0", t, r0=("R", None, None), r1=("gone", None, None)),
    )
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "died") and "rank(s) 0 then lost their peer" in d.message, d


def test_a_hung_rank_is_the_one_behind_in_its_heartbeat(tmp_path):
    """Rank 1 sleeps (state S, alive): no state tells it from its waiting peer; the heartbeat does."""
    t = time.time()
    _err(tmp_path, 0, t, TIMEOUT, True, _peers("rank 0", t, r0=("R", None, None), r1=("S", None, None)))
    _beats(tmp_path, r0=(2, "forward"), r1=(1, "done"))
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "hung") and "step 1 phase 'done'" in d.message, d
    # the same hang ended by --job-timeout: no error at all, the launcher stopped the job
    (tmp_path / "status" / "rank0.error.json").unlink()
    d = diagnose(str(tmp_path), [0, 1], stopped_by={"kind": "timeout", "text": "x"})
    assert (d.rank, d.cause) == (1, "hung"), d
    _beats(tmp_path, r0=(1, "done"), r1=(1, "done"))  # nobody behind: no culprit is invented
    d = diagnose(str(tmp_path), [0, 1], stopped_by={"kind": "timeout", "text": "x"})
    assert d.rank is None and "no rank reported an error" in d.message


def test_a_user_signal_blames_nobody_and_its_victims_are_not_culprits(tmp_path):
    t = time.time()
    for r in (0, 1):
        _rec(tmp_path, r, "signal.json", {"rank": r, "time": t, "signal": "SIGTERM", "peers": None})
    d = diagnose(str(tmp_path), [0, 1], stopped_by={"kind": "signal", "text": "SIGTERM to the launcher"})
    assert (d.rank, d.cause) == (None, "signal") and d.message == "stopped by SIGTERM to the launcher"


def test_a_peer_seen_gone_during_the_launchers_teardown_is_not_a_culprit(tmp_path):
    """SIGINT to the launcher: while it tears the job down, rank 1 is stopped a moment after
    rank 0 and records rank 0 gone.  That is the teardown, not a death: the signal is the cause
    (seen once in the full suite before the launcher recorded when it began stopping)."""
    t = time.time()
    gone = _peers("rank 1", t + 0.5, r0=("gone", None, [2, "forward"]), r1=("R", None, [2, "forward"]))
    _rec(tmp_path, 1, "signal.json", {"rank": 1, "time": t + 0.5, "signal": "SIGTERM", "peers": gone})
    _rec(tmp_path, 0, "pid", {"rank": 0, "pid": NO_PID})
    stop = {"kind": "signal", "text": "SIGINT to the launcher", "time": t}
    d = diagnose(str(tmp_path), [0, 1], stopped_by=stop)
    assert (d.rank, d.cause) == (None, "signal") and d.message == "stopped by SIGINT to the launcher", d
    # the same observation made before the launcher began stopping is evidence of a death
    d = diagnose(str(tmp_path), [0, 1], stopped_by={**stop, "time": t + 1.0})
    assert (d.rank, d.cause) == (0, "died"), d


def test_a_stop_signal_from_outside_the_job_to_one_rank_names_that_rank(tmp_path):
    """SIGTERM to rank 1 alone (an operator's ``kill``, a node agent): rank 1 records the signal and
    its sender, rank 0 then fails in its collective.  Measured on a ``--tp 2`` toy job before the
    fix: "rank 0 failed in communication: ... Connection reset by peer" (rank 0, cause comm),
    rank 1's record (written 40 ms before rank 0's error) unread."""
    t = time.time()
    sig = {"rank": 1, "time": t, "signal": "SIGTERM", "sender_pid": 4242, "sender": "kill 4242", "peers": None}
    _rec(tmp_path, 1, "signal.json", {**sig, "sender_in_job": False})
    seen = _peers("rank 0", t + 2, r0=("R", None, [2, "forward"]), r1=("gone", "signal", [2, "forward"]))
    _err(tmp_path, 0, t + 0.04, "Read error [127.0.0.1]:47009: Connection reset by peer", True, seen)
    _beats(tmp_path, r0=(2, "forward"), r1=(2, "forward"))
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause) == (1, "signal"), d
    assert d.message.startswith("rank 1 was ended by SIGTERM from pid 4242 (kill 4242), outside this job"), d.message
    assert d.message.endswith("rank(s) 0 then lost their peer") and d.detail["sender_pid"] == 4242
    # the same signal from the job's own teardown (Paddle's launcher, after rank 0 failed) is no cause
    _rec(tmp_path, 1, "signal.json", {**sig, "sender_in_job": True})
    assert (diagnose(str(tmp_path), [0, 1]).rank, diagnose(str(tmp_path), [0, 1]).cause) == (0, "comm")
    # every process signalled at once (a scheduler cancelling the job): the launcher's signal, no culprit
    _rec(tmp_path, 1, "signal.json", {**sig, "sender_in_job": False})
    d = diagnose(str(tmp_path), [0, 1], stopped_by={"kind": "signal", "text": "SIGTERM to the launcher", "time": t})
    assert (d.rank, d.cause) == (None, "signal"), d
    # ... also when the launcher's own signal came after the job had ended (measured: signalled 0.3 s
    # after the ranks, before: "the launcher failed before any worker reported", exit 15)
    late = {"kind": "signal", "signal": "SIGTERM", "sender_pid": 4242, "text": "SIGTERM to the launcher from pid 4242"}
    d = diagnose(str(tmp_path), [0, 1], late_signal=late)
    assert (d.rank, d.cause) == (None, "signal") and d.message.startswith("stopped by SIGTERM to the launcher"), d
    d = diagnose(str(tmp_path), [0, 1], late_signal={**late, "sender_pid": 999})  # another sender: rank 1's
    assert (d.rank, d.cause) == (1, "signal"), d
    # a signal from outside that landed after the launcher began stopping the job (a timeout) is its teardown
    d = diagnose(str(tmp_path), [0, 1], stopped_by={"kind": "timeout", "text": "x", "time": t - 1})
    assert d.cause != "signal", d


def test_a_signal_to_paddles_launcher_blames_no_rank(tmp_path):
    """An operator's kill of the middle process (``python -m paddleformers_glm.train.lifeline
    paddle.distributed.launch ...``) of a ``--tp 2`` toy job at step 2, measured before the fix:
    SIGKILL -> "rank 0 died without a Python error" (the workers die of the parent-death signal,
    no record; exit 1); SIGTERM -> "rank 1 failed in communication" (Paddle's handler SIGTERMs the
    workers, rank 1 loses rank 0; exit 15).  Now: Paddle's launcher named, no culprit, the exit
    status 128 + the signal (launch.py)."""
    t = time.time()
    for r in (0, 1):
        _rec(tmp_path, r, "pid", {"rank": r, "pid": NO_PID})
    _beats(tmp_path, r0=(2, "forward"), r1=(2, "forward"))
    d = diagnose(str(tmp_path), [0, 1], paddle_launcher=(4242, -signal.SIGKILL))
    assert (d.rank, d.cause) == (None, "launcher"), d
    assert d.message.startswith("Paddle's launcher (pid 4242) was killed by SIGKILL; every worker died with it"), d
    # SIGTERM: Paddle's handler stops the workers first (their records name it), then exits with 15
    sig = {"rank": 0, "time": t, "signal": "SIGTERM", "sender_pid": 4242, "sender": "paddle", "sender_in_job": True}
    _rec(tmp_path, 0, "signal.json", sig)
    gone = _peers("rank 1", t + 0.05, r0=("gone", "signal", [2, "forward"]), r1=("R", None, [2, "forward"]))
    _err(tmp_path, 1, t + 0.05, "Read error [127.0.0.1]:36490: Connection reset by peer", True, gone)
    d = diagnose(str(tmp_path), [0, 1], paddle_launcher=(4242, 15))
    assert (d.rank, d.cause, d.detail["launcher_signal"]) == (None, "launcher", "SIGTERM"), d
    assert d.message.startswith("Paddle's launcher (pid 4242) stopped the workers before any of them failed"), d
    # the same records when Paddle's launcher only tore down a job that had already failed: a rank's error first
    _err(tmp_path, 1, t - 0.05, "bad shape", False)
    assert (diagnose(str(tmp_path), [0, 1], paddle_launcher=(4242, 1)).rank, "x") == (1, "x")
    # ... or a rank that died without a record (Paddle's launcher then SIGTERMs the survivor)
    (tmp_path / "status" / "rank1.error.json").unlink()
    assert diagnose(str(tmp_path), [0, 1], paddle_launcher=(4242, 1)).cause == "died"


def test_an_error_after_a_peer_died_blames_the_dead_peer(tmp_path):
    """A survivor's error need not look like a communication failure: its own snapshot shows
    that rank 1 was gone first."""
    t = time.time()
    _err(tmp_path, 0, t, "unexpected shape", False, _peers("rank 0", t, r0=("R", None, None), r1=("gone", None, None)))
    assert diagnose(str(tmp_path), [0, 1]).rank == 1


def test_launcher_snapshots_count_only_while_another_rank_still_runs(tmp_path):
    both_gone = _peers("launcher", 1.0, r0=("gone", None, None), r1=("gone", None, None))
    one_gone = _peers("launcher", 2.0, r0=("S", None, None), r1=("gone", None, None))
    _beats(tmp_path, r0=(2, "forward"), r1=(2, "forward"))
    d = diagnose(str(tmp_path), [0, 1], launcher_snapshots=[both_gone])  # no evidence of order
    assert (d.rank, d.cause) == (0, "died")  # the fallback: the first rank without any record
    d = diagnose(str(tmp_path), [0, 1], launcher_snapshots=[both_gone, one_gone])
    assert (d.rank, d.cause) == (1, "died")


def test_ranks_exiting_0_seen_one_after_the_other_are_not_a_death(tmp_path):
    """Both ranks os._exit(0) mid-run; the launcher's watcher saw rank 1 gone while rank 0 was still
    leaving (seen in CI: test_train_dist::test_ranks_that_exit_0_before_finishing_are_a_failure said
    "rank 1 died without a Python error").  Paddle's launcher exits 0 only when every worker did, so
    with its status 0 no rank died by a signal or the OS: the silent ranks are named as exiting 0; with
    a non-zero status the same snapshot still names rank 1 dead."""
    one_gone = _peers("launcher", 2.0, r0=("R", None, [1, "done"]), r1=("gone", None, [1, "done"]))
    _beats(tmp_path, r0=(1, "done"), r1=(1, "done"))
    d = diagnose(str(tmp_path), [0, 1], launcher_snapshots=[one_gone], paddle_launcher=(4242, 0))
    assert (d.rank, d.cause) == (0, "died") and d.message.startswith(
        "rank(s) 0, 1 exited with status 0 before finishing the run"
    ), d
    d = diagnose(str(tmp_path), [0, 1], launcher_snapshots=[one_gone], paddle_launcher=(4242, 1))
    assert (d.rank, d.cause) == (1, "died") and d.message.startswith("rank 1 died without a Python error"), d


def test_a_nonfinite_step_names_the_rank_of_the_first_nonfinite_value(tmp_path):
    detail = {"kind": "nonfinite", "rank": 1, "step": 3, "message": "step 3: non-finite lm loss (nan) on rank 1"}
    t = time.time()
    _err(tmp_path, 0, t, "step 3", False, None, detail=detail)  # every rank raises the same
    _err(tmp_path, 1, t + 0.1, "step 3", False, None, detail=detail)
    d = diagnose(str(tmp_path), [0, 1])
    assert (d.rank, d.cause, d.message) == (1, "nonfinite", detail["message"])
    path = write_failure_record(
        str(tmp_path), LaunchError(1, d.message, 1, d.cause), stopped_by=None, seconds=1, diagnosis=d
    )
    rec = json.loads(open(path, encoding="utf-8").read(), parse_constant=_refuse)
    assert rec["step"] == 3 and rec["cause"] == "nonfinite" and rec["rank"] == 1


def _refuse(token):
    raise ValueError(f"not strict JSON: {token}")


def test_snapshot_reads_live_and_gone_processes(tmp_path):
    _rec(tmp_path, 0, "pid", {"rank": 0, "pid": os.getpid()})
    _rec(tmp_path, 1, "pid", {"rank": 1, "pid": NO_PID})
    _rec(tmp_path, 1, "ok")
    s = snapshot(str(tmp_path / "status"), by="test")["ranks"]
    assert s["0"]["state"] in "RSD" and s["0"]["record"] is None
    assert s["1"] == {"state": "gone", "record": "ok", "beat": None}


# ------------------------------------------------------------------ the worker's own end
_WORKER = textwrap.dedent(
    """
    import sys, time
    from paddleformers_glm.train import worker
    worker.DEADLINE_GRACE_S = 0.0
    life = worker.WorkerLife(3, sys.argv[1])
    life.start()
    print("ready", flush=True)
    time.sleep(60)
    """
)


def _worker(tmp_path, ready=True, **extra_env):
    (tmp_path / "status").mkdir(exist_ok=True)
    e = {**env(), **extra_env}
    p = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(tmp_path / "status")], env=e, stdout=subprocess.PIPE, text=True
    )
    if ready:
        assert p.stdout.readline().strip() == "ready"
    return p


def _signal_record(tmp_path):
    return json.loads((tmp_path / "status" / "rank3.signal.json").read_text(), parse_constant=_refuse)


def test_worker_names_the_sender_of_a_stop_signal_while_its_main_thread_sleeps(tmp_path):
    p = _worker(tmp_path)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    rec = _signal_record(tmp_path)
    with open("/proc/self/cmdline", "rb") as f:  # this test's process (pytest, or an xdist worker)
        own_argv0 = f.read().split(b"\0")[0].decode()
    assert rec["signal"] == "SIGTERM" and rec["sender_pid"] == os.getpid(), rec
    assert rec["sender"].split(" ")[0] == own_argv0, (rec["sender"], own_argv0)


def test_worker_tells_a_stop_signal_of_its_own_job_from_one_sent_from_outside(tmp_path):
    """Whose signal ended a worker: its parent's (Paddle's launcher; here this test), a process
    carrying the job's id (the glm52 launcher, a peer), or one outside the job (no id, another id)."""

    record = tmp_path / "status" / "rank3.signal.json"

    def ended_by(sender_job=None):
        record.unlink(missing_ok=True)
        p = _worker(tmp_path, GLM52_JOB_ID="job-a")
        if sender_job is None:
            os.kill(p.pid, signal.SIGTERM)
        else:
            e = {k: v for k, v in env().items() if k != "GLM52_JOB_ID"} | (
                {"GLM52_JOB_ID": sender_job} if sender_job else {}
            )
            # the sender lives until the worker has written its record, as the launchers that send a
            # job's stop signals do (a sender gone before the worker reads /proc/PID/environ is unknown)
            send = (
                f"import os, time; os.kill({p.pid}, {int(signal.SIGTERM)}); t = time.monotonic()\n"
                f"while not os.path.exists({str(record)!r}) and time.monotonic() - t < 30: time.sleep(0.01)"
            )
            subprocess.run([sys.executable, "-c", send], env=e, check=True)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
        return _signal_record(tmp_path)["sender_in_job"]

    assert ended_by() is True
    assert ended_by("job-a") is True
    assert ended_by("") is False
    assert ended_by("job-b") is False


def test_worker_ends_itself_past_the_job_deadline(tmp_path):
    # its watchdog may end it (1 s after its start) before it prints "ready": measured, a 1.5 s stall
    # of the worker's main thread before that line (a loaded machine) failed the wait for it
    p = _worker(tmp_path, ready=False, GLM52_JOB_DEADLINE=repr(time.time() - 1))
    assert p.wait(timeout=30) == 124
    assert "--job-timeout" in _signal_record(tmp_path)["watchdog"]


def test_worker_ends_itself_when_the_launcher_is_gone(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p = _worker(tmp_path, GLM52_LAUNCHER_PID=str(launcher.pid))
    launcher.kill()
    launcher.wait()
    assert p.wait(timeout=30) == 1
    assert f"pid {launcher.pid}" in _signal_record(tmp_path)["watchdog"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux only")
def test_lifeline_child_dies_with_its_parent_and_the_job_id_finds_it(tmp_path):
    """parent -> ``python -m paddleformers_glm.train.lifeline sleeper``: SIGKILL of the parent ends the
    child (no cleanup code of the parent runs); ``job_processes`` finds it by its job id until then."""
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    parent_code = textwrap.dedent(
        """
        import os, subprocess, sys, time
        env = dict(os.environ, GLM52_LAUNCHER_PID=str(os.getpid()))
        c = subprocess.Popen([sys.executable, "-m", "paddleformers_glm.train.lifeline", "sleeper"], env=env)
        print(c.pid, flush=True)
        time.sleep(60)
        """
    )
    # a job id of this run alone: job_processes scans every process of the machine, and another
    # checkout's run of this test (or a failed run's sleepers) carrying a fixed id would be found too
    job = f"lifeline-test-{uuid.uuid4().hex}"
    e = {**env(), "GLM52_JOB_ID": job, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=e, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        t0 = time.monotonic()
        while child not in job_processes(job) and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert child in job_processes(job) and parent.pid in job_processes(job)
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        while job_processes(job) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert job_processes(job) == [], "the child outlived its parent"
    finally:  # a failed run leaves no sleeper behind
        for pid in [parent.pid, *job_processes(job)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_job_timeout_holds_in_one_process_too(tmp_path, capsys):
    """World 1 trains in this process: --job-timeout still ends it (SIGALRM), one line, exit 124."""
    from paddleformers_glm.train.command import main as train_main

    args = ["--model", "toy", "--steps", "1000000", "--seq-len", "16", "--no-progress", "--job-timeout", "4"]
    assert train_main([*args, "--out", str(tmp_path)]) == 124
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("glm52 train: job exceeded --job-timeout 4 s; stopped"), err
    rec = json.loads((tmp_path / "logs" / "failure.json").read_text(), parse_constant=_refuse)
    assert (rec["rank"], rec["cause"], rec["returncode"]) == (None, "timeout", 124)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_one_process_glm52_train_ends_it_with_its_record(tmp_path, sig):
    """``glm52 train`` in one process (the ``glm52`` entry point): a stop signal gives one line,
    exit 128 + signal and failure.json naming the sender, as docs/failure-modes.md promises. Measured
    before: the entry imported every subcommand's module, numpy among them, whose BLAS pool made
    the process multi-threaded before the signal listener started, so none started; Paddle's own
    handler then took SIGTERM (exit 143 without failure.json; once a deadlock inside malloc)."""
    cmd = [sys.executable, "-m", "paddleformers_glm.cli", "train", "--model", "toy", "--steps", "100000"]
    e = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}  # a user's shell: BLAS may start threads
    p = subprocess.Popen([*cmd, "--out", str(tmp_path)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        for line in p.stdout:  # the progress lines: the run is past its setup
            if line.startswith("step 2/"):
                break
        os.kill(p.pid, getattr(signal, sig))
        err = p.communicate(timeout=60)[1]
    finally:
        p.kill()
    assert p.returncode == 128 + getattr(signal, sig), err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("glm52 train") or "Traceback" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"glm52 train: stopped by {sig} to the launcher"), err[-2000:]
    rec = json.loads((tmp_path / "logs" / "failure.json").read_text(), parse_constant=_refuse)
    assert (rec["rank"], rec["cause"], rec["stopped_by"]["sender_pid"]) == (None, "signal", os.getpid()), rec


def test_a_run_in_process_leaves_the_callers_stop_signals_as_they_were(tmp_path):
    """A Python caller of ``glm52 train``'s ``main`` goes on after the run: its signal mask and
    handlers are as before, and so are those of the processes it starts later.  Measured before:
    the listener's block of SIGTERM, SIGINT and SIGHUP stayed (a one-thread process: Paddle not yet
    imported, OMP_NUM_THREADS=1), every later child inherited it and ignored them (the suite run in
    one process with OMP_NUM_THREADS=1: test_cli's Ctrl-C to a ``glm52 plan --search`` started after
    this file's in-process runs let the search finish, exit 0 instead of 130)."""
    code = textwrap.dedent(
        """
        import json, signal, subprocess, sys
        from paddleformers_glm.train.command import main
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGHUP, signal.SIGINT, signal.SIGTERM])  # whatever the runner's
        mask = lambda: sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        handlers = lambda: [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)]
        before = (mask(), handlers())
        args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", sys.argv[1]]
        rc = main(args)
        child = subprocess.run(
            [sys.executable, "-c", "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(0, [])))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        print(json.dumps({"rc": rc, "before": before, "after": (mask(), handlers()), "child": json.loads(child)}))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env(), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and not {1, 2, 15} & set(got["before"][0]), got
    assert got["after"] == got["before"] and got["child"] == got["before"][0], got


def test_stop_listener_names_the_sender_although_paddle_runs_a_thread_of_its_own():
    """Paddle's import starts a thread that blocks no signal; the listener, started before it,
    still takes every stop signal (with its sender) and interrupts the main thread."""
    code = textwrap.dedent(
        """
        import json, os, sys, time
        from paddleformers_glm.train.stop_signals import listen
        listener = listen()
        import paddle  # noqa: F401  - its threads inherit the blocked mask
        import threading
        waiter = [t.native_id for t in threading.enumerate() if t.name == "glm52-stop-signals"]
        for t in os.listdir("/proc/self/task"):  # every other thread blocks SIGTERM (bit 15 of SigBlk)
            if int(t) in waiter:  # in sigwaitinfo: the kernel shows its waited signals unblocked
                continue
            blk = [ln for ln in open(f"/proc/self/task/{t}/status") if ln.startswith("SigBlk")][0]
            assert int(blk.split()[1], 16) & (1 << 14), (t, blk)
        t0 = time.monotonic()
        try:
            print("ready", len(os.listdir("/proc/self/task")), flush=True)
            while time.monotonic() - t0 < 60:  # Python at work, as training is
                sum(range(1000))
        except KeyboardInterrupt:
            print(json.dumps(listener.caught), flush=True)
        """
    )
    e = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}  # Paddle's own thread pool
    p = subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE, text=True)
    ready = p.stdout.readline().split()
    assert ready[0] == "ready" and int(ready[1]) >= 3, ready  # main, listener, Paddle's
    os.kill(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    caught = json.loads(out.strip().splitlines()[-1])
    assert caught["signal"] == "SIGTERM" and caught["sender_pid"] == os.getpid(), caught


# ------------------------------------------------------------------ one job per output folder
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from paddleformers_glm.train.out_lock import hold_out_folder
    with hold_out_folder(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None):
        print("ready", flush=True)
        time.sleep(60)
    """
)


def test_a_second_train_into_the_out_of_a_running_job_is_refused_and_touches_nothing(tmp_path, capsys):
    """Measured before: a second ``glm52 train --tp 2`` given the --out of a running one ran to the
    end (exit 0, both jobs), deleting the first job's status records and writing its own
    loss.json, job.json and step folders of the same numbers into the first job's folder.  Now it
    is one line naming the running job, exit 2, nothing written; the lock dies with its holder,
    SIGKILL included."""
    from paddleformers_glm.train.command import main as train_main

    out = tmp_path / "out"
    _rec(out / "logs", 0, "beat", {"rank": 0, "step": 7})  # the running job's post-mortem
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", str(out)]
        assert train_main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"glm52 train: error: --out {out} is in use"), err
        assert f"pid {holder.pid} on " in err, err
        assert sorted(p.name for p in out.iterdir()) == ["logs"] and not (out / "logs" / "failure.json").exists()
        assert json.loads((out / "logs" / "status" / "rank0.beat").read_text()) == {"rank": 0, "step": 7}
        # text data is tokenized into OUT/data: measured before, the second command wrote it there
        # (replacing the running job's file of that name), then found the lock
        text = tmp_path / "text.jsonl"
        text.write_text(json.dumps({"text": "hello world " * 50}) + "\n")
        tiny = ["--model", str(ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"), "--data", str(text)]
        assert train_main([*tiny, "--eval-data", str(text), *args[2:]]) == 2
        assert "is in use" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["logs"]
    finally:
        holder.kill()
        holder.wait()
    assert train_main(args) == 0  # the holder is gone (SIGKILL): no stale lock
    assert json.loads((out / "loss.json").read_text())["steps"] == 1


@pytest.mark.parametrize("holder_node, node_flags", [(0, []), (None, ["--node-rank", "1"])])
def test_a_job_of_the_other_kind_into_the_same_out_is_refused(tmp_path, capsys, holder_node, node_flags):
    """A one-node job and a node of a multi-node job hold different lock files (the nodes of one job
    share --out); each is refused beside a live holder of the other's. Measured before: a one-node
    ``glm52 train`` given the --out of a running two-node job was accepted, and when it failed its
    launcher removed that job's ``checkpoints/step_N.tmp`` (a save in progress)."""
    from paddleformers_glm.train.command import main as train_main

    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _HOLDER, str(out)] + ([] if holder_node is None else [str(holder_node)])
    holder = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", str(out)]
        if node_flags:
            args += ["--dp", "2", "--nnodes", "2", "--master", "127.0.0.1:1", *node_flags]
        assert train_main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--out {out} is in use" in err and f"pid {holder.pid} on " in err, err
        held = ["train.lock"] if holder_node is None else [f"train.node{holder_node}.lock"]
        assert sorted(p.name for p in (out / "logs").iterdir()) == held  # no lock file of the refused command
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_input_leaves_no_output_folder_behind(tmp_path, capsys):
    """The inputs are checked holding the --out folder's lock (a text --data is tokenized into it):
    a refused one removes the folder the command made, and leaves one that was there as it was."""
    from paddleformers_glm.train.command import main as train_main

    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not an array")
    args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--data", str(bad)]
    assert train_main([*args, "--out", str(tmp_path / "new")]) == 2
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    assert train_main([*args, "--out", str(kept)]) == 2
    assert (kept / "notes").is_dir()


def test_model_config_that_is_not_json_names_the_flag(tmp_path, capsys):
    """Before: ``glm52 train: error: Expecting property name enclosed in double quotes: line 1 column 2``,
    the JSON parser's words alone, no flag named."""
    from paddleformers_glm.train.command import main as train_main

    args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", str(tmp_path / "o")]
    assert train_main([*args, "--model-config", "{num_experts: 4}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glm52 train: error: --model-config is not JSON: Expecting property name"), err


def test_two_dump_steps_into_one_folder_through_a_link_are_refused(tmp_path):
    """``--dump-step D 1 --dump-step L 2`` with L a link to D: the step-2 dump replaced step 1's."""
    import argparse

    from paddleformers_glm.train.command import dump_steps

    (tmp_path / "D").mkdir()
    (tmp_path / "L").symlink_to(tmp_path / "D")
    args = argparse.Namespace(
        steps=3, model=str(tmp_path), dump_step=[(str(tmp_path / "D"), "1"), (str(tmp_path / "L"), "2")]
    )
    with pytest.raises(ValueError, match=r"L 2: .*L already takes the dump of step 1"):
        dump_steps(args)


def test_launcher_args_of_a_one_process_run_are_refused_not_dropped(tmp_path, capsys):
    """One process runs without Paddle's launcher: ``--launcher-args "--devices 3 --log_level
    DEBUG"`` trained in-process on the default device, exit 0, not a word (measured), where
    ``glm52 generate`` refuses the flag without a launched layout."""
    from paddleformers_glm.train.command import main as train_main

    args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", str(tmp_path / "o")]
    assert train_main([*args, "--launcher-args", "--devices 3"]) == 2
    err = capsys.readouterr().err.strip()
    want = "--launcher-args needs a layout of more than one process (one process runs without Paddle's launcher)"
    assert err == f"glm52 train: error: {want}", err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--nnodes", "0"], "--nnodes must be at least 1, got 0"),
        (["--node-rank", "1"], "--nnodes 2 needs --master IP:PORT"),
        (["--master", "127.0.0.1:1"], "--nnodes 2 needs --node-rank R (0..1)"),
        (["--master", "127.0.0.1:1", "--node-rank", "2"], "--node-rank must be within 0..1"),
    ],
)
def test_a_multi_node_run_without_master_or_node_rank_is_refused_before_the_launch(tmp_path, capsys, flags, says):
    """Measured before, two commands `--nnodes 2 --tp 2` on one machine: without --master each
    started its own rendezvous and both waited until killed (60 s here, forever otherwise);
    without --node-rank Paddle's launcher numbered the nodes by arrival, and the node that got
    rank 1 reported the finished job as failed (exit 1: 'rank(s) 0 exited with status 0 before
    finishing the run', rank 0's completion record being on the other node)."""
    from paddleformers_glm.train.command import main as train_main

    args = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--tp", "2", "--nnodes", "2"]
    assert train_main([*args, *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"glm52 train: error: {says}"), err
    assert not (tmp_path / "logs").exists()  # nothing launched, no lock taken


def test_ranks_given_different_runs_are_refused_naming_the_settings(monkeypatch):
    """Each node of a multi-node job reads its own command line.  Measured before (two nodes at
    --tp 2, node 1 with --lr 2e-2): both exited 0, node 0 printing lr 2e-3 while its loss at step 2
    was 4.365181 instead of the 4.401340 of a same-settings run (rank 1's shards stepped at 2e-2).
    Now every rank compares its settings with rank 0's at setup (one all-gather) and fails naming
    them; where each node reads and writes (--out, --data, --resume, --model paths) may differ."""
    from paddleformers_glm.train import loop
    from paddleformers_glm.train.loop import TrainConfig, check_same_run, run_settings

    base = {"model": "toy", "steps": 4, "seq_len": 16, "lr": 2e-3, "tp": 2, "out": "/n0", "data": "/n0/d.npy"}
    mine = TrainConfig(**base, model_args={"model_dir": "/n0/m"})
    here = {"out": "/n1", "data": "/n1/d.npy", "resume": None, "progress": False, "model_args": {"model_dir": "/n1/m"}}
    other = TrainConfig(**{**base, **here})
    monkeypatch.setattr(loop, "gather_settings", lambda text: [text, run_settings(other)])
    check_same_run(mine, 2)  # another node's paths: the same run
    other = TrainConfig(**{**base, **here, "lr": 2e-2, "steps": 6})
    with pytest.raises(ValueError) as e:
        check_same_run(mine, 2)
    assert str(e.value).startswith(
        "the ranks of this job were given different runs (lr: 0.002 on rank 0, 0.02 on rank 1; "
        "steps: 4 on rank 0, 6 on rank 1): run the same glm52 train command on every node"
    ), e.value


def test_ranks_given_different_data_or_resume_files_are_refused_naming_them(tmp_path, monkeypatch):
    """--data, --resume and the model folder are per-node paths (another mount point may hold them),
    so check_same_run left them out, and nodes given different data files with the same settings
    trained on different samples with no message.  Measured before, two nodes on one machine
    (--nnodes 2 --tp 2 --steps 2 --seq-len 16, node 1's .npy differing from node 0's in its last
    token only): both exited 0 (loss 4.682041, 4.662554), each rank drawing its rows from its own
    node's file.  Now every rank also compares what it read: the data's fingerprint (the one a
    resume compares), the checkpoint's identity (checkpoint_info less its path) and the resume
    state's step and meta.json hash; copies of the same files under other paths still pass."""
    import numpy as np

    from paddleformers_glm.train import loop
    from paddleformers_glm.train.adapter import make_adapter
    from paddleformers_glm.train.data import open_data
    from paddleformers_glm.train.loop import TrainConfig, check_same_run, run_inputs, run_settings
    from paddleformers_glm.train.state_files import FORMAT

    adapter = make_adapter("toy")
    rng = np.random.default_rng(0)
    tokens = rng.integers(adapter.vocab_size, size=16 * 8)
    other_tokens = tokens.copy()
    other_tokens[-1] = (other_tokens[-1] + 1) % adapter.vocab_size  # the last sample differs
    for node, toks in (("n0", tokens), ("n1", tokens), ("n2", other_tokens)):
        (tmp_path / node / "step_00000004").mkdir(parents=True)
        np.save(tmp_path / node / "d.npy", toks.astype(np.int32))
        meta = {"format": FORMAT, "step": 4, "world_size": 1, "profile": {}, "flex": {"stepped": []}}
        (tmp_path / node / "step_00000004" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "n2" / "step_00000006").mkdir()
    meta = {"format": FORMAT, "step": 6, "world_size": 1, "profile": {}, "flex": {"stepped": []}}
    (tmp_path / "n2" / "step_00000006" / "meta.json").write_text(json.dumps(meta))

    def node(name, step=4):
        cfg = TrainConfig(
            model="toy", steps=8, seq_len=16, tp=2, out=str(tmp_path / name), data=str(tmp_path / name / "d.npy"),
            resume=str(tmp_path / name / f"step_{step:08d}"),
        )  # fmt: skip
        data = open_data(cfg.data, cfg.seq_len, adapter.vocab_size, cfg.seed)
        return cfg, run_inputs(cfg, adapter, data)

    mine, my_inputs = node("n0")
    two = 2

    def against(other):
        monkeypatch.setattr(loop, "gather_settings", lambda text: [text, run_settings(*other)])

    against(node("n1"))  # copies of the same files under another node's paths: the same run
    check_same_run(mine, two, my_inputs)
    against(node("n2"))
    with pytest.raises(ValueError) as e:
        check_same_run(mine, two, my_inputs)
    fp0, fp1 = my_inputs["data fingerprint"], node("n2")[1]["data fingerprint"]
    assert fp0 != fp1
    assert str(e.value) == (
        f'the ranks of this job were given different runs (data fingerprint: "{fp0}" on rank 0, "{fp1}" on rank 1): '
        "run the same glm52 train command on every node, each with copies of rank 0's files (--data, the model "
        "folder, --resume)"
    ), e.value
    against(node("n2", step=6))
    with pytest.raises(
        ValueError,
        match=r"\(data fingerprint: .*; resume state: \{.*\"step\": 4\} on rank 0, "
        r"\{.*\"step\": 6\} on rank 1\): run the same",
    ):
        check_same_run(mine, two, my_inputs)


def test_a_run_that_saves_needs_an_out_every_node_sees(tmp_path, monkeypatch):
    """Two nodes with their own --out (no shared filesystem).  Measured before at --tp 2
    --save-every 2 --export: both exited 0, node 0's checkpoints/step_00000004 lacked rank 1's
    files (its --resume refused: 'rank_00001.json: missing'), node 1 kept step_*.tmp folders.
    Now every rank checks at setup that it sees a file rank 0 wrote into its --out."""
    from types import SimpleNamespace

    from paddleformers_glm.checkpoint import distributed
    from paddleformers_glm.train.loop import TrainConfig, check_shared_out

    def two_nodes(other_out):  # this process is rank 0; rank 1 looks into other_out
        def gather(obj, topo):
            if isinstance(obj, str):  # the marker's name, from rank 0
                gather.name = obj
                return [obj, None]
            return [obj, (other_out / "logs" / gather.name).exists()]

        return gather

    cfg = TrainConfig(model="toy", tp=2, save_every=2, out=str(tmp_path / "n0"))
    topo = SimpleNamespace(world_size=2, rank=0)
    monkeypatch.setattr(distributed, "all_gather_object", two_nodes(tmp_path / "n0"))
    check_shared_out(cfg, topo)  # one shared --out
    monkeypatch.setattr(distributed, "all_gather_object", two_nodes(tmp_path / "n1"))
    with pytest.raises(ValueError) as e:
        check_shared_out(cfg, topo)
    assert str(e.value).startswith("--save-every needs one --out that every node sees (a shared filesystem): rank(s) 1")
    assert list((tmp_path / "n0" / "logs").iterdir()) == []  # the marker is removed


def test_a_lost_peer_on_another_node_is_named_as_the_suspect(tmp_path):
    """Node 0 of a two-node job (ranks 0 of 2) whose peer on node 1 was killed or SIGTERMed
    (measured: both ended within 10 s; node 0's one line was 'rank 0 failed in communication:
    ... Connection reset by peer', as if its own rank were the culprit)."""
    _err(tmp_path, 0, time.time(), "Read error [127.0.0.1]:33681: Connection reset by peer", True)
    d = diagnose(str(tmp_path), [0], world_size=2)
    assert (d.rank, d.cause) == (0, "comm"), d
    assert d.message.endswith(
        "(ranks 0..0 of 2 run on this node: a rank of another node that failed or was stopped first ends them in "
        f"communication errors; see the other nodes' {tmp_path.parent}/node<R>/failure.json)"
    ), d.message
    assert "another node" not in diagnose(str(tmp_path), [0]).message  # one node: as before
