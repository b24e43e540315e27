"""What the caller's environment may not decide for a run: the options glm52 gives Paddle's launcher
win over the PADDLE_* variables that launcher would take instead, a run nothing launched is one
process whatever PADDLE_TRAINERS_NUM says, and a job deadline reaches the workers only from
--job-timeout.  A malformed value a worker reads is an error naming the variable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest

from tests._dist.runner import ROOT, env

TOY = ["--model", "toy", "--steps", "1", "--seq-len", "8"]


def _glm52_train(tmp_path, args, timeout=150, **extra_env):
    """``glm52 train args`` in its own process group (all of it killed if it outlives ``timeout``): (exit status, output)."""
    e = {k: v for k, v in env().items() if not k.startswith(("PADDLE_", "GLM52_"))} | extra_env
    cmd = [sys.executable, "-m", "paddleformers_glm.cli", "train", *args]
    p = subprocess.Popen(cmd, env=e, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"glm52 train {' '.join(args)} still running after {timeout} s:\n{out[-3000:]}")
    return p.returncode, out


def test_option_table_is_paddles_own(monkeypatch):
    """Every variable Paddle's launcher takes over an option is listed under that option."""
    import argparse

    from paddle.distributed.launch.context import args_envs

    from paddleformers_glm.train.launch import PADDLE_OPTION_ENVS

    parsers = []

    class Caught(Exception):
        pass

    class Parser(argparse.ArgumentParser):
        def parse_known_args(self, *a, **k):
            parsers.append(self)
            raise Caught

    monkeypatch.setattr(args_envs, "ArgumentParser", Parser)
    with pytest.raises(Caught):
        args_envs.parse_args()
    dest = {opt: a.dest for a in parsers[0]._actions for opt in a.option_strings}
    by_attr = {attr: var for var, (attr, _type) in args_envs.env_args_mapping.items()}
    expected = {opt: (by_attr[d],) for opt, d in dest.items() if d in by_attr}
    expected["--rank"] += ("PADDLE_TRAINER_ID",)  # parse_args: a PADDLE_TRAINER_ID >= 0 replaces --rank
    # the collective_compatible plugin sets nnodes (and master) from the trainers' endpoints
    import inspect

    from paddle.distributed.launch import plugins

    plugin = inspect.getsource(plugins.collective_compatible)
    for var in ("PADDLE_TRAINER_ENDPOINTS", "DISTRIBUTED_TRAINER_ENDPOINTS"):
        assert f"'{var}' in ctx.envs" in plugin and "ctx.args.nnodes = len(hosts)" in plugin
        expected["--nnodes"] += (var,)
    assert PADDLE_OPTION_ENVS == expected


def test_option_overrides_names_the_variables_of_the_options_given():
    from paddleformers_glm.train.launch import option_overrides

    e = {"PADDLE_NNODES": "2", "PADDLE_LOG_DIR": "/x", "PADDLE_DEVICES": "3", "PADDLE_MAX_RESTART": "5"}
    e |= {"PADDLE_MASTER": "h:1", "PADDLE_TRAINER_ID": "1", "PATH": "/bin"}
    got = option_overrides(["-m", "paddle.distributed.launch", "--nnodes", "1", "--log_dir=/o/logs", "--gpus", "0"], e)
    assert got == [
        ("PADDLE_NNODES", "2", "--nnodes", "1"),
        ("PADDLE_LOG_DIR", "/x", "--log_dir", "/o/logs"),
        ("PADDLE_DEVICES", "3", "--gpus", "0"),
    ]  # --master, --rank, --max_restart not given: their variables are not glm52's to drop
    stale = {"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.2:6170"}  # a pod's, left in the environment
    assert option_overrides(["--nnodes", "1"], stale) == [
        ("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.2:6170", "--nnodes", "1")
    ]


def test_launched_job_keeps_its_options_over_paddle_variables(tmp_path):
    """A one-node --dp 2 job with a cluster's PADDLE_NNODES, PADDLE_NPROC_PER_NODE and PADDLE_LOG_DIR:
    the job runs as glm52's options say, each dropped variable named in one line."""
    elsewhere = tmp_path / "elsewhere"
    extra = {"PADDLE_NNODES": "2", "PADDLE_NPROC_PER_NODE": "1", "PADDLE_LOG_DIR": str(elsewhere)}
    rc, out = _glm52_train(
        tmp_path, [*TOY, "--dp", "2", "--global-batch-size", "2", "--out", "out", "--job-timeout", "90"], **extra
    )
    assert rc == 0, out[-3000:]
    for var, value, option in [
        ("PADDLE_NNODES", "2", "--nnodes 1"),
        ("PADDLE_NPROC_PER_NODE", "1", "--nproc_per_node 2"),
    ]:
        assert f"ignoring {var}={value} from the environment: Paddle's launcher is given {option}" in out, out
    assert f"ignoring PADDLE_LOG_DIR={elsewhere} from the environment" in out, out
    logs = tmp_path / "out" / "logs"
    assert (logs / "workerlog.0").is_file() and (logs / "workerlog.1").is_file()
    assert not elsewhere.exists()


def test_launched_job_without_job_timeout_has_no_deadline(tmp_path):
    """A GLM52_JOB_DEADLINE left in the caller's environment (here long past) is not the job's."""
    rc, out = _glm52_train(
        tmp_path, [*TOY, "--dp", "2", "--global-batch-size", "2", "--out", "out"], GLM52_JOB_DEADLINE="1"
    )
    assert rc == 0, out[-3000:]


@pytest.mark.parametrize("value", ["2", "abc"])
def test_one_process_run_is_one_process_whatever_paddle_trainers_num_says(tmp_path, monkeypatch, capsys, value):
    from paddleformers_glm.train.command import main as train_main

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", value)
    assert train_main([*TOY, "--global-batch-size", "1", "--out", str(tmp_path / "out")]) == 0  # progress on
    said = capsys.readouterr().out
    assert f"PADDLE_TRAINERS_NUM={value} in the environment ignored: this run was not launched" in said, said


@pytest.mark.parametrize("value", ["abc", "0", "-2", "2.5"])
def test_launched_world_size_names_a_malformed_value(monkeypatch, value):
    from paddleformers_glm.parallel.topology import ParallelConfig, init_topology

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", value)
    with pytest.raises(ValueError, match=f"^PADDLE_TRAINERS_NUM must be a positive integer .*got '{value}'$"):
        init_topology(ParallelConfig())


@pytest.mark.parametrize(
    ("var", "value"), [("GLM52_JOB_DEADLINE", "abc"), ("GLM52_JOB_DEADLINE", "nan"), ("PADDLE_TRAINERS_NUM", "x2")]
)
def test_worker_records_a_malformed_variable_as_its_error(tmp_path, var, value):
    """A launched worker that reads a malformed value leaves an error record naming it (the launcher's
    diagnosis reads it), not a traceback before any record."""
    from paddleformers_glm.train.settings import TrainConfig

    cfg = TrainConfig(model="toy", steps=1, seq_len=8, global_batch_size=1, out=str(tmp_path / "out"), progress=False)
    run = tmp_path / "run_config.json"
    run.write_text(json.dumps(asdict(cfg)), encoding="utf-8")
    status = tmp_path / "status"
    status.mkdir()
    e = {k: v for k, v in env().items() if not k.startswith(("PADDLE_", "GLM52_"))}
    e |= {"GLM52_STATUS_DIR": str(status), "PADDLE_TRAINER_ID": "0", var: value}
    worker = ROOT / "paddleformers_glm" / "train" / "worker.py"
    p = subprocess.run([sys.executable, str(worker), "--config", str(run)], env=e, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1, p.stderr[-2000:]
    rec = json.loads((status / "rank0.error.json").read_text())
    assert rec["type"] == "ValueError" and f"{var} must be" in rec["message"] and repr(value) in rec["message"], rec


@pytest.mark.parametrize("given, want", [("", "2"), ("  ", "2"), ("3", "3")])
def test_an_empty_thread_count_is_the_default_one_set_per_process(monkeypatch, given, want):
    """An empty OMP_NUM_THREADS (an unset shell variable, exported) reached the workers as it was,
    and OpenMP warned and took its own default, not one thread set per process."""
    from paddleformers_glm.train.launch import worker_env

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert worker_env(2, base={"OMP_NUM_THREADS": given})["OMP_NUM_THREADS"] == want


def test_a_python_caller_under_a_launcher_trains_at_the_launchers_world_size(tmp_path, monkeypatch):
    """``run_training`` called from a user's script that Paddle's launcher started takes the world
    size the launcher set: here 2 ranks for a one-rank layout is refused by name, where taking
    world 1 would have every rank train the whole model as rank 0 into the same --out."""
    from paddleformers_glm.parallel.topology import ParallelConfigError
    from paddleformers_glm.train.loop import run_training
    from paddleformers_glm.train.settings import TrainConfig

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    cfg = TrainConfig(model="toy", steps=1, seq_len=8, global_batch_size=1, out=str(tmp_path / "out"), progress=False)
    with pytest.raises(ParallelConfigError, match="dp 2"):  # the layout at 2 ranks
        run_training(cfg)
