"""The attention cores' masked softmax and its backward."""

from __future__ import annotations

import paddle
from paddle import nn

from .kernels import usable

_SOFTMAX_GRAD = getattr(paddle._C_ops, "softmax_grad", None)


def masked_softmax_(s: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
    """softmax(s + mask, -1) in place, the mask shared by the heads: s [G, H, T] with mask [G, T],
    or s [G, H, I, T] with mask [G, I, T]. The fused CPU kernel where usable; otherwise an
    explicit `expand` of the mask (Paddle's CPU broadcast over a middle axis is much slower) and
    in-place add and softmax (fresh allocations cost page faults).

    A row holding a NaN or +inf gives a NaN row either way (as torch's softmax does): Paddle's CPU
    softmax skips those values and returns finite probabilities, so the fallback marks such rows
    itself (one max per row; Paddle's max propagates a NaN)."""
    ops = usable(s, mask)
    if ops is not None:
        return ops.glm_masked_softmax(s, mask)
    s = s.add_(mask.unsqueeze(1).expand(s.shape))  # rebound: to_static runs add_ out of place
    m = s.max(axis=-1, keepdim=True)
    factor = paddle.where(paddle.isnan(m) | (m == float("inf")), paddle.full_like(m, float("nan")), paddle.ones_like(m))
    s = nn.functional.softmax_(s, axis=-1)
    return s.multiply_(factor)  # 1 on a finite row (exact), NaN on a row that held a NaN or +inf


def softmax_backward(p: paddle.Tensor, dp: paddle.Tensor) -> paddle.Tensor:
    """p * (dp - sum(p * dp, -1)), into dp where it can: the fused CPU kernel, else Paddle's fused
    kernel (one pass, faster than op by op) where exposed, else op by op."""
    ops = usable(p, dp)
    if ops is not None:
        return ops.glm_softmax_backward(p, dp)
    if _SOFTMAX_GRAD is not None:
        return _SOFTMAX_GRAD(p, dp, -1)
    dp.subtract_((p * dp).sum(axis=-1, keepdim=True).expand(dp.shape))
    return dp.multiply_(p)
