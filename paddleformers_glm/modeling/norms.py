"""Normalisation layers, computed in fp32 whatever the parameter dtype (as HF does)."""

from __future__ import annotations

import math

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from ..kernels import cpu as cpu_kernels


def _as(t: paddle.Tensor, dtype: str | paddle.dtype) -> paddle.Tensor:
    """t cast to dtype; t itself when it already is (Paddle's cast op copies even then)."""
    want = getattr(paddle, dtype) if isinstance(dtype, str) else dtype
    return t if t.dtype == want else t.astype(want)


def _mean_square(h: paddle.Tensor) -> paddle.Tensor:
    """mean(h^2) over the last axis as a GEMV against a 1/H column.

    Against torch's mean (HF's), on 512 rows of width 64-256: Paddle's fp32 mean is up to 7 ulps
    off (8-layer logits then leave 1e-5), the GEMV (MKL accumulates in SIMD lanes) 3, an fp64
    accumulator 2; the GEMV costs ~1/10 of the fp64 route (casts, slow fp64 reduction) and keeps
    the parity margins (bench/parity_margins.py; docs/performance.md).
    """
    return _mean_last(h * h)


def _mean_last(t: paddle.Tensor) -> paddle.Tensor:
    """t.mean(-1, keepdim=True) as a GEMV (see _mean_square)."""
    H = t.shape[-1]
    return paddle.matmul(t, _constant([H, 1], 1.0 / H, t))


_CONSTANTS: dict[tuple, paddle.Tensor] = {}


try:  # True while paddle.jit.to_static's bytecode tracer simulates the code (False when run)
    from paddle.jit.sot.psdb import in_sot as _in_sot
except ImportError:  # pragma: no cover - older Paddle

    def _in_sot() -> bool:
        return False


def building_graph() -> bool:
    """True while paddle.jit.to_static builds a graph (either mode): eager-side caches keyed by
    tensor identity or place must then be bypassed, the tensors being symbolic."""
    return not paddle.in_dynamic_mode() or _in_sot()


@paddle.jit.not_to_static
def _constant(shape: list[int], value: float, like: paddle.Tensor) -> paddle.Tensor:
    """A constant tensor of like's dtype and place, made once (a norm needs two per call); made
    afresh while a static graph is being built (a cached eager tensor cannot enter it)."""
    if building_graph():
        return paddle.full(shape, value, dtype=like.dtype)
    key = (tuple(shape), value, str(like.dtype), str(like.place))
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 64:  # shapes follow the token count: keep the cache small
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = paddle.full(shape, value, dtype=like.dtype)
    return t


class _RMSNormFunction(PyLayer):
    """RMSNorm as one autograd node: the same forward values as the op-by-op form (HF's), a
    hand-written backward. About 20 autograd nodes fewer per norm, and the weight gradient is a
    GEMV instead of Paddle's slow column reduction of a [H] x [N, H] broadcast. For fp32 CPU
    tensors both directions are one fused kernel each (kernels/cpu.py; mean of squares in fp64)."""

    @staticmethod
    def forward(ctx: object, x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
        ops = cpu_kernels.usable(x, weight)
        ctx.fused = ops is not None
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)  # a frozen input gets None
        if ops is not None:
            y, r = ops.glm_rms_norm(x, weight, eps)  # r [rows]: 1 / rms
            ctx.save_for_backward(x, r, weight)
            return y
        h = _as(x, "float32")
        r = paddle.rsqrt(_mean_square(h) + eps)  # [..., 1]
        n = _as(h * r.expand(h.shape), x.dtype)  # normalised, in the input dtype (as HF casts back)
        ctx.save_for_backward(n, r, weight)
        return weight.expand(n.shape) * n

    @staticmethod
    def backward(ctx: object, dy: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        if ctx.fused:
            x, r, weight = ctx.saved_tensor()
            grads = cpu_kernels.cpu_ops().glm_rms_norm_backward(x, weight, r, dy.contiguous())
        else:
            grads = _rms_norm_backward_ops(*ctx.saved_tensor(), dy)
        return tuple(grad if need else None for grad, need in zip(grads, ctx.needs))


def _rms_norm_backward_ops(
    n: paddle.Tensor, r: paddle.Tensor, weight: paddle.Tensor, dy: paddle.Tensor
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The backward with Paddle's ops, from the normalised input n and 1 / rms r [..., 1]."""
    H = n.shape[-1]
    rows = math.prod(n.shape[:-1])
    n32 = _as(n, "float32")
    dw = paddle.matmul(_constant([1, rows], 1.0, n32), (_as(dy, "float32") * n32).reshape([rows, H]))
    gn = _as(dy * weight.expand(dy.shape), "float32")
    # d/dh of h * rsqrt(mean(h^2) + eps) applied to gn: r * (gn - n * mean(gn * n))
    dot = _mean_last(gn * n32)
    dh = (gn - n32 * dot.expand(n32.shape)) * r.expand(n32.shape)
    return _as(dh, dy.dtype), _as(dw.reshape([H]), weight.dtype)


class RMSNorm(nn.Layer):
    """y = weight * (x / sqrt(mean(x^2) + eps)); statistics in fp32, cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return _RMSNormFunction.apply(x, self.weight, float(self.eps))

    def reference(self, x: paddle.Tensor) -> paddle.Tensor:
        """The op-by-op form (autograd through every op): what the tests hold `forward` to."""
        in_dtype = x.dtype
        h = x.astype("float32")
        var = _mean_square(h)
        h = h * paddle.rsqrt(var + self.eps)
        return self.weight * h.astype(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Layer):
    """LayerNorm with weight and bias (the DSA indexer's `k_norm`), statistics in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([hidden_size], is_bias=True, default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        in_dtype = x.dtype
        h = x.astype("float32")
        out = nn.functional.layer_norm(
            h, h.shape[-1:], weight=self.weight.astype("float32"), bias=self.bias.astype("float32"), epsilon=self.eps
        )
        return out.astype(in_dtype)
