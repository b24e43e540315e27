"""Running AOA programs on Paddle's engine with lazy, slice-exact reads.

Paddle's ``AOAEngine`` turns statements into, for every target slice, the list of source slices
plus a post-process list (transposes, casts); ``assign_sharded_slice`` applies one such entry.
``load_state_dict(aoa_config=...)`` and ``full_param`` are thin drivers around exactly these two
calls, but the file driver reads *whole shard files* into memory (``safetensors.load_file``) and
writes a metadata file into the checkpoint folder. This module is a third driver: it asks the
engine the same questions and reads only the source slices the engine names, from an mmap, one
slice at a time. So a tensor-parallel rank whose target is a ``ShardedWeight`` (local slice of a
global tensor) reads only its rows/columns, and peak memory is the model plus one source slice.

Programs are built and run per layer: the engine's macro passes scan all source keys per
statement, so one engine over a 744B model's 80k statements takes ~30 s, per layer it is linear.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .aoa import MappingUnit, build_statements, quiet_paddle_logs
from .errors import CheckpointError
from .safetensors_io import Checkpoint, st_to_paddle_dtype

__all__ = [
    "Source",
    "CheckpointSource",
    "StateDictSource",
    "TargetSpec",
    "group_units",
    "run_units",
    "dtype_name",
]


def dtype_name(dtype: Any) -> str:
    """``paddle.float32`` / ``"float32"`` / numpy dtype -> ``"float32"``."""
    return str(dtype).replace("paddle.", "")


class Source(Protocol):
    """Where source tensors come from: metadata without reading, and slices on demand."""

    def meta(self, key: str) -> tuple[tuple[int, ...], str]: ...

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> Any: ...


@dataclass
class CheckpointSource:
    """Lazy source over a validated :class:`Checkpoint`; counts the bytes it reads."""

    ckpt: Checkpoint
    bytes_read: int = 0

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        info = self.ckpt.info(key)
        return info.shape, st_to_paddle_dtype(info.dtype)

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> Any:
        info = self.ckpt.info(key)
        full = tuple(offset) == (0,) * len(offset) and tuple(shape) == info.shape
        index = None if full else tuple(slice(o, o + s) for o, s in zip(offset, shape))
        t = self.ckpt.paddle(key, index)
        itemsize = info.nbytes // info.numel if info.numel else 0
        self.bytes_read += int(np.prod(shape, dtype=np.int64)) * itemsize
        return t


@dataclass
class StateDictSource:
    """In-memory source (a model's tensors) for the save direction; slices are views."""

    tensors: Mapping[str, Any]

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        t = self.tensors[key]
        return tuple(int(d) for d in t.shape), dtype_name(t.dtype)

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> Any:
        import paddle

        t = self.tensors[key]
        if tuple(offset) == (0,) * len(offset) and tuple(shape) == tuple(t.shape):
            return t
        axes = list(range(len(shape)))
        return paddle.slice(t, axes=axes, starts=list(offset), ends=[o + s for o, s in zip(offset, shape)])


@dataclass
class TargetSpec:
    """One target tensor: its global shape/dtype and, for a sharded target, the local piece."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    tensor: Any = None  # filled in place when given, else a fresh tensor is yielded
    all_shards: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def local(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.local_shape or self.global_shape, self.global_offset or (0,) * len(self.global_shape))


def group_units(units: Iterable[MappingUnit]) -> list[list[MappingUnit]]:
    """Units grouped by layer (global units first), the granularity one engine runs at."""
    groups: dict[int, list[MappingUnit]] = defaultdict(list)
    for u in units:
        groups[-1 if u.layer is None else u.layer].append(u)
    return [groups[k] for k in sorted(groups)]


def run_units(
    units: Sequence[MappingUnit],
    direction: str,
    source: Source,
    targets: Mapping[str, TargetSpec],
    produce: Iterable[str] | None = None,
    trace: dict[str, dict[str, Any]] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Run the units' AOA program on Paddle's engine; yields ``(target key, tensor)`` one at a time.

    ``targets`` describes every target of the units (the engine needs the whole output set); only
    keys in ``produce`` (default: all) are read and made — a pipeline stage passes its own. A
    target with ``tensor`` set is filled in place (its local slice); otherwise a new tensor of its
    local shape is made. Every element of every target must be written by some engine entry,
    else :class:`CheckpointError` names the target. ``trace``, when given, receives per target the
    source keys the engine used and whether it transposed or cast (for classifying differences).
    """
    import paddle
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight, ShardedWeightDesc
    from paddle.distributed.flex_checkpoint.dcp.utils import assign_sharded_slice

    quiet_paddle_logs()
    produce = set(targets) if produce is None else set(produce)
    for group in group_units(units):
        wanted = [k for u in group for k in u.targets(direction) if k in produce]
        if not wanted:
            continue
        src_keys = [k for u in group for k in u.sources(direction)]
        src_meta = {k: source.meta(k) for k in src_keys}
        src_info = {k: [ShardedWeightDesc(k, s, s, (0,) * len(s), d)] for k, (s, d) in src_meta.items()}
        # Every target of the group gets destination info (the engine needs the full output set);
        # ones not wanted are described as unsharded and never materialised.
        dst_info: dict[str, list[Any]] = {}
        dst_dtypes: dict[str, str] = {}
        for u in group:
            for k in u.targets(direction):
                t = targets.get(k)
                if t is None:
                    raise CheckpointError("internal: target of a selected unit has no spec", key=k)
                dst_dtypes[k] = t.dtype
                shards = t.all_shards or [t.local()]
                dst_info[k] = [ShardedWeightDesc(k, ls, t.global_shape, off, t.dtype) for ls, off in shards]
        stmts = build_statements(group, direction, {k: d for k, (_, d) in src_meta.items()}, dst_dtypes)
        try:
            engine = AOAEngine({"aoa_statements": stmts, "enable_traceback": False}, src_info, dst_info)
        except Exception as e:  # engine errors are asserts/KeyErrors without context
            raise CheckpointError(
                f"AOA engine rejected the program for {group[0].name}..{group[-1].name}: {type(e).__name__}: {e}"
            ) from e
        for key in wanted:
            t = targets[key]
            local_shape, offset = t.local()
            desc = ShardedWeightDesc(key, local_shape, t.global_shape, offset, t.dtype)
            mappings = engine.find_shard_sources(desc)
            out = t.tensor if t.tensor is not None else paddle.empty(list(local_shape), dtype=t.dtype)
            dst = ShardedWeight(
                key=key, local_tensor=out, local_shape=local_shape, global_shape=t.global_shape, global_offset=offset
            )
            covered = 0
            if trace is not None:
                pp = [p for m in mappings for p in (m.postprocess_list or [])]
                trace[key] = {
                    "sources": sorted({m.source_slice.key for m in mappings}),
                    "transposed": any(str(p).startswith("[") for p in pp),
                    "cast": any(not str(p).startswith("[") for p in pp),
                }
            for m in mappings:
                s = m.source_slice
                if s.dtype != t.dtype and not (m.postprocess_list and t.dtype in m.postprocess_list):
                    raise CheckpointError(
                        "AOA program assigns across dtypes without a cast",
                        key=key,
                        expected=t.dtype,
                        actual=f"{s.key}: {s.dtype}",
                    )
                piece = source.read(s.key, s.global_offset, s.local_shape)
                src = ShardedWeight(
                    key=s.key,
                    local_tensor=piece,
                    local_shape=s.local_shape,
                    global_shape=s.global_shape,
                    global_offset=s.global_offset,
                )
                assign_sharded_slice(s, src, m.target_slice, dst, m.postprocess_list)
                covered += math.prod(m.target_slice.local_shape)
                del piece, src
            if covered != math.prod(local_shape):
                raise CheckpointError(
                    "AOA mapping does not cover the whole target",
                    key=key,
                    expected=f"{math.prod(local_shape)} elements",
                    actual=f"{covered} written",
                )
            yield key, out
