"""Per-head GEMMs on tiles of head-interleaved activations [B, S, H, d] (the layout the projections
produce): the per-head dense attention's query chunks run on them without transposing to a
head-major layout or copying key prefixes."""

from __future__ import annotations

import paddle

from .kernels import usable


def head_scores(
    x: paddle.Tensor, y: paddle.Tensor, b: int, r0: int, r1: int, n: int, h0: int, h1: int, alpha: float = 1.0
) -> paddle.Tensor:
    """s[g, i, j] = alpha * x[b, r0 + i, h0 + g] . y[b, j, h0 + g] for rows [r0, r1), keys j < n,
    heads [h0, h1) -> [h1 - h0, r1 - r0, n] (x [B, S, H, d], y [B, T, H, d])."""
    ops = usable(x, y)
    if ops is not None and hasattr(ops, "glm_head_scores"):
        return ops.glm_head_scores(x, y, b, r0, r1, n, h0, h1, float(alpha))
    xs = x[b, r0:r1, h0:h1].transpose([1, 0, 2])  # [G, C, d]
    ys = y[b, :n, h0:h1].transpose([1, 0, 2])  # [G, n, d]
    s = paddle.matmul(xs, ys, transpose_y=True)
    return s * alpha if alpha != 1.0 else s


def head_context_(
    p: paddle.Tensor, y: paddle.Tensor, out: paddle.Tensor, b: int, r0: int, h0: int, alpha: float = 1.0
) -> paddle.Tensor:
    """out[b, r0 + i, h0 + g] = alpha * p[g, i] @ y[b, :n, h0 + g], written into out [B, S, H, dy]
    in place, for p [G, C, n]; returns out."""
    G, C, n = p.shape
    ops = usable(p, y, out)
    if ops is not None and hasattr(ops, "glm_head_context"):
        ops.glm_head_context(p, y, out, b, r0, h0, float(alpha))
        return out
    part = paddle.matmul(p, y[b, :n, h0 : h0 + G].transpose([1, 0, 2]))  # [G, C, dy]
    out[b, r0 : r0 + C, h0 : h0 + G] = (part * alpha if alpha != 1.0 else part).transpose([1, 0, 2])
    return out


def head_accum_(
    p: paddle.Tensor, x: paddle.Tensor, z: paddle.Tensor, b: int, r0: int, h0: int, alpha: float = 1.0
) -> paddle.Tensor:
    """z[b, j, h0 + g] += alpha * sum_i p[g, i, j] x[b, r0 + i, h0 + g] for keys j < n, in place
    into z [B, T, H, d], for p [G, C, n] (a query chunk's key or value gradients); returns z."""
    G, C, n = p.shape
    ops = usable(p, x, z)
    if ops is not None and hasattr(ops, "glm_head_accum"):
        ops.glm_head_accum(p, x, z, b, r0, h0, float(alpha))
        return z
    part = paddle.matmul(p, x[b, r0 : r0 + C, h0 : h0 + G].transpose([1, 0, 2]), transpose_x=True)  # [G, n, d]
    part = part * alpha if alpha != 1.0 else part
    z[b, :n, h0 : h0 + G] = z[b, :n, h0 : h0 + G] + part.transpose([1, 0, 2])
    return z
