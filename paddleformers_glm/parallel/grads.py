"""Gradient synchronisation across TP / DP / CP / sharding / EP / PP on Fleet's collectives, the
has-gradient flags, and the *true* global gradient norm (docs/parallel.md sections 4 and 8).

Fleet's conventions, adopted as they are: fp32 ``param.main_grad``, a zero gradient where backward
made none (every replica joins the same collectives), the mean over data-parallel and sharding
replicas (:func:`loss_multiplier` turns it into the global batch's sum). The has-gradient flags
come from the global routed-token counts, the same on every rank of every layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
from paddle.distributed.fleet.utils.hybrid_parallel_util import (
    fused_allreduce_gradients,
    fused_allreduce_gradients_with_group,
)
from paddle.distributed.fleet.utils.sequence_parallel_utils import is_sequence_parallel_parameter

from . import comm
from .layers import get_shard_spec
from .state import first_replica
from .topology import EXPERT_UPDATES, Topology

__all__ = ["GradSynchronizer", "clip_main_grads", "loss_multiplier"]


_EXPERT = re.compile(r"^(?:(.*)\.)?experts\.(\d+)\.")


def loss_multiplier(topo: Topology) -> int:
    """The factor on each rank's loss that Fleet's averaging sync expects: dp x sharding replicas."""
    return int(topo.pc.dp) * int(topo.pc.sharding)


def _release(p: paddle.Tensor, grad: bool = True) -> None:
    """Drop the parameter's fp32 main gradient (Fleet's ``main_grad`` convention) and, with ``grad``,
    its gradient.  The attribute itself goes: Fleet's collectives take any ``main_grad`` attribute,
    even ``None``, as "this parameter uses main_grad" (and then assert ``.grad`` is empty)."""
    if grad:
        p.clear_gradient(False)
        if hasattr(p, _FP32_ACC):
            delattr(p, _FP32_ACC)
    if hasattr(p, "main_grad"):
        del p.main_grad


# a low-precision parameter's gradient summed over the step's backward passes (micro-batches) in fp32
_FP32_ACC = "_glm52_fp32_grad"


def _accumulate_in_fp32(p: paddle.Tensor) -> Any:
    """Gradient hook of a bf16/fp16 parameter: each backward's gradient is added, widened, to an fp32
    sum and taken from ``.grad``, so micro-batches accumulate in fp32 (Paddle would add them in the
    parameter's dtype: a micro-batch's contribution below half a bf16 ulp of the running sum was
    lost).  Fleet's ``MixPrecisionLayer`` main-grad hook does the same; :meth:`GradSynchronizer.main_grads`
    makes the sum the ``main_grad``."""

    @paddle.no_grad()
    def hook(g: paddle.Tensor) -> None:
        if g is None or not g._is_initialized():
            return
        acc = getattr(p, _FP32_ACC, None)
        if acc is None:
            setattr(p, _FP32_ACC, g.astype("float32"))
        else:
            acc.add_(g.astype("float32"))
        g._clear_data()

    return hook


def _grad(p: paddle.Tensor) -> paddle.Tensor | None:
    """Fleet's rule: ``main_grad`` when set, else ``.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class GradSynchronizer:
    """Prepared once per model; :meth:`main_grads` after each step's backward."""

    def __init__(self, model: nn.Layer, topo: Topology, expert_update: str = "fused") -> None:
        if expert_update not in EXPERT_UPDATES:
            raise ValueError(f"expert_update must be one of {', '.join(EXPERT_UPDATES)}, got {expert_update!r}")
        self.topo = topo
        self.expert_update = expert_update
        self.params = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
        for _, p in self.params:  # low-precision parameters accumulate their micro-batches in fp32
            if p.dtype != paddle.float32 and not getattr(p, "_glm52_fp32_hook", False):
                p._register_grad_hook(_accumulate_in_fp32(p))
                p._glm52_fp32_hook = True
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ValueError("GradSynchronizer: duplicate parameter names in the stage module")
        self.specs = {n: get_shard_spec(p) for n, p in self.params}
        self.routers = _routers(model)  # MoE module name -> (its RouterBalance, number of experts)
        # one routed-token count per (MoE module, global expert id), the modules' slots one after another
        starts = dict(zip(self.routers, np.cumsum([0] + [n for _, n in self.routers.values()]).tolist()))
        self.expert_slot: dict[str, tuple[int, int, int]] = {}  # expert parameter -> its slot, its layer's [a, b)
        for n in (n for n, _ in self.params if self.specs[n].expert):
            m = _EXPERT.match(n)
            moe = (m.group(1) or "") if m else None
            if moe not in self.routers:
                raise ValueError(
                    f"expert parameter {n!r}: expected '<moe>.experts.<id>.' under a MoE module with a "
                    f"router that counts routed tokens (found {sorted(self.routers)[:4]})"
                )
            e, n_experts = int(m.group(2)), self.routers[moe][1]
            if e >= n_experts:
                raise ValueError(f"expert parameter {n!r}: id {e} >= {n_experts} experts")
            self.expert_slot[n] = (starts[moe] + e, starts[moe], starts[moe] + n_experts)
        self.holders = self._pp_holders()  # name -> stages holding it (only names on > 1 stage)
        for n, p in self.params:  # Fleet's hybrid clip counts a pipeline-shared tensor on its first stage only
            if n in self.holders:
                p.is_firstly_shared = self.holders[n][0] == topo.stage
        self.sharding: Any = None  # Fleet's DygraphShardingOptimizer (its reduce_gradients)
        self.grad_owner: dict[str, int] | None = None  # name -> sharding rank that updates it
        self.drop_others = False  # sharding stage 2: release the gradients other ranks update
        self.before_reduce_bytes: int | None = None  # the last step's gradients before that release

    def use_sharding(self, sharding: Any, owner: dict[str, int], stage: int) -> None:
        """Reduce gradients with Fleet's sharding optimizer onto the rank ``owner[name]`` that
        updates each parameter; at ``stage`` 2 the others release theirs after the reduce."""
        missing = {n for n, _ in self.params} - set(owner)
        if missing:
            raise ValueError(f"use_sharding: no owner for {sorted(missing)[:5]}")
        self.sharding, self.grad_owner, self.drop_others = sharding, dict(owner), stage == 2

    # ---------------------------------------------------------------- setup
    def _pp_holders(self) -> dict[str, tuple[int, ...]]:
        """name -> stages holding it, for names on more than one stage (same answer on every stage)."""
        self.shared_numel: dict[str, int] = {}
        if self.topo.pp_size == 1:
            return {}
        mine = [(n, int(p.size)) for n, p in self.params]
        per_stage: list[list[tuple[str, int]]] = []
        dist.all_gather_object(per_stage, mine, group=self.topo.pp_group)
        where: dict[str, list[int]] = {}
        for stage, lst in enumerate(per_stage):
            for n, numel in lst:
                where.setdefault(n, []).append(stage)
                self.shared_numel[n] = numel
        return {n: tuple(s) for n, s in where.items() if len(s) > 1}

    def sync_shared_parameters(self) -> None:
        """Make pipeline-shared parameters equal to the first holder's values (call after loading)."""
        params = dict(self.params)
        for stages, names, group in self._holder_sets():
            sizes = [self.shared_numel[n] for n in names]
            flat = _flat([params[n].detach().astype("float32") if n in params else None for n in names], sizes)
            comm.broadcast(flat, self.topo.stage_ranks[stages[0]], group)
            if self.topo.stage in stages:
                for n, part in zip(names, paddle.split(flat, sizes)):
                    params[n].set_value(part.reshape(params[n].shape).astype(params[n].dtype))

    # ---------------------------------------------------------------- per step
    @paddle.no_grad()
    def main_grads(self) -> tuple[dict[str, paddle.Tensor], dict[str, bool]]:
        """fp32 gradients synced over every replica (Fleet's scaling: see the module docstring),
        and whether each is stepped (got a gradient anywhere; experts: their layer routed any token
        this step, or with ``routed-only`` the expert itself got one)."""
        topo = self.topo
        flags = self._flags(self._to_main_grads())
        # what the backward left on this rank: sharding stage 2 releases the others' share only below
        self.before_reduce_bytes = sum(
            int(g.size) * g.element_size() for _, p in self.params if (g := _grad(p)) is not None
        )
        if topo.world_size == 1:
            return self.current_grads(), flags
        params = [p for _, p in self.params if int(p.size) > 0]  # nothing to send for an empty tensor
        if topo.sequence_parallel and topo.tp_size > 1:  # partial over the sequence slices: a plain sum
            sp = [p for p in params if is_sequence_parallel_parameter(p) or get_shard_spec(p).sequence_parallel]
            if sp:
                fused_allreduce_gradients_with_group(sp, topo.tp_group, scale=1.0)
        self._sum_shared(flags)
        if self.sharding is not None:  # mean over the sharding ranks, onto each parameter's updater
            self.sharding.reduce_gradients(params, topo.hcg)
            params = self.sharding.filter_parameters(params, topo.hcg)
            if self.drop_others:
                for n, p in self.params:
                    if self.grad_owner[n] != topo.sharding_rank:
                        _release(p)
        dense = [p for p in params if not get_shard_spec(p).expert]
        if dense and (topo.dp_size > 1 or topo.cp_size > 1):  # mean over dp, sum over cp (Fleet's sep)
            fused_allreduce_gradients(dense, topo.hcg)
        experts = [p for p in params if get_shard_spec(p).expert]
        # the dp mean of Fleet's convention, summed over the expert replicas: the edp group (it spans the cp
        # ranks, which hold *different* experts; Fleet's HCG has no such group)
        if experts and comm.group_size(topo.edp_group) > 1:
            fused_allreduce_gradients_with_group(experts, topo.edp_group, scale=1.0 / topo.dp_size)
        elif experts and topo.dp_size > 1:
            for p in experts:
                _grad(p).scale_(1.0 / topo.dp_size)
        return self.current_grads(), flags

    def current_grads(self) -> dict[str, paddle.Tensor]:
        """Each kept gradient by name (``main_grad`` when set, else ``.grad``), read from the
        parameters now: Fleet's pipeline step may have rescaled them since the sync."""
        return {n: g for n, p in self.params if (g := _grad(p)) is not None}

    def release(self) -> None:
        """Drop every gradient after the update (a parameter that gets none next step stays ``None``)."""
        for _, p in self.params:
            _release(p)

    def _to_main_grads(self) -> dict[str, bool]:
        """Fleet's ``main_grad`` for low-precision and gradient-less parameters; local has-gradient flags."""
        local = {}
        for n, p in self.params:
            g = p.grad
            acc = getattr(p, _FP32_ACC, None)
            local[n] = g is not None or acc is not None
            if acc is not None:  # the fp32 sum of the backward passes (a tensor of its own)
                delattr(p, _FP32_ACC)
                p.main_grad = acc if g is None else acc + g.astype("float32")
                p.clear_gradient(False)
            elif g is None:
                p.main_grad = paddle.zeros(p.shape, dtype="float32")
            elif g.dtype != paddle.float32 or n in self.holders:
                # fp32 copy (and for pipeline-shared ones a tensor of their own: their sum is rebound)
                p.main_grad = g.astype("float32") if g.dtype != paddle.float32 else g.clone()
                p.clear_gradient(False)
            else:
                _release(p, grad=False)
        return local

    def _flags(self, local: dict[str, bool]) -> dict[str, bool]:
        """Has-gradient flags, the same on every replica.  Dense: from the stage's ranks
        (pipeline-shared names finished in :meth:`_sum_shared`).  Experts: from this step's routed-token
        counts summed over the stage (only > 0 matters): whether an untouched expert's local gradient is
        ``None`` or zeros depends on the MoE form and the rank, so it cannot decide."""
        topo = self.topo
        dense = [n for n, _ in self.params if n not in self.expert_slot]
        # the routers' counts stay on the device and join the flags there: one read for the step,
        # not one per MoE layer (each a stream synchronisation on a GPU)
        parts = [paddle.to_tensor(np.array([1.0 if local[n] else 0.0 for n in dense], dtype=np.float64))]
        for balance, n in self.routers.values():
            c = balance.take_routed()
            parts.append(paddle.zeros([n], dtype="float64") if c is None else c.astype("float64").reshape([-1]))
        t = paddle.concat(parts) if len(parts) > 1 else parts[0]
        if t.shape[0] == 0:
            return {}
        for group in (topo.tp_group, topo.dp_group, topo.sharding_group, topo.cp_group):  # the stage's ranks
            t = comm.all_reduce(t, group)
        vec = t.numpy()
        flags = {n: bool(v > 0) for n, v in zip(dense, vec[: len(dense)].tolist())}
        routed = vec[len(dense) :]
        for n, (slot, a, b) in self.expert_slot.items():
            flags[n] = bool((routed[a:b].sum() if self.expert_update == "fused" else routed[slot]) > 0)
        return flags

    def _sum_shared(self, flags: dict[str, bool]) -> None:
        """Pipeline-shared parameters: gradients and flags summed over the holder stages."""
        params = dict(self.params)
        for stages, names, group in self._holder_sets():
            mine = self.topo.stage in stages
            fl = [paddle.to_tensor([1.0 if flags[n] else 0.0], dtype="float32") if mine else None for n in names]
            sizes = [self.shared_numel[n] for n in names] + [1] * len(names)  # gradients, then flags
            flat = comm.all_reduce(_flat([params[n].main_grad if mine else None for n in names] + fl, sizes), group)
            if mine:
                parts = paddle.split(flat, sizes)
                for i, n in enumerate(names):
                    params[n].main_grad = parts[i].reshape(params[n].shape)
                    flags[n] = bool(float(parts[len(names) + i].numpy()[0]) > 0)

    def global_norm(self, grads: dict[str, paddle.Tensor], local_extra: paddle.Tensor | None = None) -> float:
        """L2 norm of the whole model's gradient, each distinct element counted once.
        ``local_extra`` (float64 [1]) joins this rank's sum before the all-reduce: the trainer's
        non-finite loss flag (0 or NaN, train/nonfinite.py) reaches every rank with the norm."""
        total = paddle.zeros([1], dtype="float64") if local_extra is None else local_extra
        for n, _ in self.params:
            if self._owner(n, self.specs[n]):
                total = total + (grads[n] * grads[n]).sum().astype("float64")
        if self.topo.world_size > 1:
            dist.all_reduce(total)
        return math.sqrt(float(total.numpy()[0]))

    # ---------------------------------------------------------------- helpers
    def _owner(self, name: str, spec: Any) -> bool:
        """Whether this rank counts ``name``'s elements in the global norm (one holder of each)."""
        topo = self.topo
        split = spec.axis is not None and spec.group == ("etp" if spec.expert else "tp")  # each rank: its own slice
        updater = 0 if self.grad_owner is None else self.grad_owner[name]
        first_stage = self.holders.get(name, (topo.stage,))[0] == topo.stage
        return first_replica(spec, topo, split) and topo.sharding_rank == updater and first_stage

    def _holder_sets(self) -> Iterator[tuple[tuple[int, ...], list[str], Any]]:
        """(holder stages, the names they share, the group) for each set this rank joins: the group over
        exactly those stages where one exists (its members join), else the whole pipeline column."""
        sets: dict[tuple[int, ...], list[str]] = {}
        for n in sorted(self.holders):
            sets.setdefault(self.holders[n], []).append(n)
        for stages, names in sorted(sets.items()):
            if not self.topo.has_stage_group(stages):
                yield stages, names, self.topo.pp_group
            elif self.topo.stage in stages:
                yield stages, names, self.topo.stage_group(stages)


def _flat(tensors: list, sizes: list[int]) -> paddle.Tensor:
    """Concatenate (zeros where this stage does not hold the tensor: it still joins the collective)."""
    return paddle.concat(
        [t.reshape([-1]) if t is not None else paddle.zeros([n], "float32") for t, n in zip(tensors, sizes)]
    )


def _routers(model: nn.Layer) -> dict[str, tuple[Any, int]]:
    """MoE module name -> (the counter of its routed tokens, its expert count): a sublayer whose
    ``balance`` has ``take_routed()`` (the model's ``RouterBalance``; a router sublayer named ``gate``
    counts for its parent, a MoE layer may also hold the counter itself)."""
    out: dict[str, Any] = {}
    for name, layer in model.named_sublayers(include_self=True):
        balance = getattr(layer, "balance", None)
        if callable(getattr(balance, "take_routed", None)):
            moe = name if hasattr(layer, "experts") else name.rpartition(".")[0]
            out[moe] = (balance, int(layer.num_experts))
    return dict(sorted(out.items()))


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
