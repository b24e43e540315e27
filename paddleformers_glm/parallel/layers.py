"""Tensor-parallel layers: column / row parallel linear, vocab-parallel embedding, parallel LM head
and vocab-parallel cross entropy (which layer is Fleet's and which ours, and why: docs/parallel.md
section 2).

The names the model uses (:func:`ColumnParallelLinear`, ...) are factories: Fleet's stock layers
under a real TP group, else the ``Comm*`` layers defined here (world size 1, shape-only probes, SP
over another group).  Every parameter carries a :class:`ShardSpec` saying which axis of the *full*
``[in, out]`` tensor is split over which group, so checkpoints can be sliced and rebuilt.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet import meta_parallel as mpu
from paddle.distributed.fleet.layers.mpu import mp_ops
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from ..configuration import IGNORE_INDEX
from ..ops.loss import with_nonfinite_rows
from . import comm
from .topology import Topology, get_topology

__all__ = [
    "BatchFirstColumnSequenceParallelLinear",
    "BatchFirstRowSequenceParallelLinear",
    "ColumnParallelLinear",
    "CommColumnParallelLinear",
    "CommRowParallelLinear",
    "CommVocabParallelEmbedding",
    "ParallelLMHead",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "fleet_tp_group",
    "get_shard_spec",
    "local_slice",
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


def set_shard_spec(param: paddle.Tensor, spec: ShardSpec, split: int | None = None) -> paddle.Tensor:
    """Attach ``spec`` (and fleet's is_distributed / split_axis) to ``param``; ``split`` is the size of
    the group ``spec.axis`` is split over (None: keep what the parameter says already, 1 if nothing)."""
    if spec.group not in ("tp", "etp"):
        raise ValueError(f"ShardSpec.group must be 'tp' or 'etp', got {spec.group!r}")
    param.shard_spec = spec
    if split is not None:
        param.is_distributed = spec.axis is not None and split > 1
    elif not hasattr(param, "is_distributed"):
        param.is_distributed = False
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
    """Mark the replicated parameters of a layer (or a parameter) that run on SP-sharded activations
    (norms and any other replicated weight inside the sequence-parallel region): ``ShardSpec`` and
    Fleet's flag both (:func:`set_shard_spec`, docs/parallel.md section 2)."""
    for p in _params_of(obj):
        spec = get_shard_spec(p)
        if spec.axis is not None and spec.group == "tp":
            continue  # TP-split params are not partial over TP
        set_shard_spec(p, replace(spec, sequence_parallel=enabled))


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


def _xavier(fan_in: int, fan_out: int) -> nn.initializer.Initializer:
    """nn.Linear's default distribution (XavierUniform) on the *full* fans."""
    limit = math.sqrt(6.0 / float(fan_in + fan_out))
    return nn.initializer.Uniform(-limit, limit)


def _check_column(out_features: int, size: int, fuse_chunks: int, gather_output: bool, group: str) -> None:
    if out_features % (size * fuse_chunks):
        raise ValueError(
            f"ColumnParallelLinear: out_features {out_features} not divisible by {group} {size} x fuse_chunks {fuse_chunks}"
        )
    if gather_output and fuse_chunks > 1:
        raise ValueError("ColumnParallelLinear: gather_output with fuse_chunks > 1 would interleave the blocks")


def _check_row(in_features: int, size: int, sequence_parallel: bool, input_is_parallel: bool, group: str) -> None:
    if in_features % size:
        raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by {group} {size}")
    if sequence_parallel and not input_is_parallel:
        raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")


class _CommLinear(nn.Layer):
    """What our column and row layers share: the group, a ``weight`` of this rank's shape (initialised
    as ``nn.Linear`` is, on the full fans), an optional ``bias``, their specs (:meth:`_params`)."""

    def __init__(self, in_features: int, out_features: int, sp: bool, group: str, topo: Topology) -> None:
        super().__init__()
        self.group, self.group_name = topo.group(group), group
        self.world, self.rank = topo.size(group), topo.rank_in(group)
        self.in_features, self.out_features, self.sequence_parallel = in_features, out_features, sp

    def _params(self, local: list[int], weight_spec: ShardSpec, bias_size: int | None, bias_spec: ShardSpec) -> None:
        self.weight = self.create_parameter(local, default_initializer=_xavier(self.in_features, self.out_features))
        set_shard_spec(self.weight, weight_spec, self.world)
        self.bias = None
        if bias_size is not None:
            self.bias = self.create_parameter([bias_size], is_bias=True)
            set_shard_spec(self.bias, bias_spec, self.world)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.group_name}={self.world}, sp={self.sequence_parallel}"


class CommColumnParallelLinear(_CommLinear):
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
        topo: Topology | None = None,
    ) -> None:
        super().__init__(in_features, out_features, sequence_parallel, group, topo or get_topology())
        _check_column(out_features, self.world, fuse_chunks, gather_output, group)
        local, spec = out_features // self.world, ShardSpec(axis=1, group=group, chunks=fuse_chunks)
        self._params([in_features, local], spec, local if has_bias else None, replace(spec, axis=0))
        self.gather_output = gather_output

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            x = comm.gather_from_sp(x, group=self.group, grad="reduce_scatter")  # [B, S/tp, H] -> [B, S, H]
        else:
            x = comm.copy_to_tp(x, group=self.group)
        y = F.linear(x, self.weight, self.bias)  # [..., out/tp]
        return comm.gather_from_tp(y, axis=-1, group=self.group) if self.gather_output else y


class CommRowParallelLinear(_CommLinear):
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
        topo: Topology | None = None,
    ) -> None:
        super().__init__(in_features, out_features, sequence_parallel, group, topo or get_topology())
        _check_row(in_features, self.world, sequence_parallel, input_is_parallel, group)
        bias_size = out_features if has_bias else None
        local = [in_features // self.world, out_features]
        self._params(local, ShardSpec(axis=0, group=group), bias_size, ShardSpec(sequence_parallel=sequence_parallel))
        self.input_is_parallel = input_is_parallel

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, axis=-1, group=self.group)
        y = F.linear(x, self.weight)  # partial sum [..., out]
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sp(y, group=self.group)  # [B, S, H] -> [B, S/tp, H]
        else:
            y = comm.reduce_from_tp(y, group=self.group)
        return y + self.bias if self.bias is not None else y


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
        topo: Topology | None = None,
    ) -> None:
        super().__init__()
        topo = topo or get_topology()
        self.group, self.world, self.rank = topo.tp_group, topo.tp_size, topo.tp_rank
        if num_embeddings % self.world:
            raise ValueError(f"VocabParallelEmbedding: vocab size {num_embeddings} not divisible by tp {self.world}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.padding_idx = sequence_parallel, padding_idx
        self.per_rank = num_embeddings // self.world
        self.start = self.rank * self.per_rank
        init = _xavier(num_embeddings, embedding_dim)
        self.weight = self.create_parameter([self.per_rank, embedding_dim], default_initializer=init)
        set_shard_spec(self.weight, ShardSpec(axis=0), self.world)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.world == 1:
            out = F.embedding(ids, self.weight)
        else:  # this rank's rows, zeros for the ids it does not own: [B, S, H] partial under TP
            mask = paddle.logical_and(ids >= self.start, ids < self.start + self.per_rank)
            local = paddle.where(mask, ids - self.start, paddle.zeros_like(ids))
            out = F.embedding(local, self.weight) * mask.unsqueeze(-1).astype(self.weight.dtype)
        if self.padding_idx is not None:
            out = paddle.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
        if self.sequence_parallel:  # both no-ops without a group
            return comm.reduce_scatter_to_sp(out, group=self.group)
        return comm.reduce_from_tp(out, group=self.group)


def fleet_tp_group(group: str = "tp", sequence_parallel: bool = False, topo: Topology | None = None) -> Any:
    """The process group Fleet's layers are built on, or None where the ``Comm*`` layers apply:
    size 1, a topology without process groups, or sequence parallel over a group other than
    Fleet's model-parallel group (its sequence-parallel utilities always use that one)."""
    topo = topo or get_topology()
    if topo.size(group) == 1 or topo.backend == "single":
        return None
    g = topo.group(group)
    return comm.fleet_sp_group(g) if sequence_parallel else g


class _BatchFirst:
    """A Fleet sequence-parallel linear on batch-first activations: the sequence axis moved to the front,
    where Fleet's layer gathers or scatters it, and back (:func:`comm.to_sequence_first`)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return comm.to_batch_first(super().forward(comm.to_sequence_first(x)), list(x.shape))


class BatchFirstColumnSequenceParallelLinear(_BatchFirst, spu.ColumnSequenceParallelLinear):
    """Fleet's ``ColumnSequenceParallelLinear``, ``[B, S/tp, in]`` -> ``[B, S, out/tp]``."""


class BatchFirstRowSequenceParallelLinear(_BatchFirst, spu.RowSequenceParallelLinear):
    """Fleet's ``RowSequenceParallelLinear``, ``[B, S, in/tp]`` -> ``[B, S/tp, out]``."""


@contextmanager
def default_dtype(dtype: str | None) -> Iterator[None]:
    """Create parameters in ``dtype`` (Paddle takes it from the process-wide default: Fleet's
    layers have no dtype argument) and restore the default after; None changes nothing."""
    saved = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype or saved)
    try:
        yield
    finally:
        paddle.set_default_dtype(saved)


class _PaddedVocabParallelEmbedding(mpu.VocabParallelEmbedding):
    """Fleet's vocab-parallel embedding with torch's ``padding_idx`` (the pad row's positions pass no
    gradient back to the table); with ``sequence_parallel`` the partial rows are reduce-scattered into
    this rank's sequence shard ``[B, S/tp, H]`` instead of all-reduced."""

    def __init__(self, *args: Any, padding_idx: int | None = None, sequence_parallel: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if not self.sequence_parallel:
            out = super().forward(ids)
        else:  # this rank's partial rows, summed below
            out = mp_ops._c_lookup_table(
                self.weight,
                ids,
                start_index=self.vocab_start_index,
                vocab_size=self.num_embeddings,
                name=self._name,
            )
        if self.padding_idx is not None:
            out = paddle.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return comm.reduce_scatter_to_sp(out, group=self.model_parallel_group) if self.sequence_parallel else out


def _bind(cls: type, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The factory's arguments by name, as ``cls`` (the layer it stands for) takes them."""
    bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _linear(comm_cls: type, args: tuple, kwargs: dict) -> nn.Layer:
    """Fleet's column- or row-parallel linear (as ``comm_cls`` is) under a TP group, with our specs on
    its weight and bias; else ``comm_cls`` itself."""
    a = _bind(comm_cls, args, kwargs)
    sp, group, column = a["sequence_parallel"], a["group"], comm_cls is CommColumnParallelLinear
    g = fleet_tp_group(group, sp, a["topo"])
    if g is None or (column and sp and a["gather_output"]):  # Fleet's SP column never gathers its output
        return comm_cls(*args, **kwargs)
    if column:
        _check_column(a["out_features"], g.nranks, a["fuse_chunks"], a["gather_output"], group)
        cls = BatchFirstColumnSequenceParallelLinear if sp else mpu.ColumnParallelLinear
        weight = ShardSpec(axis=1, group=group, chunks=a["fuse_chunks"])
        bias, extra = replace(weight, axis=0), {"gather_output": a["gather_output"]}
    else:
        _check_row(a["in_features"], g.nranks, sp, a["input_is_parallel"], group)
        cls = BatchFirstRowSequenceParallelLinear if sp else mpu.RowParallelLinear
        weight, extra = ShardSpec(axis=0, group=group), {"input_is_parallel": a["input_is_parallel"]}
        bias = ShardSpec(sequence_parallel=sp)  # the bias is partial over TP under SP (Fleet marks it too)
    layer = cls(a["in_features"], a["out_features"], has_bias=a["has_bias"], mp_group=g, **extra)
    set_shard_spec(layer.weight, weight, g.nranks)
    if layer.bias is not None:
        set_shard_spec(layer.bias, bias, g.nranks)
    return layer


def ColumnParallelLinear(*args: Any, **kwargs: Any) -> nn.Layer:  # noqa: N802 - a layer factory
    """Column-parallel linear, arguments as :class:`CommColumnParallelLinear`: Fleet's layer under a TP
    group, else ours.  ``fuse_chunks`` only changes the ShardSpec, not the layer."""
    return _linear(CommColumnParallelLinear, args, kwargs)


def RowParallelLinear(*args: Any, **kwargs: Any) -> nn.Layer:  # noqa: N802 - a layer factory
    """Row-parallel linear, arguments as :class:`CommRowParallelLinear`: Fleet's layer under a TP
    group, else ours."""
    return _linear(CommRowParallelLinear, args, kwargs)


def VocabParallelEmbedding(*args: Any, **kwargs: Any) -> nn.Layer:  # noqa: N802 - a layer factory
    """Vocab-parallel embedding, arguments as :class:`CommVocabParallelEmbedding`: Fleet's layer
    (plus torch's ``padding_idx``) under a TP group, else ours."""
    a = _bind(CommVocabParallelEmbedding, args, kwargs)
    g = fleet_tp_group("tp", a["sequence_parallel"], a["topo"])
    if g is None:
        return CommVocabParallelEmbedding(*args, **kwargs)
    V = a["num_embeddings"]
    if V % g.nranks:
        raise ValueError(f"VocabParallelEmbedding: vocab size {V} not divisible by tp {g.nranks}")
    layer = _PaddedVocabParallelEmbedding(
        V, a["embedding_dim"], mp_group=g, padding_idx=a["padding_idx"], sequence_parallel=a["sequence_parallel"]
    )
    set_shard_spec(layer.weight, ShardSpec(axis=0), g.nranks)
    return layer


def ParallelLMHead(  # noqa: N802 - a layer factory
    hidden_size: int,
    vocab_size: int,
    sequence_parallel: bool = False,
    *,
    topo: Topology | None = None,
) -> nn.Layer:
    """Output projection [H, V] split over the vocabulary: a column-parallel linear without bias or
    gather, returning vocab-parallel logits [B, S, V/tp] for :func:`parallel_cross_entropy`."""
    return ColumnParallelLinear(hidden_size, vocab_size, sequence_parallel=sequence_parallel, topo=topo)


def parallel_cross_entropy(
    logits: paddle.Tensor,
    labels: paddle.Tensor,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    group: Any = "tp",
) -> paddle.Tensor:
    """Cross entropy over vocab-parallel logits [..., V/tp] and labels [...] (int64), in fp32.

    HF convention: tokens labelled ``ignore_index`` contribute nothing; ``reduction="mean"`` divides by
    the number of the other tokens (0 when there are none). ``"sum"`` and ``"none"`` (per token) are
    what a trainer that normalises over a whole global batch wants. No shifting happens here.
    At tp=1 this is ``F.cross_entropy``; under TP it is Fleet's ``ParallelCrossEntropy``. ``group``:
    the group the vocabulary is split over (None: not split), or the name of one of the process's.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"parallel_cross_entropy: reduction must be mean|sum|none, got {reduction!r}")
    if isinstance(group, str):  # a group name: the process's topology (the model passes its own group)
        group = get_topology().group(group)
    if labels.ndim == logits.ndim:
        labels = labels.squeeze(-1)
    labels = labels.astype("int64")
    if comm.group_size(group) == 1:
        per_tok = F.cross_entropy(
            logits.astype("float32"), labels.unsqueeze(-1), ignore_index=ignore_index, reduction="none"
        ).squeeze(-1)
        per_tok = with_nonfinite_rows(per_tok, logits, labels, ignore_index)  # Paddle's CPU op hides NaN/inf
    else:
        ce = mpu.ParallelCrossEntropy(mp_group=group, ignore_index=ignore_index)
        per_tok = ce(logits.astype("float32"), labels.unsqueeze(-1)).squeeze(-1)
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    if reduction == "sum":
        return total
    count = (labels != ignore_index).astype("float32").sum()
    return total / paddle.clip(count, min=1.0)
