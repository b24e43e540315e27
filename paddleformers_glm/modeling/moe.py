"""Feed-forward blocks: the dense SwiGLU MLP and the GLM-5.2 MoE (sigmoid router + noaux_tc).

Router (always fp32, REFERENCE §1):
    s      = sigmoid(x W_gate)                       [N, E]
    choice = s + e_score_correction_bias             (bias only chooses; it is never a weight)
    group score = sum of the top-2 `choice` in each of n_group groups -> keep topk_group groups
    experts = top-k of `choice` inside the kept groups
    weights = s[experts] (/ sum if norm_topk_prob) * routed_scaling_factor
Experts keep per-expert fused `up_gate_proj` [H, 2I] (gate columns first) like the Fleet layout.

Routed compute: the (token, expert) assignments are sorted by expert once (one gather of the
inputs). On fp32 CPU tensors all experts then run as two grouped matmuls (one op each, forward
and backward: kernels/cpu.py, one MKL GEMM per expert on its rows, as HF's `grouped_mm`);
elsewhere (GPU, bf16, no compiled kernels) the sorted rows are split into per-expert views and
each expert runs one matmul pair. Either way the weighted outputs are added into the result in
ascending expert order per token, as HF's per-expert `index_add_` adds them. `MoE.grouped = True`
runs all experts as two batched matmuls over a zero-padded [E, capacity, H] layout instead
(bench/bench_moe.py compares).
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from ..configuration import GlmMoeDsaConfig
from ..kernels import cpu as cpu_kernels
from ..parallel.experts import ExpertParallelDispatcher, LocalExperts
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardSpec, mark_sequence_parallel, set_shard_spec
from ..parallel.topology import get_topology


class SwiGLUMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [H, 2I] weight (gate columns first).

    Dense layers and shared experts split the FFN over tensor parallel (column-parallel up_gate,
    row-parallel down; with sequence parallel the input is gathered and the output reduce-scattered).
    At TP 1 the layers are plain linears.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        topo = get_topology()
        sp = topo.sequence_parallel
        self.tensor_parallel = topo.tp_size > 1
        self.intermediate_size = intermediate_size
        self.up_gate_proj = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, sequence_parallel=sp, fuse_chunks=2
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, sequence_parallel=sp)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.tensor_parallel:  # the parallel layers bring their communication
            return self.down_proj(swiglu(self.up_gate_proj(x)))
        return swiglu_ffn(x, self)


class Expert(nn.Layer):
    """One routed expert, split over expert tensor parallel with no communication of its own (the
    dispatcher pools tokens before and reduce-scatters after); names as the Fleet layout."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        etp = get_topology().etp_size
        local = intermediate_size // etp
        self.up_gate_proj = nn.Linear(hidden_size, 2 * local, bias_attr=False)
        self.down_proj = nn.Linear(local, hidden_size, bias_attr=False)
        set_shard_spec(self.up_gate_proj.weight, ShardSpec(axis=1, group="etp", chunks=2, expert=True))
        set_shard_spec(self.down_proj.weight, ShardSpec(axis=0, group="etp", expert=True))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return swiglu_ffn(x, self)


def swiglu_ffn(x: paddle.Tensor, mlp: SwiGLUMLP | Expert) -> paddle.Tensor:
    """SwiGLUMLP's maths on its weights, without two sub-Layer calls (~30 us of Python each, which
    adds up over a loop of experts)."""
    return nn.functional.linear(swiglu(nn.functional.linear(x, mlp.up_gate_proj.weight)), mlp.down_proj.weight)


def swiglu(h: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up for h [..., 2I] (gate columns first): the compiled kernel where usable,
    else one split (whose gradient is one concat), silu and a product."""
    ops = cpu_kernels.usable(h)
    if ops is not None:
        return _SwiGLU.apply(h, None, ops)
    gate, up = paddle.split(h, 2, axis=-1)
    return nn.functional.silu(gate) * up


class _SwiGLU(PyLayer):
    """silu(gate) * up on h [..., 2I], times a per-row scale [rows] if given, as one compiled
    kernel each way (kernels/cpu.py)."""

    @staticmethod
    def forward(ctx: object, h: paddle.Tensor, scale: paddle.Tensor | None, ops: object) -> paddle.Tensor:
        s = scale if scale is not None else paddle.empty([0], dtype="float32")
        ctx.save_for_backward(h, s)
        ctx.ops, ctx.scaled = ops, scale is not None
        ctx.needs = (not h.stop_gradient, scale is not None and not scale.stop_gradient)
        return ops.glm_swiglu(h, s)

    @staticmethod
    def backward(ctx: object, dact: paddle.Tensor) -> paddle.Tensor | tuple | None:
        h, s = ctx.saved_tensor()
        dh, ds = ctx.ops.glm_swiglu_backward(h, s, dact.contiguous())
        dh = dh if ctx.needs[0] else None
        return (dh, ds if ctx.needs[1] else None) if ctx.scaled else dh


class _GroupedMatmul(PyLayer):
    """Rows of x [A, K] sorted by expert (`counts` per expert) times each expert's own weight
    [K, N], as one op forward and one backward (the compiled CPU kernels' grouped matmul)."""

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


class TopkRouter(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.weight = self.create_parameter(
            [config.hidden_size, self.num_experts],
            dtype="float32",
            default_initializer=nn.initializer.Normal(0.0, config.initializer_range),
        )
        # A persistable fp32 buffer: updated by aux-loss-free balancing rules, never by the optimizer.
        self.register_buffer("e_score_correction_bias", paddle.zeros([self.num_experts], dtype="float32"))

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [N, H] -> (logits [N, E] fp32, weights [N, k] fp32, expert ids [N, k] int64)."""
        logits = paddle.matmul(x.astype("float32"), self.weight)
        scores = nn.functional.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.detach()
        with paddle.no_grad():
            c = choice.detach()
            if self.n_group > 1:
                N = c.shape[0]
                grouped = c.reshape([N, self.n_group, self.num_experts // self.n_group])
                group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(-1)  # [N, G]
                group_idx = paddle.topk(group_scores, self.topk_group, axis=-1)[1]
                group_mask = paddle.put_along_axis(
                    paddle.zeros_like(group_scores), group_idx, paddle.ones_like(group_idx, "float32"), axis=-1
                )
                expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape([N, self.num_experts]) > 0
                c = paddle.where(expert_mask, c, paddle.full_like(c, float("-inf")))
            expert_ids = paddle.topk(c, self.top_k, axis=-1)[1]
        weights = paddle.take_along_axis(scores, expert_ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, expert_ids


class MoE(nn.Layer):
    """Router + routed experts + shared experts.

    At world 1 the routed experts run locally (below). Under TP / EP / ETP the experts this rank
    owns (`mlp.experts.<global id>`) run behind `parallel.experts.ExpertParallelDispatcher`, which
    moves each token's assignments to the owning ranks by all-to-all and brings the results back;
    the router is replicated (under sequence parallel it routes this rank's tokens, so its
    gradient is summed over TP), the shared experts are split like a dense FFN.
    """

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        H, I = config.hidden_size, config.moe_intermediate_size
        topo = get_topology()
        self.num_experts = config.n_routed_experts
        self.gate = TopkRouter(config)
        mark_sequence_parallel(self.gate, enabled=topo.sequence_parallel)
        distributed = topo.tp_size > 1 or topo.ep_size > 1 or topo.etp_size > 1
        self.dispatcher = ExpertParallelDispatcher(self.num_experts, topo=topo) if distributed else None
        ids = self.dispatcher.local_expert_ids if self.dispatcher else list(range(self.num_experts))
        self.experts = LocalExperts(ids, lambda _e: Expert(H, I))
        self.shared_experts = SwiGLUMLP(H, I * config.n_shared_experts) if config.n_shared_experts else None

    def expert(self, e: int) -> Expert:
        return self.experts[str(e)]

    # False (default): the grouped kernel on fp32 CPU, else one matmul pair per expert on its sorted
    # rows; True: padded batched matmuls over all experts. Same routing, same sums to rounding;
    # bench/bench_moe.py measured the padded form slower than both (the padding and weight
    # stacking cost what the fewer launches save).
    grouped = False

    def routed(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """sum_k w_k * expert_{e_k}(x) for x [N, H], each token's terms added in ascending expert order
        (the order of HF's per-expert `index_add_`: the per-expert loop is bitwise HF's sums; the
        grouped kernel applies w_k before the down projection, so it rounds differently)."""
        N, K = expert_ids.shape
        if not paddle.in_dynamic_mode():  # a static graph (to_static) needs shapes known in advance
            return self._static_routed(x, weights, expert_ids)
        with paddle.no_grad():
            flat_e = expert_ids.reshape([-1])  # assignment a = token * K + j
            order = paddle.argsort(flat_e, stable=True)  # assignments grouped by expert, then token
            counts = paddle.bincount(flat_e, minlength=self.num_experts)
        if self.grouped:
            return self._grouped(x, weights, expert_ids, order, counts)
        sizes = counts.tolist()  # split sizes must be Python ints: the one host read per layer
        w_sorted = paddle.gather(weights.reshape([-1]), order).astype(x.dtype)  # [N*K] by expert
        x_sorted = paddle.gather(x, order // K)
        experts = [self.expert(e) for e in range(self.num_experts)]
        ops = cpu_kernels.usable(x, experts[0].up_gate_proj.weight)
        if ops is not None and hasattr(ops, "glm_grouped_matmul"):
            w1 = [e.up_gate_proj.weight for e in experts]  # E x [H, 2I]
            w2 = [e.down_proj.weight for e in experts]  # E x [I, H]
            # the routing weight scales each row before the down projection (linear: the same
            # product as HF's scaling after it, another rounding), fused into the SwiGLU kernel
            act = _SwiGLU.apply(_GroupedMatmul.apply(sizes, ops, x_sorted, *w1), w_sorted, ops)
            y = _GroupedMatmul.apply(sizes, ops, act, *w2)
            # one index_add over rows sorted by (expert, token): each token's terms in expert order
            return paddle.index_add(paddle.zeros_like(x), order // K, 0, y)
        with paddle.no_grad():
            tokens = paddle.split(order // K, sizes) if len(sizes) > 1 else [order // K]
        xs = paddle.split(x_sorted, sizes) if len(sizes) > 1 else [x_sorted]
        w_sorted = w_sorted.unsqueeze(-1)
        ws = paddle.split(w_sorted, sizes) if len(sizes) > 1 else [w_sorted]
        out = paddle.zeros_like(x)
        for e, n in enumerate(sizes):
            if n:
                out = out.index_add_(tokens[e], 0, swiglu_ffn(xs[e], experts[e]) * ws[e])
        return out

    def _static_routed(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """The routed sum with no data-dependent shape, for graphs built by paddle.jit.to_static:
        every expert runs on every token and is weighted by its routing weight (0 when not chosen),
        added in ascending expert order like the per-expert loop. E / K times the flops: an
        export form, not a training one."""
        out = paddle.zeros_like(x)
        for e in range(self.num_experts):
            w_e = paddle.where(expert_ids == e, weights, paddle.zeros_like(weights)).sum(axis=-1, keepdim=True)
            out = out + swiglu_ffn(x, self.expert(e)) * w_e.astype(x.dtype)
        return out

    def _grouped(
        self,
        x: paddle.Tensor,
        weights: paddle.Tensor,
        expert_ids: paddle.Tensor,
        order: paddle.Tensor,
        counts: paddle.Tensor,
    ) -> paddle.Tensor:
        """The routed sum from two batched matmuls over a zero-padded [E, capacity, H] layout."""
        E, H = self.num_experts, x.shape[-1]
        N, K = expert_ids.shape
        NK = N * K
        cap = int(counts.max())  # the one host read: the padded block's shape
        with paddle.no_grad():
            flat_e = expert_ids.reshape([-1])
            starts = paddle.cumsum(counts) - counts
            e_sorted = paddle.gather(flat_e, order)
            slot = e_sorted * cap + (paddle.arange(NK, dtype="int64") - paddle.gather(starts, e_sorted))
            # padded slot -> token row (row N of the extended input is zeros), assignment -> slot
            token_of_slot = paddle.scatter(paddle.full([E * cap], N, dtype="int64"), slot, order // K)
            slot_of_assign = paddle.scatter(paddle.zeros([NK], dtype="int64"), order, slot).reshape([N, K])
            perm = paddle.argsort(expert_ids, axis=-1)  # a token's experts in ascending id order
            slot_of_assign = paddle.take_along_axis(slot_of_assign, perm, axis=-1).reshape([-1])
        x_ext = paddle.concat([x, paddle.zeros([1, H], dtype=x.dtype)], axis=0)
        x_pad = paddle.gather(x_ext, token_of_slot).reshape([E, cap, H])
        experts = [self.expert(e) for e in range(E)]
        w1 = paddle.stack([e.up_gate_proj.weight for e in experts])  # [E, H, 2I]
        w2 = paddle.stack([e.down_proj.weight for e in experts])  # [E, I, H]
        gate, up = paddle.split(paddle.matmul(x_pad, w1), 2, axis=-1)
        y = paddle.matmul(nn.functional.silu(gate) * up, w2)  # [E, cap, H]
        w = paddle.take_along_axis(weights, perm, axis=-1).astype(x.dtype)  # [N, K]
        y = paddle.gather(y.reshape([E * cap, H]), slot_of_assign).reshape([N, K, H]) * w.unsqueeze(-1)
        parts = paddle.unbind(y, axis=1)
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        if self.dispatcher is not None:
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            if shared is not None:
                # Collectives must run in the same order on every rank. The shared experts (TP
                # group) and the dispatcher (EP / TP groups) are independent branches, and the
                # ranks' graphs differ inside the dispatcher (each rank holds other experts and
                # tokens), so backward could visit them in a different order per rank. A zero
                # dependency makes the shared branch's backward run after the dispatcher's.
                flat = flat + 0.0 * shared.reshape(flat.shape)
            _, weights, expert_ids = self.gate(flat)
            out = self.dispatcher(flat, expert_ids, weights, self.experts).reshape(shape)
            return out + shared if shared is not None else out
        _, weights, expert_ids = self.gate(flat)
        out = self.routed(flat, weights, expert_ids).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
