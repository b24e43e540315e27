"""MLA's latent output projection: W_uv per head, then o_proj."""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .kernels import usable


def latent_out_proj(o: paddle.Tensor, w_uv: paddle.Tensor, w_o: paddle.Tensor) -> paddle.Tensor:
    """out = [o[h, :L] W_uv[h]]_h W_o for the latent attention output o [B, S, H, L + rope],
    w_uv [H, L, dv], w_o [H * dv, hidden] -> [B, S, hidden] (no bias).

    On fp32 CPU tensors W_uv runs per head on each head's first L columns (the compiled strided
    GEMMs, 2 H (L dv + dv hidden) flops a row); elsewhere W_uv is folded into o_proj once per call
    (a product of small weights, zero rows for the rope columns) and the output is one GEMM of
    2 H (L + rope) hidden flops a row. Same maths, other rounding.
    """
    B, S, H, D = o.shape
    L, dv = w_uv.shape[1], w_uv.shape[2]
    hidden = w_o.shape[1]
    ops = usable(o, w_o)
    if ops is not None and hasattr(ops, "glm_head_matmul"):
        v = _HeadMatmul.apply(o.reshape([B * S, H, D]), w_uv.contiguous(), ops)  # [B*S, H, dv]
        return paddle.matmul(v.reshape([B, S, H * dv]), w_o)
    w = paddle.matmul(w_uv, w_o.reshape([H, dv, hidden]))  # [H, L, hidden]
    w = paddle.concat([w, paddle.zeros([H, D - L, hidden], dtype=w.dtype)], axis=1).reshape([H * D, hidden])
    return paddle.matmul(o.reshape([B, S, H * D]), w)


def head_matmul(a: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """out[n, h] = a[n, h, :Din] @ w[h] for a [N, H, D >= Din], w [H, Din, Dout] -> [N, H, Dout]:
    the compiled per-head GEMMs where usable (no transposes), else a batched matmul over heads."""
    ops = usable(a, w)
    if ops is not None and hasattr(ops, "glm_head_matmul"):
        if not paddle.is_grad_enabled():
            return ops.glm_head_matmul(a, w)
        return _HeadMatmul.apply(a, w, ops)
    Din = w.shape[1]
    heads = a.transpose([1, 0, 2])  # [H, N, D]
    if Din < a.shape[2]:
        heads = heads[:, :, :Din]
    return paddle.matmul(heads, w).transpose([1, 0, 2])


class _HeadMatmul(PyLayer):
    """out[n, h] = a[n, h, :Din] @ w[h] for a [N, H, D >= Din], w [H, Din, Dout]: the compiled
    per-head GEMMs, forward and backward."""

    @staticmethod
    def forward(ctx: object, a: paddle.Tensor, w: paddle.Tensor, ops: object) -> paddle.Tensor:
        ctx.save_for_backward(a, w)
        ctx.ops, ctx.needs = ops, (not a.stop_gradient, not w.stop_gradient)
        return ops.glm_head_matmul(a, w)

    @staticmethod
    def backward(ctx: object, dout: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        a, w = ctx.saved_tensor()
        grads = ctx.ops.glm_head_matmul_backward(a, w, dout.contiguous())
        return tuple(grad if need else None for grad, need in zip(grads, ctx.needs))
