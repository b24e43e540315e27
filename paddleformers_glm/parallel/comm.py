"""Collectives and Megatron's f / g autograd pairs for model parallelism, on CPU gloo and GPU NCCL.

Raw ops (no autograd) use the native collective on NCCL and an emulation on gloo, whose Paddle 3.3.1
CPU build lacks reduce_scatter / alltoall and sums fp16 wrongly; the pairs are built on them, and
the sequence-parallel ones (``*_sp``) are Fleet's ``sequence_parallel_utils`` PyLayers on Fleet's
model-parallel group.  Everything is a no-op at group size 1.  Table and rationale:
docs/parallel.md section 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from .._io import env_flag

__all__ = [
    "all_gather",
    "all_gather_varlen",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_tensor",
    "copy_to_tp",
    "detect_backend",
    "exchange_counts",
    "fleet_sp_group",
    "gather_counts",
    "gather_from_sp",
    "gather_from_tp",
    "gather_rows_from_tp",
    "group_size",
    "my_rows",
    "recv_tensors",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_to_sp",
    "reduce_scatter_varlen",
    "row_split",
    "scatter_rows_to_tp",
    "scatter_to_sp",
    "scatter_to_tp",
    "send_tensors",
    "split_take",
    "to_batch_first",
    "to_sequence_first",
    "uses_emulation",
]

SEQ_AXIS = 1


# ------------------------------------------------------------------------------ helpers
def group_size(group: Any) -> int:
    return 1 if group is None else int(group.nranks)


def _live(group: Any) -> bool:
    return group is not None and group.nranks > 1


def detect_backend() -> str:
    """'nccl' where Paddle sees a GPU, else 'gloo': the backend the trainer's topology initialises."""
    return "nccl" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "gloo"


def uses_emulation() -> bool:
    """True on gloo (CPU), or anywhere with GLM52_EMULATE_COLLECTIVES=1 (to test the emulation on GPU)."""
    return env_flag("GLM52_EMULATE_COLLECTIVES", False, strict=False) or detect_backend() != "nccl"


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _check_axis(x: paddle.Tensor, n: int, axis: int, what: str) -> int:
    axis = axis % x.ndim
    if x.shape[axis] % n:
        raise ValueError(f"{what}: dim {axis} of shape {list(x.shape)} is not divisible by the group size {n}")
    return axis


# ------------------------------------------------------------------------------ raw ops
def all_reduce(x: paddle.Tensor, group: Any, op: str = "sum") -> paddle.Tensor:
    """Reduced copy of ``x`` (the input is not modified).

    A zero-element tensor is returned as is: every rank of the group holds the same shape, so all
    of them skip the call together (gloo aborts on an empty all-reduce; e.g. an expert-tensor-parallel
    group that received no token).
    """
    if not _live(group) or x.size == 0:
        return x
    y = x.contiguous().clone()
    low = uses_emulation() and y.dtype in (paddle.float16, paddle.bfloat16)
    if low:  # gloo's fp16 all_reduce gives wrong sums (probe t_fp16_ar); reduce in fp32
        y = y.astype("float32")
    dist.all_reduce(y, op=_OPS[op], group=group)
    return y.astype(x.dtype) if low else y


def all_gather(x: paddle.Tensor, group: Any, axis: int = -1) -> paddle.Tensor:
    """Concatenation of every rank's ``x`` along ``axis`` (equal shapes; none sent when empty)."""
    if not _live(group):
        return x
    if x.size == 0:
        shape = list(x.shape)
        shape[axis % x.ndim] *= group.nranks
        return paddle.zeros(shape, dtype=x.dtype)
    parts: list[paddle.Tensor] = []
    dist.all_gather(parts, x.contiguous(), group=group)
    return paddle.concat(parts, axis=axis)


def split_take(x: paddle.Tensor, group: Any, axis: int = -1) -> paddle.Tensor:
    """This rank's equal slice of ``x`` along ``axis``."""
    if not _live(group):
        return x
    axis = _check_axis(x, group.nranks, axis, "split_take")
    return paddle.split(x, group.nranks, axis=axis)[group.rank].contiguous().clone()


def reduce_scatter(x: paddle.Tensor, group: Any, axis: int = 0) -> paddle.Tensor:
    """Sum over ranks, then this rank's equal slice along ``axis``; gloo: all_reduce + slice."""
    if not _live(group):
        return x
    axis = _check_axis(x, group.nranks, axis, "reduce_scatter")
    if uses_emulation():
        return split_take(all_reduce(x, group), group, axis)
    parts = [p.contiguous() for p in paddle.split(x, group.nranks, axis=axis)]
    out = paddle.empty_like(parts[group.rank])
    dist.reduce_scatter(out, parts, group=group)
    return out


def broadcast(x: paddle.Tensor, src: int, group: Any) -> paddle.Tensor:
    """In-place broadcast from global rank ``src``; returns ``x`` (nothing sent when empty)."""
    if _live(group) and x.size:
        dist.broadcast(x, src=src, group=group)
    return x


# tensors of any shape and dtype between ranks that do not know them: one int64 header per transfer
# (per tensor: ndim, dims, dtype) travels first; bf16 / fp16 travel as fp32 where collectives are
# emulated (gloo)
_WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32")
_HEADER = 8  # one tensor's entry: ndim, up to 6 dims, dtype


def _header(xs: Sequence[paddle.Tensor]) -> paddle.Tensor:
    rows = []
    for x in xs:
        dtype = str(x.dtype).replace("paddle.", "")
        if dtype not in _WIRE_DTYPES or x.ndim > _HEADER - 2:
            raise ValueError(f"a tensor sent whole must be one of {_WIRE_DTYPES} of <= 6 dims, got {dtype} {x.shape}")
        rows += [x.ndim, *x.shape] + [0] * (_HEADER - 2 - x.ndim) + [_WIRE_DTYPES.index(dtype)]
    return paddle.to_tensor(rows, dtype="int64")


def _on_wire(x: paddle.Tensor) -> paddle.Tensor:
    low = uses_emulation() and x.dtype in (paddle.float16, paddle.bfloat16)
    return x.astype("float32") if low else x.contiguous()


def _buffers(header: paddle.Tensor) -> list[tuple[paddle.Tensor, str]]:
    h = [int(v) for v in header.numpy()]
    out = []
    for i in range(0, len(h), _HEADER):
        shape, dtype = h[i + 1 : i + 1 + h[i]], _WIRE_DTYPES[h[i + _HEADER - 1]]
        low = uses_emulation() and dtype in ("float16", "bfloat16")
        out.append((paddle.empty(shape, dtype="float32" if low else dtype), dtype))
    return out


def send_tensors(xs: Sequence[paddle.Tensor], dst: int, group: Any, counted: bool = False) -> None:
    """Send ``xs`` whole to global rank ``dst``, which calls :func:`recv_tensors` knowing neither
    their shapes nor their dtypes, only how many (a pipeline stage's carry) unless ``counted`` sends
    their number first: one header, then each non-empty tensor."""
    if counted:
        dist.send(paddle.to_tensor([len(xs)], dtype="int64"), dst=dst, group=group)
    dist.send(_header(xs), dst=dst, group=group)
    for x in xs:
        if x.size:
            dist.send(_on_wire(x), dst=dst, group=group)


def recv_tensors(src: int, group: Any, count: int | None = None) -> list[paddle.Tensor]:
    """The ``count`` tensors global rank ``src`` sends with :func:`send_tensors` (None: as many as it
    says, sent ``counted``)."""
    if count is None:
        n = paddle.zeros([1], dtype="int64")
        dist.recv(n, src=src, group=group)
        count = int(n.item())
    header = paddle.zeros([count * _HEADER], dtype="int64")
    dist.recv(header, src=src, group=group)
    out = []
    for buf, dtype in _buffers(header):
        if buf.size:
            dist.recv(buf, src=src, group=group)
        out.append(buf.astype(dtype))
    return out


def broadcast_tensor(x: paddle.Tensor | None, src: int, group: Any) -> paddle.Tensor:
    """``x`` of global rank ``src`` on every rank of ``group`` (the others pass None: its shape and
    dtype travel with it)."""
    header = _header([x]) if x is not None else paddle.zeros([_HEADER], dtype="int64")
    dist.broadcast(header, src=src, group=group)
    if x is not None:
        return broadcast(_on_wire(x), src, group).astype(x.dtype) if x.size else x
    buf, dtype = _buffers(header)[0]
    return broadcast(buf, src, group).astype(dtype)


def exchange_counts(send_counts: Sequence[int], group: Any) -> list[list[int]]:
    """Every rank's send counts: ``m[src][dst]`` rows go from src to dst. Needed to size all-to-all."""
    if not _live(group):
        return [list(int(c) for c in send_counts)]
    t = paddle.to_tensor(np.asarray(send_counts, dtype=np.int64))
    parts: list[paddle.Tensor] = []
    dist.all_gather(parts, t, group=group)
    return [[int(v) for v in p.numpy().tolist()] for p in parts]


def gather_counts(counts: paddle.Tensor, *groups: Any) -> np.ndarray:
    """Every rank's ``counts`` (an int64 vector on the device) on the host, in ONE read: all-gathered
    over each of ``groups`` in turn on the device, shape ``[size of the last group, ..., size of the
    first, len(counts)]`` (a size-1 axis for a group of one rank), indexed by group rank.

    On a GPU each read of a device value is a stream synchronisation; gathering first lets one read
    size every uneven exchange that follows (the expert dispatch's all-to-all and etp pooling).
    """
    x = counts.astype("int64").reshape([-1])
    for g in groups:
        if _live(g):
            parts: list[paddle.Tensor] = []
            dist.all_gather(parts, x.contiguous(), group=g)
            x = paddle.stack(parts)
        else:
            x = x.unsqueeze(0)
    return x.numpy()


def all_to_all_single(x: paddle.Tensor, counts: list[list[int]], group: Any, reverse: bool = False) -> paddle.Tensor:
    """Uneven all-to-all along axis 0: rows ``counts[me][j]`` of ``x`` go to rank j.

    ``reverse`` sends along the transposed matrix (the way back). NCCL: native alltoall_single;
    gloo: one padded all_gather, then each rank cuts out its rows (O(world x rows) memory, fine for CPU).
    """
    if not _live(group):
        return x
    n, r = group.nranks, group.rank
    m = [[counts[d][s] for d in range(n)] for s in range(n)] if reverse else counts
    send = m[r]
    recv = [m[s][r] for s in range(n)]
    if x.shape[0] != sum(send):
        raise ValueError(f"all_to_all: input has {x.shape[0]} rows, send counts {send} sum to {sum(send)}")
    tail = list(x.shape[1:])
    if not uses_emulation():
        out = paddle.empty([sum(recv)] + tail, dtype=x.dtype)
        dist.alltoall_single(out, x.contiguous(), send, recv, group=group)
        return out
    take = [(s, sum(m[s][:r]), sum(m[s][: r + 1])) for s in range(n)]
    return _gather_rows(x, group, max(sum(row) for row in m), take)


def _gather_rows(x: paddle.Tensor, group: Any, rows: int, take: list[tuple[int, int, int]]) -> paddle.Tensor:
    """One all-gather of ``x`` padded to ``rows`` rows (gloo needs equal shapes), then the rows
    ``[a, b)`` of rank ``s``'s block for each ``(s, a, b)`` in ``take``, concatenated."""
    tail, rows = list(x.shape[1:]), max(rows, 1)
    if x.shape[0] < rows:
        x = paddle.concat([x, paddle.zeros([rows - x.shape[0]] + tail, dtype=x.dtype)], axis=0)
    gathered: list[paddle.Tensor] = []
    dist.all_gather(gathered, x.contiguous(), group=group)
    pieces = [gathered[s][a:b] for s, a, b in take if b > a]
    return paddle.concat(pieces, axis=0) if pieces else paddle.zeros([0] + tail, dtype=x.dtype)


def _varlen_gather(x: paddle.Tensor, sizes: list[int], group: Any) -> paddle.Tensor:
    return _gather_rows(x, group, max(sizes), [(s, 0, n) for s, n in enumerate(sizes)])


def _varlen_sum_take(x: paddle.Tensor, sizes: list[int], group: Any) -> paddle.Tensor:
    off = sum(sizes[: group.rank])
    return all_reduce(x, group)[off : off + sizes[group.rank]].clone()


# ------------------------------------------------------------------------------ autograd pairs
class _FwdBwd(PyLayer):
    """One tensor in, one out; forward and backward are given as closures."""

    @staticmethod
    def forward(ctx, x: paddle.Tensor, fwd: Callable, bwd: Callable) -> paddle.Tensor:
        ctx.bwd = bwd
        y = fwd(x)
        return y.clone() if y is x else y

    @staticmethod
    def backward(ctx, dy: paddle.Tensor) -> paddle.Tensor:
        g = ctx.bwd(dy)
        return g.clone() if g is dy else g


def _apply(x: paddle.Tensor, fwd: Callable, bwd: Callable) -> paddle.Tensor:
    if x.stop_gradient:  # no graph needed (e.g. integer inputs or no_grad regions)
        return fwd(x)
    return _FwdBwd.apply(x, fwd, bwd)


def _pair(x: paddle.Tensor, group: Any, fwd: Callable, bwd: Callable) -> paddle.Tensor:
    """``fwd`` forward and ``bwd`` backward over a group of more than one rank; else ``x`` itself."""
    return _apply(x, fwd, bwd) if _live(group) else x


def copy_to_tp(x: paddle.Tensor, group: Any = None) -> paddle.Tensor:
    """f: enter a TP region with a replicated input (identity forward, all-reduce of grads)."""
    return _pair(x, group, lambda t: t, lambda d: all_reduce(d, group))


def reduce_from_tp(x: paddle.Tensor, group: Any = None) -> paddle.Tensor:
    """g: leave a TP region by summing partial results (all-reduce forward, identity backward)."""
    return _pair(x, group, lambda t: all_reduce(t, group), lambda d: d)


def scatter_to_tp(x: paddle.Tensor, axis: int = -1, group: Any = None) -> paddle.Tensor:
    """Keep this rank's slice of a replicated tensor; backward all-gathers the slices."""
    return _pair(x, group, lambda t: split_take(t, group, axis), lambda d: all_gather(d, group, axis))


def gather_from_tp(x: paddle.Tensor, axis: int = -1, group: Any = None) -> paddle.Tensor:
    """All-gather slices into a replicated tensor; backward keeps this rank's slice of the grad."""
    return _pair(x, group, lambda t: all_gather(t, group, axis), lambda d: split_take(d, group, axis))


def row_split(rows: int, group: Any) -> list[int]:
    """Rows of each rank when ``rows`` rows are shared out over ``group`` as evenly as they go (the
    first ``rows % n`` ranks one more): any count splits, a rank may get none."""
    n = group_size(group)
    return [rows // n + (r < rows % n) for r in range(n)]


def my_rows(x: paddle.Tensor, sizes: list[int], group: Any) -> paddle.Tensor:
    """This rank's ``sizes[rank]`` rows (axis 0) of a tensor split by :func:`row_split`, no communication."""
    off = sum(sizes[: group.rank])
    return x[off : off + sizes[group.rank]].clone()


def scatter_rows_to_tp(x: paddle.Tensor, sizes: list[int], group: Any = None) -> paddle.Tensor:
    """Keep this rank's ``sizes[r]`` rows (axis 0) of a replicated tensor, sizes uneven allowed
    (:func:`row_split`); backward all-gathers every rank's row gradients (:func:`scatter_to_tp` for
    row blocks of any size)."""
    return _pair(x, group, lambda t: my_rows(t, sizes, group), lambda d: _varlen_gather(d, sizes, group))


def gather_rows_from_tp(x: paddle.Tensor, sizes: list[int], group: Any = None) -> paddle.Tensor:
    """All-gather uneven row blocks (``sizes[r]`` rows from rank r) into a replicated tensor;
    backward keeps this rank's rows of the gradient, no sum (:func:`gather_from_tp` for row blocks
    of any size; :func:`all_gather_varlen` sums instead, for a consumer that is not replicated)."""
    return _pair(x, group, lambda t: _varlen_gather(t, sizes, group), lambda d: my_rows(d, sizes, group))


def fleet_sp_group(group: Any = None) -> Any:
    """``group`` when it is Fleet's hybrid model-parallel group, the one
    ``fleet.utils.sequence_parallel_utils`` always communicates over; None otherwise (size 1, no
    Fleet, or another group such as expert tensor parallel), where the ``*_sp`` pairs are built here."""
    if not _live(group):
        return None
    from paddle.distributed import fleet

    hcg = getattr(fleet.fleet, "_hcg", None)  # the one sequence_parallel_utils asks for
    if hcg is None:
        return None
    mp = hcg.get_model_parallel_group()
    return group if mp is group or getattr(mp, "id", None) == getattr(group, "id", None) else None


def _fleet_sp_op(op: Any, x: paddle.Tensor, axis: int) -> paddle.Tensor:
    return to_batch_first(op.apply(to_sequence_first(x, axis)), list(x.shape), axis)


def to_sequence_first(x: paddle.Tensor, axis: int = SEQ_AXIS) -> paddle.Tensor:
    """Move the sequence axis of ``x`` to the front, as Fleet's sequence-parallel ops expect.

    Free (a reshape) when every axis before it has size 1, e.g. a batch of one ``[1, S, H]``;
    otherwise a transposed copy of the activation (and its gradient on the way back)."""
    axis = axis % x.ndim
    if all(int(d) == 1 for d in x.shape[:axis]):  # also axis 0: a reshape to the same shape
        return x.reshape([x.shape[axis], *x.shape[:axis], *x.shape[axis + 1 :]])
    perm = [axis, *range(axis), *range(axis + 1, x.ndim)]
    return paddle.transpose(x, perm).contiguous()


def to_batch_first(y: paddle.Tensor, like: list[int], axis: int = SEQ_AXIS) -> paddle.Tensor:
    """Inverse of :func:`to_sequence_first`; ``like`` is the shape the input had (its leading axes)."""
    axis = axis % len(like)
    if all(int(d) == 1 for d in like[:axis]):
        return y.reshape([*like[:axis], y.shape[0], *y.shape[1 + axis :]])
    perm = [*range(1, axis + 1), 0, *range(axis + 1, y.ndim)]
    return paddle.transpose(y, perm).contiguous()


def _sp_pair(x: paddle.Tensor, axis: int, g: Any, fleet_op: Any, fwd: Callable, bwd: Callable, what: str = "") -> Any:
    """A sequence-parallel pair: Fleet's ``fleet_op`` on Fleet's model-parallel group; on any other,
    forward ``fwd(x, g, axis)`` and backward ``bwd(dy, g, axis)`` built here.  ``what``: the op,
    named when ``x`` must split evenly along ``axis``."""
    if not _live(g):
        return x
    if what:
        _check_axis(x, g.nranks, axis, what)
    if fleet_sp_group(g) is not None:
        return _fleet_sp_op(fleet_op, x, axis)
    return _apply(x, lambda t: fwd(t, g, axis), lambda d: bwd(d, g, axis))


def scatter_to_sp(x: paddle.Tensor, axis: int = SEQ_AXIS, group: Any = None) -> paddle.Tensor:
    """Enter the sequence-parallel region: keep my sequence slice (backward all-gathers).
    Fleet's ``ScatterOp`` on the sequence-first view."""
    return _sp_pair(x, axis, group, spu.ScatterOp, split_take, all_gather, "scatter_to_sp")


def gather_from_sp(
    x: paddle.Tensor, axis: int = SEQ_AXIS, group: Any = None, grad: str = "reduce_scatter"
) -> paddle.Tensor:
    """All-gather the sequence shards (Fleet's ops on the sequence-first view).

    ``grad="reduce_scatter"`` (Fleet's ``AllGatherOp``) when the consumer is TP-partitioned (a
    column-parallel linear: each rank's gradient is a partial sum); ``grad="split"`` (Fleet's
    ``GatherOp``) when the consumer is replicated and computes the same thing on every TP rank
    (e.g. a replicated indexer, the loss): summing would count it tp times.
    """
    ops = {"reduce_scatter": (spu.AllGatherOp, reduce_scatter), "split": (spu.GatherOp, split_take)}
    if grad not in ops:
        raise ValueError(f"gather_from_sp: grad must be 'reduce_scatter' or 'split', got {grad!r}")
    return _sp_pair(x, axis, group, ops[grad][0], all_gather, ops[grad][1])


def reduce_scatter_to_sp(x: paddle.Tensor, axis: int = SEQ_AXIS, group: Any = None) -> paddle.Tensor:
    """Leave a TP region into the sequence-parallel region (reduce-scatter; backward all-gathers).
    Fleet's ``ReduceScatterOp`` on the sequence-first view."""
    return _sp_pair(x, axis, group, spu.ReduceScatterOp, reduce_scatter, all_gather, "reduce_scatter_to_sp")


def all_to_all(x: paddle.Tensor, counts: list[list[int]], group: Any, reverse: bool = False) -> paddle.Tensor:
    """Differentiable uneven all-to-all along axis 0 (token dispatch; ``reverse`` for the way back)."""
    return _pair(
        x,
        group,
        lambda t: all_to_all_single(t, counts, group, reverse=reverse),
        lambda d: all_to_all_single(d, counts, group, reverse=not reverse),
    )


def all_gather_varlen(x: paddle.Tensor, sizes: list[int], group: Any) -> paddle.Tensor:
    """Concatenate uneven row blocks (``sizes[r]`` rows from rank r); backward sums and keeps my rows."""
    return _pair(x, group, lambda t: _varlen_gather(t, sizes, group), lambda d: _varlen_sum_take(d, sizes, group))


def reduce_scatter_varlen(x: paddle.Tensor, sizes: list[int], group: Any) -> paddle.Tensor:
    """Sum ``x`` [sum(sizes), ...] over ranks, keep my ``sizes[r]`` rows; backward all-gathers."""
    return _pair(x, group, lambda t: _varlen_sum_take(t, sizes, group), lambda d: _varlen_gather(d, sizes, group))
