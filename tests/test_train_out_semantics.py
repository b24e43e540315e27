"""What a ``glm52 train`` run leaves in, and says about, its ``--out``: an earlier run's failure
record is moved aside (``logs/failure.prev.json``) so that ``logs/failure.json`` is only ever this
run's; an earlier run's ``export/`` that this run does not replace is named in one warning; a
warm-up at or above the steps its schedule spans is one warning naming the lr the last step trains
at; ``--save-every`` also saves the last step; ``--save-total-limit N`` keeps the newest N step
folders (and the one ``latest`` names)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from paddleformers_glm._io import read_json
from paddleformers_glm.cli import main

TINY = str(Path(__file__).parent / "fixtures" / "tiny" / "checkpoint")
TOY = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "4", "--no-progress", "--lr", "1e-3"]


def _train(out, *more, steps=2):
    return main([*TOY, "--steps", str(steps), *more, "--out", str(out)])


def _warnings(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "warning:" in ln]


def _steps(out) -> list[str]:
    return sorted(n for n in os.listdir(Path(out) / "checkpoints") if n != "latest")


def _latest(out) -> str:
    return (Path(out) / "checkpoints" / "latest").read_text().strip()


# ---------------------------------------------------------------- an earlier run in the same --out
def test_a_later_run_moves_the_earlier_failure_record_aside(tmp_path, capsys):
    """A run that failed left ``logs/failure.json``; the resume into the same OUT succeeded and the
    stale record stayed beside its loss.json. Now it is moved to ``failure.prev.json`` (an older
    .prev replaced) before the run starts, and the run says so."""
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", "--fault", "rank=0,step=2,kind=raise", steps=3) == 1
    record = out / "logs" / "failure.json"
    first = read_json(record, "the failure record")
    assert "injected fault on rank 0 at step 2" in first["message"], first
    capsys.readouterr()
    assert _train(out, "--resume", str(out / "checkpoints"), steps=3) == 0
    said = capsys.readouterr().out
    prev = out / "logs" / "failure.prev.json"
    assert not record.exists() and read_json(prev, "the earlier failure record") == first
    assert f"{record} (an earlier run's failure record) moved to {prev}" in said, said
    # a second failure, then a success: the .prev is the latest earlier record, failure.json none
    assert _train(out, "--fault", "rank=0,step=1,kind=raise", steps=1) == 1
    second = read_json(record, "the failure record")
    assert second["message"] != first["message"] and "step 1" in second["message"]
    assert _train(out, steps=1) == 0
    assert not record.exists() and read_json(prev, "the earlier failure record") == second
    # a failing run's own record is the one failure.json holds
    assert _train(out, "--fault", "rank=0,step=1,kind=raise", steps=1) == 1
    assert read_json(record, "the failure record")["time"] > second["time"]


def test_an_earlier_export_left_in_place_is_named_in_one_warning(tmp_path, capsys):
    """A run without ``--export`` into an OUT holding an earlier run's ``export/`` left that export
    beside its own loss.json without a word; now one warning line names OUT/export (kept as it is)."""
    out = tmp_path / "run"
    assert _train(out, "--export", steps=1) == 0
    exported = {p.name: p.read_bytes() for p in (out / "export").iterdir() if p.is_file()}
    assert exported
    capsys.readouterr()
    assert _train(out, "--seed", "7", steps=1) == 0
    warned = _warnings(capsys.readouterr().out)
    assert len(warned) == 1 and str(out / "export") in warned[0] and "earlier run's" in warned[0], warned
    assert {p.name: p.read_bytes() for p in (out / "export").iterdir() if p.is_file()} == exported
    assert _train(out, "--export", steps=1) == 0  # this run replaces it: nothing to say
    assert _warnings(capsys.readouterr().out) == []


@pytest.mark.slow
def test_a_launched_run_moves_the_failure_record_aside_and_prunes_on_rank_0(tmp_path, capsys):
    """The launched path (``--dp 2``): the earlier failure record is moved aside by the command before
    the launch, the earlier export is named, and ``--save-total-limit`` deletes on rank 0 only (no
    rank fails on a folder another deleted)."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "failure.json").write_text('{"message": "an earlier job"}\n')
    (out / "export").mkdir()
    rc = _train(out, "--dp", "2", "--save-every", "1", "--save-total-limit", "1", steps=3)
    said = capsys.readouterr()
    assert rc == 0, said.err
    assert not (out / "logs" / "failure.json").exists()
    assert json.loads((out / "logs" / "failure.prev.json").read_text()) == {"message": "an earlier job"}
    assert len(_warnings(said.out)) == 1 and str(out / "export") in _warnings(said.out)[0], said.out
    assert _steps(out) == ["step_00000003"] and _latest(out) == "step_00000003"


# ---------------------------------------------------------------- the learning-rate schedule
@pytest.mark.parametrize("warmup, last", [(4, "lr 0.001 (the peak, --lr)"), (6, "lr 0.0006667 (4/6 of --lr 0.001)")])
def test_a_warmup_not_shorter_than_the_run_is_one_warning_naming_the_last_lr(tmp_path, capsys, warmup, last):
    """``--warmup-steps`` >= ``--steps`` was taken silently: the lr never decays (warm-up = steps:
    the last step trains at the peak; above: at a fraction of it)."""
    out = tmp_path / "run"
    assert _train(out, "--warmup-steps", str(warmup), steps=4) == 0
    warned = _warnings(capsys.readouterr().out)
    assert len(warned) == 1, warned
    assert f"--warmup-steps {warmup} >= --steps 4" in warned[0] and last in warned[0], warned
    assert "never decays to --min-lr 0.0001" in warned[0], warned
    lrs = json.loads((out / "loss.json").read_text())["lrs"]
    assert f"lr {lrs[-1]:.4g} " in warned[0], (lrs, warned)
    assert _train(tmp_path / "short", "--warmup-steps", "3", steps=4) == 0  # it decays at the last step
    assert _warnings(capsys.readouterr().out) == []


def test_the_warmup_warning_counts_the_steps_of_the_indexer_stage(tmp_path, capsys):
    """A resume into another indexer stage restarts the lr schedule at the resumed step, with the
    same ``--warmup-steps``: the warning counts the stage's steps, and names the lr its last step trains at."""
    base = ["train", "--model", TINY, "--seq-len", "16", "--global-batch-size", "2", "--no-progress", "--lr", "1e-3"]
    warm = tmp_path / "warm"
    args = ["--indexer-stage", "warmup", "--warmup-steps", "2", "--save-every", "2"]
    assert main([*base, *args, "--steps", "4", "--out", str(warm)]) == 0
    assert _warnings(capsys.readouterr().out) == []  # 2 < 4: it decays
    state = str(warm / "checkpoints" / "step_00000002")
    more = ["--indexer-stage", "sparse", "--indexer-loss-coeff", "0.01", "--warmup-steps", "2", "--resume", state]
    assert main([*base, *more, "--steps", "4", "--out", str(tmp_path / "sparse")]) == 0
    warned = _warnings(capsys.readouterr().out)
    assert len(warned) == 1, warned
    assert "--warmup-steps 2 >= --steps 4 (this indexer stage's schedule starts at step 2: 2 steps)" in warned[0]
    lrs = json.loads((tmp_path / "sparse" / "loss.json").read_text())["lrs"]
    assert f"lr {lrs[-1]:.4g} (the peak, --lr)" in warned[0] and lrs[-1] == pytest.approx(1e-3), (lrs, warned)


def test_the_warmup_warning_names_the_schedules_last_lr():
    """The lr the warning names is the one the schedule gives the last step (train/optim.py), a
    stage's span counted from its start (settings.lr_schedule_start)."""
    from paddleformers_glm.train.optim import lr_at
    from paddleformers_glm.train.settings import TrainConfig, lr_schedule_start, warmup_warning

    for steps, warmup, start in [(4, 4, 0), (4, 6, 0), (10, 1000, 0), (8, 5, 3), (8, 6, 3)]:
        cfg = TrainConfig(model="toy", steps=steps, warmup_steps=warmup, lr=3e-4)
        line = warmup_warning(cfg, start)
        last = lr_at(steps - start, 3e-4, 3e-5, warmup, steps - start)
        assert line is not None and f"lr {last:.4g} " in line, (steps, warmup, start, line, last)
    assert warmup_warning(TrainConfig(model="toy", steps=8, warmup_steps=4), 3) is None  # 4 < 5 steps
    assert warmup_warning(TrainConfig(model="toy", steps=4, warmup_steps=4), 0, first_step=4) is None  # trains none
    meta = {"step": 6, "indexer": {"stage": "warmup", "stage_start": 2}}
    assert lr_schedule_start(meta, "warmup") == 2 and lr_schedule_start(meta, "sparse") == 6
    assert lr_schedule_start({"step": 6}, None) == 0 and lr_schedule_start(None, "sparse") == 0


# ---------------------------------------------------------------- checkpoints
def test_save_every_also_saves_the_last_step(tmp_path, capsys):
    """``--steps 5 --save-every 2`` saved steps 2 and 4: the trained step-5 state was lost, and a run
    extended from OUT redid step 5. Now the last step is saved too, and an extension continues from it."""
    out = tmp_path / "run"
    assert _train(out, "--save-every", "2", steps=5) == 0
    assert _steps(out) == ["step_00000002", "step_00000004", "step_00000005"] and _latest(out) == "step_00000005"
    more = ["--resume", str(out / "checkpoints"), "--resume-override", "steps"]
    assert _train(tmp_path / "more", *more, steps=6) == 0
    got = json.loads((tmp_path / "more" / "loss.json").read_text())
    assert got["run"]["resumed_from_step"] == 5 and len(got["losses"]) == 6
    assert got["losses"][:5] == json.loads((out / "loss.json").read_text())["losses"]
    assert _train(tmp_path / "none", steps=3) == 0 and not (tmp_path / "none" / "checkpoints").exists()


def test_save_total_limit_keeps_the_newest_saves(tmp_path, capsys):
    """``--save-total-limit N`` (HF TrainingArguments' name): after each save the oldest step folders
    beyond N are deleted; the kept ones resume as before. Every save was kept before (no such flag)."""
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", "--save-total-limit", "2", steps=5) == 0
    said = capsys.readouterr().out
    assert _steps(out) == ["step_00000004", "step_00000005"] and _latest(out) == "step_00000005"
    for n in (1, 2, 3):
        assert f"deleting checkpoint step_{n:08d} (--save-total-limit 2)" in said, said
    assert _train(tmp_path / "back", "--resume", str(out / "checkpoints" / "step_00000004"), steps=5) == 0


def test_save_total_limit_deletes_off_the_training_thread(tmp_path, capsys, monkeypatch):
    """Every rank waits for rank 0 at the next collective, and at scale a save is the whole optimizer
    state: the folders beyond the limit are renamed in the loop and deleted by a thread of their
    own, waited for by the next save and the run's end (nothing is left at the end)."""
    real, where = shutil.rmtree, {}

    def rmtree(path, *a, **kw):
        if str(path).endswith(".tmp") and os.path.isdir(path):
            where[os.path.basename(str(path))] = threading.current_thread().name
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", "--save-total-limit", "1", steps=3) == 0
    capsys.readouterr()
    assert where == {f"step_{n:08d}.tmp": "glm52-prune-saves" for n in (1, 2)}, where
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_00000003"]


def test_a_failing_run_finishes_the_deletes_it_announced(tmp_path, capsys, monkeypatch):
    """A run that fails after a --save-total-limit delete started waits for it (60 s at most) before
    it reports: the folder the log named as deleting is gone, not a half-deleted step_N.tmp."""
    real = shutil.rmtree

    def slow(path, *a, **kw):
        if str(path).endswith(".tmp") and os.path.isdir(path):
            time.sleep(1.0)
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", slow)
    out = tmp_path / "run"
    rc = _train(out, "--save-every", "1", "--save-total-limit", "1", "--fault", "rank=0,step=3,kind=raise", steps=5)
    assert rc == 1 and "deleting checkpoint step_00000001" in capsys.readouterr().out
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_00000002"]


def test_save_total_limit_leaves_a_link_named_like_a_save_alone(tmp_path, capsys):
    """A link in ``checkpoints/`` named like a save (a user's pointer to a state kept elsewhere) is not
    one of the run's saves: it is neither deleted nor counted. It was renamed to ``step_N.tmp``, its
    delete then failed with a warning naming a path that was gone, and the link stayed so named."""
    out, elsewhere = tmp_path / "run", tmp_path / "kept_elsewhere"
    elsewhere.mkdir()
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_00000009").symlink_to(elsewhere, target_is_directory=True)
    assert _train(out, "--save-every", "1", "--save-total-limit", "1", steps=2) == 0
    said = capsys.readouterr().out
    assert _steps(out) == ["step_00000002", "step_00000009"] and elsewhere.is_dir()
    assert (out / "checkpoints" / "step_00000009").is_symlink() and "cannot delete" not in said, said


def test_save_total_limit_never_deletes_the_state_latest_names_and_may_change_on_resume(tmp_path, capsys):
    """A run resumed from step 2 into its own OUT saves step 3 while the first run's steps 4-6 are
    still there: ``latest`` names step 3, which is kept although not among the newest by number.
    ``--save-total-limit`` is not a setting a resume must keep (like ``--save-every``)."""
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", steps=6) == 0
    (out / "checkpoints" / "step_notes").mkdir()  # not a step folder: never touched
    resume = ["--resume", str(out / "checkpoints" / "step_00000002"), "--resume-override", "steps"]
    assert _train(out, *resume, "--save-every", "1", "--save-total-limit", "2", steps=3) == 0
    assert _latest(out) == "step_00000003"
    assert _steps(out) == ["step_00000003", "step_00000006", "step_notes"]


def test_a_failed_delete_warns_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """A step folder that cannot be deleted is one warning naming it and the limit; the run goes on,
    and what the failed delete left (``step_N.tmp``) goes with the next save's sweep."""
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, *a, **kw):
        if str(path).endswith("step_00000001.tmp") and not ignore_errors:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, ignore_errors, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", "--save-total-limit", "1", steps=3) == 0
    warned = _warnings(capsys.readouterr().out)  # the background delete's, logged before the run ends
    assert len(warned) == 1, warned
    assert "--save-total-limit 1: cannot delete step_00000001" in warned[0], warned
    assert str(out / "checkpoints" / "step_00000001.tmp") in warned[0] and "Permission denied" in warned[0]
    assert _steps(out) == ["step_00000003"] and _latest(out) == "step_00000003"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--save-every", "1", "--save-total-limit", "-1"], "--save-total-limit must be >= 0, got -1"),
        (["--save-total-limit", "2"], "--save-total-limit 2 keeps the newest checkpoints of --save-every"),
    ],
)
def test_save_total_limit_is_checked_before_the_run_and_by_plan(tmp_path, capsys, flags, words):
    """A negative limit, or a limit without saves, is one line and exit 2 with nothing left behind;
    ``glm52 plan`` given the train line refuses it in the same words."""
    from paddleformers_glm.train.command import train_line_error

    out = tmp_path / "run"
    assert _train(out, *flags, steps=2) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"glm52 train: error: {words}") and not out.exists(), err
    assert words in (train_line_error(["--model", "toy", *flags]) or "")
    rc = main(["plan", "--model", TINY, *flags])
    assert rc == 2 and words in capsys.readouterr().err


def test_saves_of_an_earlier_run_this_run_does_not_continue_are_named(tmp_path, capsys):
    """A fresh run into an OUT holding an earlier run's saves said nothing: its saves replaced those
    of their steps and the earlier run's later ones stayed beside them (a resume from such a folder
    continues the earlier run). Now one warning names them; a resume that continues the newest save
    in OUT says nothing, one that resumes an earlier step names the saves after it."""
    out = tmp_path / "run"
    assert _train(out, "--save-every", "1", steps=4) == 0
    capsys.readouterr()
    assert _train(out, "--save-every", "1", "--seed", "7", steps=2) == 0
    warned = _warnings(capsys.readouterr().out)
    ckpt = out / "checkpoints"
    assert (
        len(warned) == 1
        and f"{ckpt} holds 4 save(s) of an earlier run (at steps 1, 2, 3, 4) that this run does not continue: a save"
        in warned[0]
    ), warned
    assert _steps(out) == [f"step_{s:08d}" for s in (1, 2, 3, 4)] and _latest(out) == "step_00000002"
    newest = ["--resume", str(ckpt / "step_00000004"), "--resume-override", "steps"]  # the first run's
    assert _train(out, *newest, steps=5) == 0
    assert _warnings(capsys.readouterr().out) == []
    earlier = ["--resume", str(ckpt / "step_00000002"), "--resume-override", "steps", "--seed", "7"]
    assert _train(out, *earlier, steps=3) == 0
    warned = _warnings(capsys.readouterr().out)
    assert (
        len(warned) == 1
        and "holds 2 save(s) of an earlier run (at steps 3, 4) that this run does not continue" in warned[0]
    ), warned
