"""Expert parallelism: route each token's top-k assignments to the rank that owns the expert, run
the local experts, and bring the results back (all-to-all both ways; differentiable).  Layout and
rules: docs/parallel.md section 1 ("Expert layout").

Tokens must be distinct across the ranks that exchange them. Under sequence parallel they are;
without it the tp ranks hold the same tokens, so the dispatcher keeps 1/tp of them on each rank
and all-gathers the result: no expert work is duplicated and every expert gradient is a partial
sum over the expert-data-parallel group.  At ep = etp = tp = 1 every collective is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import paddle
import paddle.nn as nn

from ..ops.activation import silu
from ..ops.selection import bin_counts
from . import comm
from .layers import ShardSpec, set_shard_spec
from .topology import Topology, get_topology

__all__ = ["ExpertMLP", "ExpertParallelDispatcher", "LocalExperts"]

ExpertFn = Callable[[paddle.Tensor, list[int]], paddle.Tensor]


def _rank(group: object) -> int:
    """This process's rank in ``group`` (0 in a group of one or none)."""
    return group.rank if comm.group_size(group) > 1 else 0


class ExpertParallelDispatcher:
    """Dispatch / compute / combine for one MoE layer (``num_experts``: the global count)."""

    def __init__(self, num_experts: int, *, topo: Topology | None = None) -> None:
        topo = topo or get_topology()
        ep = topo.ep_size
        if num_experts % ep:
            raise ValueError(f"ExpertParallelDispatcher: ep {ep} does not divide n_routed_experts {num_experts}")
        self.num_experts, self.ep_size = num_experts, ep
        self.num_local = num_experts // ep
        self.local_start = topo.ep_rank * self.num_local
        self.ep_group, self.etp_group, self.tp_group = topo.ep_group, topo.etp_group, topo.tp_group
        self.split_tp = topo.tp_size > 1 and not topo.sequence_parallel  # the tp ranks hold the same tokens
        # a forward that needs no gradient can then share the routed sum out over the TP ranks and sum
        # the shares in one all-reduce (`sums_partials`): by expert when the TP ranks hold every
        # expert (slice) once between them, by token when each holds them all
        block = topo.ep_size * topo.etp_size
        self.share = (
            ("experts" if block == topo.tp_size else "tokens" if block == 1 else None) if self.split_tp else None
        )

    @property
    def local_expert_ids(self) -> list[int]:
        """Global ids of the experts this rank owns."""
        return list(range(self.local_start, self.local_start + self.num_local))

    def __call__(
        self, hidden: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor, expert_fn: ExpertFn
    ) -> paddle.Tensor:
        """hidden [T, H], topk_ids [T, K] int64 (global expert ids), topk_weights [T, K] -> [T, H].

        ``expert_fn(x, counts)`` gets rows grouped by local expert (``counts[e]`` rows for local
        expert e, in order) and returns their outputs in the same order.
        Output = sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(hidden), summed over k in order,
        computed in the weights' dtype and cast back to ``hidden.dtype``.
        """
        if hidden.ndim != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"dispatcher: expected hidden [T, H], ids/weights [T, K]; got {list(hidden.shape)}, "
                f"{list(topk_ids.shape)}, {list(topk_weights.shape)}"
            )
        out_dtype = hidden.dtype
        if self.split_tp:
            # each tp rank takes its share of the replicated tokens, as evenly as they go: any count
            # splits (an odd micro-batch x sequence at tp 2; a rank may get none)
            tp_rows = comm.row_split(hidden.shape[0], self.tp_group)
            # hidden and weights travel as ONE tensor: two independent scatters would be two
            # all-gathers in backward whose order may differ per rank (fatal on gloo)
            H = hidden.shape[-1]
            joint = paddle.concat([hidden.astype(topk_weights.dtype), topk_weights], axis=-1)
            joint = comm.scatter_rows_to_tp(joint, tp_rows, self.tp_group)
            hidden, topk_weights = joint[:, :H].astype(out_dtype), joint[:, H:]
            topk_ids = comm.my_rows(topk_ids, tp_rows, self.tp_group)
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape([-1]).astype("int64")  # [t*K]
        order = paddle.argsort(flat_ids, stable=True)  # assignments grouped by expert (hence by owner rank)
        x = paddle.gather(hidden, paddle.floor_divide(order, paddle.full_like(order, k)))  # [t*K, H]
        sorted_ids = paddle.gather(flat_ids, order)
        counts, etp_sizes, counts_local = self._sizes(flat_ids)
        x = comm.all_to_all(x, counts, self.ep_group)  # tokens -> owner ranks
        local_ids = comm.all_to_all_single(sorted_ids, counts, self.ep_group) - self.local_start

        if etp_sizes is not None:  # pool the etp group's tokens; each rank holds an FFN slice
            x = comm.all_gather_varlen(x, etp_sizes, self.etp_group)
            local_ids = comm.all_gather_varlen(local_ids, etp_sizes, self.etp_group)

        order2 = paddle.argsort(local_ids, stable=True)
        xs = paddle.gather(x, order2) if x.shape[0] else x
        ys = expert_fn(xs, counts_local)
        y = paddle.gather(ys, paddle.argsort(order2)) if ys.shape[0] else ys
        if etp_sizes is not None:
            y = comm.reduce_scatter_varlen(y, etp_sizes, self.etp_group)
        y = comm.all_to_all(y, counts, self.ep_group, reverse=True)  # results -> token owners

        w = paddle.gather(topk_weights.reshape([-1]), order)  # [t*K] in dispatch order
        y = y.astype(w.dtype) * w.unsqueeze(-1)
        # explicit H: Paddle reads a 0 in a reshape target as "keep that input dim" (t = 0 tokens)
        y = paddle.gather(y, paddle.argsort(order)).reshape([t, k, y.shape[-1]]).sum(axis=1).astype(out_dtype)
        if self.split_tp:
            y = comm.gather_rows_from_tp(y, tp_rows, self.tp_group)
        return y

    def _sizes(self, flat_ids: paddle.Tensor) -> tuple[list[list[int]], list[int] | None, list[int]]:
        """Everything the dispatch must know on the host, from ONE read (on a GPU each read is a
        stream synchronisation, and this runs per MoE layer per forward): ``(counts, etp_sizes,
        counts_local)``, i.e. the all-to-all matrix ``counts[src][dst]`` (rows from EP rank src to
        dst), the rows each etp rank pools (None at etp 1), and the pooled rows per local expert.

        Each rank counts its assignments per expert on the device (``ops.bin_counts``, of fixed
        length, where ``paddle.bincount`` reads the ids' range on a GPU), the
        count vectors are all-gathered over EP then etp, and the gathered block is read once. Ids
        outside ``[0, n_routed_experts)`` count in one extra slot, so every rank of the exchange
        sees them and all raise together instead of leaving the others waiting in the all-to-all.
        """
        E, n, ep = self.num_experts, self.num_local, self.ep_size
        bins = paddle.where((flat_ids >= 0) & (flat_ids < E), flat_ids, paddle.full_like(flat_ids, E))
        per_expert = bin_counts(bins, E + 1)
        block = comm.gather_counts(per_expert, self.ep_group, self.etp_group)  # [etp, ep, E + 1]
        if block[..., E].any():
            here = sorted({int(i) for i in paddle.masked_select(flat_ids, bins == E).numpy()})
            which = f"expert ids {here[:8]}" if here else "an expert id routed on another rank"
            raise ValueError(f"dispatcher: {which} outside [0, n_routed_experts {E})")
        m = block[_rank(self.etp_group), :, :E].reshape(ep, ep, n)  # [src, dst, local expert of dst]
        counts = m.sum(axis=2).tolist()
        # [etp rank, src, local expert]: the rows each rank of my etp group (same experts) receives
        pooled = block[:, :, self.local_start : self.local_start + n]
        etp_sizes = pooled.sum(axis=(1, 2)).tolist() if comm.group_size(self.etp_group) > 1 else None
        return counts, etp_sizes, pooled.sum(axis=(0, 1)).tolist()

    def sums_partials(self) -> bool:
        """Whether the inference form can replace the dispatch now: tokens replicated over the TP
        group, whose ranks hold every expert (slice) once between them (ep x etp = tp) or each all of
        them (ep = etp = 1); no gradient; eager. Each rank then computes its share of the routed sum
        (`local_partial`: its experts' assignments, or its rows' share of the tokens) and one
        all-reduce over TP sums the shares (the MoE layer adds its shared experts' share first): one
        collective where the dispatch takes up to five (the split, the counts, two all-to-alls, the
        gather); at decoding's few tokens their latency is the step's. The MoE layer takes it in
        eval mode only: a training forward without gradient is recompute's first pass, whose
        replay must compute the same values (the shares round differently from the dispatch)."""
        return self.share is not None and not paddle.is_grad_enabled() and paddle.in_dynamic_mode()

    def local_partial(
        self, hidden: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor, expert_fn: ExpertFn
    ) -> paddle.Tensor:
        """This rank's share of the routed sum (`sums_partials`) [T, H] in the weights' dtype, zero
        elsewhere: its experts' weighted outputs, or all experts' on its rows (`comm.row_split`, as
        the dispatch splits them); the TP sum of the shares is the routed sum. Summed per rank, then
        over the ranks: the one-process order's result to fp32 reduction error."""
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape([-1]).astype("int64")
        keep = (flat_ids >= self.local_start) & (flat_ids < self.local_start + self.num_local)
        if self.share == "tokens":  # assignment a = token * k + j: this rank's rows' assignments
            sizes = comm.row_split(t, self.tp_group)
            lo = sum(sizes[: self.tp_group.rank])
            keep = paddle.logical_and(keep, paddle.arange(t * k) // k >= lo)
            keep = paddle.logical_and(keep, paddle.arange(t * k) // k < lo + sizes[self.tp_group.rank])
        mine = paddle.nonzero(keep).reshape([-1])  # this rank's assignments
        local_ids = paddle.gather(flat_ids, mine) - self.local_start
        order = paddle.argsort(local_ids, stable=True)  # grouped by local expert
        assign = paddle.gather(mine, order)
        rows = paddle.floor_divide(assign, paddle.full_like(assign, k))
        counts = [int(c) for c in np.bincount(local_ids.numpy(), minlength=self.num_local)]
        out = paddle.zeros([t, hidden.shape[-1]], dtype=topk_weights.dtype)
        if assign.shape[0]:
            y = expert_fn(paddle.gather(hidden, rows), counts)  # partial over etp
            w = paddle.gather(topk_weights.reshape([-1]), assign)
            out = paddle.index_add(out, rows, 0, y.astype(w.dtype) * w.unsqueeze(-1))
        return out


class ExpertMLP(nn.Layer):
    """One SwiGLU expert, ``down(silu(gate(x)) * up(x))``, gate|up fused as ``up_gate_proj`` (gate first).

    Split over the etp group (column for up_gate, row for down) with no communication of its own:
    the dispatcher pools tokens before and reduce-scatters after.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, topo: Topology | None = None, dtype: str | None = None
    ) -> None:
        super().__init__()
        topo = topo or get_topology()
        etp = topo.etp_size
        if intermediate_size % etp:
            raise ValueError(f"ExpertMLP: etp {etp} does not divide moe_intermediate_size {intermediate_size}")
        local = intermediate_size // etp
        dtype = dtype or paddle.get_default_dtype()
        self.up_gate_proj = self.create_parameter([hidden_size, 2 * local], dtype=dtype)
        self.down_proj = self.create_parameter([local, hidden_size], dtype=dtype)
        set_shard_spec(self.up_gate_proj, ShardSpec(axis=1, group="etp", chunks=2, expert=True))
        set_shard_spec(self.down_proj, ShardSpec(axis=0, group="etp", expert=True))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.chunk(paddle.matmul(x, self.up_gate_proj), 2, axis=-1)
        return paddle.matmul(silu(gate) * up, self.down_proj)  # partial over etp


class LocalExperts(nn.LayerDict):
    """This rank's experts keyed by *global* expert id, so names (``<prefix>.<id>.*``) match the full model."""

    def __init__(self, expert_ids: Sequence[int], make_expert: Callable[[int], nn.Layer]) -> None:
        super().__init__({str(e): make_expert(e) for e in expert_ids})
        self.expert_ids = list(expert_ids)

    def forward(self, x: paddle.Tensor, counts: list[int]) -> paddle.Tensor:
        """Rows of ``x`` grouped by local expert (``counts``), outputs in the same order."""
        if len(counts) != len(self.expert_ids):
            raise ValueError(f"LocalExperts: {len(counts)} counts for {len(self.expert_ids)} local experts")
        outs, off = [], 0
        for e, c in zip(self.expert_ids, counts):
            if c:
                outs.append(self[str(e)](x[off : off + c]))
            off += c
        if not outs:  # no rows: return the (empty) input so backward still reaches it
            return x
        return paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
