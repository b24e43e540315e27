"""The routed experts' SwiGLU FFNs over rows sorted by expert, summed back per token."""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .activation import SwiGLUKernel, swiglu
from .kernels import usable
from .norm import cast
from .selection import bin_counts


def routed_experts(
    x: paddle.Tensor,
    tokens: paddle.Tensor,
    sizes: list[int],
    row_weights: paddle.Tensor,
    up_gate: list[paddle.Tensor],
    down: list[paddle.Tensor],
) -> paddle.Tensor:
    """sum over a token's assignments of w * down_e(swiglu(up_gate_e(x))), for x [N, H].

    The assignments arrive sorted by expert: `tokens` [A] is each assignment's token, `sizes` the
    number of assignments per expert (Python ints), `row_weights` [A] the routing weights (the
    router's fp32); `up_gate` / `down` hold each expert's [H, 2I] / [I, H] weight. Each token's
    terms are added in ascending expert order.

    For a low-precision x (bf16) the products w * ffn and their sum per token are taken in fp32
    and rounded to x's dtype once, as HF's default experts form (``grouped_mm``) does.

    On fp32 CPU tensors all experts run as two grouped matmuls (one compiled op each way, one MKL
    GEMM per expert on its rows) with the routing weight applied inside the SwiGLU kernel, before
    the down projection (linear: the same product as HF's scaling after it, another rounding);
    elsewhere each expert runs one matmul pair on its rows (bitwise HF's sums).
    """
    x_sorted = paddle.gather(x, tokens)
    ops = usable(x, up_gate[0], row_weights)
    if ops is not None and hasattr(ops, "glm_grouped_matmul"):
        act = SwiGLUKernel.apply(_GroupedMatmul.apply(sizes, ops, x_sorted, *up_gate), row_weights, ops)
        y = _GroupedMatmul.apply(sizes, ops, act, *down)
        # one index_add over rows sorted by (expert, token): each token's terms in expert order
        return paddle.index_add(paddle.zeros_like(x), tokens, 0, y)
    with paddle.no_grad():
        token_parts = paddle.split(tokens, sizes) if len(sizes) > 1 else [tokens]
    xs = paddle.split(x_sorted, sizes) if len(sizes) > 1 else [x_sorted]
    row_weights = row_weights.unsqueeze(-1)
    ws = paddle.split(row_weights, sizes) if len(sizes) > 1 else [row_weights]
    out = paddle.zeros(x.shape, dtype=row_weights.dtype)
    for e, n in enumerate(sizes):
        if n:
            ffn = nn.functional.linear(swiglu(nn.functional.linear(xs[e], up_gate[e])), down[e])
            out = out.index_add_(token_parts[e], 0, cast(ffn, ws[e].dtype) * ws[e])
    return cast(out, x.dtype)


def routed_rows(
    x: paddle.Tensor,
    expert_ids: paddle.Tensor,
    weights: paddle.Tensor,
    up_gate: list[paddle.Tensor],
    down: list[paddle.Tensor],
) -> paddle.Tensor:
    """`routed_experts` straight from the router's choice: x [N, H], expert_ids / weights [N, k] ->
    [N, H], each token's terms added in ascending expert order.

    A few tokens without autograd (decoding: N k <= E) on fp32 CPU tensors run one compiled op,
    which reads the ids itself: no sort, no per-expert counts read back to Python, each assignment
    a one-row GEMM pair, the weight applied after the down projection (HF's order). Otherwise the
    assignments are sorted by expert for `routed_experts` (the counts: the one host read)."""
    N, K = expert_ids.shape
    ops = usable(x, expert_ids, weights, up_gate[0])
    if ops is not None and hasattr(ops, "glm_routed_rows") and not paddle.is_grad_enabled() and N * K <= len(up_gate):
        return ops.glm_routed_rows(x, expert_ids, weights.astype("float32"), up_gate, down)
    with paddle.no_grad():
        flat_e = expert_ids.reshape([-1])  # assignment a = token * K + j
        order = paddle.argsort(flat_e, stable=True)  # assignments grouped by expert, then token
        sizes = bin_counts(flat_e, len(up_gate)).tolist()  # split sizes: Python ints, the one read
    w_sorted = paddle.gather(weights.reshape([-1]), order)  # [N*K] by expert, fp32
    return routed_experts(x, order // K, sizes, w_sorted, up_gate, down)


class _GroupedMatmul(PyLayer):
    """Rows of x [A, K] sorted by expert (`counts` per expert) times each expert's own weight
    [K, N], as one op forward and one backward (the compiled grouped matmul)."""

    @staticmethod
    def forward(
        ctx: object, counts: list[int], ops: object, x: paddle.Tensor, *weights: paddle.Tensor
    ) -> paddle.Tensor:
        ctx.save_for_backward(x, *weights)
        ctx.counts, ctx.ops = counts, ops
        ctx.needs = [not t.stop_gradient for t in (x, *weights)]
        return ops.glm_grouped_matmul(x, list(weights), counts)

    @staticmethod
    def backward(ctx: object, dy: paddle.Tensor) -> tuple[paddle.Tensor | None, ...]:
        x, *weights = ctx.saved_tensor()
        dws = [paddle.empty(w.shape, dtype=w.dtype) for w in weights]  # the kernel fills them
        dx = ctx.ops.glm_grouped_matmul_backward(x, weights, dy.contiguous(), dws, ctx.counts)[0]
        return tuple(grad if need else None for grad, need in zip((dx, *dws), ctx.needs))
