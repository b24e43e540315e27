"""Per-rank memory: one accounting rule for parameters, gradients and optimizer state, shared by
``glm52 plan`` (which applies it to shapes built under ``paddle.LazyGuard``) and by the trainer
(which measures the tensors it really holds and records both in ``loss.json``).  The rule (fp32
main grads, Paddle AdamW's multi-precision state, what sharding divides) is docs/scale.md; sharded
divisions are an even split, so at sharding degree 1 every number is exact.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..checkpoint.safetensors_io import ST_DTYPES, dtype_name

__all__ = ["DTYPE_BYTES", "MemoryMonitor", "dtype_name", "fleet_sharding_partition", "shard_totals", "state_bytes"]

DTYPE_BYTES = {name: size for size, _, name in ST_DTYPES.values() if name}  # by Paddle dtype name


def state_bytes(
    params: Iterable[tuple[int, str] | tuple[int, str, bool] | tuple[int, str, bool, bool]],
    *,
    sharding_degree: int = 1,
    sharding_stage: int = 0,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state for ``params`` = ``(numel, dtype)`` or
    ``(numel, dtype, trainable)`` (a frozen parameter has no gradient and no optimizer state) or
    ``(numel, dtype, trainable, stepped)``: a trainable parameter that never receives a gradient
    (the optimizer never steps it, so creates no state for it) still has its fp32 main-grad buffer."""
    if sharding_degree < 1 or sharding_stage not in (0, 1, 2, 3):
        raise ValueError(f"state_bytes: sharding degree {sharding_degree} / stage {sharding_stage} is not valid")
    p_bytes = g_bytes = o_bytes = 0
    for numel, dtype, *flags in params:
        d = dtype_name(dtype)
        p_bytes += numel * DTYPE_BYTES[d]
        trainable = flags[0] if flags else True
        stepped = flags[1] if len(flags) > 1 else trainable
        if trainable:
            g_bytes += numel * 4
        if stepped:
            o_bytes += 2 * numel * 4 + (numel * 4 if d != "float32" else 0) + 8
    totals = {"params_bytes": p_bytes, "grads_bytes": g_bytes, "optimizer_bytes": o_bytes}
    return shard_totals(totals, sharding_degree, sharding_stage)


def shard_totals(totals: Mapping[str, int], sharding_degree: int, sharding_stage: int) -> dict[str, int]:
    """Unsharded :func:`state_bytes` totals on one sharding rank (an even split, rounded up):
    optimizer state (and the planner's ``expert_optimizer_bytes``, its routed experts' part) from
    stage 1, the gradients held after the reduce (``grads_after_reduce_bytes``, where given) from
    stage 2, the gradients held through the backward (``grads_bytes``) and parameters from stage 3:
    the trainer's stage 2 reduces each gradient onto its owner after the step's backward passes, so
    until then every rank holds them all. Totals add up over parts, so a planner can sum them per
    layer kind first and split once."""
    sd, out = sharding_degree, dict(totals)
    stages = (("optimizer_bytes", 1), ("expert_optimizer_bytes", 1), ("grads_after_reduce_bytes", 2))
    for key, stage in (*stages, ("grads_bytes", 3), ("params_bytes", 3)):
        if sharding_stage >= stage and sd > 1 and key in out:
            out[key] = math.ceil(out[key] / sd)
    return out


def fleet_sharding_partition(numels: Sequence[int], degree: int) -> list[list[int]]:
    """Which parameters (indices, in the optimizer's order) each sharding rank owns under Fleet's
    ``DygraphShardingOptimizer`` (stage 1): sorted by element count, largest first (a stable sort,
    Fleet's default ``FLAGS_sharding_sort_parameters=1``), each to the rank holding the fewest
    elements so far (the first such rank).  Whole tensors, so ranks differ by up to one tensor."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    sizes, out = [0] * degree, [[] for _ in range(degree)]
    for i in order:
        r = sizes.index(min(sizes))
        out[r].append(i)
        sizes[r] += numels[i]
    return out


def _tensor_bytes(t: Any) -> int:
    return int(math.prod(t.shape)) * DTYPE_BYTES[dtype_name(t.dtype)]


class _Saved:
    """A tensor kept for backward (a plain object: PyLayers unpack tuples element-wise).  It stops
    counting (``release``, once) when its backward reads it, or when the graph node holding it lets
    it go unread (a PyLayer that ran without gradient, e.g. the frozen layers of the indexer's
    warm-up, saves its inputs but no backward ever unpacks them)."""

    __slots__ = ("ptr", "release", "tensor")

    def __init__(self, ptr: int | None, tensor: Any, release: Any = None) -> None:
        self.ptr, self.tensor, self.release = ptr, tensor, release

    def done(self) -> None:
        if self.release is not None:
            release, self.release = self.release, None
            release(self.ptr)

    __del__ = done  # the graph node let it go unread


class MemoryMonitor:
    """The trainer's measurement: the first step's peak saved activations (:meth:`track`); after the
    first optimizer step the parameters the rank holds and the fp32 main gradients; at the end the
    optimizer's tensors and the peak memory (``max_memory_allocated`` on a GPU, peak RSS on the
    host) and gathers every rank's record."""

    def __init__(self, module: Any, topo: Any) -> None:
        self.module, self.topo = module, topo
        self.record: dict[str, Any] | None = None

    def track(self, first: bool) -> Any:
        """Context for a step's forwards and backwards: on the first step, counts the peak bytes
        autograd keeps saved for backward (distinct storages, parameters excluded), the quantity
        the planner's activation estimate describes.  Under recompute nothing is counted
        (``activations_bytes`` is None): the recomputed layers install their own saved-tensor hooks
        and Paddle allows one pair at a time."""
        import contextlib

        if not first:
            return contextlib.nullcontext()
        if getattr(self.module, "recompute", "none") != "none":
            self.activations_peak = None
            return contextlib.nullcontext()
        import paddle

        params = {p.data_ptr() for p in self.module.parameters()}
        live: dict[int, list[int]] = {}
        cur = [0]
        self.activations_peak = 0

        def release(ptr: int) -> None:
            entry = live.get(ptr)
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    cur[0] -= live.pop(ptr)[1]

        def pack(t: Any) -> Any:
            ptr = t.data_ptr()
            if ptr in params:
                return _Saved(None, t)
            if ptr not in live:
                live[ptr] = [0, int(math.prod(t.shape)) * t.element_size()]
                cur[0] += live[ptr][1]
                self.activations_peak = max(self.activations_peak, cur[0])
            live[ptr][0] += 1
            return _Saved(ptr, t, release)

        def unpack(s: Any) -> Any:
            s.done()
            return s.tensor

        return paddle.autograd.saved_tensors_hooks(pack, unpack)

    def observe(self, grads: Mapping[str, Any], before_reduce_bytes: int | None = None) -> None:
        """Call after each optimizer step (cheap after the first); ``before_reduce_bytes``: the fp32
        gradients this rank held at the end of the backward, before sharding's reduce."""
        if self.record is not None:
            return
        params = list(self.module.parameters())
        peak = getattr(self, "activations_peak", 0)
        self.record = {
            "rank": int(self.topo.rank),
            "params_bytes": sum(_tensor_bytes(p) for p in params),
            "grads_bytes": sum(_tensor_bytes(g) for g in grads.values()),
            "grads_before_reduce_bytes": before_reduce_bytes,
            "param_tensors": len(params),
            "activations_bytes": None if peak is None else int(peak),
        }

    def gather(self, opt: Any) -> list[dict[str, Any]]:
        """Every rank's record, in rank order.  Collective: call on every rank."""
        import paddle

        rec = dict(self.record or {"rank": int(self.topo.rank)})
        rec["optimizer_bytes"], rec["optimizer"] = opt.state_bytes(), "paddle.optimizer.AdamW"  # end-of-run state
        keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
        rec["total_bytes"] = sum(rec.get(k) or 0 for k in keys)  # activations None: not measured
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            rec["peak_bytes"], rec["peak_kind"] = int(paddle.device.cuda.max_memory_allocated()), "max_memory_allocated"
        else:  # Linux reports KiB, macOS bytes
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            rec["peak_bytes"], rec["peak_kind"] = peak, "peak_rss"
        if self.topo.world_size == 1:
            return [rec]
        import paddle.distributed as dist

        out: list[dict[str, Any]] = []
        dist.all_gather_object(out, rec)
        return sorted(out, key=lambda r: r["rank"])
