"""A sparse-stage run that began from a warm-up state keeps its own learning-rate schedule across a
second resume: the schedule's first step (meta.json indexer.stage_start) travels with each state."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _train(ckpt, out, **kw):
    from paddleformers_glm.train.loop import TrainConfig, run_training

    base = dict(model="glm", model_args={"model_dir": str(ckpt)}, seq_len=32, global_batch_size=4, micro_batch_size=2,
                lr=1e-3, warmup_steps=1, out=str(out), progress=False)  # fmt: skip
    return run_training(TrainConfig(**{**base, **kw}))


def test_a_sparse_stage_resumed_again_keeps_the_schedule_that_began_at_the_warmup_state(tiny, tmp_path):
    """warm-up 2 steps -> sparse stage to step 6 (its schedule over steps 3-6), saving each step ->
    that run's step-4 state resumed: steps 5 and 6 train at the uninterrupted sparse run's lr and loss."""
    import json

    _train(tiny, tmp_path / "warm", steps=2, indexer_stage="warmup", save_every=2)
    warm = tmp_path / "warm" / "checkpoints" / "step_00000002"
    sparse = _train(tiny, tmp_path / "sparse", steps=6, indexer_stage="sparse", indexer_loss_coeff=0.1, resume=str(warm),
                    save_every=1)  # fmt: skip
    s4 = tmp_path / "sparse" / "checkpoints" / "step_00000004"
    again = _train(tiny, tmp_path / "again", steps=6, indexer_stage="sparse", indexer_loss_coeff=0.1, resume=str(s4))
    assert again["lrs"] == sparse["lrs"], (again["lrs"], sparse["lrs"])
    assert again["losses"] == sparse["losses"]
    assert json.loads((s4 / "meta.json").read_text())["indexer"]["stage_start"] == 2
