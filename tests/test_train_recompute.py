"""``--recompute full``: every decoder layer runs again in backward (Fleet's recompute), and the
fp32 losses, MTP losses and gradient norms are bit-identical to the run without recompute."""

from __future__ import annotations

import pytest

from paddleformers_glm.parallel.recompute import run_layer
from paddleformers_glm.testing import toy
from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import losses


def _run(tmp_path, mode: str, monkeypatch) -> tuple[dict, int]:
    calls = {"n": 0}
    orig = toy.ToyLayer.forward

    def counted(self, *a, **k):
        calls["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(toy.ToyLayer, "forward", counted)
    out = tmp_path / mode
    cfg = TrainConfig(
        model="toy",
        steps=2, seq_len=16, global_batch_size=2, micro_batch_size=1, lr=1e-3, warmup_steps=1, seed=5,
        out=str(out), progress=False, model_args={"seed": 5}, recompute=mode,
    )  # fmt: skip
    run_training(cfg)
    monkeypatch.setattr(toy.ToyLayer, "forward", orig)
    return losses(out), calls["n"]


def test_full_recompute_is_bit_identical_and_replays_each_layer(tmp_path, monkeypatch):
    ref, n_ref = _run(tmp_path, "none", monkeypatch)
    rec, n_rec = _run(tmp_path, "full", monkeypatch)
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert rec[key] == ref[key], (key, ref[key], rec[key])
    # 6 decoder layers + the MTP layer (not recomputed), 2 steps x 2 micro-batches
    assert n_ref == 2 * 2 * 7 and n_rec == n_ref + 2 * 2 * 6, (n_ref, n_rec)
    # saved activations are counted with saved-tensor hooks, which recompute needs for itself
    assert ref["memory"][0]["activations_bytes"] > 0 and rec["memory"][0]["activations_bytes"] is None


def test_run_layer_rejects_unknown_mode():
    import paddle

    x = paddle.ones([2])
    x.stop_gradient = False
    with pytest.raises(ValueError, match="--recompute must be one of"):
        run_layer(lambda t: t * 2, x, mode="core")
