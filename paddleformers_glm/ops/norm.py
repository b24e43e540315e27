"""RMSNorm as one autograd node, and the small fp32 helpers the norms share."""

from __future__ import annotations

import math
import sys

import paddle
from paddle.autograd import PyLayer

from .kernels import usable


def cast(t: paddle.Tensor, dtype: str | paddle.dtype) -> paddle.Tensor:
    """t cast to dtype; t itself when it already is (Paddle's cast op copies even then)."""
    want = getattr(paddle, dtype) if isinstance(dtype, str) else dtype
    return t if t.dtype == want else t.astype(want)


def mean_square(h: paddle.Tensor) -> paddle.Tensor:
    """mean(h^2) over the last axis as a GEMV against a 1/H column.

    Against torch's mean (HF's), Paddle's fp32 mean is several ulps further off than the GEMV
    (MKL accumulates in SIMD lanes); an fp64 accumulator is closer still but costs far more (casts,
    slow fp64 reduction). The GEMV keeps the parity margins (bench/parity_margins.py;
    docs/performance.md has the measurements).
    """
    return mean_last(h * h)


def mean_last(t: paddle.Tensor) -> paddle.Tensor:
    """t.mean(-1, keepdim=True) as a GEMV (see mean_square)."""
    H = t.shape[-1]
    return paddle.matmul(t, _constant([H, 1], 1.0 / H, t))


_CONSTANTS: dict[tuple, paddle.Tensor] = {}


def _in_sot() -> bool:
    """True while paddle.jit.to_static's bytecode tracer simulates the code (False when run).

    The tracer imports ``paddle.jit.sot.psdb``; a process that never loaded it is not being traced,
    and does not pay for importing the tracer (a tenth of a second in every training worker)."""
    psdb = sys.modules.get("paddle.jit.sot.psdb")
    return psdb is not None and psdb.in_sot()


_CUDA_GRAPH_CAPTURING = getattr(paddle.base.core, "is_cuda_graph_capturing", None)


def capturing_cuda_graph() -> bool:
    """True while a CUDA graph is being captured: the code must then read no value back to the
    host and give every tensor a shape known in advance."""
    return bool(_CUDA_GRAPH_CAPTURING()) if _CUDA_GRAPH_CAPTURING is not None else False


def building_graph() -> bool:
    """True while paddle.jit.to_static builds a graph (either mode): eager-side caches keyed by
    tensor identity or place must then be bypassed, the tensors being symbolic."""
    return not paddle.in_dynamic_mode() or _in_sot()


@paddle.jit.not_to_static
def _constant(shape: list[int], value: float, like: paddle.Tensor) -> paddle.Tensor:
    """A constant tensor of like's dtype and place, made once (a norm needs two per call)."""
    if building_graph():
        return paddle.full(shape, value, dtype=like.dtype)
    key = (tuple(shape), value, str(like.dtype), str(like.place))
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 64:  # shapes follow the token count: keep the cache small
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = paddle.full(shape, value, dtype=like.dtype)
    return t


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), statistics in fp32, cast back to x's dtype before the
    weight (HF's order): the fused CPU kernel each way where usable, else Paddle's ops."""
    if not paddle.is_grad_enabled():  # no autograd node to record: the kernel alone (decoding)
        ops = usable(x, weight)
        if ops is not None:
            return ops.glm_rms_norm(x, weight, float(eps))[0]
    return _RMSNorm.apply(x, weight, float(eps))


class _RMSNorm(PyLayer):
    """RMSNorm as one autograd node: the same forward values as the op-by-op form (HF's), a
    hand-written backward. Far fewer autograd nodes per norm, and the weight gradient is a GEMV
    instead of Paddle's slow column reduction of a [H] x [N, H] broadcast. For fp32 CPU tensors
    both directions are one fused kernel each (mean of squares in fp64); the backward follows the
    forward's choice."""

    @staticmethod
    def forward(ctx: object, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        ops = usable(x, weight)
        ctx.ops = ops
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)  # a frozen input gets None
        if ops is not None:
            y, r = ops.glm_rms_norm(x, weight, eps)  # r [rows]: 1 / rms
            ctx.save_for_backward(x, r, weight)
            return y
        h = cast(x, "float32")
        r = paddle.rsqrt(mean_square(h) + eps)  # [..., 1]
        n32 = h * r.expand(h.shape)
        n = cast(n32, x.dtype)  # normalised, in the input dtype (as HF casts back)
        # fp32: n itself; a low-precision x instead, from which backward rebuilds the fp32
        # normalised values HF's autograd differentiates through (n is their rounding)
        ctx.save_for_backward(n if n is n32 else x, r, weight)
        return weight.expand(n.shape) * n

    @staticmethod
    def backward(ctx: object, dy: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        if ctx.ops is not None:
            x, r, weight = ctx.saved_tensor()
            grads = ctx.ops.glm_rms_norm_backward(x, weight, r, dy.contiguous())
        else:
            grads = _rms_norm_backward_ops(*ctx.saved_tensor(), dy)
        return tuple(grad if need else None for grad, need in zip(grads, ctx.needs))


def _rms_norm_backward_ops(
    saved: paddle.Tensor, r: paddle.Tensor, weight: paddle.Tensor, dy: paddle.Tensor
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The backward with Paddle's ops, from 1 / rms r [..., 1] and what the forward saved: the
    normalised input (fp32) or the input itself (a low-precision one, see the forward).

    Low precision follows the rounding of HF's autograd through its op-by-op form: the weight
    gradient sums the products dy * n rounded to the input dtype, the input gradient comes from the
    fp32 normalised values."""
    H = saved.shape[-1]
    rows = math.prod(saved.shape[:-1])
    if saved.dtype == paddle.float32:
        n32 = saved
        prod = cast(dy, "float32") * n32
    else:
        n32 = cast(saved, "float32") * r.expand(saved.shape)
        prod = cast(dy * cast(n32, saved.dtype), "float32")
    dw = paddle.matmul(_constant([1, rows], 1.0, n32), prod.reshape([rows, H]))
    gn = cast(dy * weight.expand(dy.shape), "float32")
    # d/dh of h * rsqrt(mean(h^2) + eps) applied to gn: r * (gn - n * mean(gn * n))
    dot = mean_last(gn * n32)
    dh = (gn - n32 * dot.expand(n32.shape)) * r.expand(n32.shape)
    return cast(dh, dy.dtype), cast(dw.reshape([H]), weight.dtype)
