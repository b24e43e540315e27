"""Tensor-parallel layers: column / row parallel linear, vocab-parallel embedding, parallel LM head
and vocab-parallel cross entropy.

The names the model uses (:func:`ColumnParallelLinear`, :func:`RowParallelLinear`,
:func:`VocabParallelEmbedding`, :func:`ParallelLMHead`, :func:`parallel_cross_entropy`) are
factories.  Under a real tensor-parallel group (Fleet initialised with ``mp_degree`` > 1) they
return Fleet's stock layers (on CPU gloo through the compatibility ops of ``fleet_gloo.py``), with
our :class:`ShardSpec` attached to their parameters:

* without sequence parallel, ``paddle.distributed.fleet.meta_parallel``'s;
* with it, ``fleet.utils.sequence_parallel_utils``' ``ColumnSequenceParallelLinear`` /
  ``RowSequenceParallelLinear`` through thin subclasses (:class:`BatchFirstColumnSequenceParallelLinear`,
  :class:`BatchFirstRowSequenceParallelLinear`): Fleet's layers split and gather the *first* axis
  (sequence-first ``[S, B, H]``), this model is batch-first ``[B, S, H]``, so the subclasses move
  the sequence axis to the front and back around Fleet's forward (free for a batch of one, a
  transposed copy otherwise); the embedding is Fleet's with its rows reduce-scattered by Fleet's
  ``ReduceScatterOp`` into the sequence shard.

Otherwise they return the ``Comm*`` layers defined here, written on comm.py, which are

* the plain ``paddle.nn`` computation at world size 1 (same op, same result bits);
* the shape-only probe layers when a topology has sizes but no process groups (memory planning);
* sequence parallel over a group other than Fleet's model-parallel group (Fleet's SP utilities
  always use that one; the model has none), and a sequence-parallel column layer that gathers
  its output (Fleet's does not).

Conventions:

* weights are Paddle-layout ``[in, out]`` and named ``weight`` / ``bias``; under TP a layer holds
  only its slice (a fused ``[gate | up]`` projection holds ``[gate_r | up_r]``);
* every parameter carries a :class:`ShardSpec` (``param.shard_spec``; fleet's ``is_distributed`` /
  ``split_axis`` are set too) saying which axis of the *full* tensor is split over which group, so
  ``state.shard_full_state`` can slice a checkpoint and ``state.gather_full_state`` can rebuild it;
* activations are ``[B, S, H]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from ..ops.loss import with_nonfinite_rows
from . import comm
from .topology import get_topology

__all__ = [
    "BatchFirstColumnSequenceParallelLinear",
    "BatchFirstRowSequenceParallelLinear",
    "ColumnParallelLinear",
    "CommColumnParallelLinear",
    "CommParallelLMHead",
    "CommRowParallelLinear",
    "CommVocabParallelEmbedding",
    "ParallelLMHead",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "fleet_tp_group",
    "get_shard_spec",
    "local_slice",
    "mark_expert",
    "mark_sequence_parallel",
    "merge_slices",
    "parallel_cross_entropy",
    "set_shard_spec",
]


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to the full (single-process) tensor.

    axis:   axis of the full tensor split evenly over ``group`` (None: replicated).
    group:  "tp" or "etp" (expert tensor parallel).
    chunks: the axis holds ``chunks`` fused blocks (e.g. gate|up = 2) and each block is split on
            its own, so rank r holds [gate_r, up_r], not half of the concatenation.
    expert: EP-local expert parameter: its name carries the global expert id; its gradient is
            summed over the expert-data-parallel group instead of the data-parallel group.
    sequence_parallel: replicated over TP but applied to sequence-sharded activations (norms,
            row-parallel bias, router under SP): gradients are partial and get summed over TP.
    """

    axis: int | None = None
    group: str = "tp"
    chunks: int = 1
    expert: bool = False
    sequence_parallel: bool = False


_REPLICATED = ShardSpec()


def get_shard_spec(param: paddle.Tensor) -> ShardSpec:
    return getattr(param, "shard_spec", _REPLICATED)


def set_shard_spec(param: paddle.Tensor, spec: ShardSpec) -> paddle.Tensor:
    """Attach ``spec`` (and fleet's is_distributed / split_axis) to ``param``."""
    if spec.group not in ("tp", "etp"):
        raise ValueError(f"ShardSpec.group must be 'tp' or 'etp', got {spec.group!r}")
    param.shard_spec = spec
    param.is_distributed = spec.axis is not None and get_topology().size(spec.group) > 1
    if spec.axis is not None:
        param.split_axis = spec.axis
    # Fleet's own flag (``is_sequence_parallel_parameter``, read by its allreduce hooks) says the same
    if spec.sequence_parallel:
        spu.mark_as_sequence_parallel_parameter(param)
    elif spu.is_sequence_parallel_parameter(param):
        param.sequence_parallel = False
    return param


def _params_of(obj: Any) -> list[paddle.Tensor]:
    if isinstance(obj, nn.Layer):
        return list(obj.parameters())
    if isinstance(obj, (list, tuple)):
        return [p for o in obj for p in _params_of(o)]
    return [obj]


def mark_sequence_parallel(obj: Any, enabled: bool = True) -> None:
    """Mark the replicated parameters of a layer (or a parameter) that run on SP-sharded activations.

    Call it for norms and any other replicated weight inside the sequence-parallel region; it
    is harmless when sequence parallel is off (the flag is only read when it is on).  Sets both
    ``ShardSpec.sequence_parallel`` and Fleet's ``mark_as_sequence_parallel_parameter`` flag, so
    Fleet's ``is_sequence_parallel_parameter`` / ``register_sequence_parallel_allreduce_hooks``
    see the same parameters as the trainer's gradient sync.
    """
    for p in _params_of(obj):
        spec = get_shard_spec(p)
        if spec.axis is not None and spec.group == "tp":
            continue  # TP-split params are not partial over TP
        set_shard_spec(p, replace(spec, sequence_parallel=enabled))


def mark_expert(obj: Any) -> None:
    """Mark EP-local expert parameters (their gradient sync group is the expert-data-parallel group)."""
    for p in _params_of(obj):
        set_shard_spec(p, replace(get_shard_spec(p), expert=True))


def local_slice(full: np.ndarray, spec: ShardSpec, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s slice of the full tensor (``size`` ranks in ``spec.group``)."""
    if spec.axis is None or size == 1:
        return full
    axis = spec.axis % full.ndim
    n = full.shape[axis]
    if n % (spec.chunks * size):
        raise ValueError(
            f"axis {axis} of shape {list(full.shape)} not divisible by chunks {spec.chunks} x {spec.group} {size}"
        )
    blocks = np.split(full, spec.chunks, axis=axis)
    parts = [np.split(b, size, axis=axis)[rank] for b in blocks]
    return np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def merge_slices(parts: list[np.ndarray], spec: ShardSpec) -> np.ndarray:
    """Inverse of :func:`local_slice`: rebuild the full tensor from every rank's slice (rank order)."""
    if spec.axis is None or len(parts) == 1:
        return parts[0]
    axis = spec.axis % parts[0].ndim
    per_rank = [np.split(p, spec.chunks, axis=axis) for p in parts]
    blocks = [np.concatenate([pr[c] for pr in per_rank], axis=axis) for c in range(spec.chunks)]
    return np.concatenate(blocks, axis=axis) if len(blocks) > 1 else blocks[0]


def _xavier(shape: list[int], fan_in: int, fan_out: int, dtype: str) -> nn.initializer.Initializer:
    # Same distribution as nn.Linear's default (XavierUniform on the *full* fans).
    limit = math.sqrt(6.0 / float(fan_in + fan_out))
    return nn.initializer.Uniform(-limit, limit)


def _tp_size_rank(group_name: str) -> tuple[int, int, Any]:
    topo = get_topology()
    return topo.size(group_name), topo.rank_in(group_name), topo.group(group_name)


class CommColumnParallelLinear(nn.Layer):
    """``y = x W + b`` with W's output columns split over TP: weight [in, out/tp].

    Input is replicated (or, with ``sequence_parallel``, sequence-sharded and all-gathered here).
    Output is TP-partitioned on the last axis unless ``gather_output``.  ``fuse_chunks`` > 1 for
    fused projections (gate|up) so each rank gets matching blocks.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        has_bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        fuse_chunks: int = 1,
        group: str = "tp",
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        size, rank, _ = _tp_size_rank(group)
        if out_features % (size * fuse_chunks):
            raise ValueError(
                f"ColumnParallelLinear: out_features {out_features} not divisible by {group} {size} x fuse_chunks {fuse_chunks}"
            )
        if gather_output and fuse_chunks > 1:
            raise ValueError("ColumnParallelLinear: gather_output with fuse_chunks > 1 would interleave the blocks")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.group_name, self.world, self.rank = group, size, rank
        local = out_features // size
        dtype = dtype or paddle.get_default_dtype()
        self.weight = self.create_parameter(
            [in_features, local],
            dtype=dtype,
            default_initializer=_xavier([in_features, local], in_features, out_features, dtype),
        )
        set_shard_spec(self.weight, ShardSpec(axis=1, group=group, chunks=fuse_chunks))
        if has_bias:
            self.bias = self.create_parameter([local], dtype=dtype, is_bias=True)
            set_shard_spec(self.bias, ShardSpec(axis=0, group=group, chunks=fuse_chunks))
        else:
            self.bias = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            return F.linear(x, self.weight, self.bias)
        group = get_topology().group(self.group_name)
        if self.sequence_parallel:
            x = comm.gather_from_sp(x, group=group, grad="reduce_scatter")  # [B, S/tp, H] -> [B, S, H]
        else:
            x = comm.copy_to_tp(x, group=group)
        y = F.linear(x, self.weight, self.bias)  # [..., out/tp]
        if self.gather_output:
            y = comm.gather_from_tp(y, axis=-1, group=group)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.group_name}={self.world}, sp={self.sequence_parallel}"


class CommRowParallelLinear(nn.Layer):
    """``y = x W + b`` with W's input rows split over TP: weight [in/tp, out].

    Partial products are all-reduced (or reduce-scattered along the sequence with
    ``sequence_parallel``); the bias is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        has_bias: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        group: str = "tp",
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        size, rank, _ = _tp_size_rank(group)
        if in_features % size:
            raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by {group} {size}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.group_name, self.world, self.rank = group, size, rank
        local = in_features // size
        dtype = dtype or paddle.get_default_dtype()
        self.weight = self.create_parameter(
            [local, out_features],
            dtype=dtype,
            default_initializer=_xavier([local, out_features], in_features, out_features, dtype),
        )
        set_shard_spec(self.weight, ShardSpec(axis=0, group=group))
        if has_bias:
            self.bias = self.create_parameter([out_features], dtype=dtype, is_bias=True)
            set_shard_spec(self.bias, ShardSpec(sequence_parallel=sequence_parallel))
        else:
            self.bias = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            return F.linear(x, self.weight, self.bias)
        group = get_topology().group(self.group_name)
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, axis=-1, group=group)
        y = F.linear(x, self.weight)  # partial sum [..., out]
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sp(y, group=group)  # [B, S, H] -> [B, S/tp, H]
        else:
            y = comm.reduce_from_tp(y, group=group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.group_name}={self.world}, sp={self.sequence_parallel}"


class CommVocabParallelEmbedding(nn.Layer):
    """Embedding with the vocabulary rows split over TP: weight [V/tp, H].

    Each rank looks up the ids it owns (zeros elsewhere) and the partial rows are summed:
    all-reduce, or reduce-scatter along the sequence into the SP region with ``sequence_parallel``.
    ``padding_idx`` follows torch (the row is returned, it just gets no gradient), as HF checkpoints expect.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        sequence_parallel: bool = False,
        *,
        padding_idx: int | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        size, rank, _ = _tp_size_rank("tp")
        if num_embeddings % size:
            raise ValueError(f"VocabParallelEmbedding: vocab size {num_embeddings} not divisible by tp {size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.padding_idx = sequence_parallel, padding_idx
        self.world, self.rank = size, rank
        self.per_rank = num_embeddings // size
        self.start = rank * self.per_rank
        dtype = dtype or paddle.get_default_dtype()
        self.weight = self.create_parameter(
            [self.per_rank, embedding_dim],
            dtype=dtype,
            default_initializer=_xavier([self.per_rank, embedding_dim], num_embeddings, embedding_dim, dtype),
        )
        set_shard_spec(self.weight, ShardSpec(axis=0))

    def _lookup(self, ids: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            return F.embedding(ids, weight)
        mask = paddle.logical_and(ids >= self.start, ids < self.start + self.per_rank)
        local = paddle.where(mask, ids - self.start, paddle.zeros_like(ids))
        return F.embedding(local, weight) * mask.unsqueeze(-1).astype(weight.dtype)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        out = self._lookup(ids, self.weight)  # [B, S, H] (partial under TP)
        if self.padding_idx is not None:
            frozen = self._lookup(ids, self.weight.detach())
            out = paddle.where((ids == self.padding_idx).unsqueeze(-1), frozen, out)
        if self.world == 1:
            return out
        group = get_topology().tp_group
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(out, group=group)
        return comm.reduce_from_tp(out, group=group)


class CommParallelLMHead(CommColumnParallelLinear):
    """Output projection [H, V] split over the vocabulary: returns vocab-parallel logits [B, S, V/tp].

    Feed them to :func:`parallel_cross_entropy`; gather them (``comm.gather_from_tp``) only to look at them.
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, sequence_parallel: bool = False, *, dtype: str | None = None
    ) -> None:
        super().__init__(
            hidden_size,
            vocab_size,
            has_bias=False,
            gather_output=False,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
        )


def fleet_tp_group(group: str = "tp", sequence_parallel: bool = False) -> Any:
    """The process group Fleet's layers are built on, or None where the ``Comm*`` layers apply:
    size 1, a topology without process groups, or sequence parallel over a group other than
    Fleet's model-parallel group (its sequence-parallel utilities always use that one)."""
    topo = get_topology()
    if topo.size(group) == 1 or topo.backend == "single":
        return None
    g = topo.group(group)
    return comm.fleet_sp_group(g) if sequence_parallel else g


class BatchFirstColumnSequenceParallelLinear(spu.ColumnSequenceParallelLinear):
    """Fleet's ``ColumnSequenceParallelLinear`` on batch-first activations:
    ``[B, S/tp, in]`` -> ``[B, S, out/tp]``.

    Fleet's layer all-gathers the first axis (sequence-first ``[S, B, H]``); the sequence axis is
    moved there and back around it (:func:`comm.to_sequence_first`: free for a batch of one, a
    transposed copy of the input and output otherwise).  Everything else is Fleet's forward.
    """

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return comm.to_batch_first(super().forward(comm.to_sequence_first(x)), list(x.shape))


class BatchFirstRowSequenceParallelLinear(spu.RowSequenceParallelLinear):
    """Fleet's ``RowSequenceParallelLinear`` on batch-first activations: ``[B, S, in/tp]`` ->
    ``[B, S/tp, out]`` (reduce-scatter over the sequence, bias added after it; Fleet marks the
    bias sequence-parallel).  Layout conversion as :class:`BatchFirstColumnSequenceParallelLinear`."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return comm.to_batch_first(super().forward(comm.to_sequence_first(x)), list(x.shape))


@contextmanager
def _dtype_scope(dtype: str | None) -> Iterator[None]:
    # Fleet's layers take the default dtype; ours take an argument.
    if dtype is None:
        yield
        return
    saved = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(saved)


def _fleet_vocab_embedding_class() -> type:
    from paddle.distributed.fleet.layers.mpu import mp_ops
    from paddle.distributed.fleet.meta_parallel import VocabParallelEmbedding as FleetVocab

    class _PaddedVocabParallelEmbedding(FleetVocab):
        """Fleet's vocab-parallel embedding with torch's ``padding_idx``: the pad row is returned
        (summed like any row) but its positions pass no gradient back to the table.

        With ``sequence_parallel`` the partial rows of Fleet's lookup (``_c_lookup_table``) are
        summed by Fleet's ``ReduceScatterOp`` over the sequence instead of its all-reduce: the
        output is this rank's sequence shard ``[B, S/tp, H]``."""

        def __init__(
            self, *args: Any, padding_idx: int | None = None, sequence_parallel: bool = False, **kw: Any
        ) -> None:
            super().__init__(*args, **kw)
            self.padding_idx = padding_idx
            self.sequence_parallel = sequence_parallel

        def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
            if not self.sequence_parallel:
                out = super().forward(ids)
                if self.padding_idx is None:
                    return out
                return paddle.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
            part = mp_ops._c_lookup_table(
                self.weight, ids, start_index=self.vocab_start_index, vocab_size=self.num_embeddings, name=self._name
            )
            if self.padding_idx is not None:
                part = paddle.where((ids == self.padding_idx).unsqueeze(-1), part.detach(), part)
            return comm.reduce_scatter_to_sp(part, group=self.model_parallel_group)

    return _PaddedVocabParallelEmbedding


def ColumnParallelLinear(  # noqa: N802 - a layer factory, named like the layer it returns
    in_features: int,
    out_features: int,
    has_bias: bool = False,
    gather_output: bool = False,
    sequence_parallel: bool = False,
    *,
    fuse_chunks: int = 1,
    group: str = "tp",
    dtype: str | None = None,
) -> nn.Layer:
    """Column-parallel ``y = x W + b`` (W ``[in, out/tp]``): Fleet's ``ColumnParallelLinear`` under a
    TP group (with ``sequence_parallel``: :class:`BatchFirstColumnSequenceParallelLinear`), else
    :class:`CommColumnParallelLinear`.  ``fuse_chunks`` only changes the ShardSpec (each rank's
    slice is ``[chunk0_r | chunk1_r | ...]``); the layer itself is the same."""
    g = fleet_tp_group(group, sequence_parallel)
    if g is None or (sequence_parallel and gather_output):  # Fleet's SP column never gathers its output
        return CommColumnParallelLinear(
            in_features,
            out_features,
            has_bias,
            gather_output,
            sequence_parallel,
            fuse_chunks=fuse_chunks,
            group=group,
            dtype=dtype,
        )
    if out_features % (g.nranks * fuse_chunks):
        raise ValueError(
            f"ColumnParallelLinear: out_features {out_features} not divisible by {group} {g.nranks} x fuse_chunks {fuse_chunks}"
        )
    if gather_output and fuse_chunks > 1:
        raise ValueError("ColumnParallelLinear: gather_output with fuse_chunks > 1 would interleave the blocks")
    from paddle.distributed.fleet import meta_parallel as mpu

    with _dtype_scope(dtype):
        if sequence_parallel:
            layer = BatchFirstColumnSequenceParallelLinear(
                in_features, out_features, has_bias=has_bias, gather_output=False, mp_group=g
            )
        else:
            layer = mpu.ColumnParallelLinear(
                in_features, out_features, has_bias=has_bias, gather_output=gather_output, mp_group=g
            )
    set_shard_spec(layer.weight, ShardSpec(axis=1, group=group, chunks=fuse_chunks))
    if layer.bias is not None:
        set_shard_spec(layer.bias, ShardSpec(axis=0, group=group, chunks=fuse_chunks))
    return layer


def RowParallelLinear(  # noqa: N802 - a layer factory, named like the layer it returns
    in_features: int,
    out_features: int,
    has_bias: bool = False,
    input_is_parallel: bool = True,
    sequence_parallel: bool = False,
    *,
    group: str = "tp",
    dtype: str | None = None,
) -> nn.Layer:
    """Row-parallel ``y = x W + b`` (W ``[in/tp, out]``, partial products all-reduced, bias added
    once): Fleet's ``RowParallelLinear`` under a TP group (with ``sequence_parallel``:
    :class:`BatchFirstRowSequenceParallelLinear`, output reduce-scattered over the sequence), else
    :class:`CommRowParallelLinear`."""
    g = fleet_tp_group(group, sequence_parallel)
    if g is None:
        return CommRowParallelLinear(
            in_features, out_features, has_bias, input_is_parallel, sequence_parallel, group=group, dtype=dtype
        )
    if in_features % g.nranks:
        raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by {group} {g.nranks}")
    if sequence_parallel and not input_is_parallel:
        raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
    from paddle.distributed.fleet import meta_parallel as mpu

    with _dtype_scope(dtype):
        if sequence_parallel:
            layer = BatchFirstRowSequenceParallelLinear(
                in_features, out_features, has_bias=has_bias, input_is_parallel=True, mp_group=g
            )
        else:
            layer = mpu.RowParallelLinear(
                in_features, out_features, has_bias=has_bias, input_is_parallel=input_is_parallel, mp_group=g
            )
    set_shard_spec(layer.weight, ShardSpec(axis=0, group=group))
    if layer.bias is not None:  # partial over TP under SP (Fleet marks it too)
        set_shard_spec(layer.bias, ShardSpec(sequence_parallel=sequence_parallel))
    return layer


def VocabParallelEmbedding(  # noqa: N802 - a layer factory, named like the layer it returns
    num_embeddings: int,
    embedding_dim: int,
    sequence_parallel: bool = False,
    *,
    padding_idx: int | None = None,
    dtype: str | None = None,
) -> nn.Layer:
    """Embedding with the vocabulary rows split over TP (weight ``[V/tp, H]``): Fleet's
    ``VocabParallelEmbedding`` (plus torch's ``padding_idx``; with ``sequence_parallel`` its rows
    summed by Fleet's ``ReduceScatterOp`` into the sequence shard) under a TP group, else
    :class:`CommVocabParallelEmbedding`."""
    g = fleet_tp_group("tp", sequence_parallel)
    if g is None:
        return CommVocabParallelEmbedding(
            num_embeddings, embedding_dim, sequence_parallel, padding_idx=padding_idx, dtype=dtype
        )
    if num_embeddings % g.nranks:
        raise ValueError(f"VocabParallelEmbedding: vocab size {num_embeddings} not divisible by tp {g.nranks}")
    with _dtype_scope(dtype):
        layer = _fleet_vocab_embedding_class()(
            num_embeddings, embedding_dim, mp_group=g, padding_idx=padding_idx, sequence_parallel=sequence_parallel
        )
    set_shard_spec(layer.weight, ShardSpec(axis=0))
    return layer


def ParallelLMHead(  # noqa: N802 - a layer factory, named like the layer it returns
    hidden_size: int, vocab_size: int, sequence_parallel: bool = False, *, dtype: str | None = None
) -> nn.Layer:
    """Output projection ``[H, V]`` split over the vocabulary: returns vocab-parallel logits
    ``[B, S, V/tp]`` for :func:`parallel_cross_entropy` (a column-parallel linear without gather;
    with ``sequence_parallel`` it all-gathers the sequence shards first, Fleet's SP column layer)."""
    if fleet_tp_group("tp", sequence_parallel) is None:
        return CommParallelLMHead(hidden_size, vocab_size, sequence_parallel, dtype=dtype)
    return ColumnParallelLinear(
        hidden_size, vocab_size, has_bias=False, gather_output=False, sequence_parallel=sequence_parallel, dtype=dtype
    )


def parallel_cross_entropy(
    logits: paddle.Tensor,
    labels: paddle.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    group: Any = None,
) -> paddle.Tensor:
    """Cross entropy over vocab-parallel logits [..., V/tp] and labels [...] (int64), in fp32.

    HF convention: tokens labelled ``ignore_index`` contribute nothing; ``reduction="mean"`` divides by
    the number of the other tokens (0 when there are none). ``"sum"`` and ``"none"`` (per token) are
    what a trainer that normalises over a whole global batch wants. No shifting happens here.
    At tp=1 this is ``F.cross_entropy``; under TP it is Fleet's ``ParallelCrossEntropy``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"parallel_cross_entropy: reduction must be mean|sum|none, got {reduction!r}")
    topo = get_topology()
    group = topo.tp_group if group is None else group
    if labels.ndim == logits.ndim:
        labels = labels.squeeze(-1)
    labels = labels.astype("int64")
    if comm.group_size(group) == 1:
        per_tok = F.cross_entropy(
            logits.astype("float32"), labels.unsqueeze(-1), ignore_index=ignore_index, reduction="none"
        ).squeeze(-1)
        per_tok = with_nonfinite_rows(per_tok, logits, labels, ignore_index)  # Paddle's CPU op hides NaN/inf
    else:
        from paddle.distributed.fleet import meta_parallel as mpu

        ce = mpu.ParallelCrossEntropy(mp_group=group, ignore_index=ignore_index)
        per_tok = ce(logits.astype("float32"), labels.unsqueeze(-1)).squeeze(-1)
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    if reduction == "sum":
        return total
    count = (labels != ignore_index).astype("float32").sum()
    return total / paddle.clip(count, min=1.0)
