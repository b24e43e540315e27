"""SwiGLU: silu(gate) * up, optionally times a per-row scale."""

from __future__ import annotations

import functools

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .kernels import computes_on_cpu, usable
from .norm import building_graph


def swiglu(h: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up for h [..., 2I] (gate columns first): the compiled kernel where usable,
    else one split (whose gradient is one concat), silu and a product."""
    ops = usable(h)
    if ops is not None:
        if not paddle.is_grad_enabled():  # no autograd node to record: the kernel alone (decoding)
            return ops.glm_swiglu(h, _no_scale())
        return SwiGLUKernel.apply(h, None, ops)
    gate, up = paddle.split(h, 2, axis=-1)
    return silu(gate) * up


# Below this the fp32 derivative of silu is under 1.5e-33 (about -0); Paddle's CPU gradient overflows
# from about -87 (-inf, then NaN below -88.7)
_SILU_FLAT = -80.0


def silu(x: paddle.Tensor) -> paddle.Tensor:
    """``nn.functional.silu(x)`` (bitwise the same values) with a finite gradient on the CPU.

    Paddle 3.3's CPU silu gradient, dout / (1 + e^-x) * (1 + x e^-x / (1 + e^-x)), overflows for
    x below about -87: -inf, then NaN below -88.7, where the derivative is about -1e-33 .. -0 (torch's
    is finite). On the CPU, elements at or below -80 take their value without a gradient (0) and the
    others Paddle's silu and its gradient; elsewhere (accelerators' kernels compute it finitely)
    Paddle's silu alone. tests/test_silu_grad.py."""
    if x.stop_gradient or not paddle.is_grad_enabled() or not computes_on_cpu(x):
        return nn.functional.silu(x)
    with paddle.no_grad():
        flat = x <= _SILU_FLAT
        usual = not building_graph() and not bool(flat.any())  # eager: read whether any is that low
        value = None if usual else nn.functional.silu(x)
    if value is None:
        return nn.functional.silu(x)
    live = nn.functional.silu(paddle.where(flat, paddle.zeros_like(x), x))
    return paddle.where(flat, value, live)


@functools.cache
def _no_scale() -> paddle.Tensor:
    """The empty CPU tensor that tells the kernel "no per-row scale" (made once)."""
    return paddle.empty([0], dtype="float32").cpu()


class SwiGLUKernel(PyLayer):
    """silu(gate) * up on h [..., 2I], times a per-row scale [rows] if given, as one compiled
    kernel each way (`ops` is the loaded kernel library)."""

    @staticmethod
    def forward(ctx: object, h: paddle.Tensor, scale: paddle.Tensor | None, ops: object) -> paddle.Tensor:
        s = scale if scale is not None else paddle.empty([0], dtype="float32")
        ctx.save_for_backward(h, s)
        ctx.ops, ctx.scaled = ops, scale is not None
        ctx.needs = (not h.stop_gradient, scale is not None and not scale.stop_gradient)
        return ops.glm_swiglu(h, s)

    @staticmethod
    def backward(ctx: object, dact: paddle.Tensor) -> paddle.Tensor | tuple | None:
        h, s = ctx.saved_tensor()
        dh, ds = ctx.ops.glm_swiglu_backward(h, s, dact.contiguous())
        dh = dh if ctx.needs[0] else None
        return (dh, ds if ctx.needs[1] else None) if ctx.scaled else dh
