"""The MoE router's choice: sigmoid scores -> each token's experts and routing weights (noaux_tc)."""

from __future__ import annotations

import paddle

from .kernels import usable
from .selection import topk


def route(
    scores: paddle.Tensor, bias: paddle.Tensor, n_group: int, topk_group: int, top_k: int, norm: bool, scaling: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(weights [N, k] fp32, expert ids [N, k] int64) for sigmoid scores [N, E] fp32 and the
    selection bias [E] (it only chooses; it is never a weight):

        choice = scores + bias
        group score = sum of the top-2 choices in each of n_group groups -> keep topk_group groups
        experts = top-k of choice inside the kept groups
        weights = scores[experts] (/ (sum + 1e-20) if norm) * scaling

    The weights carry the scores' gradient. Without autograd (decoding) and on fp32 CPU tensors it
    is one compiled pass; otherwise Paddle's ops (the selection itself never has a gradient)."""
    if not paddle.is_grad_enabled():
        ops = usable(scores, bias)
        if ops is not None:
            return tuple(ops.glm_router_topk(scores, bias, n_group, topk_group, top_k, norm, scaling))  # type: ignore[return-value]
    with paddle.no_grad():
        c = scores.detach() + bias.detach()
        if n_group > 1:
            N, E = c.shape
            grouped = c.reshape([N, n_group, E // n_group])
            group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(-1)  # [N, G]
            group_idx = topk(group_scores, topk_group)[1]
            group_mask = paddle.put_along_axis(
                paddle.zeros_like(group_scores), group_idx, paddle.ones_like(group_idx, "float32"), axis=-1
            )
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape([N, E]) > 0
            c = paddle.where(expert_mask, c, paddle.full_like(c, float("-inf")))
        expert_ids = topk(c, top_k)[1]  # ties: HF's choice
    weights = paddle.take_along_axis(scores, expert_ids, axis=-1)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, expert_ids
