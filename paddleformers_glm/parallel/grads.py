"""Gradient synchronisation across TP / DP / EP / PP and the *true* global gradient norm.

After backward every trainable parameter's gradient is copied into an fp32 "main grad" (so bf16
parameters reduce and clip in fp32) and summed over the ranks that hold a replica of it:

* sequence-parallel-marked parameters (norms, row bias, router under SP): over TP (each rank saw
  only its sequence slice);
* every parameter: over the sharding group (Fleet's ``sharding_degree``: more data replicas); at
  sharding stage 2 (:meth:`GradSynchronizer.shard_gradients`) each gradient is *reduced* to the
  sharding rank that updates it (Fleet's ``DygraphShardingOptimizer`` partition) and the other
  ranks drop it, so a rank keeps the fp32 gradients of its own part only;
* dense parameters: over DP, then over the context-parallel group (each cp rank holds a slice of
  every sequence, no weight slice); expert parameters (``ShardSpec.expert``): over the
  expert-data-parallel group only (their replicas: edp = tp x dp x cp / (ep x etp)). The expert
  grid spans the cp ranks, so a cp group holds *different* experts: summing an expert gradient
  over it would add another expert's gradient;
* parameters held by several pipeline stages under the same name (the embedding the MTP head reuses):
  over those stages, in stage order.

The loss is normalised by the *global* token count before backward, so every sync is a SUM.
A parameter that got no gradient anywhere (an expert no token chose) is reported as such, so the
optimizer can skip it as torch's AdamW does, identically in every layout.

The global norm counts each distinct tensor element once: a replicated tensor only on its
canonical owner (sharding rank 0; dp and cp rank 0 and tp rank 0 unless TP-split for dense tensors,
edp rank 0 and etp rank 0 unless ETP-split for experts; the first stage
holding a pipeline-shared name), then one all-reduce over the world.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from . import comm
from .layers import get_shard_spec
from .topology import Topology

__all__ = ["GradSynchronizer", "clip_main_grads"]

_BUCKET_ELEMS = 32 * 1024 * 1024


class GradSynchronizer:
    """Prepared once per model; :meth:`main_grads` after each step's backward."""

    def __init__(self, model: nn.Layer, topo: Topology) -> None:
        self.topo = topo
        self.params = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ValueError("GradSynchronizer: duplicate parameter names in the stage module")
        self.holders = self._pp_holders(names)  # name -> stages holding it (only names on > 1 stage)
        for n, p in self.params:  # Fleet's hybrid clip counts a pipeline-shared tensor on its first stage only
            if n in self.holders:
                p.is_firstly_shared = self.holders[n][0] == topo.stage
        self.grad_owner: dict[str, int] | None = None  # sharding stage 2: name -> sharding rank that keeps it

    def shard_gradients(self, owner: dict[str, int]) -> None:
        """Sharding stage 2: keep each gradient only on the sharding rank ``owner[name]`` (the rank
        whose optimizer updates it); the others drop theirs once it is reduced there."""
        missing = {n for n, _ in self.params} - set(owner)
        if missing:
            raise ValueError(f"shard_gradients: no owner for {sorted(missing)[:5]}")
        self.grad_owner = dict(owner)

    # ---------------------------------------------------------------- setup
    def _pp_holders(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        """name -> stages holding it, for names on more than one stage (same answer on every stage)."""
        topo = self.topo
        self.shared_numel: dict[str, int] = {}
        if topo.pp_size == 1:
            return {}
        mine = [(n, int(p.size)) for n, p in self.params]
        per_stage: list[list[tuple[str, int]]] = []
        dist.all_gather_object(per_stage, mine, group=topo.pp_group)
        where: dict[str, list[int]] = {}
        for stage, lst in enumerate(per_stage):
            for n, numel in lst:
                where.setdefault(n, []).append(stage)
                self.shared_numel[n] = numel
        return {n: tuple(s) for n, s in where.items() if len(s) > 1}

    def _set_group(self, stages: tuple[int, ...]) -> tuple[object, bool]:
        """(group, holders_only): the group over exactly ``stages`` if it exists, else the whole column."""
        if self.topo.has_stage_group(stages):
            return self.topo.stage_group(stages), True
        return self.topo.pp_group, False

    def sync_shared_parameters(self) -> None:
        """Make pipeline-shared parameters equal to the first holder's values (call after loading)."""
        params = dict(self.params)
        for stages, names in self._by_holder_set():
            group, holders_only = self._set_group(stages)
            if holders_only and self.topo.stage not in stages:
                continue
            flat = self._flat([params[n].detach().astype("float32") if n in params else None for n in names], names)
            comm.broadcast(flat, self.topo.stage_ranks[stages[0]], group)
            if self.topo.stage in stages:
                for n, part in zip(names, self._split_sizes(flat, names)):
                    params[n].set_value(part.reshape(params[n].shape).astype(params[n].dtype))

    # ---------------------------------------------------------------- per step
    def main_grads(self) -> tuple[dict[str, paddle.Tensor], dict[str, bool]]:
        """fp32 gradients summed over every replica, and whether each got a gradient anywhere."""
        topo = self.topo
        grads: dict[str, paddle.Tensor] = {}
        flags: dict[str, paddle.Tensor] = {}
        for n, p in self.params:
            g = p.grad
            grads[n] = g.astype("float32") if g is not None else paddle.zeros(p.shape, dtype="float32")
            flags[n] = paddle.to_tensor([1.0 if g is not None else 0.0], dtype="float32")
        specs = {n: get_shard_spec(p) for n, p in self.params}
        if topo.sequence_parallel and topo.tp_size > 1:
            self._reduce([n for n, _ in self.params if specs[n].sequence_parallel], grads, flags, topo.tp_group)
        self._reduce([n for n, _ in self.params if not specs[n].expert], grads, flags, topo.dp_group)
        self._reduce([n for n, _ in self.params if specs[n].expert], grads, flags, topo.edp_group)
        # sharding ranks are more data-parallel replicas (Fleet's sharding_degree): every grad sums over them
        if self.grad_owner is None:
            self._reduce([n for n, _ in self.params], grads, flags, topo.sharding_group)
        # context parallel: no dense weight is split over cp; each cp rank's gradient covers its own
        # tokens.  Experts are not: their edp group above already spans the cp ranks.
        self._reduce([n for n, _ in self.params if not specs[n].expert], grads, flags, topo.cp_group)
        for stages, names in self._by_holder_set():  # pipeline-shared tensors: sum over the holder stages
            group, holders_only = self._set_group(stages)
            if holders_only and topo.stage not in stages:
                continue
            mine = topo.stage in stages
            flat = self._flat(
                [grads[n] if mine else None for n in names] + [flags[n] if mine else None for n in names],
                names + names,
                flags_from=len(names),
            )
            flat = comm.all_reduce(flat, group)
            if mine:
                parts = self._split_sizes(flat, names + names, flags_from=len(names))
                for i, n in enumerate(names):
                    grads[n] = parts[i].reshape(grads[n].shape)
                    flags[n] = parts[len(names) + i]
        if self.grad_owner is not None:  # stage 2: after the stage sum, so every holder adds its part first
            self._reduce_to_owners(grads, flags)
        return grads, {n: bool(float(flags[n].numpy()[0]) > 0) for n, _ in self.params}

    def _reduce_to_owners(self, grads: dict, flags: dict) -> None:
        """Sum each gradient over the sharding group onto its owner; drop it elsewhere.  The
        has-gradient flags are all-reduced (every rank needs them: the optimizer broadcasts every
        updated parameter from its owner)."""
        topo, owner = self.topo, self.grad_owner
        names = [n for n, _ in self.params]
        group = topo.sharding_group
        if comm.group_size(group) > 1:
            flat = comm.all_reduce(paddle.concat([flags[n].reshape([-1]) for n in names]), group)
            for n, f in zip(names, paddle.split(flat, len(names)) if len(names) > 1 else [flat]):
                flags[n] = f
        for rank in range(topo.sharding_size):
            mine = [n for n in names if owner[n] == rank]
            for bucket in _buckets(mine, grads):
                if comm.group_size(group) > 1:
                    flat = comm.reduce(
                        paddle.concat([grads[n].reshape([-1]) for n in bucket]), group.ranks[rank], group
                    )
                    if rank == topo.sharding_rank:
                        for n, part in zip(bucket, self._split(flat, [grads[n] for n in bucket])):
                            grads[n] = part.reshape(grads[n].shape)
                if rank != topo.sharding_rank:
                    for n in bucket:
                        del grads[n]

    def global_norm(self, grads: dict[str, paddle.Tensor]) -> float:
        """L2 norm of the whole model's gradient, each distinct element counted once."""
        topo = self.topo
        total = paddle.zeros([1], dtype="float64")
        for n, p in self.params:
            if self._owner(n, get_shard_spec(p)):  # at sharding stage 2 the owner is the one rank holding it
                total = total + (grads[n] * grads[n]).sum().astype("float64")
        if topo.world_size > 1:
            dist.all_reduce(total)
        return math.sqrt(float(total.numpy()[0]))

    # ---------------------------------------------------------------- helpers
    def _owner(self, name: str, spec) -> bool:
        topo = self.topo
        if topo.sharding_rank != (0 if self.grad_owner is None else self.grad_owner[name]):
            return False
        if spec.expert:  # edp spans the cp ranks: the cp rank says nothing about an expert replica
            if topo.edp_rank != 0:
                return False
            if (spec.axis is None or spec.group != "etp") and topo.etp_rank != 0:
                return False
        else:
            if topo.dp_rank != 0 or topo.cp_rank != 0:
                return False
            if (spec.axis is None or spec.group != "tp") and topo.tp_rank != 0:
                return False
        if name in self.holders and self.holders[name][0] != topo.stage:
            return False
        return True

    def _by_holder_set(self) -> list[tuple[tuple[int, ...], list[str]]]:
        sets: dict[tuple[int, ...], list[str]] = {}
        for n in sorted(self.holders):
            sets.setdefault(self.holders[n], []).append(n)
        return sorted(sets.items())

    @staticmethod
    def _split(flat: paddle.Tensor, like: list[paddle.Tensor]) -> list[paddle.Tensor]:
        sizes = [int(v.size) for v in like]
        return paddle.split(flat, sizes) if len(sizes) > 1 else [flat]

    def _reduce(self, names: list[str], grads: dict, flags: dict, group) -> None:
        if comm.group_size(group) == 1 or not names:
            return
        for bucket in _buckets(names, grads):
            vals = [grads[n] for n in bucket] + [flags[n] for n in bucket]
            flat = comm.all_reduce(paddle.concat([v.reshape([-1]) for v in vals]), group)
            parts = self._split(flat, vals)
            for i, n in enumerate(bucket):
                grads[n] = parts[i].reshape(grads[n].shape)
                flags[n] = parts[len(bucket) + i]

    def _numel(self, name: str, flag: bool) -> int:
        return 1 if flag else self.shared_numel[name]

    def _flat(self, tensors: list, names: list[str], flags_from: int | None = None) -> paddle.Tensor:
        """Concatenate (zeros where this stage does not hold the tensor: it still joins the all-reduce)."""
        parts = []
        for i, (t, n) in enumerate(zip(tensors, names)):
            flag = flags_from is not None and i >= flags_from
            parts.append(t.reshape([-1]) if t is not None else paddle.zeros([self._numel(n, flag)], dtype="float32"))
        return paddle.concat(parts)

    def _split_sizes(self, flat: paddle.Tensor, names: list[str], flags_from: int | None = None) -> list[paddle.Tensor]:
        sizes = [self._numel(n, flags_from is not None and i >= flags_from) for i, n in enumerate(names)]
        return paddle.split(flat, sizes) if len(sizes) > 1 else [flat]


def _buckets(names: list[str], grads: dict) -> Iterable[list[str]]:
    cur, size = [], 0
    for n in names:
        cur.append(n)
        size += int(grads[n].size)
        if size >= _BUCKET_ELEMS:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def clip_main_grads(grads: dict[str, paddle.Tensor], total_norm: float, max_norm: float) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the factor."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return 1.0
    for n in grads:
        grads[n] = grads[n] * coef
    return coef
