"""Summed cross entropy of rows of logits against integer targets."""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .kernels import usable


def cross_entropy_sum(logits: paddle.Tensor, target: paddle.Tensor, ignore_index: int) -> paddle.Tensor:
    """sum over rows of -log softmax(logits)[target] for logits [N, V] and target [N] int64, rows
    whose target is `ignore_index` adding 0. One multi-threaded compiled pass each way on CPU
    (Paddle's CPU kernel runs on one thread), else Paddle's cross entropy with non-finite rows
    made non-finite as the kernel's are (:func:`with_nonfinite_rows`)."""
    ops = usable(logits) if target.place.is_cpu_place() else None
    if ops is not None:
        return _RowCrossEntropy.apply(logits, target, ignore_index, ops).sum()
    rows = nn.functional.cross_entropy(logits, target.unsqueeze(-1), ignore_index=ignore_index, reduction="none")
    return with_nonfinite_rows(rows.squeeze(-1), logits, target, ignore_index).sum()


def with_nonfinite_rows(
    rows: paddle.Tensor, logits: paddle.Tensor, target: paddle.Tensor, ignore_index: int
) -> paddle.Tensor:
    """Per-row losses `rows` [...] of Paddle's cross entropy of logits [..., V] against target [...],
    made non-finite where the exact cross entropy is (as torch's and the compiled kernel's are):
    a row holding a NaN or +inf, or only -inf, gives NaN (value and the row's gradient); a row
    whose target logit alone is -inf gives +inf (its gradient stays finite). Ignored rows are left.

    Why: Paddle's CPU ``cross_entropy`` (and ``softmax``) skip a NaN or +inf in the row and clamp
    the log of a zero probability, giving finite losses and gradients where torch gives NaN/inf,
    so a run whose logits overflowed would train on silently.  Cost: one max over the vocabulary
    and one gather, nothing kept for backward."""
    with paddle.no_grad():
        x = logits.detach()
        m = x.max(axis=-1)  # NaN when the row holds one (Paddle's max propagates it)
        V = x.shape[-1]
        safe = paddle.clip(target, 0, V - 1).astype("int64")
        picked = paddle.take_along_axis(x, safe.unsqueeze(-1), axis=-1).squeeze(-1)
        kept = target != ignore_index
        nan_row = (paddle.isnan(m) | (m == float("inf")) | (m == float("-inf"))) & kept
        inf_row = (picked == float("-inf")) & kept & ~nan_row
        factor = paddle.where(nan_row, paddle.full_like(m, float("nan")), paddle.ones_like(m)).astype(rows.dtype)
        offset = paddle.where(inf_row, paddle.full_like(m, float("inf")), paddle.zeros_like(m)).astype(rows.dtype)
    return rows * factor + offset


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
