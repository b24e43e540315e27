"""Feed-forward blocks: the dense SwiGLU MLP and the GLM-5.2 MoE (sigmoid router + noaux_tc, always
fp32; docs/model.md "MoE"). Experts keep per-expert fused `up_gate_proj` [H, 2I] (gate columns
first) like the Fleet layout.

Routed compute: `ops.routed_rows` sorts the (token, expert) assignments by expert once and
`ops.routed_experts` runs them (`MoE.routed`); `MoE(config, routed_form="padded")` runs all experts as
two batched matmuls over a zero-padded [E, capacity, H] layout instead (bench/bench_moe.py compares).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from ..configuration import GlmMoeDsaConfig
from ..ops import bin_counts, route, routed_rows, silu, swiglu
from ..ops.norm import capturing_cuda_graph, cast
from ..parallel import comm
from ..parallel.context import zigzag_positions
from ..parallel.experts import ExpertParallelDispatcher, LocalExperts
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardSpec, mark_sequence_parallel, set_shard_spec
from ..parallel.recompute import replaying
from ..parallel.topology import Topology


class SwiGLUMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [H, 2I] weight (gate columns first).

    Dense layers and shared experts split the FFN over tensor parallel (column-parallel up_gate,
    row-parallel down; with sequence parallel the input is gathered and the output reduce-scattered).
    At TP 1 the layers are plain linears.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, topo: Topology) -> None:
        super().__init__()
        sp = topo.sequence_parallel
        self.tensor_parallel = topo.tp_size > 1
        self.up_gate_proj = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, sequence_parallel=sp, fuse_chunks=2, topo=topo
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, sequence_parallel=sp, topo=topo)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.tensor_parallel:  # the parallel layers bring their communication
            return self.down_proj(swiglu(self.up_gate_proj(x)))
        return swiglu_ffn(x, self)


class Expert(nn.Layer):
    """One routed expert, split over expert tensor parallel with no communication of its own (the
    dispatcher pools tokens before and reduce-scatters after); names as the Fleet layout."""

    def __init__(self, hidden_size: int, intermediate_size: int, etp: int = 1) -> None:
        super().__init__()
        local = intermediate_size // etp
        self.up_gate_proj = nn.Linear(hidden_size, 2 * local, bias_attr=False)
        self.down_proj = nn.Linear(local, hidden_size, bias_attr=False)
        set_shard_spec(self.up_gate_proj.weight, ShardSpec(axis=1, group="etp", chunks=2, expert=True), etp)
        set_shard_spec(self.down_proj.weight, ShardSpec(axis=0, group="etp", expert=True), etp)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return swiglu_ffn(x, self)


def swiglu_ffn(x: paddle.Tensor, mlp: SwiGLUMLP | Expert) -> paddle.Tensor:
    """SwiGLUMLP's maths on its weights, without two sub-Layer calls (~30 us of Python each, which
    adds up over a loop of experts)."""
    return nn.functional.linear(swiglu(nn.functional.linear(x, mlp.up_gate_proj.weight)), mlp.down_proj.weight)


def sequence_aux_loss(
    scores: paddle.Tensor,
    expert_ids: paddle.Tensor,
    batch_shape: tuple[int, ...] | None,
    num_experts: int,
    tp_group: object = None,
    tp_size: int = 1,
    valid: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i * P_i`` (docs/model.md, "MoE balancing"),
    summed over this micro-batch's sequences; the caller applies the coefficient and the mean.

    Under sequence parallel (``tp_group`` given) the counts ``f`` are summed over the group and
    ``P`` is this slice's share, so the ranks' terms and router gradients add up to the full ones.
    ``valid`` [N] bool (None: every row is a real token): padding rows count neither in ``f``,
    ``P`` nor a sequence's length T; a sequence without a real token adds 0.
    """
    N, E = scores.shape
    K = expert_ids.shape[-1]
    B = int(batch_shape[0]) if batch_shape is not None and len(batch_shape) > 1 else 1
    S = N // B
    probs = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    if valid is None:
        T = S * tp_size
        P = probs.reshape([B, S, E]).sum(1) / T  # [B, E]
    else:
        m = valid.astype(probs.dtype).reshape([B, S, 1])
        with paddle.no_grad():
            T = m.sum(1)  # [B, 1]: each sequence's real tokens (over the group below)
            if tp_group is not None:
                T = comm.all_reduce(T, tp_group)
            T = paddle.clip(T, min=1.0)  # a sequence of padding only: f = P = 0
        P = (probs.reshape([B, S, E]) * m).sum(1) / T
    with paddle.no_grad():
        seq = (paddle.arange(N, dtype="int64") // S).unsqueeze(-1)  # [N, 1]: each row's sequence
        flat = seq * E + expert_ids
        if valid is not None:  # padding rows into an extra bin, dropped
            flat = paddle.where(valid.unsqueeze(-1), flat, paddle.full_like(flat, B * E))
        counts = bin_counts(flat, B * E + 1)[: B * E]
        counts = counts.astype("float32").reshape([B, E])
        if tp_group is not None:
            counts = comm.all_reduce(counts, tp_group)
        f = counts * (float(num_experts) / (K * T))  # T: an int, or [B, 1] real tokens
    return (f * P).sum()


class _AuxLossGrad(PyLayer):
    """Identity on the routing weights whose backward also starts the aux loss's gradient with
    ``scale`` (the loss enters the objective without changing any loss plumbing; Megatron's
    auxiliary-loss scaler does the same)."""

    @staticmethod
    def forward(ctx: object, weights: paddle.Tensor, aux: paddle.Tensor, scale: float) -> paddle.Tensor:
        ctx.scale, ctx.shape, ctx.dtype = scale, aux.shape, aux.dtype
        return weights.clone()

    @staticmethod
    def backward(ctx: object, dw: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        return dw, paddle.full(ctx.shape, ctx.scale, dtype=ctx.dtype)


_FROZEN_TRAINING_FORWARDS = [0]


@contextlib.contextmanager
def frozen_training_forward() -> Iterator[None]:
    """A training forward run under ``no_grad`` because every weight it touches is frozen (the
    indexer's dense warm-up): the routers still count their load, which they count in no other
    training forward without gradients."""
    _FROZEN_TRAINING_FORWARDS[0] += 1
    try:
        with paddle.no_grad():
            yield
    finally:
        _FROZEN_TRAINING_FORWARDS[0] -= 1


class RouterBalance:
    """A router's training-time balancing state, kept out of the state dict.

    ``counts``: real (not padding) tokens' assignments to each expert [E] since the trainer last
    took them (``train/moe_balance.py``); ``routed``: every row's, padding included, since the
    gradient sync last took them (a layer or expert no token reached is not stepped;
    ``parallel/grads.py``). ``aux_loss_coeff`` > 0 adds
    the sequence-wise balance loss times ``aux_loss_scale`` (set by the trainer so the gradient is
    that of ``coeff * mean over sequences``); ``aux_loss`` sums the unscaled losses.
    """

    def __init__(self, topo: Topology | None = None) -> None:
        sp = topo is not None and topo.sequence_parallel and topo.tp_size > 1
        self.sp_group, self.sp_size = (topo.tp_group, topo.tp_size) if sp else (None, 1)
        self.sp_rank = topo.tp_rank if sp else 0
        self.cp_size, self.cp_rank = (topo.cp_size, topo.cp_rank) if topo is not None else (1, 0)
        self.counts: paddle.Tensor | None = None
        self.routed: paddle.Tensor | None = None
        self.aux_loss_coeff = 0.0
        self.aux_loss_scale = 1.0
        self.aux_loss: paddle.Tensor | None = None

    def local_valid(self, valid: paddle.Tensor | None, rows: int) -> paddle.Tensor | None:
        """This rank's rows of a token-validity mask: ``valid`` [B, S] (1 = a real token, 0 =
        padding) indexed by global position, as the key-padding mask is -> [rows] bool in the
        router's row order (under context parallel the rank's zigzag positions, under sequence
        parallel then its equal slice of them). None stays None: every token is real."""
        if valid is None:
            return None
        v = valid.detach()
        if self.cp_size > 1:
            pos = zigzag_positions(int(v.shape[1]), self.cp_size, self.cp_rank)
            v = paddle.index_select(v, paddle.to_tensor(pos), axis=1)
        if self.sp_size > 1:
            v = paddle.split(v, self.sp_size, axis=1)[self.sp_rank]
        if int(v.shape[0]) * int(v.shape[1]) != rows:
            raise ValueError(
                f"MoE token mask: {list(valid.shape)} gives {list(v.shape)} on this rank, the router has {rows} rows"
            )
        return v.reshape([-1]).astype("bool")

    def track(
        self,
        scores: paddle.Tensor,
        expert_ids: paddle.Tensor,
        weights: paddle.Tensor,
        batch_shape: tuple[int, ...] | None,
        valid: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """Count the step's assignments and add the balance loss. ``valid`` [B, S] (1 = real token,
        by global position; None: all real): padding counts neither in ``counts`` (the load of the
        bias update and loss.json) nor in the balance loss; ``routed`` counts every row, since an
        expert that computed a padding row is stepped (zero gradient) as in torch."""
        E = scores.shape[-1]
        mask = self.local_valid(valid, int(expert_ids.shape[0]))
        count = not replaying()  # a recomputed layer's second run routes the same tokens again
        if count:
            with paddle.no_grad():
                c = bin_counts(expert_ids, E)
                self.routed = c if self.routed is None else self.routed + c
                if mask is not None:  # padding rows' assignments into an extra bin, dropped
                    ids = paddle.where(mask.unsqueeze(-1), expert_ids, paddle.full_like(expert_ids, E))
                    c = bin_counts(ids, E + 1)[:E]
                self.counts = c if self.counts is None else self.counts + c
        if self.aux_loss_coeff <= 0:
            return weights
        aux = sequence_aux_loss(scores, expert_ids, batch_shape, E, self.sp_group, self.sp_size, mask)
        if count:
            done = aux.detach()
            self.aux_loss = done if self.aux_loss is None else self.aux_loss + done
        return _AuxLossGrad.apply(weights, aux, self.aux_loss_coeff * self.aux_loss_scale)

    def take_routed(self) -> paddle.Tensor | None:
        """Tokens routed to each expert since the last call; resets."""
        out, self.routed = self.routed, None
        return out

    def take(self) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        """(counts, aux loss sum) since the last take; resets both."""
        out = (self.counts, self.aux_loss)
        self.counts = self.aux_loss = None
        return out


class TopkRouter(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig, topo: Topology | None = None) -> None:
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
        self.balance = RouterBalance(topo)  # training-time load counts and aux loss; not in the state dict

    def forward(
        self, x: paddle.Tensor, batch_shape: tuple[int, int] | None = None, valid: paddle.Tensor | None = None
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [N, H] -> (logits [N, E] fp32, weights [N, k] fp32, expert ids [N, k] int64).

        ``batch_shape`` (B, S) says how the N rows split into sequences (this rank's sequence
        slice under sequence parallel); the sequence-wise balance loss needs it. ``valid`` [B, S]
        (1 = real token, by global position; ``RouterBalance.track``) keeps padding out of the
        training-time load counts and balance loss; routing itself is the same for every token."""
        logits = paddle.matmul(x.astype("float32"), self.weight)
        scores = nn.functional.sigmoid(logits)
        weights, expert_ids = route(
            scores,
            self.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            self.top_k,
            self.norm_topk_prob,
            self.scaling,
        )
        if self.training and (paddle.is_grad_enabled() or _FROZEN_TRAINING_FORWARDS[0]):
            weights = self.balance.track(scores, expert_ids, weights, batch_shape, valid)
        return logits, weights, expert_ids


def partial_ffn(x: paddle.Tensor, mlp: SwiGLUMLP) -> paddle.Tensor:
    """This TP rank's share of a tensor-parallel SwiGLU FFN without sequence parallel: its columns of
    up_gate, its rows of down, not yet summed over TP (the caller sums it with other shares)."""
    if mlp.down_proj.bias is not None:
        raise ValueError("partial_ffn: a down projection with a bias (added once, after the sum)")
    return paddle.matmul(swiglu(mlp.up_gate_proj(x)), mlp.down_proj.weight)


class MoE(nn.Layer):
    """Router + routed experts + shared experts.

    At world 1 the routed experts run locally (below). Under TP / EP / ETP the experts this rank
    owns (`mlp.experts.<global id>`) run behind `parallel.experts.ExpertParallelDispatcher`, which
    moves each token's assignments to the owning ranks by all-to-all and brings the results back;
    the router is replicated (under sequence parallel it routes this rank's tokens, so its
    gradient is summed over TP), the shared experts are split like a dense FFN.
    """

    # "sorted" (default): the grouped kernel on fp32 CPU, else one matmul pair per expert on its sorted
    # rows; "padded": batched matmuls over all experts. Same routing, same sums to rounding;
    # bench/bench_moe.py measured the padded form slower than both (the padding and weight
    # stacking cost what the fewer launches save).
    ROUTED_FORMS = ("sorted", "padded")

    def __init__(self, config: GlmMoeDsaConfig, topo: Topology | None = None, routed_form: str = "sorted") -> None:
        super().__init__()
        topo = topo or Topology.single()
        if routed_form not in self.ROUTED_FORMS:
            raise ValueError(f"MoE routed_form must be one of {self.ROUTED_FORMS}, got {routed_form!r}")
        self.routed_form = routed_form
        H, I = config.hidden_size, config.moe_intermediate_size
        self.num_experts = config.n_routed_experts
        self.gate = TopkRouter(config, topo)
        mark_sequence_parallel(self.gate, enabled=topo.sequence_parallel)
        distributed = topo.tp_size > 1 or topo.ep_size > 1 or topo.etp_size > 1
        self.dispatcher = ExpertParallelDispatcher(self.num_experts, topo=topo) if distributed else None
        ids = self.dispatcher.local_expert_ids if self.dispatcher else list(range(self.num_experts))
        self.experts = LocalExperts(ids, lambda _e: Expert(H, I, topo.etp_size))
        self.shared_experts = SwiGLUMLP(H, I * config.n_shared_experts, topo) if config.n_shared_experts else None

    def expert(self, e: int) -> Expert:
        return self.experts[str(e)]

    def routed(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """sum_k w_k * expert_{e_k}(x) for x [N, H], each token's terms added in ascending expert order
        (the order of HF's per-expert `index_add_`: the per-expert loop is bitwise HF's sums; the
        grouped kernel applies w_k before the down projection, so it rounds differently)."""
        N, K = expert_ids.shape
        if not paddle.in_dynamic_mode() or capturing_cuda_graph():  # shapes known in advance, no host read
            return self._static_routed(x, weights, expert_ids)
        # decoding a few assignments takes routed_rows' compiled op in either form
        if self.routed_form == "padded" and (paddle.is_grad_enabled() or N * K > self.num_experts):
            return self._padded(x, weights, expert_ids)
        return routed_rows(x, expert_ids, weights, *self._expert_weights())

    def _expert_weights(self) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
        """The experts' up_gate and down weights in expert order (the parameter objects, looked up
        once: a load or an optimizer step changes their values, not the objects)."""
        cached = self.__dict__.get("_weights")
        if cached is None:
            experts = [self.expert(e) for e in range(self.num_experts)]
            cached = ([e.up_gate_proj.weight for e in experts], [e.down_proj.weight for e in experts])
            self.__dict__["_weights"] = cached  # not a sublayer or parameter list
        return cached

    def _static_routed(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """The routed sum with no data-dependent shape, for graphs built by paddle.jit.to_static or
        captured as CUDA graphs: every expert runs on every token, weighted by its routing weight
        (0 when not chosen), in ascending expert order. E / K times the flops: an export form."""
        out = paddle.zeros_like(x)
        for e in range(self.num_experts):
            w_e = paddle.where(expert_ids == e, weights, paddle.zeros_like(weights)).sum(axis=-1, keepdim=True)
            out = out + cast(cast(swiglu_ffn(x, self.expert(e)), w_e.dtype) * w_e, x.dtype)
        return out

    def _padded(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """The routed sum from two batched matmuls over a zero-padded [E, capacity, H] layout."""
        E, H = self.num_experts, x.shape[-1]
        N, K = expert_ids.shape
        NK = N * K
        with paddle.no_grad():
            flat_e = expert_ids.reshape([-1])  # assignment a = token * K + j
            order = paddle.argsort(flat_e, stable=True)  # assignments grouped by expert, then token
            counts = bin_counts(flat_e, E)
            cap = int(counts.max())  # the one host read: the padded block's shape
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
        w1, w2 = (paddle.stack(ws) for ws in self._expert_weights())  # [E, H, 2I], [E, I, H]
        gate, up = paddle.split(paddle.matmul(x_pad, w1), 2, axis=-1)
        y = paddle.matmul(silu(gate) * up, w2)  # [E, cap, H]
        w = paddle.take_along_axis(weights, perm, axis=-1)  # [N, K] fp32
        y = paddle.gather(y.reshape([E * cap, H]), slot_of_assign).reshape([N, K, H])
        y = cast(cast(y, w.dtype) * w.unsqueeze(-1), x.dtype)  # the weight product in fp32, as HF
        parts = paddle.unbind(y, axis=1)
        return sum(parts[1:], parts[0])  # a token's terms added left to right, in ascending expert order

    def forward(self, x: paddle.Tensor, valid: paddle.Tensor | None = None) -> paddle.Tensor:
        """x [B, S, H] -> [B, S, H]. ``valid`` [B, S_global] (1 = real token, indexed by global
        position like the key-padding mask; None: every token real) reaches the router's
        training-time balancing only (``RouterBalance.track``)."""
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        if self.dispatcher is not None and not self.training and self.dispatcher.sums_partials():
            return self._summed_partials(flat, shape, valid)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.dispatcher is not None and shared is not None:
            # Collectives must run in the same order on every rank. The shared experts (TP group) and
            # the dispatcher (EP / TP groups) are independent branches, and the ranks' graphs differ
            # inside the dispatcher (each rank holds other experts and tokens), so backward could visit
            # them in a different order per rank. A zero dependency makes the shared branch's backward
            # run after the dispatcher's.
            flat = flat + 0.0 * shared.reshape(flat.shape)
        _, weights, expert_ids = self.gate(flat, tuple(shape[:-1]), valid)
        if self.dispatcher is not None:
            out = self.dispatcher(flat, expert_ids, weights, self.experts).reshape(shape)
        else:
            out = self.routed(flat, weights, expert_ids).reshape(shape)
        return out + shared if shared is not None else out

    def _summed_partials(self, flat: paddle.Tensor, shape: list[int], valid: paddle.Tensor | None) -> paddle.Tensor:
        """The dispatcher's inference form (`ExpertParallelDispatcher.sums_partials`): this rank's
        routed share plus its shared experts' share, summed over TP in one all-reduce (the shared
        experts' own all-reduce folded into the routed one)."""
        _, weights, expert_ids = self.gate(flat, tuple(shape[:-1]), valid)
        out = self.dispatcher.local_partial(flat, expert_ids, weights, self.experts)
        if self.shared_experts is not None:
            out = out + partial_ffn(flat, self.shared_experts).astype(out.dtype)
        return comm.all_reduce(out, self.dispatcher.tp_group).astype(flat.dtype).reshape(shape)
