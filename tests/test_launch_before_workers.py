"""A launched job that fails or waits before any worker of this node started: Paddle's launcher
raising (two nodes claiming one node rank, a master port another process holds), nodes that never
meet at the master, and node flags of a one-node job.  Measured before: the launcher's process never
ended (the interpreter's teardown waited on its key-value server's thread), the diagnosis blamed a
rank 0 that never ran and pointed at a workerlog.0 that did not exist, a node waiting for its peers
printed nothing, and ``--nnodes 1 --node-rank 1`` ran the whole job alone and exited 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from paddleformers_glm.train.job_status import diagnose
from tests._dist.runner import env

NO_PID = 2**22 + 12345  # beyond the kernel's pid_max: never a live process

PADDLE_TYPE_ERROR = "TypeError: the JSON object must be str, bytes or bytearray, not NoneType"

# a stand-in for Paddle's launcher: a non-daemon thread (its key-value server's), then an exception
RAISING_LAUNCHER = """
import threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
import json
json.loads(None)
"""

WAITING_LAUNCHER = """
import time
print("LAUNCH INFO waiting for peers", flush=True)
time.sleep(600)
"""

# waits at the rendezvous and, stopped, prints what Paddle's launcher 3.3.1 prints then (measured: a
# node SIGINTed or timed out while it waited alone)
TORN_DOWN_LAUNCHER = """
import signal, sys, time
def down(*_):
    print("LAUNCH WARNING put value failed", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("AssertionError: No container in the pod", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, down)
print("LAUNCH INFO waiting for peers", flush=True)
time.sleep(600)
"""


def _module(tmp_path, name: str, text: str) -> dict[str, str]:
    """``name`` importable from ``tmp_path``: the environment that finds it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path), e["PYTHONPATH"]])
    e.pop("GLM52_LAUNCHER_PID", None)
    return e


def test_lifeline_ends_its_process_when_the_module_raises_beside_a_non_daemon_thread(tmp_path):
    e = _module(tmp_path, "raising_launcher", RAISING_LAUNCHER)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "paddleformers_glm.train.lifeline", "raising_launcher", "--nnodes", "2"]
    p = subprocess.run(cmd, env=e, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert PADDLE_TYPE_ERROR in p.stderr  # the traceback is printed before the process ends
    assert time.monotonic() - t0 < 20


def _launch(
    tmp_path,
    module: str,
    text: str,
    launcher_args: list[str],
    timeout_s: float | None,
    every: float = 30.0,
    rendezvous_s: float | None = None,
):
    """``launch.launch_workers`` in a child process with Paddle's launcher replaced by ``module``
    (``rendezvous_s``: its ``rendezvous_timeout_s``): (its LaunchError as a dict, what it printed,
    the log folder)."""
    e = _module(tmp_path, module, text)
    log_dir = tmp_path / "logs"
    script = textwrap.dedent(f"""
        import json, sys
        from paddleformers_glm.train import launch
        launch.WAITING_EVERY_S = {every!r}
        def command(nproc, log_dir, args):
            return [sys.executable, "-m", "paddleformers_glm.train.lifeline", {module!r}, *args]
        launch.launcher_command = command
        try:
            launch.launch_workers([], 1, {str(log_dir)!r}, launcher_args={launcher_args!r}, timeout_s={timeout_s!r},
                                  rendezvous_timeout_s={rendezvous_s!r}, world_size=2)
        except launch.LaunchError as err:
            print("RESULT " + json.dumps({{"rank": err.rank, "message": err.message, "rc": err.returncode,
                                           "cause": err.cause}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], env=e, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return json.loads(lines[-1][len("RESULT ") :]), p.stdout, log_dir


def test_a_launcher_that_raises_before_any_worker_is_one_line_with_its_exception(tmp_path):
    t0 = time.monotonic()
    err, _, log_dir = _launch(tmp_path, "raising_launcher", RAISING_LAUNCHER, [], timeout_s=None)
    assert time.monotonic() - t0 < 40
    assert err["message"].startswith(f"the launcher failed before any worker started: {PADDLE_TYPE_ERROR}"), err
    assert len(err["message"].splitlines()) == 1 and "workerlog" not in err["message"], err
    assert (err["rank"], err["cause"], err["rc"]) == (None, "launcher", 1), err
    rec = json.loads((log_dir / "failure.json").read_text())
    assert rec["cause"] == "launcher" and rec["rank"] is None and rec["workers_started"] is False, rec
    assert rec["launcher_said"] == PADDLE_TYPE_ERROR, rec
    assert PADDLE_TYPE_ERROR in (log_dir / "launcher.log").read_text()


def test_a_node_waiting_for_the_others_says_so_and_its_timeout_names_the_master(tmp_path):
    master = "127.0.0.1:1"
    options = ["--nnodes", "2", "--master", master, "--rank", "0"]
    err, out, log_dir = _launch(tmp_path, "waiting_launcher", WAITING_LAUNCHER, options, timeout_s=4.5, every=1.0)
    waiting = [ln for ln in out.splitlines() if ln.startswith("[glm52] waiting for the other 1 node(s) to join at")]
    assert len(waiting) >= 2 and master in waiting[0] and "--node-rank 0..1" in waiting[0], out
    assert (err["rank"], err["cause"], err["rc"]) == (None, "timeout", 124), err
    assert f"the 2 nodes never met at the master {master}" in err["message"], err
    assert "no rank reported an error" not in err["message"] and "workerlog" not in err["message"], err
    rec = json.loads((log_dir / "failure.json").read_text())
    assert rec["rendezvous"] == {"nnodes": 2, "master": master, "rank": 0, "met": False}, rec


def test_the_launchers_teardown_traceback_stays_in_its_log_not_on_the_console(tmp_path):
    """A node stopped while it waits at the rendezvous: Paddle's launcher, stopped, prints a
    traceback ending in ``AssertionError: No container in the pod``, which came before the one-line
    reason and read as the cause.  What it prints once the job is being stopped stays in
    launcher.log."""
    options = ["--nnodes", "2", "--master", "127.0.0.1:1", "--rank", "0"]
    err, out, log_dir = _launch(tmp_path, "torn_down_launcher", TORN_DOWN_LAUNCHER, options, timeout_s=3.0)
    assert (err["cause"], err["rc"]) == ("timeout", 124), err
    assert "the 2 nodes never met at the master" in err["message"], err
    assert "No container in the pod" not in out and "Traceback" not in out, out
    assert "AssertionError: No container in the pod" in (log_dir / "launcher.log").read_text()


def _launcher_left(d, said: str) -> None:
    """A log folder as Paddle's launcher leaves it when it fails before starting a worker: its own
    output, no workerlog.N, no status record of any rank."""
    (d / "status").mkdir(parents=True)
    (d / "launcher.log").write_text(
        "LAUNCH INFO job starts\nTraceback (most recent call last):\n"
        '  File "controller.py", line 81, in run\n    self.deploy_pod()\n'
        f"{said}\nException ignored in: <module 'threading'>\n"
    )


def test_no_worker_started_is_the_launchers_failure_not_a_rank_that_died(tmp_path):
    said = "AssertionError: No container in the pod"
    _launcher_left(tmp_path, said)
    from paddleformers_glm.train.job_status import worker_logs

    (tmp_path / "workerlog.0").write_text("an earlier run's worker\n")  # Paddle's launcher appends to it
    before = worker_logs(str(tmp_path))  # as the launcher records them in job.json when the job starts
    (tmp_path / "job.json").write_text(json.dumps({"started": time.time(), "worker_logs_before": before}))
    d = diagnose(str(tmp_path), [0], paddle_launcher=(NO_PID, 1), world_size=2)
    assert (d.rank, d.cause) == (None, "launcher"), d
    assert d.message.startswith(f"the launcher failed before any worker started: {said}"), d.message
    assert str(tmp_path / "launcher.log") in d.message and "workerlog" not in d.message, d.message
    # the same log grown since (this job's worker wrote to it, whatever its file time says): a rank's death
    with open(tmp_path / "workerlog.0", "a") as f:
        f.write("this job's worker\n")
    os.utime(tmp_path / "workerlog.0", (time.time() - 3600, time.time() - 3600))
    d = diagnose(str(tmp_path), [0], paddle_launcher=(NO_PID, 1), world_size=2)
    assert (d.rank, d.cause) == (0, "died"), d


def test_a_timeout_before_any_worker_started_says_the_nodes_never_met(tmp_path):
    _launcher_left(tmp_path, "LAUNCH INFO waiting for peers")
    rdv = {"nnodes": 3, "master": "10.255.255.1:6170", "rank": 1}
    stopped = {"kind": "timeout", "text": "job exceeded --job-timeout 60 s; stopped", "time": 1.0}
    d = diagnose(str(tmp_path), [1], stopped_by=stopped, paddle_launcher=(NO_PID, -15), world_size=3, rendezvous=rdv)
    assert (d.rank, d.cause) == (None, "timeout"), d
    assert "the 3 nodes never met at the master 10.255.255.1:6170 (--nnodes 3" in d.message, d.message
    assert "--node-rank 1" in d.message and "workerlog" not in d.message, d.message


TRAIN = ["--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--tp", "2"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--node-rank", "1"], "--node-rank must be within 0..0 for --nnodes 1, got 1"),
        (["--launcher-args", "--rank 1"], "--node-rank must be within 0..0 for --nnodes 1, got 1"),
        (["--master", "127.0.0.1:1"], "--master 127.0.0.1:1 needs --nnodes N > 1"),
        (["--master", "127.0.0.1:1", "--node-rank", "0"], "--master 127.0.0.1:1 needs --nnodes N > 1"),
    ],
)
def test_node_flags_of_a_one_node_train_are_refused_before_the_launch(tmp_path, capsys, flags, says):
    from paddleformers_glm.train.command import main as train_main

    assert train_main([*TRAIN, "--nnodes", "1", *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glm52 train: error: ") and says in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--node-rank", "1"], "--node-rank must be within 0..0 for --nnodes 1, got 1"),
        (["--master", "127.0.0.1:1"], "--master 127.0.0.1:1 needs --nnodes N > 1"),
    ],
)
def test_node_flags_of_a_one_node_generate_are_refused_before_the_launch(tmp_path, capsys, flags, says):
    from paddleformers_glm.cli import main
    from paddleformers_glm.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    args = ["generate", "--prompt", "Hello", "--max-new-tokens", "2", "--model", tiny, "--tp", "2", "--nnodes", "1"]
    assert main([*args, *flags, "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "logs").exists()


COPYING_LAUNCHER = """
import os, sys, time
print("LAUNCH INFO building the pod", flush=True)
with open(os.path.join(sys.argv[sys.argv.index("--log_dir") + 1] if "--log_dir" in sys.argv else "logs", "workerlog.0"), "w") as f:
    f.write("worker 0 started\\n")
time.sleep(1.5)  # the launcher's poll sees the worker start
for i in range(300):
    print(f"copied worker line {i}", flush=True)  # Paddle's launcher copies workerlog.0 to its output
sys.exit(1)
"""


def test_the_launcher_log_keeps_what_was_said_before_the_workers_not_their_copied_output(tmp_path):
    """Paddle's launcher copies workerlog.0 to its output for the whole run: written to launcher.log
    too, rank 0's log was kept twice, without bound, on every node. The file keeps what the launcher
    said until the workers started (why it failed, when it fails before them)."""
    script = COPYING_LAUNCHER.replace('"logs"', repr(str(tmp_path / "logs")))
    (tmp_path / "logs").mkdir()
    _launch(tmp_path, "copying_launcher", script, [], timeout_s=None)
    text = (tmp_path / "logs" / "launcher.log").read_text()
    assert "LAUNCH INFO building the pod" in text and "the rest is in workerlog" in text, text
    assert "copied worker line 299" not in text and text.count("copied worker line") <= 1, text
