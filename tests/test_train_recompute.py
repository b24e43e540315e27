"""``--recompute full`` (every decoder layer runs again in backward) and ``--recompute core`` (only
each layer's attention core: indexer + attention) through Fleet's recompute: the fp32 losses, MTP
losses and gradient norms are bit-identical to the run without recompute, and so is every gradient
of the model in each attention form (their PyLayers save views, which Fleet's recompute restored
misplaced before parallel/_compat.py's fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paddleformers_glm.parallel.recompute import run_layer
from paddleformers_glm.train import toy
from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import losses


def _run(tmp_path, mode: str, monkeypatch, counted_fn: str = "forward") -> tuple[dict, int]:
    calls = {"n": 0}
    orig = getattr(toy.ToyLayer, counted_fn)

    def counted(self, *a, **k):
        calls["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(toy.ToyLayer, counted_fn, counted)
    out = tmp_path / f"{mode}_{counted_fn}"
    cfg = TrainConfig(
        model="toy",
        steps=2, seq_len=16, global_batch_size=2, micro_batch_size=1, lr=1e-3, warmup_steps=1, seed=5,
        out=str(out), progress=False, model_args={"seed": 5}, recompute=mode,
    )  # fmt: skip
    run_training(cfg)
    monkeypatch.setattr(toy.ToyLayer, counted_fn, orig)
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


def test_core_recompute_is_bit_identical_and_replays_only_the_attention_core(tmp_path, monkeypatch):
    ref, n_ref = _run(tmp_path, "none", monkeypatch, "_core")
    rec, n_rec = _run(tmp_path, "core", monkeypatch, "_core")
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert rec[key] == ref[key], (key, ref[key], rec[key])
    # each decoder layer's core runs twice (forward, backward replay); the MTP layer's once
    assert n_ref == 2 * 2 * 7 and n_rec == n_ref + 2 * 2 * 6, (n_ref, n_rec)
    _, n_layers = _run(tmp_path, "core", monkeypatch)  # the rest of the layer is not replayed
    assert n_layers == n_ref, n_layers


def test_run_core_recomputes_only_inside_a_core_recompute_layer():
    import paddle

    from paddleformers_glm.parallel.recompute import run_core

    calls = []

    def core(t):
        calls.append(1)
        return t * t

    def layer(t):
        return run_core(core, t).sum()

    for mode, replays in (("none", 0), ("core", 1)):
        calls.clear()
        x = paddle.to_tensor([1.0, 2.0, 3.0], stop_gradient=False)
        run_layer(layer, x, mode=mode).backward()
        assert len(calls) == 1 + replays, (mode, calls)
        assert x.grad.numpy().tolist() == [2.0, 4.0, 6.0]


def test_run_layer_rejects_unknown_mode():
    import paddle

    x = paddle.ones([2])
    x.stop_gradient = False
    with pytest.raises(ValueError, match="--recompute must be one of"):
        run_layer(lambda t: t * 2, x, mode="attention")


def test_full_recompute_counts_each_routed_token_once(tmp_path):
    """The routers' training statistics under ``--recompute full``: Fleet's hook-based recompute runs
    a layer's first pass with gradients on, then again in backward; both passes counted (measured
    before on the tiny model, seq 8, micro-batch 2, aux 0.5: aux_losses 1.9334 where the run without
    recompute reports 1.0533, and every decoder MoE layer's load 384 where 192 tokens x top-k were
    routed; a torch computation of the sequence-wise loss gives 1.06175 at seq 8, batch 2). Now the
    expert load, the aux losses and the biases equal the run without recompute bit for bit."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    got = {}
    for mode in ("none", "full"):
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(ckpt)}, steps=2, seq_len=8, global_batch_size=4,
            micro_batch_size=2, lr=1e-4, warmup_steps=1, out=str(tmp_path / mode), progress=False, recompute=mode,
            moe_aux_loss_coeff=0.5, moe_bias_update_rate=0.01,
        )  # fmt: skip
        got[mode] = run_training(cfg)
    load = {m: got[m]["expert_load"] for m in got}
    assert load["full"]["aux_losses"] == load["none"]["aux_losses"] and load["none"]["aux_losses"][0] > 0
    assert load["full"]["load_total"] == load["none"]["load_total"]
    assert got["full"]["losses"] == got["none"]["losses"]


def test_glm_core_recompute_is_bit_identical(tmp_path, monkeypatch):
    """The real model: its attention core (indexer + sparse attention form) replayed in backward."""
    from paddleformers_glm.modeling.attention import MLAttention
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    calls = {"n": 0}
    orig = MLAttention._core

    def counted(self, *a, **k):
        calls["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(MLAttention, "_core", counted)
    out, n = {}, {}
    for mode in ("none", "core"):
        calls["n"] = 0
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(ckpt)}, steps=2, seq_len=32, global_batch_size=2,
            micro_batch_size=1, lr=1e-3, warmup_steps=1, out=str(tmp_path / mode), progress=False, recompute=mode,
        )  # fmt: skip
        out[mode], n[mode] = run_training(cfg), calls["n"]
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert out["core"][key] == out["none"][key], (key, out["none"][key], out["core"][key])
    layers = json.loads((Path(ckpt) / "config.json").read_text())["num_hidden_layers"]
    # every decoder layer's core is replayed once per micro-batch (the MTP layer is not recomputed)
    assert n["none"] > 0 and n["core"] - n["none"] == 2 * 2 * layers, (n, layers)


def _model_grads(model, mode: str, B: int, S: int) -> tuple[float, dict, list]:
    """One forward + backward of the tiny model's stage (LM + MTP losses) under ``--recompute mode``."""
    import paddle

    from ._tiny import tokens

    model.clear_gradients(set_to_zero=False)
    model.recompute = mode
    ids = tokens(B, S, model.config.vocab_size, seed=3)
    out = model.forward_stage(None, {"input_ids": ids, "labels": ids})
    loss = paddle.add_n([t.sum / max(float(t.count), 1.0) for t in out.losses.values()])
    loss.backward()
    grads = {n: p.grad.numpy() if p.grad is not None else None for n, p in model.named_parameters()}
    return float(loss), grads, sorted(out.losses)


@pytest.mark.parametrize(
    "form",
    ["dense", "dense-chunked", "sparse", "latent", "reference", "auto-short", "dense-indexer-kl", "latent-indexer-kl"],
)
@pytest.mark.parametrize("mode", ["full", "core"])
def test_every_gradient_is_bit_identical_under_recompute_in_every_attention_form(form, mode, monkeypatch):
    """Measured before the fix (Paddle 3.3.1): the dense form (what ``auto`` picks at the official widths
    for every sequence up to 8192, and on the tiny model while S <= 2 x top-k) under either mode gave the
    same loss but q/k-side gradients off by up to 100% (the embedding's by 0.34 at B 2, S 16): its PyLayer
    saves the transposed keys and values, which the replay handed back with the elements misplaced."""
    from paddleformers_glm.modeling import attention_forms

    from ._tiny import tiny_model

    impl = form.split("-")[0]
    if form == "dense-chunked":  # the query-chunked dense path (long sequences): every chunk over the budget
        monkeypatch.setattr(attention_forms, "CHUNK_BYTES", 1)
    kl = form.endswith("indexer-kl")  # the indexer's sparse stage: its KL loss and the attention's probabilities
    model = tiny_model(seed=4, attn_implementation=impl, indexer_loss_coeff=0.1 if kl else 0.0)
    model.train()
    model.set_indexer_training("sparse" if kl else "none")
    B, S = 2, 16
    loss0, want, terms = _model_grads(model, "none", B, S)
    loss1, got, _ = _model_grads(model, mode, B, S)
    assert loss1 == loss0 and kl == ("indexer_kl" in terms), terms
    assert set(got) == set(want) and sum(g is not None for g in want.values()) > 100
    bad = {n: float(abs(got[n] - want[n]).max()) for n in want if want[n] is not None and (got[n] != want[n]).any()}
    assert not bad and all((got[n] is None) == (want[n] is None) for n in want), bad


def test_a_pylayer_saving_a_view_gets_its_gradient_under_recompute_and_keeps_the_view_outside():
    """The fix in isolation: a PyLayer that saves a transposed view. Under ``run_layer(mode="full")``
    its gradient equals the one without recompute (stock Paddle 3.3.1 + Fleet: the view came back
    misplaced, a's gradient off by 2.9); outside a recompute the view is saved as it is (no copy)."""
    import numpy as np
    import paddle
    from paddle.autograd import PyLayer

    seen = []

    class Mul(PyLayer):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensor()
            seen.append(y.is_contiguous())
            return g * y, g * x

    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((3, 5)).astype("float32"), rng.standard_normal((5, 3)).astype("float32")

    def grads(mode):
        a, b = paddle.to_tensor(a_np, stop_gradient=False), paddle.to_tensor(b_np, stop_gradient=False)
        out = run_layer(lambda x, y: Mul.apply(x * 1.0, (y * 1.0).transpose([1, 0])), a, b, mode=mode)
        (out * out).sum().backward()
        return a.grad.numpy(), b.grad.numpy()

    plain = grads("none")
    assert seen == [False]  # outside a recompute the backward reads the view itself: nothing was copied
    recomputed = grads("full")
    assert all((p == r).all() for p, r in zip(plain, recomputed))
