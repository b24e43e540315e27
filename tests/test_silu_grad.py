"""SwiGLU's gradient is finite for a very negative gate pre-activation on every CPU path.

Paddle 3.3's CPU ``silu`` gradient computes dout / (1 + e^-x) * (1 + x e^-x / (1 + e^-x)): e^-x
overflows below x = -87, giving -inf (x in about [-88.7, -87]) and NaN below, where the derivative is
about -1e-33 .. -0 (torch: -1.43e-33 at -80, -1.42e-36 at -87, -0 from -89). Measured before:
ops.swiglu with the kernels off, the trainer's expert MLP (parallel/experts.py) and the padded MoE
form (``F.silu``) gave gradients -inf and NaN there; bf16 on a CPU takes the same fp32 op. The
compiled kernel was finite. Now those paths use ``ops.silu``, whose forward is bitwise Paddle's silu
and whose gradient is Paddle's above -80 and 0 below (exactly the kernels' -0 from -88.7).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops

GATE = np.array([-1e30, -1000.0, -100.0, -89.0, -88.0, -87.0, -80.5, -80.0, -10.0, -1.0, 0.0, 3.0, 90.0], np.float32)


def _exact_grad() -> np.ndarray:
    x = GATE.astype(np.float64)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    return s * (1.0 + x * (1.0 - s))


def _swiglu_grad(fn) -> tuple[np.ndarray, np.ndarray]:
    h = paddle.to_tensor(np.concatenate([GATE, np.full_like(GATE, 2.0)])[None], stop_gradient=False)
    y = fn(h)
    y.sum().backward()
    return y.numpy()[0], h.grad.numpy()[0, : len(GATE)]


def test_silu_keeps_paddles_forward_and_has_a_finite_gradient():
    x = paddle.to_tensor(GATE, stop_gradient=False)
    y = ops.silu(x)
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy(), paddle.nn.functional.silu(paddle.to_tensor(GATE)).numpy())
    g = x.grad.numpy()
    assert np.isfinite(g).all(), g  # before: -inf at -88 and -87, NaN from -89 down
    np.testing.assert_allclose(g, _exact_grad(), rtol=1e-5, atol=2e-33)


def test_silu_is_paddles_where_no_input_is_that_low():
    """The usual case (no element at or below -80): Paddle's silu, value and gradient bitwise."""
    x0 = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 20
    w = paddle.arange(32, dtype="float32").reshape([4, 8])
    res = []
    for fn in (ops.silu, paddle.nn.functional.silu):
        x = paddle.to_tensor(x0, stop_gradient=False)
        y = fn(x)
        (y * w).sum().backward()
        res.append((y.numpy(), x.grad.numpy()))
    np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_array_equal(res[0][1], res[1][1])


@pytest.mark.parametrize("kernels", [True, False])
def test_swiglu_gradient_is_finite_with_and_without_the_kernels(kernels):
    if kernels:
        out, grad = _swiglu_grad(ops.swiglu)
    else:
        with ops.disabled():
            out, grad = _swiglu_grad(ops.swiglu)
    assert np.isfinite(grad).all(), grad
    np.testing.assert_allclose(grad, 2.0 * _exact_grad(), rtol=1e-5, atol=4e-33)


def test_the_expert_mlp_gradient_is_finite():
    from paddleformers_glm.parallel.experts import ExpertMLP
    from paddleformers_glm.parallel.topology import Topology

    mlp = ExpertMLP(1, len(GATE), topo=Topology.single(), dtype="float32")
    w = np.concatenate([GATE, np.full_like(GATE, 2.0)])[None]  # x = 1: gate = GATE, up = 2
    mlp.up_gate_proj.set_value(w)
    mlp.down_proj.set_value(np.ones((len(GATE), 1), np.float32))
    mlp(paddle.ones([1, 1])).sum().backward()
    g = mlp.up_gate_proj.grad.numpy()[0, : len(GATE)]
    assert np.isfinite(g).all(), g
    np.testing.assert_allclose(g, 2.0 * _exact_grad(), rtol=1e-5, atol=4e-33)


def test_the_exact_gradient_is_torchs():
    torch = pytest.importorskip("torch")
    x = torch.tensor(GATE, requires_grad=True)
    torch.nn.functional.silu(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), _exact_grad(), rtol=1e-5, atol=2e-33)
