"""Summed cross entropy of rows of logits against integer targets."""

from __future__ import annotations

import functools

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .kernels import computes_on_cpu, usable


def cross_entropy_sum(logits: paddle.Tensor, target: paddle.Tensor, ignore_index: int) -> paddle.Tensor:
    """sum over rows of -log softmax(logits)[target] for logits [N, V] and target [N] int64, rows
    whose target is `ignore_index` adding 0. One multi-threaded compiled pass each way on CPU
    (Paddle's CPU kernel runs on one thread), else Paddle's cross entropy with non-finite rows
    made non-finite as the kernel's are (:func:`with_nonfinite_rows`). A target of another length
    than the rows is refused (the compiled pass would read past its end)."""
    n, t = logits.shape[0], target.shape[0]
    if n >= 0 and t >= 0 and (n != t or len(target.shape) != 1):  # -1: a graph's unknown size
        raise ValueError(f"cross_entropy_sum: target of shape {list(target.shape)} for {n} rows of logits")
    ops = usable(logits, target)
    if ops is not None:
        return _RowCrossEntropy.apply(logits, target, ignore_index, ops).sum()
    rows = nn.functional.cross_entropy(logits, target.unsqueeze(-1), ignore_index=ignore_index, reduction="none")
    return with_nonfinite_rows(rows.squeeze(-1), logits, target, ignore_index).sum()


def log_softmax(x: paddle.Tensor, axis: int = -1) -> paddle.Tensor:
    """log softmax(x) along ``axis``, exact on the CPU too: there it is ``x - logsumexp(x)``, since
    Paddle's CPU ``log_softmax`` clips x - max at -64 (an entry 100 below its row's max gets -64);
    elsewhere Paddle's ``log_softmax``."""
    if computes_on_cpu(x):
        return x - paddle.logsumexp(x, axis=axis, keepdim=True)
    return nn.functional.log_softmax(x, axis=axis)


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
    and one gather, nothing kept for backward.

    Also a finite row whose target logit lies more than 64 below its max, where Paddle's CPU op
    computed (:func:`_cpu_softmax_floor`): its softmax clips x - max at -64, so the loss was
    64 + log(sum) for the exact (max - x[target]) + log(sum) (torch: 100.0 for logits [0, -100],
    target 1; Paddle 64.0). The difference is added (the gradient was right: the clipped
    probabilities are within e^-64 of the exact ones)."""
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
        offset = paddle.where(inf_row, paddle.full_like(m, float("inf")), paddle.zeros_like(m))
        floor = _cpu_softmax_floor() if computes_on_cpu(x) else None
        if floor is not None:  # the part of max - x[target] the clipped softmax left out
            ct = "float64" if x.dtype == paddle.float64 else "float32"
            gap = m.astype(ct) - picked.astype(ct)
            far = kept & ~nan_row & ~inf_row & (gap > floor)
            offset = paddle.where(far, gap - floor, offset.astype(ct))
        offset = offset.astype(rows.dtype)
    return rows * factor + offset


@functools.cache
@paddle.jit.not_to_static
def _cpu_softmax_floor() -> float | None:
    """The floor Paddle's CPU cross entropy puts under a target's shifted logit x[t] - max, measured
    once (64.0 in Paddle 3.3: its CPU softmax clips x - max at -64); None where it gives the exact
    loss."""
    cpu = paddle.CPUPlace()
    with paddle.base.dygraph.guard(), paddle.no_grad():  # eager even when first asked while a graph is built
        x = paddle.to_tensor([[0.0, -1000.0]], dtype="float32", place=cpu)
        loss = float(nn.functional.cross_entropy(x, paddle.to_tensor([[1]], dtype="int64", place=cpu)))
    return loss if loss < 999.0 else None


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
