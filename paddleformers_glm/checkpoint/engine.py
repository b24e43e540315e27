"""Running AOA programs on Paddle's engine with lazy, slice-exact reads (docs/checkpoints.md, "Loading").

Paddle's own drivers read *whole shard files* and write a metadata file into the checkpoint folder;
this one asks ``AOAEngine`` the same questions and reads only the source slices it names, from an
mmap, one at a time: peak memory is the model plus one source slice. Programs run per mapping unit
(one engine over a whole program takes ~30 s, docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import progress
from .aoa import MappingUnit, build_statements, quiet_paddle_logs
from .errors import CheckpointError
from .safetensors_io import ST_DTYPES, Checkpoint, bf16_bits_to_float32, dtype_name, st_to_paddle_dtype, to_paddle

__all__ = ["CheckpointSource", "StateDictSource", "TargetSpec", "run_units", "dtype_name"]


# A source (where source tensors come from) has ``meta(key) -> (shape, dtype)``, ``read_numpy(key,
# offset, shape)`` (a numpy slice, or None to use ``read``, a Paddle slice) and ``done(key)``.


@dataclass
class CheckpointSource:
    """Lazy source over a validated :class:`Checkpoint`; counts the bytes it reads."""

    ckpt: Checkpoint
    bytes_read: int = 0

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        info = self.ckpt.info(key)
        return info.shape, st_to_paddle_dtype(info.dtype)

    def read_numpy(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray | None:
        """Zero-copy view of the slice in the file map (bf16 as uint16); pages are read on access."""
        self.bytes_read += math.prod(shape) * ST_DTYPES[self.ckpt.info(key).dtype][0]
        return self.ckpt.numpy(key, tuple(slice(o, o + s) for o, s in zip(offset, shape)))

    def done(self, key: str) -> None:
        """Drop the tensor's pages and the fault-around neighbours mapped with them: released one by one,
        those neighbours stayed mapped (in RSS) until the file closed, ~1 of every 5 bytes of a checkpoint
        of small tensors (tests/test_load_pages.py)."""
        self.ckpt.file_of(key).release(key, around=True)


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

    def read_numpy(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray | None:
        return None  # tensors may live on an accelerator: use Paddle ops

    def done(self, key: str) -> None:
        pass


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
    # where a fresh tensor is made (None: Paddle's default device); the copy runs there, so a
    # target filled from host tensors and read back to the host stays on the host
    place: Any = None

    def local(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.local_shape or self.global_shape, self.global_offset or (0,) * len(self.global_shape))


_BLOCK_BYTES = 1 << 19  # transpose in source-row blocks of ~512 KiB: stays in cache on both sides
_PARALLEL_BYTES = 4 << 20  # plain copies from this size are split over the load threads


def numpy_view(tensor: Any) -> np.ndarray | None:
    """A writable numpy view of a contiguous CPU Paddle tensor (bf16 as uint16), else None."""
    import paddle

    try:
        name = dtype_name(tensor.dtype)
        if name not in _NUMPY_OF or not tensor.place.is_cpu_place():
            return None
        if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
            return None
        arr = np.from_dlpack(tensor.view(paddle.int16) if name == "bfloat16" else tensor).view(_NUMPY_OF[name])
    except Exception:  # no DLPack for this tensor: use the generic path
        return None
    return arr if arr.flags.writeable else None  # NumPy < 2.1 makes DLPack imports read-only


_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


@functools.cache
def libc() -> Any:
    """The C library through ctypes (``errno`` kept), or None where it cannot be loaded."""
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def advise_huge_pages(arr: np.ndarray) -> bool:
    """Ask Linux to back ``arr``'s memory with transparent huge pages (``madvise(MADV_HUGEPAGE)``):
    the load's copy is a fresh parameter's first write, one page fault per page (docs/checkpoints.md,
    "Huge pages"). Advice only: False where it does not apply (not Linux, small arrays, no libc)."""
    import ctypes

    if sys.platform != "linux" or arr.nbytes < (4 << 20) or libc() is None:
        return False
    page = 4096
    start = arr.ctypes.data // page * page
    n = arr.ctypes.data + arr.nbytes - start
    return libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(n), ctypes.c_int(_MADV_HUGEPAGE)) == 0


_NUMPY_OF = {"bfloat16": np.uint16, "float32": np.float32, "float16": np.float16, "float64": np.float64}
_WIDTH = {"bfloat16": 1, "float16": 1, "float32": 2, "float64": 3}  # a cast to a wider float is exact


def apply_entry_numpy(src: np.ndarray, src_dtype: str, postprocess: Sequence[str] | None, dst: np.ndarray) -> bool:
    """Apply one engine entry (transposes then casts, in the engine's order) from a numpy source
    into a numpy destination region; False if it needs Paddle (a rounding cast, an odd list).

    Same result as ``assign_sharded_slice``; 2-D transposes go block by block so a large matrix is
    not walked column-wise through memory (Paddle's strided assign is ~5x slower here).
    """
    perm: list[int] = list(range(src.ndim))
    dtype = src_dtype
    for pp in postprocess or []:
        if str(pp).startswith("["):
            if dtype != src_dtype:
                return False  # transpose after a cast: keep the engine's exact order via Paddle
            p = [int(x) for x in str(pp).strip("[]").split(",") if x.strip()]
            perm = [perm[i] for i in p]
        else:
            dtype = str(pp)
    if dtype != src_dtype and not _WIDTH.get(src_dtype, 9) < _WIDTH.get(dtype, 0):
        return False
    if tuple(src.shape[i] for i in perm) != dst.shape or dst.dtype != _NUMPY_OF.get(dtype):
        return False
    if src_dtype == "bfloat16" and dtype == "float32" and dst.dtype == np.float32 and sys.byteorder == "little":
        # bf16 is the high half of fp32: zero the low halves, copy the bits into the high halves
        # (a same-dtype copy, ~1.6x faster than a widening cast through the transpose)
        out, conv, zero = dst.view(np.uint16)[..., 1::2], None, True
    else:
        out, conv, zero = dst, (None if dtype == src_dtype else dtype), False

    def put(region: tuple[slice, ...] | Any, a: np.ndarray) -> None:
        if zero:  # block by block, so the block is still in cache when its high halves land
            dst[region] = 0
        if conv is not None:  # bf16 arrives as uint16 bits and widens by a bit shift
            a = (bf16_bits_to_float32(a) if src_dtype == "bfloat16" else a).astype(_NUMPY_OF[conv], copy=False)
        out[region] = a

    if src.ndim == 2 and perm == [1, 0] and (conv is None or zero):
        from ..ops.transpose import transpose_into  # compiled tiled transpose; False -> numpy below

        pool = _pool()
        if transpose_into(src, dst, widen_bf16=zero, run=(lambda f, xs: list(pool.map(f, xs))) if pool else None):
            return True
    if src.ndim == 2 and perm == [1, 0]:
        rows = max(1, _BLOCK_BYTES // max(1, src.shape[1] * src.itemsize))
        _each(lambda r0: put((slice(None), slice(r0, r0 + rows)), src[r0 : r0 + rows].T), src.shape[0], rows)
    elif perm == list(range(src.ndim)) and src.ndim >= 1 and src.nbytes >= _PARALLEL_BYTES and _pool() is not None:
        # a large untransposed copy (the embedding): row chunks on the pool, like the transposes
        rows = max(1, _BLOCK_BYTES // max(1, src.nbytes // max(1, src.shape[0])))
        _each(lambda r0: put((slice(r0, r0 + rows),), src[r0 : r0 + rows]), src.shape[0], rows)
    else:
        put(Ellipsis, np.transpose(src, perm))
    return True


def _each(block: Callable[[int], None], n: int, step: int) -> None:
    """``block(r0)`` for r0 in 0, step, ... < n; on the load threads when there are some (numpy drops
    the GIL for these copies: blocks run in parallel)."""
    pool, starts = _pool(), range(0, n, step)
    list(pool.map(block, starts) if pool is not None and len(starts) > 1 else map(block, starts))


@functools.cache
def _pool() -> Any:
    """Worker threads for block copies (``GLM52_LOAD_THREADS``, default: CPU count up to 8; 1 = off)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    raw = os.environ.get("GLM52_LOAD_THREADS", "").strip()  # empty: unset
    try:
        n = int(raw) if raw else min(8, os.cpu_count() or 1)
    except ValueError:
        raise ValueError(
            f"GLM52_LOAD_THREADS must be a whole number of threads (1 or less: none), got {raw!r}"
        ) from None
    return ThreadPoolExecutor(n, thread_name_prefix="glm52-load") if n > 1 else None


def _build_engine(group: Sequence[MappingUnit], stmts: list[str], src_info: dict, dst_info: dict) -> Any:
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine

    try:
        return AOAEngine({"aoa_statements": stmts, "enable_traceback": False}, src_info, dst_info)
    except Exception as e:  # engine errors are asserts/KeyErrors without context
        raise CheckpointError(
            f"AOA engine rejected the program for {group[0].name}..{group[-1].name}: {type(e).__name__}: {e}"
        ) from e


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _planner_for(
    group: Sequence[MappingUnit], direction: str, source: Any, targets: Mapping[str, TargetSpec], cache: dict | None
) -> Callable[[Any], list[Any]]:
    """A function target-desc -> engine mapping entries for ``group``, from Paddle's AOAEngine given the
    group's AOA statements and its source and destination shard descriptions.

    With ``cache``, the engine runs the program with every source and target key replaced by a
    placeholder (``glm52_k0``, ``glm52_k1``... in order of appearance), so one engine serves every
    group whose program and shard metadata are the same up to names — all routed experts of all
    MoE layers, say — and its entries are renamed back per group. The engine's answer cannot depend
    on the names: only programs without name patterns (``$`` macros, ``*`` wildcards) are shared.
    """
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    src_meta = {k: source.meta(k) for u in group for k in u.sources(direction)}
    src_info = {k: [ShardedWeightDesc(k, s, s, (0,) * len(s), d)] for k, (s, d) in src_meta.items()}
    if direction == "hf_to_fleet":
        for u in group:
            for k, n in u.source_splits:
                src_info[k] = _column_shards(k, *src_meta[k], n)
    # every target of the group is described (the engine needs the full output set); one not
    # wanted is unsharded and never materialised
    dst = {k: targets[k] for u in group for k in u.targets(direction)}
    dst_info = {
        k: [ShardedWeightDesc(k, ls, t.global_shape, off, t.dtype) for ls, off in t.all_shards or [t.local()]]
        for k, t in dst.items()
    }
    stmts = build_statements(
        group, direction, {k: d for k, (_, d) in src_meta.items()}, {k: t.dtype for k, t in dst.items()}
    )
    if cache is None or any("$" in x or "*" in x for x in stmts):
        return _build_engine(group, stmts, src_info, dst_info).find_shard_sources
    names = {k: f"glm52_k{i}" for i, k in enumerate(dict.fromkeys((*src_info, *dst_info)))}
    real = {v: k for k, v in names.items()}

    def canon(info: dict) -> dict:
        return {names[k]: [dataclasses.replace(d, key=names[k]) for d in v] for k, v in info.items()}

    def meta(info: dict) -> tuple:
        return tuple(
            (k, tuple((d.local_shape, d.global_shape, d.global_offset, d.dtype) for d in v)) for k, v in info.items()
        )

    c_stmts = [_IDENT.sub(lambda m: names.get(m.group(0), m.group(0)), x) for x in stmts]
    c_src, c_dst = canon(src_info), canon(dst_info)
    sig = (tuple(c_stmts), meta(c_src), meta(c_dst))
    if sig not in cache:
        try:
            engine = _build_engine(group, c_stmts, c_src, c_dst)
        except CheckpointError:  # say it with the real names
            _build_engine(group, stmts, src_info, dst_info)
            raise
        cache[sig] = (engine, {})
    engine, memo = cache[sig]

    def rename(desc: Any) -> Any:
        return dataclasses.replace(desc, key=real.get(desc.key, desc.key))

    def plan(desc: Any) -> list[Any]:
        key = (names[desc.key], tuple(desc.local_shape), tuple(desc.global_offset))
        if key not in memo:
            memo[key] = engine.find_shard_sources(dataclasses.replace(desc, key=key[0]))
        return [
            dataclasses.replace(m, target_slice=rename(m.target_slice), source_slice=rename(m.source_slice))
            for m in memo[key]
        ]

    return plan


def _column_shards(key: str, shape: tuple[int, ...], dtype: str, n: int) -> list[Any]:
    """A source tensor described as ``n`` equal pieces of its last axis (a tensor-parallel file)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    if not shape or shape[-1] % n:
        raise CheckpointError(
            "tensor-parallel shard count does not divide the fused weight",
            key=key,
            expected=f"last axis % {n} == 0",
            actual=shape,
        )
    w = shape[-1] // n
    local = (*shape[:-1], w)
    return [ShardedWeightDesc(key, local, shape, (0,) * (len(shape) - 1) + (r * w,), dtype) for r in range(n)]


def run_units(
    units: Sequence[MappingUnit],
    direction: str,
    source: Any,
    targets: Mapping[str, TargetSpec],
    produce: Iterable[str] | None = None,
    trace: dict[str, dict[str, Any]] | None = None,
    plan_cache: bool = True,
) -> Iterator[tuple[str, Any]]:
    """Run the units' AOA program on Paddle's engine; yields ``(target key, tensor)`` one at a time.

    ``targets`` describes every target of the units (the engine needs the whole output set); only
    keys in ``produce`` (default: all) are read and made — a pipeline stage passes its own. A
    target with ``tensor`` set is filled in place (its local slice); otherwise a new tensor of its
    local shape is made. Every element of every target must be written by some engine entry,
    else :class:`CheckpointError` names the target. ``trace``, when given, receives per target the
    source keys the engine used and whether it transposed (for classifying differences).

    ``plan_cache``: one engine plan per unit program up to key names (:func:`_planner_for`);
    without it, one engine per layer with the real names.
    """
    quiet_paddle_logs()
    produce = set(targets) if produce is None else set(produce)
    plans: dict[Any, Any] = {}
    sizes = {k: math.prod(targets[k].local()[0]) * progress.itemsize(targets[k].dtype) for k in produce if k in targets}
    bar = progress.start("load" if isinstance(source, CheckpointSource) else "save", sum(sizes.values()), len(sizes))
    by_layer: dict[int, list[MappingUnit]] = defaultdict(list)  # global units (-1) first
    for u in units:
        by_layer[-1 if u.layer is None else u.layer].append(u)
    for _, layer_group in sorted(by_layer.items()):
        # with the cache, each unit is its own program: units are self-contained, and a unit's
        # program recurs (every routed expert) far more often than a whole layer's does
        for group in [[u] for u in layer_group] if plan_cache else [layer_group]:
            wanted = [k for u in group for k in u.targets(direction) if k in produce]
            if not wanted:
                continue
            planner = _planner_for(group, direction, source, targets, plans if plan_cache else None)
            for key in wanted:
                out = _fill_target(key, targets[key], planner, source, trace)
                bar.update(sizes.get(key, 0))
                yield key, out
    bar.close()


def _fill_target(
    key: str, t: TargetSpec, planner: Callable[[Any], list[Any]], source: Any, trace: dict[str, dict[str, Any]] | None
) -> Any:
    """Make (or fill in place) one target's local slice from the engine's entries for it; every
    element must be written."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight, ShardedWeightDesc

    local_shape, offset = t.local()
    mappings = planner(ShardedWeightDesc(key, local_shape, t.global_shape, offset, t.dtype))
    out = t.tensor if t.tensor is not None else paddle.empty(list(local_shape), dtype=t.dtype, device=t.place)
    dst = ShardedWeight(key, out, local_shape, t.global_shape, offset)
    if trace is not None:
        pp = [p for m in mappings for p in (m.postprocess_list or [])]
        trace[key] = {
            "sources": sorted({m.source_slice.key for m in mappings}),
            "transposed": any(str(p).startswith("[") for p in pp),
        }
    out_np = numpy_view(out)
    if out_np is not None:
        advise_huge_pages(out_np)
    covered = 0
    for m in mappings:
        covered += math.prod(m.target_slice.local_shape)
        _apply_entry(key, t, m, source, offset, out_np, dst)
    for k in {m.source_slice.key for m in mappings}:
        source.done(k)
    if covered != math.prod(local_shape):
        raise CheckpointError(
            "AOA mapping does not cover the whole target",
            key=key,
            expected=f"{math.prod(local_shape)} elements",
            actual=f"{covered} written",
        )
    return out


def _apply_entry(key: str, t: TargetSpec, m: Any, source: Any, offset: tuple[int, ...], out_np: Any, dst: Any) -> None:
    """Write one engine entry (a source slice, its transposes / casts) into the target: in numpy
    when both sides allow it, else through Paddle's own slice / transpose / cast / assign."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.flex_checkpoint.dcp.utils import assign_sharded_slice

    s = m.source_slice
    if s.dtype != t.dtype and not (m.postprocess_list and t.dtype in m.postprocess_list):
        raise CheckpointError(
            "AOA program assigns across dtypes without a cast", key=key, expected=t.dtype, actual=f"{s.key}: {s.dtype}"
        )
    src_np = source.read_numpy(s.key, s.global_offset, s.local_shape)
    if src_np is not None and out_np is not None:
        region = tuple(
            slice(g - o, g - o + n) for g, o, n in zip(m.target_slice.global_offset, offset, m.target_slice.local_shape)
        )
        if apply_entry_numpy(src_np, s.dtype, m.postprocess_list, out_np[region]):
            return
    piece = to_paddle(src_np, s.dtype) if src_np is not None else source.read(s.key, s.global_offset, s.local_shape)
    del src_np
    src = ShardedWeight(s.key, piece, s.local_shape, s.global_shape, s.global_offset)
    assign_sharded_slice(s, src, m.target_slice, dst, m.postprocess_list)
