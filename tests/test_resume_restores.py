"""What a resume restores beyond the next loss: the optimizer's own record of its state, the RNG
streams, every state tensor of a GLM run with moving router biases; what it refuses (a rank file
missing on any rank, another state format, other training samples); what the sweep of stale saves
keeps."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

STEP = "step_00000002"


def _toy(out, **kw):
    from paddleformers_glm.train.loop import TrainConfig

    base = dict(model="toy", steps=3, seq_len=16, global_batch_size=4, micro_batch_size=2, lr=2e-3, seed=11)
    return TrainConfig(**{**base, "progress": False, "out": str(out), **kw})


@pytest.fixture(scope="module")
def toy_step2(tmp_path_factory) -> Path:
    from paddleformers_glm.train.loop import run_training

    out = tmp_path_factory.mktemp("toy_state")
    run_training(_toy(out, save_every=2))
    return out / "checkpoints" / STEP


def _resume_capturing(folder: Path, out: Path, monkeypatch) -> dict:
    """Resume ``folder`` into a run of no further step; returns what the load left: the optimizer, and
    the numpy / Python / Paddle RNG states right after it."""
    import paddle

    from paddleformers_glm.train import loop
    from paddleformers_glm.train.loop import run_training

    seen: dict = {}
    real = loop.load_resume_state

    def capture(path, topo, model, optimizer, *a, **k):
        meta = real(path, topo, model, optimizer, *a, **k)
        seen.update(optimizer=optimizer, numpy=np.random.get_state(), python=random.getstate(),
                    paddle=[g.__getstate__() for g in paddle.get_rng_state()])  # fmt: skip
        return meta

    monkeypatch.setattr(loop, "load_resume_state", capture)
    np.random.seed(12345)  # some other stream than the saved one
    random.seed(12345)
    run_training(
        _toy(out, steps=2, seed=12, resume=str(folder), resume_override=["steps", "seed", "data"])
    )  # another seed: the run seeds its generators before the load
    return seen


def test_a_resumed_optimizer_holds_the_saved_optimizer_state_as_its_own(toy_step2, tmp_path, monkeypatch):
    """Right after the load, the optimizer's state (what its next save writes and what the layout-free
    copy lists as stepped) is the saved state's, parameter for parameter: a parameter that gets no
    gradient before the next save (an expert no token is routed to) keeps its moments in that save."""
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile

    seen = _resume_capturing(toy_step2, tmp_path / "out", monkeypatch)
    with SafetensorsFile(str(toy_step2 / "rank_00000.safetensors")) as r:
        saved = {k.split("/")[1] for k in r.keys() if k.startswith("optimizer/") and not k.endswith("/master")}
    opt = seen["optimizer"]
    assert saved and set(opt.state) == saved, sorted(saved ^ set(opt.state))[:5]
    meta = json.loads((toy_step2 / "meta.json").read_text())
    assert set(meta["flex"]["stepped"]) == saved


def test_a_resume_restores_the_saved_rng_streams(toy_step2, tmp_path, monkeypatch):
    """numpy's, Python's and Paddle's generators continue from the saved rank's state (rank_N.json "rng")."""
    doc = json.loads((toy_step2 / "rank_00000.json").read_text())["rng"]
    seen = _resume_capturing(toy_step2, tmp_path / "out", monkeypatch)
    kind, keys, pos, _, _ = seen["numpy"]
    assert (kind, keys.tolist(), int(pos)) == (doc["numpy"]["kind"], doc["numpy"]["keys"], doc["numpy"]["pos"])
    version, state, _ = seen["python"]
    assert (version, list(state)) == (doc["python"]["version"], doc["python"]["state"])
    if doc["paddle"] is not None:
        from paddleformers_glm.train.state_files import _encode_rng_field

        got = [[_encode_rng_field(f) for f in g] for g in seen["paddle"]]
        assert got == doc["paddle"]


def test_every_ranks_files_are_checked_before_launch(toy_step2, tmp_path):
    """check_resume_state reads the JSON and tensor header of every rank meta.json counts: a state
    whose rank 1 files are missing is refused naming them, before any worker starts."""
    from paddleformers_glm.train.state_files import ResumeStateError, check_resume_state

    folder = tmp_path / STEP
    shutil.copytree(toy_step2, folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["world_size"] = 2
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ResumeStateError, match="rank_00001.json: missing"):
        check_resume_state(str(folder))


@pytest.mark.parametrize("file", ["meta.json", "rank_00000.json"])
def test_a_state_of_another_format_version_is_refused_naming_it(toy_step2, tmp_path, file):
    """meta.json / rank_N.json ``format`` must be this version's (glm52-train-state/2): an earlier or
    later layout of the state is refused by name, not read as this one."""
    from paddleformers_glm.train.state_files import ResumeStateError, check_resume_state

    folder = tmp_path / STEP
    shutil.copytree(toy_step2, folder)
    doc = json.loads((folder / file).read_text())
    doc["format"] = "glm52-train-state/1"
    (folder / file).write_text(json.dumps(doc))
    with pytest.raises(ResumeStateError, match="`format` is 'glm52-train-state/1', this version reads"):
        check_resume_state(str(folder))


def test_a_resume_onto_other_training_samples_is_refused_naming_the_data(toy_step2, tmp_path):
    """The state records its data's fingerprint (meta.json "data"); a resume whose samples differ (here
    the toy data of another seed, the seed itself allowed to change) is refused naming --data."""
    from paddleformers_glm.train.loop import run_training

    assert json.loads((toy_step2 / "meta.json").read_text()).get("data")
    with pytest.raises(ValueError, match="data saved 'other samples', now 'these'"):
        run_training(_toy(tmp_path / "out", seed=12, resume=str(toy_step2), resume_override=["seed"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def test_a_glm_resume_with_moving_router_biases_continues_every_state_tensor(tiny, tmp_path):
    """--moe-bias-update-rate 0.01: 4 steps in one go vs 2 + resume 2 (one process): the same losses
    and a bit-identical step-4 state (weights, expert-selection biases, moments, beta powers)."""
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile
    from paddleformers_glm.train.loop import TrainConfig, run_training

    def cfg(out, **kw):
        return TrainConfig(model="glm", model_args={"model_dir": str(tiny)}, steps=4, seq_len=32, global_batch_size=4,
                           micro_batch_size=2, out=str(out), progress=False, warmup_steps=1, moe_bias_update_rate=0.01,
                           save_every=2, **kw)  # fmt: skip

    full = run_training(cfg(tmp_path / "full"))
    res = run_training(cfg(tmp_path / "res", resume=str(tmp_path / "full" / "checkpoints" / STEP)))
    assert res["losses"] == full["losses"]

    def state(d, step):
        with SafetensorsFile(str(d / "checkpoints" / f"step_{step:08d}" / "rank_00000.safetensors")) as r:
            return {k: r.numpy(k).copy() for k in r.keys()}

    a, b, a2 = state(tmp_path / "full", 4), state(tmp_path / "res", 4), state(tmp_path / "full", 2)
    biases = [k for k in a if k.endswith("e_score_correction_bias")]
    assert biases and any(not np.array_equal(a[k], a2[k]) for k in biases)  # they moved
    assert a.keys() == b.keys()
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []


def test_a_sweep_keeps_the_only_copy_a_save_killed_between_its_renames_left(tmp_path):
    """step_N.old without step_N (a save of step N killed after moving the earlier state of N aside and
    before renaming the new one in) is that state's only copy: a later save's sweep keeps it, and removes
    step_M.tmp and a step_K.old whose step_K is in place."""
    from paddleformers_glm.train.state_files import sweep_stale_saves

    for name in ("step_00000004.old", "step_00000005.tmp", "step_00000003", "step_00000003.old"):
        (tmp_path / name).mkdir()
    removed = sweep_stale_saves(str(tmp_path), 6)
    assert sorted(removed) == ["step_00000003.old", "step_00000005.tmp"]
    assert (tmp_path / "step_00000004.old").is_dir() and (tmp_path / "step_00000003").is_dir()


def test_a_sweep_leaves_the_step_being_saved_to_its_caller(tmp_path):
    """sweep_stale_saves(root, N) leaves step_N.tmp / step_N.old alone (the save of step N owns them)."""
    from paddleformers_glm.train.state_files import sweep_stale_saves

    for name in ("step_00000006.tmp", "step_00000006.old", "step_00000006"):
        (tmp_path / name).mkdir()
    assert sweep_stale_saves(str(tmp_path), 6) == []
