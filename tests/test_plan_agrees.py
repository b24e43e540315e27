"""``glm52 plan`` and ``glm52 train`` refuse the same runs with the same words: a grid of command
lines (layout and run settings, two checkpoints: the indexer's loss weighted or not) goes through
each command's own argument parsing and checks (plan: ``layout_from_args`` + ``check_layout``;
train: ``command.check_args``, all it checks before launching that reads no file but the config).
No process, no model: only the checks.  Both call ``settings.check_run``; this pins that they keep to it
(plan once accepted ``--indexer-stage sparse`` on a checkpoint whose ``indexer_loss_coeff`` is 0,
``--cp`` with ``--moe-aux-loss-coeff`` and the warm-up with ``--moe-bias-update-rate``, which the
trainer refuses, and had no flag for any of those settings)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random

import pytest

from paddleformers_glm.configuration import GlmMoeDsaConfig
from paddleformers_glm.train import plan as planmod
from paddleformers_glm.train.command import add_train_arguments, check_args

from .conftest import TINY_CONFIG

_GRID = {
    "--tp": ["1", "1", "2", "2", "4", "4", "8"],
    "--pp": ["1", "1", "2", "3"],
    "--dp": ["1", "2"],
    "--sharding": ["1", "1", "2"],
    "--sharding-stage": ["1", "2"],
    "--cp": ["1", "1", "2"],
    "--ep": ["1", "1", "2", "4"],
    "--etp": ["1", "1", "1", "2"],
    "--sp": [False, True],
    "--vpp": ["1", "1", "1", "2"],
    "--first-stage-layers": [None, None, "1", "3"],
    "--seq-len": ["32", "48", "64"],
    "--global-batch-size": ["4", "8", "8", "2", "1"],
    "--micro-batch-size": ["1", "1", "2"],
    "--recompute": ["none", "core", "full"],
    "--dtype": ["float32", "bfloat16"],
    "--indexer-stage": [None, None, "none", "warmup", "sparse"],
    "--indexer-loss-coeff": [None, None, None, "0", "0.01"],
    "--indexer-shared-supervision": [False, False, True],
    "--moe-bias-update-rate": ["0", "0", "0.001"],
    "--moe-aux-loss-coeff": ["0", "0", "0.0001"],
}
# glm52 train flags plan does not have (a train line's): not planned, checked as the trainer does;
# one of them on a third of the lines
_TRAIN_ONLY = {
    "--steps": ["3", "0"],
    "--lr": ["1e-3", "nan", "-1"],
    "--skip-nonfinite-steps": ["2", "-1"],
    "--nnodes": ["2", "3"],
    "--comm-timeout": ["0.0001", "inf", "30"],
    "--job-timeout": ["60", "0"],
    "--dump-step": [["d", "2"], ["d", "9"], ["d", "x"]],  # with --steps 5 (the default)
    "--save-total-limit": ["2", "-1"],  # without --save-every: refused by both
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny config with the indexer's KL weighted (sparse by default) and not (none by default)."""
    out = {}
    for coeff in (0.0, 0.001):
        d = tmp_path_factory.mktemp(f"coeff{coeff}")
        c = json.loads(TINY_CONFIG.read_text()) | {"indexer_loss_coeff": coeff}
        (d / "config.json").write_text(json.dumps(c))
        out[coeff] = (str(d), GlmMoeDsaConfig.from_pretrained(str(d)))
    return out


def _line(rng: random.Random) -> list[str]:
    """A random command line of the grid; --sp, --vpp and the first stage's size mostly where a
    tensor / pipeline split makes them valid, so that a fair share of the lines is accepted."""
    pick = {flag: rng.choice(values) for flag, values in _GRID.items()}
    if rng.random() < 0.9:
        pick["--sp"] = pick["--sp"] and pick["--tp"] != "1"
        pick["--vpp"] = pick["--vpp"] if pick["--pp"] != "1" else "1"
        pick["--first-stage-layers"] = pick["--first-stage-layers"] if pick["--pp"] != "1" else None
    if rng.random() < 1 / 3:
        flag = rng.choice(sorted(_TRAIN_ONLY))
        pick[flag] = rng.choice(_TRAIN_ONLY[flag])
    flags = []
    for flag, v in pick.items():
        if v is True:
            flags.append(flag)
        elif isinstance(v, list):
            flags += [flag, *v]
        elif v not in (None, False):
            flags += [flag, v]
    return flags


def _plan_parser() -> argparse.ArgumentParser:
    from paddleformers_glm.cli import build_parser

    return build_parser()


def _verdicts(model: tuple[str, object], flags: list[str], tmp: str) -> tuple[str | None, str | None]:
    """(train's refusal or None, plan's refusal or None) of one command line."""
    model_dir, config = model
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(["--model", model_dir, "--out", tmp, *flags])
    try:
        check_args(args)
        train = None
    except ValueError as e:  # ParallelConfigError too
        train = f"{type(e).__name__}: {e}"
    pargs = _plan_parser().parse_args(["plan", "--model", model_dir, *flags])
    with contextlib.redirect_stderr(io.StringIO()):
        planmod._train_line_note(pargs)
    try:
        planmod.check_layout(config, planmod.layout_from_args(pargs))
        plan = None
    except ValueError as e:
        plan = f"{type(e).__name__}: {e}"
    return train, plan


def test_plan_and_train_refuse_the_same_lines_with_the_same_message(models, tmp_path):
    rng = random.Random(20261203)
    refused, accepted, kinds = 0, 0, set()
    for i in range(400):
        coeff = rng.choice(sorted(models))
        flags = _line(rng)
        train, plan = _verdicts(models[coeff], flags, str(tmp_path))
        assert train == plan, (i, coeff, " ".join(flags))
        if train is None:
            accepted += 1
        else:
            refused += 1
            kinds.add(train.split(":")[1].split()[0])
    # the grid reaches both verdicts and many different refusals
    assert accepted >= 20 and refused >= 100, (accepted, refused)
    assert len(kinds) >= 6, kinds


@pytest.mark.parametrize(
    "coeff, flags, words",
    [
        (0.0, ["--indexer-stage", "sparse"], "--indexer-stage sparse needs --indexer-loss-coeff > 0"),
        (0.001, ["--cp", "2", "--moe-aux-loss-coeff", "0.01"], "--cp with --moe-aux-loss-coeff > 0"),
        (0.0, ["--indexer-stage", "warmup", "--moe-bias-update-rate", "0.001"], "--moe-bias-update-rate and"),
        (0.0, ["--indexer-stage", "warmup", "--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff must be 0"),
        (0.0, ["--indexer-shared-supervision"], "shared-layer supervision needs an indexer stage"),
        (0.001, ["--indexer-stage", "warmup", "--indexer-loss-coeff", "0.1"], "--indexer-loss-coeff weighs"),
        (0.001, ["--pp", "2", "--first-stage-layers", "3", "--indexer-shared-supervision"], "starts on shared layer 3"),
        (0.001, ["--seq-len", "0"], "--seq-len must be >= 1"),
        # a train line's flags plan does not plan: checked all the same
        (0.001, ["--lr", "nan"], "--lr must be a finite number, got nan"),
        (0.001, ["--tp", "2", "--nnodes", "3"], "world size 2 is not divisible by --nnodes 3"),
        (0.001, ["--comm-timeout", "0.0001"], "--comm-timeout must be at least 0.001 s"),
        (0.001, ["--steps", "3", "--dump-step", "d", "4"], "K must be within 1..--steps (3)"),
        # the step-2 dump replaced the step-1 dump in d, exit 0 (measured: d's weights hashed as step 2's)
        (
            0.001,
            ["--steps", "3", "--dump-step", "d", "1", "--dump-step", "d", "2"],
            "d already takes the dump of step 1",
        ),
    ],
)
def test_plan_refuses_what_train_refuses_before_launch(models, tmp_path, capsys, coeff, flags, words):
    """Each refusal the trainer made alone (the plan said the layout fits), now the plan's too,
    through ``glm52 plan`` itself (exit 2, the trainer's words)."""
    from paddleformers_glm.cli import main as cli_main

    model_dir = models[coeff][0]
    base = ["--seq-len", "64", "--global-batch-size", "4", "--dtype", "float32"]
    train, plan = _verdicts(models[coeff], [*base, *flags], str(tmp_path))
    assert train is not None and words in train and train == plan
    assert cli_main(["plan", "--model", model_dir, *base, *flags]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("glm52 plan: error: ")]
    assert len(err) == 1 and words in err[0], err


def test_plan_takes_the_run_settings_of_a_train_line(models, tmp_path):
    """The settings that decide a refusal are plan's own flags (train's names, defaults and help), not
    train-only flags it ignores with a note."""
    pargs = _plan_parser().parse_args(
        ["plan", "--model", models[0.0][0], "--moe-aux-loss-coeff", "0.01", "--moe-bias-update-rate", "0.001"]
        + ["--indexer-loss-coeff", "0.1", "--indexer-shared-supervision"]
    )
    lay = planmod.layout_from_args(pargs)
    assert (lay.moe_aux_loss_coeff, lay.moe_bias_update_rate, lay.indexer_loss_coeff) == (0.01, 0.001, 0.1)
    assert lay.indexer_shared_supervision is True
    assert not any(k.startswith("train_only_moe") or k.startswith("train_only_indexer") for k in vars(pargs))


def test_plan_of_a_resumed_train_line_plans_the_saved_runs_indexer_stage(models, tmp_path):
    """glm52 train gives an unset --indexer-stage the resumed run's stage (settings.check_resume_run);
    plan ignored --resume and sized the checkpoint's default instead.  Measured before, a state saved
    in the warm-up on the tiny checkpoint whose default is sparse (--seq-len 64 --global-batch-size 4
    --dtype float32): plan's rank total 19,998,792 bytes (grads 3,247,680, optimizer 6,497,224), the
    sparse stage's, for the 5,145,312 (238,592, 477,344) of the warm-up train runs.  Now both take
    the stage from the state's meta.json (settings.resumed_indexer_stage)."""
    from paddleformers_glm.train.state_files import FORMAT

    model_dir, config = models[0.001]
    step = tmp_path / "ckpt" / "step_00000004"
    step.mkdir(parents=True)
    meta = {
        "format": FORMAT, "step": 4, "world_size": 1, "profile": {}, "flex": {"stepped": []},
        "indexer": {"stage": "warmup", "stage_start": 0, "stages": []},
    }  # fmt: skip
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "latest").write_text("step_00000004\n")
    base = ["--seq-len", "64", "--global-batch-size", "4", "--dtype", "float32", "--steps", "8"]

    def plan_of(flags):
        pargs = _plan_parser().parse_args(["plan", "--model", model_dir, *base, *flags])
        with contextlib.redirect_stderr(io.StringIO()):
            planmod._train_line_note(pargs)
        lay = planmod.layout_from_args(pargs)
        return lay, planmod.plan_layout(config, lay)

    # what train runs: check_args resolves the stage from the same meta.json
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", model_dir, "--out", str(tmp_path / "o"), *base, "--resume", str(tmp_path / "ckpt")]
    )
    assert check_args(args)[0].indexer_stage == "warmup"
    lay, resumed = plan_of(["--resume", str(tmp_path / "ckpt")])
    assert lay.indexer_stage == "warmup"
    _, warmup = plan_of(["--indexer-stage", "warmup"])
    _, sparse = plan_of([])
    assert resumed["kinds"] == warmup["kinds"] != sparse["kinds"]
    # a stage given on the line is the run's, as train's
    lay, _ = plan_of(["--resume", str(tmp_path / "ckpt"), "--indexer-stage", "sparse"])
    assert lay.indexer_stage == "sparse"
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", model_dir, "--out", str(tmp_path / "o"), *base, "--resume", str(tmp_path / "ckpt")]
        + ["--indexer-stage", "sparse"]
    )
    assert check_args(args)[0].indexer_stage == "sparse"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--rendezvous-timeout", "5"], "--rendezvous-timeout 5 needs --nnodes N > 1"),
        (
            ["--tp", "2", "--nnodes", "2", "--master", "127.0.0.1:1", "--node-rank", "0", "--rendezvous-timeout", "-3"],
            "--rendezvous-timeout must be a finite number of seconds >= 0",
        ),
    ],
)
def test_plan_checks_a_train_lines_nodes_as_train_does(models, tmp_path, capsys, flags, words):
    """The rendezvous flags of a train line (checked after the layout, before a launch): ``glm52 plan``
    refuses what ``glm52 train`` refuses, in its words. Measured before: plan exited 0 on both lines."""
    from paddleformers_glm.cli import main as cli_main

    model_dir = models[0.001][0]
    base = ["--model", model_dir, "--seq-len", "64", "--global-batch-size", "4", *flags]
    assert cli_main(["train", *base, "--out", str(tmp_path / "o")]) == 2
    train = capsys.readouterr().err.strip().splitlines()[-1]
    assert cli_main(["plan", *base]) == 2
    plan = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("glm52 plan: error: ")]
    assert words in train and len(plan) == 1 and words in plan[0], (train, plan)
