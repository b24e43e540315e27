"""``--resume ROOT`` of a checkpoint root another run is still saving into (``--save-every`` with
``--save-total-limit``): ROOT's ``latest`` is followed once, by the process that starts the run, and
every later check and the training itself read that step folder, even when ``latest`` has moved on
in between; the step folder it chose, when pruned while it is read (renamed ``step_N.tmp``, then
deleted), is said to be removed while being read, not blamed for missing files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.train import command, loop, state_files

TOY = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "1", "--no-progress", "--lr", "1e-3"]
STEP1, STEP2 = "step_00000001", "step_00000002"


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory) -> Path:
    """A checkpoint root with two complete saves (steps 1 and 2); ``latest`` names step 2."""
    out = tmp_path_factory.mktemp("writer") / "w"
    assert main([*TOY, "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == STEP2 and (root / STEP1 / "meta.json").is_file()
    return root


def _copy(root: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(root, dest, symlinks=True)
    return dest


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "ccache" not in ln]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_run_resumes_the_step_the_launcher_checked_when_latest_moves_on(saved_root, tmp_path, capsys, monkeypatch):
    """Before: the launcher followed ``latest`` for its checks, and the run followed it again at each
    later stage (run_inputs, _train, load_resume_state), so a root whose ``latest`` moved in between
    was checked at one step and resumed at another (measured against a live root: checked at ~17,
    resumed at 50). Now the step chosen first is the one trained from and recorded."""
    root = _copy(saved_root, tmp_path / "ckpt")
    checked = command.check_inputs_before_launch

    def check_then_move_latest(cfg, args, vocab_size):
        checked(cfg, args, vocab_size)
        (root / "latest").write_text(STEP1 + "\n")  # another run's save moves it (here: back) after the check

    monkeypatch.setattr(command, "check_inputs_before_launch", check_then_move_latest)
    out = tmp_path / "r"
    argv = [*TOY, "--steps", "3", "--resume", str(root), "--resume-override", "steps", "--out", str(out)]
    assert main(argv) == 0
    got = json.loads((out / "loss.json").read_text())
    assert got["run"]["resumed_from_step"] == 2 and len(got["losses"]) == 3, got["run"]
    stdout = capsys.readouterr().out
    assert f"--resume {root}: resuming {root / STEP2} (step 2)" in stdout, stdout
    assert got["run"]["resumed_from"] == str(root / STEP2)
    load = json.loads((out / "logs" / "load" / "rank0.json").read_text())
    assert load["resume"] == str(root) and load["resume_folder"] == str(root / STEP2), load


def test_a_run_resolves_latest_once_in_its_own_process(saved_root, tmp_path, monkeypatch):
    """``run_training`` given a root (one process, no launcher) follows ``latest`` in its first check
    and reads that step at every later stage."""
    from paddleformers_glm.train.settings import TrainConfig

    root = _copy(saved_root, tmp_path / "ckpt")
    real = loop.check_run

    def check_then_move_latest(cfg, adapter, world):
        got = real(cfg, adapter, world)
        (root / "latest").write_text(STEP1 + "\n")
        return got

    monkeypatch.setattr(loop, "check_run", check_then_move_latest)
    cfg = TrainConfig(
        model="toy", model_args={"seed": 1234}, steps=3, seq_len=8, global_batch_size=1, lr=1e-3,
        out=str(tmp_path / "r"), progress=False, resume=str(root), resume_override=["steps"],
    )  # fmt: skip
    got = loop.run_training(cfg)
    assert got["run"]["resumed_from_step"] == 2 and got["run"]["resumed_from"] == str(root / STEP2), got["run"]


def test_a_step_pruned_after_it_was_chosen_is_said_removed_while_read(saved_root, tmp_path, capsys, monkeypatch):
    """Before: a step renamed ``step_N.tmp`` by the saving run's --save-total-limit after ``latest``
    named it was reported as ``latest: names step_N, which is not a folder`` (the launcher's check)
    or as a missing file of the state. Now one line naming the step folder, saying it was removed
    while being read and that another run may be pruning its root; exit 2."""
    root = _copy(saved_root, tmp_path / "ckpt")
    checked = command.check_args

    def check_then_prune(args):
        got = checked(args)  # --resume resolved here: latest -> step 2
        (root / "latest").write_text(STEP1 + "\n")
        os.replace(root / STEP2, root / (STEP2 + ".tmp"))  # resume.prune_saves' rename
        return got

    monkeypatch.setattr(command, "check_args", check_then_prune)
    argv = [*TOY, "--steps", "3", "--resume", str(root), "--resume-override", "steps", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    line = _one_error(capsys.readouterr().err)
    assert line.startswith(f"glm52 train: error: {root / STEP2}: removed while it was being read"), line
    assert "another run may be saving into" in line and str(root) in line and "missing" not in line, line


def test_a_step_pruned_while_its_files_are_checked_is_not_called_broken(saved_root, tmp_path, monkeypatch):
    """The report's case: the folder renamed between meta.json and the ranks' files. Before:
    ``rank_00000.json: missing (the state of rank 0)``, an intact state called broken. A step
    folder that is there with a file missing keeps that wording."""
    root = _copy(saved_root, tmp_path / "ckpt")
    folder = root / STEP2
    read_meta = state_files.read_meta

    def read_then_prune(path):
        meta = read_meta(path)
        if Path(path) == folder and folder.is_dir():
            os.replace(folder, str(folder) + ".tmp")
        return meta

    monkeypatch.setattr(state_files, "read_meta", read_then_prune)
    with pytest.raises(state_files.ResumeStateError) as e:
        state_files.check_resume_state(str(folder))
    assert str(e.value).startswith(f"{folder}: removed while it was being read"), e.value
    assert "another run may be saving into" in str(e.value)
    monkeypatch.undo()
    broken = _copy(saved_root, tmp_path / "broken") / STEP1
    (broken / "rank_00000.json").unlink()
    with pytest.raises(state_files.ResumeStateError, match=r"rank_00000\.json: missing \(the state of rank 0\)"):
        state_files.check_resume_state(str(broken))


def test_a_resolved_step_is_kept_only_for_the_resume_it_came_from(saved_root, tmp_path):
    """``resume_folder`` is what ``resume`` resolved to: a config whose ``resume`` changed since (a
    Python caller's, a run_config.json edited) resolves again instead of resuming the other root's step."""
    from paddleformers_glm.train.settings import TrainConfig, resolved_resume

    a, b = _copy(saved_root, tmp_path / "a"), _copy(saved_root, tmp_path / "b")
    (b / "latest").write_text(STEP1 + "\n")
    cfg = TrainConfig(model="toy", steps=3, seq_len=8, out=str(tmp_path / "r"), resume=str(a))
    assert resolved_resume(cfg) == str(a / STEP2)
    (a / "latest").write_text(STEP1 + "\n")  # the same root: kept
    assert resolved_resume(cfg) == str(a / STEP2)
    cfg.resume = str(b)
    assert resolved_resume(cfg) == str(b / STEP1)
    cfg.resume = str(b / STEP2)  # a step folder given itself
    assert resolved_resume(cfg) == str(b / STEP2)


def test_nodes_that_followed_a_moving_latest_are_told_so(saved_root, tmp_path, monkeypatch):
    """Each node's launcher follows a root's ``latest`` when it starts: nodes started while another run
    saved there resume different steps. The ranks' check refused it blaming the user's command and
    files; it now also names the moving ``latest`` and what to give instead."""
    from paddleformers_glm.train import loop
    from paddleformers_glm.train.loop import TrainConfig, check_same_run, run_settings

    root = str(saved_root)
    mine = TrainConfig(model="toy", steps=3, seq_len=8, out="/n0", resume=root, resume_folder=f"{root}/{STEP1}")
    other = TrainConfig(model="toy", steps=3, seq_len=8, out="/n1", resume=root, resume_folder=f"{root}/{STEP2}")
    seen = {"resume state": {"step": 2, "meta_sha256": "b"}}
    monkeypatch.setattr(loop, "gather_settings", lambda text: [text, run_settings(other, seen)])
    with pytest.raises(ValueError) as e:
        check_same_run(mine, 2, {"resume state": {"step": 1, "meta_sha256": "a"}})
    assert "resume state: " in str(e.value) and str(e.value).endswith(
        f"; --resume {root} is a checkpoint root whose `latest` each node followed when it started (another run "
        "saving there moves it): give every node the step folder itself"
    ), e.value


def test_a_resolved_step_of_a_linked_checkpoints_folder_is_kept(saved_root, tmp_path):
    """``--resume OUT`` whose ``OUT/checkpoints`` is a link (to another disk): the step resolved first
    is kept, not followed again each time (the check compared a resolved path with an unresolved one)."""
    from paddleformers_glm.train.settings import TrainConfig, resolved_resume

    target = _copy(saved_root, tmp_path / "elsewhere")
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").symlink_to(target)
    cfg = TrainConfig(model="toy", steps=3, seq_len=8, out=str(tmp_path / "r"), resume=str(out))
    first = resolved_resume(cfg)
    assert os.path.basename(first) == STEP2
    (target / "latest").write_text(STEP1 + "\n")
    assert resolved_resume(cfg) == first
