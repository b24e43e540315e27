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
    in-place add and softmax (fresh allocations cost page faults)."""
    ops = usable(s, mask)
    if ops is not None:
        return ops.glm_masked_softmax(s, mask)
    s = s.add_(mask.unsqueeze(1).expand(s.shape))  # rebound: to_static runs add_ out of place
    return nn.functional.softmax_(s, axis=-1)


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
