"""Full (single-process) state <-> sharded local state, for loading checkpoints and exporting them.

Contract with the model: a parameter's structured name is the same in every layout (pipeline
stages keep global layer indices, e.g. ``layers.5.``; experts keep global ids,
``experts.17.``), and its :class:`~paddleformers_glm.parallel.layers.ShardSpec` says how the local
tensor is cut out of the full one.  A name present on several pipeline stages (an embedding the
MTP head also uses) is one tensor replicated across stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn

from .layers import get_shard_spec, local_slice, merge_slices
from .topology import Topology, get_topology

__all__ = ["gather_full_state", "shard_full_state", "sharded_state_dict", "to_numpy"]


def to_numpy(t: paddle.Tensor) -> np.ndarray:
    """Host copy; bf16/fp16 are widened to fp32 (lossless) because numpy has no bf16."""
    if t.dtype in (paddle.bfloat16, paddle.float16):
        t = t.astype("float32")
    return np.asarray(t.numpy())


def first_replica(spec: Any, topo: Topology, split: bool = False) -> bool:
    """Whether this rank holds the first replica of a tensor (of its own slice with ``split``) over
    the ranks that hold the same values (sharding aside): dp, cp and tp, or edp and etp for experts."""
    if spec.expert:  # the expert grid spans the cp ranks: edp rank 0 holds each expert once
        return topo.edp_rank == 0 and (split or topo.etp_rank == 0)
    return topo.dp_rank == 0 and topo.cp_rank == 0 and (split or topo.tp_rank == 0)


def gather_full_state(model: nn.Layer, topo: Topology | None = None, dst: int = 0) -> dict[str, np.ndarray] | None:
    """Rebuild every full tensor on global rank ``dst`` (None elsewhere). Collective: call on all ranks.

    TP / ETP slices are all-gathered and merged, expert and pipeline-stage tensors are sent to ``dst``.
    Memory: ``dst`` holds the whole model on the host; meant for export of models that fit.
    """
    topo = topo or get_topology()
    state = model.state_dict()
    mine: dict[str, np.ndarray] = {}
    for name, t in state.items():
        spec = get_shard_spec(t)
        if spec.axis is not None and topo.size(spec.group) > 1:
            group = topo.group(spec.group)
            parts: list[paddle.Tensor] = []
            dist.all_gather(parts, t.detach().contiguous(), group=group)
            full = merge_slices([to_numpy(p) for p in parts], spec)
        else:
            full = to_numpy(t.detach())
        if topo.sharding_rank == 0 and first_replica(spec, topo):  # the one rank per full tensor
            mine[name] = full
    if topo.world_size == 1:
        return mine
    # Collectives over the world only: gloo p2p between two members of a larger group is unsafe
    # (per-group message tags), and every rank must join each broadcast in the same order.
    listing: list[list[tuple[str, list[int], str]]] = []
    dist.all_gather_object(listing, [(n, list(a.shape), str(a.dtype)) for n, a in mine.items()])
    out: dict[str, np.ndarray] | None = dict(mine) if topo.rank == dst else None
    for src, entries in enumerate(listing):
        if src == dst:
            continue
        for n, shape, dtype in entries:
            t = paddle.to_tensor(mine[n]) if topo.rank == src else paddle.zeros(shape, dtype=dtype)
            dist.broadcast(t, src=src)
            if out is None:
                continue
            arr = t.numpy()
            if n not in out:
                out[n] = arr
            elif out[n].shape != arr.shape or not np.array_equal(out[n], arr):
                diff = float(np.max(np.abs(out[n] - arr))) if out[n].shape == arr.shape else "n/a"
                raise RuntimeError(
                    f"gather_full_state: {n!r} differs between ranks (replicas out of sync; max diff {diff})"
                )
    return out


def shard_full_state(
    model: nn.Layer, full_state: Mapping[str, Any], topo: Topology | None = None, strict: bool = True
) -> list[str]:
    """Load this rank's slice of every parameter/buffer of ``model`` from full tensors.

    ``full_state`` maps the model's structured names to full arrays (anything ``np.asarray`` takes).
    Returns the names the model has but ``full_state`` lacks; with ``strict`` that is an error.
    Keys of ``full_state`` that this rank does not hold (other stages / experts) are ignored.
    """
    topo = topo or get_topology()
    missing: list[str] = []
    for name, t in model.state_dict().items():
        if name not in full_state:
            missing.append(name)
            continue
        spec = get_shard_spec(t)
        full = np.asarray(full_state[name])
        size, rank = (topo.size(spec.group), topo.rank_in(spec.group)) if spec.axis is not None else (1, 0)
        part = local_slice(full, spec, rank, size)
        if list(part.shape) != list(t.shape):
            raise ValueError(
                f"shard_full_state: {name!r}: full shape {list(full.shape)} sliced for {spec.group} rank {rank}/{size} "
                f"gives {list(part.shape)}, the model holds {list(t.shape)}"
            )
        t.set_value(paddle.to_tensor(np.ascontiguousarray(part)).astype(t.dtype))
    if strict and missing:
        raise KeyError(f"shard_full_state: {len(missing)} tensors missing from the full state, e.g. {missing[:5]}")
    return missing


def sharded_state_dict(
    model: nn.Layer, topo: Topology | None = None
) -> tuple[dict[str, Any], dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """This rank's parameters described for a slice-reading checkpoint loader (Paddle's flex-checkpoint
    convention): ``(state, shard_info)``.

    A replicated parameter is itself; a split one is a Paddle ``ShardedWeight`` (the local tensor,
    its shape, the full shape, its global offset).  A fused split parameter (``chunks`` > 1, e.g.
    gate|up) is described as Paddle's ``fused_ffn`` expects it: the local piece as a plain slice
    of the full tensor at ``rank * local`` and, in ``shard_info``, every rank's piece of its group,
    from which the engine lays rank r out as ``[gate_r | up_r]`` (what ``local_slice`` cuts).
    """
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    topo = topo or get_topology()
    state: dict[str, Any] = {}
    info: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for name, t in model.state_dict().items():
        spec = get_shard_spec(t)
        size = topo.size(spec.group) if spec.axis is not None else 1
        if size == 1:
            state[name] = t
            continue
        if spec.chunks not in (1, 2):
            raise ValueError(
                f"sharded_state_dict: {name!r}: only gate|up (chunks 2) fusion is described, got {spec.chunks}"
            )
        local = tuple(int(d) for d in t.shape)
        axis = spec.axis % len(local)
        full = local[:axis] + (local[axis] * size,) + local[axis + 1 :]

        def offset(r: int, axis: int = axis, n: int = local[axis], ndim: int = len(local)) -> tuple[int, ...]:
            return tuple(r * n if a == axis else 0 for a in range(ndim))

        rank = topo.rank_in(spec.group)
        state[name] = ShardedWeight(
            key=name, local_tensor=t, local_shape=local, global_shape=full, global_offset=offset(rank)
        )
        if spec.chunks > 1:
            info[name] = [(local, offset(r)) for r in range(size)]
    return state, info
