"""Nodes of one job given different commands: another layout of the same world size, another
``--nnodes``.  Measured before, two nodes simulated on this machine: ``--tp 2`` on node 0 and
``--tp 1 --pp 2`` on node 1 both printed nothing for 100 s (their workers waited for each other in
``fleet.init``, which built different groups on each) and a ``--job-timeout`` ended them as "a slow
or hung job"; node 0 at ``--nnodes 2`` beside node 1 at ``--nnodes 3`` printed nothing for 420 s
(its worker waited for a rank 1 that never came) and its timeout said the same."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from paddleformers_glm.train.job_status import diagnose, still_connecting
from paddleformers_glm.train.launch import connecting_line, job_processes
from tests._dist.runner import env

TRAIN = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", "--model", "toy", "--steps", "2"]
TRAIN += ["--seq-len", "16", "--global-batch-size", "2", "--micro-batch-size", "1", "--seed", "7"]


def _nodes(out, per_node: list[list[str]], timeout: float) -> list[tuple[int, str, float]]:
    """One ``glm52 train`` per entry of ``per_node`` (its own flags, ``--nnodes`` included), as
    node R of one rendezvous on this machine: (status, stdout + stderr, seconds to end) per node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [*TRAIN, *flags, "--out", str(out), "--master", f"127.0.0.1:{port}", "--node-rank", str(r)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, flags in enumerate(per_node)
    ]
    got = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            got.append((p.returncode, text, time.monotonic() - t0))
    finally:
        for p in procs:
            p.kill()
    return got


def _no_process_left(out, node: int) -> None:
    job = json.loads((out / "logs" / f"node{node}" / "job.json").read_text())["job_id"]
    t0 = time.monotonic()
    while job_processes(job) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert job_processes(job) == [], f"node {node}: processes of the job still running"


@pytest.mark.slow
def test_nodes_given_different_layouts_fail_naming_them_instead_of_waiting_forever(tmp_path):
    """Every rank compares its settings with rank 0's on the job's default group before Fleet builds
    its sub-groups: both nodes end with status 1, naming the layouts."""
    got = _nodes(tmp_path, [["--nnodes", "2", "--tp", "2"], ["--nnodes", "2", "--tp", "1", "--pp", "2"]], timeout=240)
    for r, (rc, text, _) in enumerate(got):
        assert rc == 1, f"node {r} rc {rc}:\n{text[-3000:]}"
        assert (
            "the ranks of this job were given different runs (pp: 1 on rank 0, 2 on rank 1; tp: 2 on rank 0, 1 on rank 1)"
            in text
        ), text[-3000:]
        _no_process_left(tmp_path, r)


@pytest.mark.slow
def test_a_node_given_another_nnodes_says_its_ranks_wait_to_connect_and_its_timeout_names_it(tmp_path):
    """Paddle's rendezvous lets the ``--nnodes 2`` node start its worker once the ``--nnodes 3`` node
    joined; that worker then waits for a rank 1 that never starts.  The node now says so every 30 s
    and its ``--job-timeout`` names the ranks that never connected instead of a slow job."""
    two = ["--nnodes", "2", "--tp", "2", "--job-timeout", "45"]
    three = ["--nnodes", "3", "--tp", "1", "--dp", "3", "--global-batch-size", "6", "--job-timeout", "45"]
    (rc, text, _), (rc1, text1, _) = _nodes(tmp_path, [two, three], timeout=240)
    assert rc == 124 and rc1 == 124, (rc, text[-2000:], rc1, text1[-2000:])
    waiting = [ln for ln in text.splitlines() if ln.startswith("[glm52] rank(s) 0 of this node still wait for")]
    assert waiting and "another --nnodes than 2" in waiting[0], text[-3000:]
    assert "glm52 train: rank(s) 0 of this node never finished connecting to the job's other ranks" in text, text
    assert "a slow or hung job" not in text, text
    assert "the 3 nodes never met at the master" in text1, text1[-3000:]  # the other node's own account
    for r in (0, 1):
        _no_process_left(tmp_path, r)


def _snap(**ranks):
    return {"ranks": {str(r): s for r, s in ranks.items()}}


def test_only_ranks_all_held_at_their_first_heartbeat_count_as_still_connecting():
    start = {"state": "S", "record": None, "beat": [0, "start"]}
    assert still_connecting(_snap(**{"0": start, "1": {**start, "beat": None}}), [0, 1]) == [0, 1]
    assert still_connecting(_snap(**{"0": start}), [0, 1]) == [0, 1]  # rank 1 not yet recorded
    assert still_connecting(_snap(**{"0": start, "1": {**start, "beat": [0, "setup"]}}), [0, 1]) == []
    assert still_connecting(_snap(**{"0": start, "1": {**start, "record": "error"}}), [0, 1]) == []
    assert still_connecting(_snap(**{"0": start, "1": {**start, "state": "gone"}}), [0, 1]) == []
    line = connecting_line({"nnodes": 4, "master": "m:1", "rank": 2}, [4, 5], 61.2)
    assert line.startswith("[glm52] rank(s) 4, 5 of this node still wait for the job's other ranks to connect (61 s")
    assert "another --nnodes than 4" in line


def _records(d, beats):
    (d / "status").mkdir(parents=True)
    (d / "workerlog.0").write_text("")
    for r, b in beats.items():
        (d / "status" / f"rank{r}.pid").write_text(json.dumps({"rank": r, "pid": 2**22 + 12345, "time": 1.0}))
        if b is not None:
            beat = {"rank": r, "pid": 2**22 + 12345, "step": b[0], "phase": b[1], "time": 1.0}
            (d / "status" / f"rank{r}.beat").write_text(json.dumps(beat))


@pytest.mark.parametrize(
    ("beats", "connecting"),
    [({0: (0, "start"), 1: (0, "start")}, True), ({0: (0, "start"), 1: None}, True), ({0: (0, "setup")}, False)],
)
def test_a_timed_out_node_whose_ranks_never_left_their_start_names_the_connection(tmp_path, beats, connecting):
    rdv = {"nnodes": 2, "master": "127.0.0.1:1", "rank": 0}
    stopped = {"kind": "timeout", "text": "job exceeded --job-timeout 45 s; stopped", "time": 2.0}
    local = sorted(beats)
    _records(tmp_path, beats)
    d = diagnose(str(tmp_path), local, stopped_by=stopped, world_size=4, rendezvous=rdv)
    said = d.message.startswith(f"rank(s) {', '.join(map(str, local))} of this node never finished connecting")
    assert said == connecting and d.cause == "timeout", d
    if connecting:
        assert "another --nnodes than 2" in d.message and "slow or hung" not in d.message, d.message
    d1 = diagnose(str(tmp_path), local, stopped_by=stopped, world_size=4)  # one node: nothing to connect to
    assert "never finished connecting" not in d1.message, d1.message
