"""Rotary embedding applied per head, and rope fused with its concatenation."""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .kernels import usable
from .norm import building_graph

_ROPE_CACHE: dict[tuple, tuple] = {}


@paddle.jit.not_to_static
def _expanded_table(
    cos: paddle.Tensor, sin: paddle.Tensor, B: int, S: int, H: int, r: int, dtype: paddle.dtype
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos/sin expanded to [B, S, H, r/2], cached per shape for the current table (eager only)."""
    eager = not building_graph()  # no eager cache for symbolic tensors
    shape = (B, S, H, r, dtype)
    hit = _ROPE_CACHE.get(shape) if eager else None  # one entry per shape: 1-, H- and Hi-head tensors in turn
    if hit is not None and hit[0] is cos and hit[1] is sin:  # type: ignore[index]
        return hit[2], hit[3]  # type: ignore[index]
    c, s_ = (t.unsqueeze(2).astype(dtype).expand([B, S, H, r // 2]) for t in (cos, sin))
    if eager:
        if any(v[0] is not cos or v[1] is not sin for v in _ROPE_CACHE.values()):  # a new table: drop the old
            _ROPE_CACHE.clear()
        _ROPE_CACHE[shape] = (cos, sin, c, s_)
    return c, s_


def rope_heads(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleave: bool) -> paddle.Tensor:
    """`modeling.rope.apply_rope` for x [B, S, H, dim]: element for element the same arithmetic,
    but cos/sin are expanded to the H heads once per table (cached) instead of broadcast in every
    multiply; Paddle's CPU broadcasting over a middle axis is far slower than a same-shape multiply."""
    B, S, H, r = x.shape
    c, s_ = _expanded_table(cos, sin, B, S, H, r, x.dtype)
    if interleave:  # pairs (x0, x1), (x2, x3), ...: unbind's gradient (a stack) beats two strided-slice grads
        x1, x2 = paddle.unbind(x.reshape([B, S, H, r // 2, 2]), axis=-1)
    else:
        x1, x2 = paddle.split(x, 2, axis=-1)
    return paddle.concat([x1 * c - x2 * s_, x2 * c + x1 * s_], axis=-1)


def rope_concat(
    a: paddle.Tensor,
    r: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    interleave: bool,
    rope_first: bool = False,
) -> paddle.Tensor:
    """concat([a, rope_heads(r)], -1), or [rope(r), a] with rope_first, for a [B, S, (H,) Da] and
    r [B, S, (H,) Dr]: the fused CPU kernel (one pass, no concat) where usable, bitwise the same."""
    ops = usable(a, r, cos, sin)
    if ops is not None:
        if not paddle.is_grad_enabled():  # no autograd node to record: the kernel alone (decoding)
            H = a.shape[2] if a.ndim == 4 else 1
            return ops.glm_rope_concat(a, r, cos, sin, H, a.shape[1], rope_first, interleave)
        return _RopeConcat.apply(a, r, cos, sin, interleave, rope_first, ops)
    roped = rope_heads(r if r.ndim == 4 else r.unsqueeze(2), cos, sin, interleave)
    roped = roped if r.ndim == 4 else roped.squeeze(2)
    return paddle.concat([roped, a] if rope_first else [a, roped], axis=-1)


class _RopeConcat(PyLayer):
    """[a, rope(r)] (or [rope(r), a]) as one compiled kernel each way."""

    @staticmethod
    def forward(
        ctx: object,
        a: paddle.Tensor,
        r: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        interleave: bool,
        rope_first: bool,
        ops: object,
    ) -> paddle.Tensor:
        H, S = (a.shape[2] if a.ndim == 4 else 1), a.shape[1]
        ctx.save_for_backward(cos, sin)
        ctx.args = (a.shape[-1], H, S, rope_first, interleave)
        ctx.ops, ctx.needs = ops, (not a.stop_gradient, not r.stop_gradient)
        return ops.glm_rope_concat(a, r, cos, sin, H, S, rope_first, interleave)

    @staticmethod
    def backward(ctx: object, dout: paddle.Tensor) -> tuple:
        cos, sin = ctx.saved_tensor()
        da, dr = ctx.ops.glm_rope_concat_backward(dout.contiguous(), cos, sin, *ctx.args)
        return (da if ctx.needs[0] else None), (dr if ctx.needs[1] else None), None, None
