"""Nodes of one job given different commands: another layout of the same world size, another
``--nnodes``.  Measured before, two nodes simulated on this machine: ``--tp 2`` on node 0 and
``--tp 1 --pp 2`` on node 1 both printed nothing for 100 s (their workers waited for each other in
``fleet.init``, which built different groups on each) and a ``--job-timeout`` ended them as "a slow
or hung job"; node 0 at ``--nnodes 2`` beside node 1 at ``--nnodes 3`` printed nothing for 420 s
(its worker waited for a rank 1 that never came) and its timeout said the same."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from paddleformers_glm.train.job_status import TELL_PEERS, diagnose, still_connecting
from paddleformers_glm.train.launch import connecting_line, job_processes
from tests._dist.runner import env, run_nodes

TRAIN = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", "--model", "toy", "--steps", "2"]
TRAIN += ["--seq-len", "16", "--global-batch-size", "2", "--micro-batch-size", "1", "--seed", "7"]


def _nodes(out, per_node: list[list[str]], timeout: float) -> list[tuple[int, str]]:
    """One ``glm52 train`` per entry of ``per_node`` (its own flags, ``--nnodes`` included), as node R
    of one rendezvous on this machine: (status, stdout + stderr) per node."""
    got = run_nodes([*TRAIN, "--out", str(out)], nnodes=len(per_node), timeout=timeout, per_node=per_node)
    return [(rc, stdout + stderr) for rc, stdout, stderr in got]


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
    for r, (rc, text) in enumerate(got):
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
    (rc, text), (rc1, text1) = _nodes(tmp_path, [two, three], timeout=240)
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


def test_only_ranks_all_held_at_the_default_group_count_as_still_connecting():
    """Heartbeat ``connect``: the rank reached the job's default group; ``start`` (imports, the data
    file read before it) is no wait on other ranks, nor ``setup`` (the settings agreed: every rank
    arrived)."""
    at = {"state": "S", "record": None, "beat": [0, "connect"]}
    assert still_connecting(_snap(**{"0": at, "1": at}), [0, 1]) == [0, 1]
    for other in ({**at, "beat": None}, {**at, "beat": [0, "start"]}, {**at, "beat": [0, "setup"]}):
        assert still_connecting(_snap(**{"0": at, "1": other}), [0, 1]) == [], other
    assert still_connecting(_snap(**{"0": at}), [0, 1]) == []  # rank 1 not yet recorded
    assert still_connecting(_snap(**{"0": at, "1": {**at, "record": "error"}}), [0, 1]) == []
    assert still_connecting(_snap(**{"0": at, "1": {**at, "state": "gone"}}), [0, 1]) == []
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
    [
        ({0: (0, "connect"), 1: (0, "connect")}, True),
        ({0: (0, "connect"), 1: None}, False),
        ({0: (0, "start")}, False),
        ({0: (0, "setup")}, False),
    ],
)
def test_a_timed_out_node_whose_ranks_all_wait_at_the_default_group_names_the_connection(tmp_path, beats, connecting):
    rdv = {"nnodes": 2, "master": "127.0.0.1:1", "rank": 0}
    stopped = {"kind": "timeout", "text": "job exceeded --job-timeout 45 s; stopped", "time": 2.0}
    local = sorted(beats)
    _records(tmp_path, beats)
    d = diagnose(str(tmp_path), local, stopped_by=stopped, world_size=4, rendezvous=rdv)
    said = d.message.startswith(f"rank(s) {', '.join(map(str, local))} of this node never finished connecting")
    assert said == connecting, d
    if connecting:
        assert d.cause == "timeout", d
        assert "another --nnodes than 2" in d.message and "slow or hung" not in d.message, d.message
    d1 = diagnose(str(tmp_path), local, stopped_by=stopped, world_size=4)  # one node: nothing to connect to
    assert "never finished connecting" not in d1.message, d1.message


def test_settings_are_compared_at_the_default_group_and_files_read_once_the_groups_exist(tmp_path, monkeypatch):
    """A rank that fails reading its node's files (a resume folder pruned meanwhile, a data file
    too big for its memory) must end its peers in a failed collective, which names the other
    nodes' records within seconds; at the default group nothing notices a rank gone (measured,
    the data read there, rank 1 failing in it: node 0 waited out its --job-timeout of 100 s, told
    that a node had another --nnodes, against 10 s and 'failed in communication' now).  So the
    settings alone are compared there, and the files are read and compared after Fleet's groups."""
    from types import SimpleNamespace

    from paddleformers_glm.train import loop

    calls: list[str] = []

    class Done(Exception):
        pass

    def init_topology(pc, *, agree=None, **kw):
        calls.append("default group")
        agree()
        calls.append("groups")
        return SimpleNamespace(world_size=2, rank=0)

    def gather(text):
        calls.append("files" if "data fingerprint" in text else "settings")
        return [text, text]

    def open_data(*args, **kwargs):
        calls.append("read data")
        return real_open(*args, **kwargs)

    def check_shared_out(cfg, topo):
        raise Done

    real_open = loop.open_data
    monkeypatch.setattr(loop, "launched_world_size", lambda: 2)
    for name, fn in (("init_topology", init_topology), ("gather_settings", gather), ("open_data", open_data)):
        monkeypatch.setattr(loop, name, fn)
    monkeypatch.setattr(loop, "check_shared_out", check_shared_out)
    with pytest.raises(Done):
        loop.run_training(loop.TrainConfig(model="toy", steps=1, seq_len=16, tp=2, out=str(tmp_path), progress=False))
    assert calls == ["default group", "settings", "groups", "read data", "files"], calls


def test_fleets_warning_that_the_default_group_exists_is_dropped_and_only_it():
    """The default group is made before ``fleet.init`` on purpose (the settings are compared on it);
    Fleet then logs 'The dygraph parallel environment has been initialized.' (Paddle 3.3.1,
    fleet.py), which came first on the console of every multi-process run.  Other warnings stay, also
    its look-alike for groups already made (a second ``fleet.init`` keeps the old layout: the only sign)."""
    import logging

    from paddle.distributed.fleet.utils.log_util import logger

    from paddleformers_glm.parallel.topology import _quiet_about_the_default_group

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with _quiet_about_the_default_group():
            logger.warning("The dygraph parallel environment has been initialized.")
            logger.warning("another warning")
            logger.warning("The dygraph hybrid parallel environment has been initialized.")  # groups kept: say so
        logger.warning("The dygraph parallel environment has been initialized.")  # outside: as Paddle logs it
    finally:
        logger.removeHandler(handler)
    hybrid = "The dygraph hybrid parallel environment has been initialized."
    assert seen == ["another warning", hybrid, "The dygraph parallel environment has been initialized."], seen


def test_a_rank_failing_before_the_default_group_tells_the_ranks_waiting_there(tmp_path, monkeypatch):
    """A rank that fails before it reaches the job's default group (its node's --resume step folder
    removed after that node's launcher checked it, its model folder unreadable) left the ranks of
    the other nodes waiting there until --job-timeout (measured: 94 s), told that a node had another
    --nnodes.  It now joins the group, sends its error in place of its settings and raises its own;
    every other rank raises naming it (measured: both nodes exit 1 within 22 s)."""
    from paddleformers_glm.train import loop

    sent: list[str] = []
    joined: list[bool] = []

    def gone(*args, **kwargs):
        raise OSError("/n1/model/config.json: No such file or directory")

    monkeypatch.setattr(loop, "launched_world_size", lambda: 2)
    monkeypatch.setattr(loop, "make_adapter", gone)
    monkeypatch.setattr(loop, "join_default_group", lambda: joined.append(True))
    monkeypatch.setattr(loop, "gather_settings", lambda text: sent.append(text) or [text, text])
    cfg = loop.TrainConfig(model="toy", steps=1, seq_len=16, tp=2, out=str(tmp_path), progress=False)
    with pytest.raises(OSError, match="No such file") as raised:
        loop.run_training(cfg)
    assert joined == [] and sent == []  # nothing waits before the worker has recorded the error
    getattr(raised.value, TELL_PEERS)()  # what the worker then runs (worker.WorkerLife.failed)
    assert joined == [True] and len(sent) == 1, (joined, sent)
    monkeypatch.setattr(loop, "gather_settings", lambda text: [text, sent[0]])  # rank 0's view of the same gather
    with pytest.raises(ValueError) as e:
        loop.check_same_run(cfg, 2)
    assert str(e.value) == (
        "rank 1 failed before the ranks connected: OSError: /n1/model/config.json: No such file or directory"
    ), e.value


def test_a_worker_records_its_error_before_it_tells_the_waiting_ranks(tmp_path):
    """Telling the ranks at the default group needs them all there: a peer killed before it never
    comes, and the telling rank waits.  Its error is recorded (and printed) first, so its launcher
    names it and stops the job; measured when it told first: its node ended at --job-timeout as 'a
    slow or hung job', the error never printed."""
    status = tmp_path / "status"
    status.mkdir()
    script = textwrap.dedent(f"""
        import time
        from paddleformers_glm.train.job_status import TELL_PEERS
        from paddleformers_glm.train.worker import WorkerLife
        life = WorkerLife(1, {str(status)!r})
        e = OSError("/n1/model/config.json: Permission denied")
        setattr(e, TELL_PEERS, lambda: time.sleep(600))  # a peer that never arrives
        try:
            raise e
        except OSError as err:
            life.failed(err)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], env=env(), stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (status / "rank1.error.json").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        rec = json.loads((status / "rank1.error.json").read_text())
        assert (rec["type"], rec["message"]) == ("OSError", "/n1/model/config.json: Permission denied"), rec
        assert p.poll() is None  # still telling
    finally:
        p.kill()
    assert "OSError: /n1/model/config.json: Permission denied" in p.stderr.read()
