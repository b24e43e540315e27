"""Summed cross entropy of rows of logits against integer targets."""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .kernels import usable


def cross_entropy_sum(logits: paddle.Tensor, target: paddle.Tensor, ignore_index: int) -> paddle.Tensor:
    """sum over rows of -log softmax(logits)[target] for logits [N, V] and target [N] int64, rows
    whose target is `ignore_index` adding 0. One multi-threaded compiled pass each way on CPU
    (Paddle's CPU kernel runs on one thread), else Paddle's cross entropy."""
    ops = usable(logits) if target.place.is_cpu_place() else None
    if ops is not None:
        return _RowCrossEntropy.apply(logits, target, ignore_index, ops).sum()
    return nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")


class _RowCrossEntropy(PyLayer):
    """Per-row cross entropy of logits [N, V] against target [N] (0 on ignored rows), the
    compiled kernel each way."""

    @staticmethod
    def forward(
        ctx: object, logits: paddle.Tensor, target: paddle.Tensor, ignore_index: int, ops: object
    ) -> paddle.Tensor:
        loss, lse = ops.glm_cross_entropy(logits, target, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.ops, ctx.ignore_index = ops, ignore_index
        return loss

    @staticmethod
    def backward(ctx: object, g: paddle.Tensor) -> tuple[paddle.Tensor, None]:
        logits, target, lse = ctx.saved_tensor()
        return ctx.ops.glm_cross_entropy_backward(logits, target, lse, g.contiguous(), ctx.ignore_index), None
