"""How experts are stepped: as the reference steps its fused expert tensors.

The reference (HF transformers 5.23 ``GlmMoeDsaExperts``) holds a layer's experts as two fused
parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], trained by
``torch.optim.AdamW``: whenever any expert of the layer got a token, the fused tensor has a
gradient, so every expert is stepped, an idle one with a zero-gradient slice (its moments decay,
the moment-driven update and the weight decay go on), and all share the tensor's step count.
Measured with torch 2.13 (``torch.optim.AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)`` on a
fused [4, 6, 5] tensor, expert 0 given tokens at step 1 and a zero slice at steps 2-3, lr 1e-3,
2e-3, 3e-3): expert 0 moved by up to 4.0e-3 over steps 2-3 (a per-expert rule that skips it would
leave it 3.0e-3 away), its ``state["step"]`` is 3, and the textbook AdamW below
(:func:`fused_adamw`) reproduces torch's weights within 3.5e-9, exp_avg within 3.2e-10 and
exp_avg_sq within 4.5e-12.  ``test_fused_adamw_is_torch_adamw`` repeats that comparison when torch
is installed.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from paddle import nn

from paddleformers_glm.parallel.grads import GradSynchronizer
from paddleformers_glm.parallel.topology import get_topology, set_topology
from paddleformers_glm.train.dump import adam_moments
from paddleformers_glm.train.optim import AdamW
from tests._reference import missing_reference_extra
from tests._tiny import tiny_config

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def fused_adamw(w0: np.ndarray, grads: list[np.ndarray], lrs: list[float], wd: float = WD):
    """torch.optim.AdamW's update (decoupled decay, bias-corrected moments, one step count for the
    whole tensor), in float64: (weights, exp_avg, exp_avg_sq) after ``len(grads)`` steps."""
    b1, b2 = BETAS
    w = w0.astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.astype(np.float64)
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + EPS)
    return w, m, v


def assert_close_rel(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    """max |got - want| / max |want| <= tol: fp32 noise on the tensor's own scale (an element near
    zero after cancelling updates carries the rounding of the larger ones)."""
    scale = float(np.abs(want).max())
    assert scale > 0, what
    err = float(np.abs(got.astype(np.float64) - want).max()) / scale
    assert err <= tol, (what, err)


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra(("torch",)) is not None, reason=str(missing_reference_extra(("torch",))))
def test_fused_adamw_is_torch_adamw():
    import torch

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 6, 5)).astype(np.float32) * 0.02
    grads = [rng.standard_normal((4, 6, 5)).astype(np.float32) * 1e-2 for _ in range(3)]
    for g in grads[1:]:
        g[0] = 0.0  # expert 0: tokens at step 1 only
    lrs = [1e-3, 2e-3, 3e-3]
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for g, lr in zip(grads, lrs):
        p.grad = torch.from_numpy(g)
        opt.param_groups[0]["lr"] = lr
        opt.step()
    w, m, v = fused_adamw(w0, grads, lrs)
    st = opt.state[p]
    assert float(st["step"]) == 3
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=0, atol=1e-8)
    np.testing.assert_allclose(st["exp_avg"].numpy(), m, rtol=0, atol=1e-9)
    np.testing.assert_allclose(st["exp_avg_sq"].numpy(), v, rtol=0, atol=1e-11)
    assert np.abs(p.detach().numpy()[0] - w0[0]).max() > 1e-3  # the idle expert moved


def _two_moe_layers(n_experts: int = 4) -> nn.Layer:
    from paddleformers_glm.modeling.moe import MoE

    cfg = tiny_config(n_routed_experts=n_experts, n_group=1, topk_group=1, num_experts_per_tok=2)
    m = nn.Layer()
    m.layers = nn.LayerDict({"3": MoE(cfg), "5": MoE(cfg)})  # layer 5 never runs: no token, no gradient
    m.train()
    return m


def _run(expert_update: str, steps: int = 3, lrs=(1e-2, 2e-2, 3e-2)):
    """Steps of a one-layer MoE (layer 3 runs, layer 5 never does); expert 0 of layer 3 gets tokens
    at step 1 and none after (its router bias then keeps every token away).  Returns the initial
    weights, each step's synced gradients and flags, the final weights and moments."""
    set_topology(None)
    paddle.seed(0)
    m = _two_moe_layers()
    # the default must be the reference's rule: "fused" is not passed
    extra = {} if expert_update == "fused" else {"expert_update": expert_update}
    sync = GradSynchronizer(m, get_topology(), **extra)
    opt = AdamW(sync.params, betas=BETAS, eps=EPS, weight_decay=WD)
    params = dict(sync.params)
    w0 = {n: p.numpy().copy() for n, p in sync.params}
    grads, flags = [], []
    hidden = m.layers["3"].gate.weight.shape[0]
    for step in range(steps):
        if step == 1:
            m.layers["3"].gate.e_score_correction_bias.set_value(paddle.to_tensor([-10.0, 0.0, 0.0, 0.0]))
        x = paddle.to_tensor(np.random.default_rng(step + 1).standard_normal([2, 8, hidden]).astype(np.float32))
        (m.layers["3"](x) ** 2).mean().backward()
        g, has = sync.main_grads()
        grads.append({n: t.numpy().copy() for n, t in g.items()})
        flags.append(dict(has))
        opt.step(g, has, lrs[step])
        sync.release()
    final = {}
    for n, p in sync.params:
        m1, m2 = adam_moments(opt, n, p)
        final[n] = (p.numpy().copy(), None if m1 is None else m1.numpy().copy(), None if m2 is None else m2.numpy())
    return w0, grads, flags, final, params


def test_idle_expert_is_stepped_like_the_fused_reference():
    """Expert 0 of a layer: tokens at step 1, none at steps 2-3.  Its weights, exp_avg and exp_avg_sq
    equal the fused-tensor AdamW's (the reference's) within fp32 noise, like its busy neighbours;
    the layer that routed no token at all is not stepped (torch: the fused tensor's gradient is None)."""
    lrs = [1e-2, 2e-2, 3e-2]
    w0, grads, flags, final, _ = _run("fused", lrs=lrs)
    experts3 = sorted(n for n in w0 if n.startswith("layers.3.experts."))
    idle = [n for n in experts3 if ".experts.0." in n]
    assert len(idle) == 2 and len(experts3) == 8
    for step in (1, 2):  # idle at steps 2 and 3: a zero gradient, still stepped
        assert all(flags[step][n] for n in experts3)
        assert all(not grads[step][n].any() for n in idle)
    assert any(grads[0][n].any() for n in idle)  # it did get tokens at step 1
    for n in experts3:
        w, m, v = fused_adamw(w0[n], [g[n] for g in grads], lrs)
        got_w, got_m, got_v = final[n]
        np.testing.assert_allclose(got_w, w, rtol=0, atol=2e-7, err_msg=n)
        assert_close_rel(got_m, m, 1e-6, n)
        assert_close_rel(got_v, v, 1e-6, n)
    for n in idle:  # what a rule that skips it would have missed: two steps of moment-driven update
        assert np.abs(final[n][0] - fused_adamw(w0[n], [grads[0][n]], lrs[:1])[0]).max() > 1e-3, n
    # no token reached layer 5 in any step: its experts are not stepped at all
    experts5 = [n for n in w0 if n.startswith("layers.5.experts.")]
    assert experts5 and not any(f[n] for f in flags for n in experts5)
    for n in experts5:
        assert np.array_equal(final[n][0], w0[n]) and final[n][1] is None, n


def test_routed_only_steps_an_expert_only_when_tokens_reached_it():
    """``--expert-update routed-only``: an expert no token reached is not stepped (weights, moments
    and bias-correction powers keep their bits) though it stepped before; its neighbours are."""
    w0, grads, flags, final, params = _run("routed-only", steps=2)
    experts3 = sorted(n for n in w0 if n.startswith("layers.3.experts."))
    idle = [n for n in experts3 if ".experts.0." in n]
    live = [n for n in experts3 if ".experts.1." in n]
    assert all(flags[0][n] for n in experts3)
    assert not any(flags[1][n] for n in idle) and all(flags[1][n] for n in live)
    for n in idle:  # as after step 1
        w, m, v = fused_adamw(w0[n], [grads[0][n]], [1e-2])
        np.testing.assert_allclose(final[n][0], w, rtol=0, atol=2e-7, err_msg=n)
        assert_close_rel(final[n][1], m, 1e-6, n)


def test_expert_update_is_validated():
    set_topology(None)
    with pytest.raises(ValueError, match="expert_update must be one of fused, routed-only"):
        GradSynchronizer(_two_moe_layers(), get_topology(), "lazy")
    from paddleformers_glm.train.loop import TrainConfig

    with pytest.raises(ValueError, match="--expert-update"):
        TrainConfig(model="toy", expert_update="all").validate()
