"""``--rendezvous-timeout``: a multi-node job whose nodes never meet at the master, or whose ranks
never all connect at the job's default group (a rank of another node died before it got there),
stops by itself (default 600 s, torchrun's rendezvous join timeout; 0: no limit), exit 124, with
the one-line "never met" / "never finished connecting" diagnosis a ``--job-timeout`` gives.  A stop
signal to such a node (a scheduler's walltime) keeps that explanation.  Measured before: node 0
of ``--nnodes 2`` started alone still ran at 120 s, printing its waiting line every 30 s; node 0
whose peer node's worker was SIGKILLed before the default group formed still ran at 100 s; the
walltime's SIGTERM then said only "stopped by SIGTERM".  Paddle's launcher waits at ``--master``
without a deadline (``HTTPMaster.sync_peers``)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paddleformers_glm.train.job_status import diagnose
from tests._dist.runner import env, run_nodes
from tests.test_launch_before_workers import WAITING_LAUNCHER, _launch, _module

# a stand-in for Paddle's launcher whose one worker started and waits at the job's default group:
# workerlog.0, the worker's pid record (this process) and its heartbeat at ``connect``, then nothing
CONNECTING_LAUNCHER = """
import json, os, time
status = os.environ["GLM52_STATUS_DIR"]
open(os.path.join(os.path.dirname(status), "workerlog.0"), "w").write("worker 0 started\\n")
pid = {"rank": 0, "pid": os.getpid(), "job": os.environ["GLM52_JOB_ID"], "time": time.time()}
open(os.path.join(status, "rank0.pid"), "w").write(json.dumps(pid))
beat = {"rank": 0, "pid": os.getpid(), "step": 0, "phase": "connect", "time": time.time()}
open(os.path.join(status, "rank0.beat"), "w").write(json.dumps(beat))
print("LAUNCH INFO worker 0 started", flush=True)
time.sleep(600)
"""

NODE0 = ["--nnodes", "2", "--master", "127.0.0.1:1", "--rank", "0"]


def test_a_node_whose_peers_never_come_stops_at_the_rendezvous_timeout(tmp_path):
    """No ``--job-timeout``: before, the node waited for the other node without a limit."""
    t0 = time.monotonic()
    err, _, log_dir = _launch(tmp_path, "waiting_launcher", WAITING_LAUNCHER, NODE0, timeout_s=None, rendezvous_s=3.0)
    assert time.monotonic() - t0 < 40
    assert (err["rank"], err["cause"], err["rc"]) == (None, "timeout", 124), err
    first, why = err["message"].splitlines()
    assert first.startswith("no worker of this node started: the 2 nodes never met at the master 127.0.0.1:1"), err
    assert why == "(the 2 nodes did not meet within --rendezvous-timeout 3 s; stopped)", err
    rec = json.loads((log_dir / "failure.json").read_text())
    assert rec["rendezvous"] == {"nnodes": 2, "master": "127.0.0.1:1", "rank": 0, "met": False}, rec
    assert rec["stopped_by"]["kind"] == "timeout" and "--rendezvous-timeout 3 s" in rec["stopped_by_launcher"], rec


def test_ranks_held_at_the_default_group_stop_at_the_rendezvous_timeout(tmp_path):
    """This node's worker started and waits at the job's default group for ranks of another node
    (one killed before it got there, or a node given another ``--nnodes``): before, without
    ``--job-timeout``, it waited without a limit."""
    t0 = time.monotonic()
    err, _, log_dir = _launch(tmp_path, "connecting_launcher", CONNECTING_LAUNCHER, NODE0, None, rendezvous_s=3.0)
    assert time.monotonic() - t0 < 40
    assert (err["rank"], err["cause"], err["rc"]) == (None, "timeout", 124), err
    first, why = err["message"].splitlines()
    assert first.startswith("rank(s) 0 of this node never finished connecting to the job's other ranks"), err
    assert "last heartbeat step 0 phase 'connect'" in first and "another --nnodes than 2" in first, err
    assert why == "(the job's ranks did not all connect within --rendezvous-timeout 3 s; stopped)", err
    assert json.loads((log_dir / "failure.json").read_text())["stopped_by"]["kind"] == "timeout"


def test_a_stop_signal_to_a_node_that_waits_for_the_others_says_why_it_waited(tmp_path):
    """A scheduler's walltime (SIGTERM to ``glm52 train``'s launcher) on a node that never met its
    peers: the one line keeps the "never met" explanation; before, "stopped by SIGTERM ..." only."""
    e = _module(tmp_path, "waiting_launcher", WAITING_LAUNCHER)
    log_dir = tmp_path / "logs"
    script = textwrap.dedent(f"""
        import json, sys
        from paddleformers_glm.train import launch
        launch.launcher_command = lambda n, d, args: [sys.executable, "-m", "paddleformers_glm.train.lifeline",
                                                      "waiting_launcher", *args]
        try:
            launch.launch_workers([], 1, {str(log_dir)!r}, launcher_args={NODE0!r}, world_size=2)
        except launch.LaunchError as err:
            print("RESULT " + json.dumps({{"message": err.message, "rc": err.returncode, "cause": err.cause}}))
    """)
    p = subprocess.Popen([sys.executable, "-c", script], env=e, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (log_dir / "launcher.log").is_file() and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        time.sleep(1.0)  # Paddle's launcher (here its stand-in) waits at the master
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert (result["rc"], result["cause"]) == (143, "signal"), result
    msg = result["message"]
    assert msg.startswith("stopped by SIGTERM to the launcher") and len(msg.splitlines()) == 1, msg
    assert re.search(r" \d+ s after the launch; no worker of this node started: the 2 nodes never met at the", msg), msg
    rec = json.loads((log_dir / "failure.json").read_text())
    assert rec["rendezvous"]["met"] is False and rec["cause"] == "signal", rec


def _records(d, beat, signalled_at=None):
    (d / "status").mkdir(parents=True)
    (d / "workerlog.0").write_text("")
    (d / "status" / "rank0.pid").write_text(json.dumps({"rank": 0, "pid": 2**22 + 12345, "time": 1.0}))
    if beat:
        (d / "status" / "rank0.beat").write_text(json.dumps({"rank": 0, "step": 0, "phase": beat, "time": 1.0}))
    if signalled_at is not None:  # the rank's own record of the SIGTERM that ended it, sent by its launcher
        sig = {"signal": "SIGTERM", "sender_pid": 7, "sender_in_job": True, "time": signalled_at}
        (d / "status" / "rank0.signal.json").write_text(json.dumps(sig))


@pytest.mark.parametrize(
    "beat, signalled_at, explained",
    [("connect", None, True), ("connect", 3.0, True), ("connect", 1.5, False), ("start", None, False)],
)
def test_a_stop_signal_to_ranks_held_at_the_default_group_says_they_never_connected(
    tmp_path, beat, signalled_at, explained
):
    """Rank 0 at heartbeat ``connect`` when the launcher began stopping the job (time 2.0): the record of
    the SIGTERM the launcher's teardown sent it (time 3.0) leaves it held there; one from before (1.5)
    does not, nor a rank still at ``start``."""
    rdv = {"nnodes": 2, "master": "127.0.0.1:1", "rank": 0}
    stopped = {"kind": "signal", "signal": "SIGTERM", "text": "SIGTERM to the launcher (pid 7)", "time": 2.0}
    _records(tmp_path, beat, signalled_at)
    (tmp_path / "job.json").write_text(json.dumps({"started": 1.0}))
    d = diagnose(str(tmp_path), [0], stopped_by=stopped, world_size=2, rendezvous=rdv)
    assert (d.rank, d.cause) == (None, "signal"), d
    said = "1 s after the launch; rank(s) 0 of this node never finished connecting to the job's other ranks"
    assert (said in d.message) == explained and d.message.startswith("stopped by SIGTERM to the launcher"), d
    d1 = diagnose(str(tmp_path), [0], stopped_by=stopped, world_size=2)  # one node: nothing else to wait for
    assert d1.message == "stopped by SIGTERM to the launcher (pid 7)", d1


TRAIN = [sys.executable, "-m", "paddleformers_glm.train", "--model", "toy", "--steps", "1", "--seq-len", "16"]
TRAIN += ["--no-progress", "--dp", "2", "--global-batch-size", "2", "--micro-batch-size", "1"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--rendezvous-timeout", "-1"], "--rendezvous-timeout must be a finite number of seconds >= 0"),
        (["--rendezvous-timeout", "nan"], "--rendezvous-timeout must be a finite number of seconds >= 0"),
        (["--rendezvous-timeout", "inf"], "--rendezvous-timeout must be a finite number of seconds >= 0"),
        (["--nnodes", "1", "--rendezvous-timeout", "60"], "--rendezvous-timeout 60 needs --nnodes N > 1"),
    ],
)
def test_a_rendezvous_timeout_no_run_can_use_is_refused_before_the_launch(tmp_path, capsys, flags, says):
    from paddleformers_glm.train.command import main as train_main

    multi = ["--nnodes", "2", "--master", "127.0.0.1:1", "--node-rank", "0"] if flags[0] != "--nnodes" else []
    assert train_main([*TRAIN[3:], *multi, *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glm52 train: error: ") and says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_limit_is_600_s_unless_given_and_0_is_none():
    import argparse

    from paddleformers_glm.train.command import rendezvous_limit

    def limit(nnodes, given):
        return rendezvous_limit(argparse.Namespace(nnodes=nnodes, rendezvous_timeout=given))

    assert (limit(2, None), limit(2, 0.0), limit(3, 5.0), limit(1, None)) == (600.0, None, 5.0, None)
    assert rendezvous_limit(argparse.Namespace(nnodes=2)) == 600.0  # a caller's namespace without the flag


def test_the_flag_and_its_default_are_in_the_help(capsys):
    from paddleformers_glm.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--rendezvous-timeout RENDEZVOUS_TIMEOUT with --nnodes > 1: stop the job", text), text
    assert "(default: 600, as torchrun's; 0: no limit)" in text, text


@pytest.mark.slow
def test_glm52_train_on_a_node_whose_peers_never_come_exits_124_at_the_limit(tmp_path):
    """The real Paddle launcher, node 0 of two started alone, no ``--job-timeout``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node0 = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--node-rank", "0", "--rendezvous-timeout", "6"]
    t0 = time.monotonic()
    p = subprocess.run([*TRAIN, *node0, "--out", str(tmp_path)], env=env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 124, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert lines[-3].startswith(
        f"glm52 train: no worker of this node started: the 2 nodes never met at the master 127.0.0.1:{port}"
    ), lines
    assert lines[-2] == "(the 2 nodes did not meet within --rendezvous-timeout 6 s; stopped)", lines
    assert took < 60, took


@pytest.mark.slow
def test_a_node_whose_ranks_wait_for_a_node_given_another_nnodes_exits_124_at_the_limit(tmp_path):
    """Node 0 (``--nnodes 2``) starts its worker once node 1 (``--nnodes 3``) joined at the master, and
    that worker waits at the default group for ranks that never come (what it does for a rank of
    another node killed before it got there); node 1 waits for a third node. Both stop at the limit."""
    base = [*TRAIN, "--out", str(tmp_path)]
    two = ["--nnodes", "2", "--rendezvous-timeout", "10"]
    three = ["--nnodes", "3", "--dp", "3", "--global-batch-size", "3", "--rendezvous-timeout", "10"]
    t0 = time.monotonic()
    (rc0, _, err0), (rc1, _, err1) = run_nodes(base, nnodes=2, timeout=180, per_node=[two, three])
    assert time.monotonic() - t0 < 150
    assert (rc0, rc1) == (124, 124), (rc0, err0[-3000:], rc1, err1[-3000:])
    assert "glm52 train: rank(s) 0 of this node never finished connecting to the job's other ranks" in err0, err0
    assert "(the job's ranks did not all connect within --rendezvous-timeout 10 s; stopped)" in err0, err0
    assert "the 3 nodes never met at the master" in err1, err1[-3000:]
