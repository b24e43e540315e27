"""Hybrid-parallel topology: which ranks share a tensor-, pipeline-, data- or expert-parallel group.

Dense layout comes from ``paddle.distributed.fleet`` (order dp > pp > mp, mp fastest), so fleet
utilities keep working. The expert layout is ours (docs/parallel.md section 1): inside one pipeline
stage the ``dp x cp x tp`` ranks are re-factored as ``edp x ep x etp`` (etp fastest), the
Megatron-Core rule; Fleet's ``EPHybridCommunicateGroup`` insists on dp == 1 and has no ETP.

At world size 1 nothing distributed is initialised; every group is ``None`` and every size 1, so
model code calls the same parallel layers in a unit test and on a cluster.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPERT_UPDATES",
    "GROUP_NAMES",
    "ParallelConfig",
    "ParallelConfigError",
    "RECOMPUTE_MODES",
    "Topology",
    "check_seq_len",
    "get_topology",
    "init_topology",
    "join_default_group",
    "launched_world_size",
    "set_topology",
    "topology_override",
]

GROUP_NAMES = ("tp", "pp", "dp", "sharding", "ep", "etp", "edp", "cp")
# what --recompute may name (parallel/recompute.py)
RECOMPUTE_MODES = ("none", "full", "core")
# how experts are stepped: every expert of a layer that routed any token (torch's AdamW steps the reference's
# fused expert tensors then), or only those that got one (parallel/grads.py; docs/parallel.md section 8)
EXPERT_UPDATES = ("fused", "routed-only")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message names the setting, expected and actual."""


def check_seq_len(seq_len: int, cp: int) -> None:
    """Context parallel's zigzag split (parallel/context.py) needs 2 x cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        raise ParallelConfigError(
            f"--seq-len {seq_len} must be divisible by 2 x cp = {2 * cp} (zigzag: each cp rank holds 2 chunks)"
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of each parallel dimension. ``dp`` is usually derived: world / (tp * pp * sharding).

    ``sharding`` is Fleet's ``sharding_degree``: more data-parallel replicas whose optimizer state
    (stage 1) is split between them; the batch is divided over ``dp x sharding`` replicas.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    sharding: int = 1
    sharding_stage: int = 1
    cp: int = 1  # context parallel: each rank of a cp group holds a zigzag slice of every sequence

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.sharding * self.cp

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the model: dp x sharding (each gets its share of the batch)."""
        return self.dp * self.sharding

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of one expert shard inside a stage (over dp x cp x tp)."""
        return (self.tp * self.dp * self.cp) // (self.ep * self.etp)

    @classmethod
    def from_world(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        etp: int = 1,
        sp: bool = False,
        dp: int | None = None,
        sharding: int = 1,
        sharding_stage: int = 1,
        cp: int = 1,
    ) -> ParallelConfig:
        """Derive dp from the world size (the launcher's process count) and check the product."""
        sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "sharding": sharding, "cp": cp, "world size": world_size}
        for name, v in sizes.items():
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if dp is None:
            n = tp * pp * sharding * cp
            if world_size % n:
                raise ParallelConfigError(
                    f"world size {world_size} is not a multiple of tp {tp} x pp {pp}"
                    f"{f' x sharding {sharding}' if sharding > 1 else ''}{f' x cp {cp}' if cp > 1 else ''} = {n}; "
                    f"launch a multiple of {n} processes"
                )
            dp = world_size // n
        pc = cls(
            tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, sp=bool(sp), sharding=sharding, sharding_stage=sharding_stage, cp=cp
        )
        pc.validate(world_size)
        return pc

    def validate(
        self,
        world_size: int | None = None,
        *,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        moe_intermediate_size: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """Reject layouts that cannot work, before any process group exists.

        Model sizes are arguments (not a config object) so the same check serves the toy model,
        GLM-5.2 and anything else; pass the ones the model has.
        """
        for name in ("tp", "pp", "dp", "ep", "etp", "sharding", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if world_size is not None and world_size != self.world_size:
            shard = f" x sharding {self.sharding}" if self.sharding > 1 else ""
            shard += f" x cp {self.cp}" if self.cp > 1 else ""
            raise ParallelConfigError(
                f"world size {world_size} != tp {self.tp} x pp {self.pp} x dp {self.dp}{shard} = {self.world_size}"
            )
        if self.sharding_stage in (2, 3):  # the planner's 3 too: named as given before its own choices
            check_sharding_stage(self.sharding_stage, self.sharding)
        if self.sharding_stage not in (1, 2):
            raise ParallelConfigError(f"--sharding-stage must be 1 or 2, got {self.sharding_stage}")
        if self.sp and self.tp == 1:
            raise ParallelConfigError("sequence parallel (--sp) needs tp > 1, got tp 1")
        if (self.tp * self.dp * self.cp) % (self.ep * self.etp):
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ParallelConfigError(
                f"ep {self.ep} x etp {self.etp} = {self.ep * self.etp} must divide tp {self.tp} x dp {self.dp}{cp} = "
                f"{self.tp * self.dp * self.cp} (experts are laid out over the tp x dp x cp ranks of one pipeline stage)"
            )

        def _div(what: str, size: int, n: int | None, n_name: str) -> None:
            if n is not None and n % size:
                raise ParallelConfigError(f"{what} {size} does not divide {n_name} {n}")

        _div("tp", self.tp, num_attention_heads, "num_attention_heads")
        _div("tp", self.tp, num_key_value_heads, "num_key_value_heads")
        _div("tp", self.tp, vocab_size, "vocab_size")
        _div("ep", self.ep, num_experts, "n_routed_experts")
        _div("etp", self.etp, moe_intermediate_size, "moe_intermediate_size")
        if num_layers is not None and self.pp > num_layers:
            raise ParallelConfigError(f"pp {self.pp} > num_hidden_layers {num_layers}: a stage would have no layer")


def check_sharding_stage(stage: int, sharding: int) -> None:
    """Refuse a sharding stage above 1 without sharding ranks: it would be accepted and do nothing."""
    if stage > 1 and sharding == 1:
        raise ParallelConfigError(
            f"--sharding-stage {stage} splits gradients{' and parameters' if stage > 2 else ''} over the --sharding "
            "ranks; with --sharding 1 there is nothing to split: give --sharding > 1 or leave the stage at 1"
        )


def _known(name: str) -> str:
    if name not in GROUP_NAMES:
        raise KeyError(f"unknown group {name!r}; expected one of {GROUP_NAMES}")
    return name


class Topology:
    """Groups and ranks of this process. Use :func:`init_topology`; build directly only in tests."""

    def __init__(
        self,
        pc: ParallelConfig,
        *,
        rank: int = 0,
        backend: str = "single",
        groups: dict[str, Any] | None = None,
        ranks: dict[str, int] | None = None,
        stage_ranks: list[int] | None = None,
        hcg: Any = None,
    ) -> None:
        self.pc, self.rank, self.backend = pc, rank, backend
        self._sizes = {n: getattr(pc, n) for n in GROUP_NAMES}
        self._ranks = {n: (ranks or {}).get(n, 0) for n in GROUP_NAMES}
        self._groups = {n: (groups or {}).get(n) if self._sizes[n] > 1 else None for n in GROUP_NAMES}
        # a topology is fixed once built: what layers read is plain data, ``<name>_size``, ``<name>_rank``
        # and ``<name>_group`` for each name of GROUP_NAMES (tp_size, tp_rank, tp_group, pp_size, ...)
        for n in GROUP_NAMES:
            for what, table in (("size", self._sizes), ("rank", self._ranks), ("group", self._groups)):
                setattr(self, f"{n}_{what}", table[n])
        self.world_size, self.sequence_parallel, self.stage = pc.world_size, pc.sp, self._ranks["pp"]
        # global rank of every pipeline stage at this process's (dp, tp) coordinate
        self.stage_ranks = list(stage_ranks) if stage_ranks is not None else [rank]
        self.hcg = hcg
        self._stage_groups: dict[tuple[int, ...], Any] = {}  # groups over subsets of my pipeline column
        self._stage_sets: set[tuple[int, ...]] = set()  # which subsets have a group (in every column)

    def stage_group(self, stages: tuple[int, ...]) -> Any:
        """A group of exactly the stages ``stages`` of this column, if one was created at init (else None):
        on gloo every adjacent pair (gloo tags p2p messages per group, so p2p between two members of a
        larger group desynchronises), and (first, last) for the tensors both ends hold (embedding + MTP)."""
        stages = tuple(sorted(stages))
        if len(stages) == self.pc.pp:
            return self.pp_group
        return self._stage_groups.get(stages)

    def stage_peer(self, stage: int) -> tuple[int, Any]:
        """(global rank, group) for point-to-point transfers with pipeline stage ``stage`` of this
        column: the two stages' own group where one exists (:meth:`stage_group`), else the pipeline group."""
        return self.stage_ranks[stage], self.stage_group((self.stage, stage)) or self.pp_group

    def has_stage_group(self, stages: tuple[int, ...]) -> bool:
        """Whether a group over exactly ``stages`` exists in every column (same answer on every rank)."""
        stages = tuple(sorted(stages))
        return len(stages) == self.pc.pp or stages in self._stage_sets

    @classmethod
    def single(cls) -> Topology:
        """One process: every group None, every size 1 (what a model is built for by default)."""
        return cls(ParallelConfig())

    # ---------------------------------------------------------------- sizes / ranks / groups by name
    def size(self, name: str) -> int:
        """Size of group ``name`` (one of GROUP_NAMES)."""
        return self._sizes[_known(name)]

    def group(self, name: str) -> Any:
        """The ``paddle.distributed`` Group for ``name``, or None when that dimension has size 1."""
        return self._groups[_known(name)]

    def rank_in(self, name: str) -> int:
        """This process's rank inside group ``name``."""
        return self._ranks[_known(name)]

    def describe(self) -> str:
        shown = ("pp", "tp", "dp", "sharding", "ep", "etp", "edp", "cp")
        shown = [n for n in shown if self._sizes[n] > 1 or n not in ("sharding", "cp")]  # those two when used
        dims = " ".join(f"{'stage' if n == 'pp' else n} {self._ranks[n]}/{self._sizes[n]}" for n in shown)
        return f"rank {self.rank}/{self.world_size} [{self.backend}] {dims}{' sp' if self.pc.sp else ''}"

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"


_CURRENT: Topology | None = None


def get_topology() -> Topology:
    """The topology set by :func:`init_topology`, or a single-process one (model code at world 1)."""
    return _CURRENT if _CURRENT is not None else Topology.single()


def set_topology(topo: Topology | None) -> None:
    """Install ``topo`` as current (None resets to single process; tests use it between runs)."""
    global _CURRENT
    _CURRENT = topo


@contextmanager
def topology_override(topo: Topology | None = None) -> Iterator[Topology]:
    """Temporarily install ``topo`` (default: single process), e.g. to build a full-size model
    for its parameter names and shapes while a distributed topology is active."""
    global _CURRENT
    saved, _CURRENT = _CURRENT, topo if topo is not None else Topology.single()
    try:
        yield _CURRENT
    finally:
        _CURRENT = saved


def join_default_group() -> None:
    """Make the job's default group as :func:`init_topology` would (collective over the job): for a
    rank that failed before it, so that it can tell the ranks waiting there instead of leaving them
    waiting without a limit."""
    from paddle.distributed import fleet

    _init_default_group(fleet.DistributedStrategy())


def _init_default_group(strategy: Any) -> None:
    """The job's default group, as ``fleet.init`` makes it first (the same NCCL settings), so that a
    check can run on it before Fleet's sub-groups; ``fleet.init`` then finds it made."""
    import paddle.distributed as dist
    from paddle.distributed import parallel_helper

    if parallel_helper._is_parallel_ctx_initialized():
        return
    os.environ.setdefault("FLAGS_nccl_nrings", str(strategy.nccl_comm_num))
    dist.init_parallel_env(strategy.hybrid_configs["default_comm_group_configs"].nccl_config)


@contextmanager
def _quiet_about_the_default_group() -> Iterator[None]:
    """Drop Fleet's warning that the default group exists (made first by :func:`_init_default_group`,
    on purpose): on the console of every multi-process run it read as an environment set up twice."""
    import logging

    from paddle.distributed.fleet.utils.log_util import logger

    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() != "The dygraph parallel environment has been initialized."

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def expert_layout(pc: ParallelConfig, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> tuple[int, int, int]:
    """(edp, ep, etp) ranks of the dense-plane position (dp_rank, cp_rank, tp_rank) of a stage.

    The stage's ranks are numbered i = (dp_rank * cp + cp_rank) * tp + tp_rank (tp fastest, then
    cp, as Megatron's tp-cp-ep-dp order) and factored i = (edp * ep + ep_r) * etp + etp_r.
    """
    i = (dp_rank * pc.cp + cp_rank) * pc.tp + tp_rank
    return i // (pc.ep * pc.etp), (i // pc.etp) % pc.ep, i % pc.etp


def _coord_rank(ftopo: Any, me: Any, **coords: int) -> int:
    """Global rank at ``me`` with ``coords`` replaced (axes Fleet's topology lacks are ignored)."""
    fields = me._asdict()
    return ftopo.get_rank(**{**fields, **{k: v for k, v in coords.items() if k in fields}})


ENV_WORLD = "PADDLE_TRAINERS_NUM"  # the job's process count, set by the launcher for each process it starts


def launched_world_size() -> int:
    """The world size a launcher gave this process: ``PADDLE_TRAINERS_NUM`` (1 when unset or empty);
    a value that is not a positive integer is a ValueError naming the variable."""
    raw = os.environ.get(ENV_WORLD, "").strip()
    if not raw:
        return 1
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(f"{ENV_WORLD} must be a positive integer (the launcher's process count), got {raw!r}")
    return world


def init_topology(
    pc: ParallelConfig,
    *,
    accumulate_steps: int = 1,
    micro_batch_size: int = 1,
    world: int | None = None,
    agree: Callable[[], None] | None = None,
    **model_sizes: int | None,
) -> Topology:
    """Initialise fleet (when world > 1) and every group for ``pc``; install and return the topology.

    ``model_sizes`` (num_attention_heads, vocab_size, num_experts, ...) go to
    :meth:`ParallelConfig.validate` so a bad layout fails here with a clear message, on every rank.
    ``accumulate_steps`` / ``micro_batch_size`` (micro-batches per replica per step and their size)
    go to Fleet's ``pipeline_configs``, which its pipeline engine reads.  ``world``: the processes of
    the job; None: the launcher's (:func:`launched_world_size`).  ``agree``: a collective check
    every rank runs once the job's default group exists and before Fleet builds any sub-group
    (``fleet.init``): ranks given different layouts build different groups there and wait for each
    other forever (measured: two nodes, ``--tp 2`` and ``--tp 1 --pp 2``, silent until killed), so
    what must agree is compared first.
    """
    if world is None:
        world = launched_world_size()
    pc.validate(world, **model_sizes)
    if world == 1:
        topo = Topology(pc)
        set_topology(topo)
        return topo
    if _CURRENT is not None and _CURRENT.world_size > 1:
        if _CURRENT.pc != pc:
            raise ParallelConfigError(f"topology already initialised as {_CURRENT.pc}, cannot re-init as {pc}")
        return _CURRENT

    import paddle.distributed as dist
    from paddle.distributed import fleet

    from .comm import detect_backend

    backend = detect_backend()
    if backend == "gloo":
        from . import _compat, fleet_gloo

        _compat.apply_gloo_subgroup_store_fix()
        fleet_gloo.install(backend, get_topology)  # Fleet's stock TP/SP layers on CPU: the ops its CPU build lacks
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": pc.dp,
        "mp_degree": pc.tp,
        "pp_degree": pc.pp,
        "sharding_degree": pc.sharding,
        "sep_degree": pc.cp,  # context parallel on Fleet's "sep" axis (why not cp_degree: docs/parallel.md 9)
    }
    # Fleet's partial send/recv (on by default, NCCL's batched p2p) sends each TP rank's 1/tp slice of
    # a carry and all-gathers it on the receiver: right only where every TP rank holds the same tensor.
    # Under --sp each holds its own sequence shard, which it would mix silently (docs/parallel.md 3).
    strategy.pipeline_configs = {
        "accumulate_steps": accumulate_steps,
        "micro_batch_size": micro_batch_size,
        "enable_partial_send_recv": False,
    }
    if pc.sp:
        # Fleet's sequence-parallel linears read mp_configs; keep the plain (non-overlapped) forward,
        # the one whose collectives go through sequence_parallel_utils (and fleet_gloo on CPU)
        strategy.hybrid_configs["mp_configs"].sp_async_reduce_scatter = False
    if pc.pp > 1:
        pp_configs = strategy.hybrid_configs["pp_configs"]
        # The trainer's loss scales already normalise over the global batch: Fleet must not divide
        # each micro-batch's loss by the micro-batch count again.
        pp_configs.delay_scale_loss = True
        if backend == "gloo":  # gloo has no batched (calc-stream) p2p kernels; plain send/recv works
            pp_configs.use_batch_p2p_comm = False
    if agree is not None:
        _init_default_group(strategy)
        agree()
    with _quiet_about_the_default_group():
        fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    ftopo = hcg.topology()
    rank = dist.get_rank()
    me = ftopo.get_coord(rank)
    getters = {  # our name -> Fleet's (group, rank) getters
        "tp": (hcg.get_model_parallel_group, hcg.get_model_parallel_rank),
        "pp": (hcg.get_pipe_parallel_group, hcg.get_stage_id),
        "dp": (hcg.get_data_parallel_group, hcg.get_data_parallel_rank),
        "sharding": (hcg.get_sharding_parallel_group, hcg.get_sharding_parallel_rank),
        "cp": (hcg.get_sep_parallel_group, hcg.get_sep_parallel_rank) if pc.cp > 1 else (lambda: None, lambda: 0),
    }
    groups: dict[str, Any] = {n: get_group() for n, (get_group, _) in getters.items()}
    ranks = {n: get_rank() for n, (_, get_rank) in getters.items()}
    stage_ranks = [_coord_rank(ftopo, me, pipe=p) for p in range(pc.pp)]

    # Expert groups: every rank enumerates every group in the same order (paddle's new_group is
    # collective over the world), reusing the fleet group when the rank lists coincide.
    fleet_axes = {"tp": "model", "dp": "data", **({"cp": "sep"} if pc.cp > 1 else {})}
    existing = {tuple(sorted(r)): name for name, axis in fleet_axes.items() for r in ftopo.get_comm_list(axis)}
    ranks.update(zip(("edp", "ep", "etp"), expert_layout(pc, ranks["dp"], ranks["tp"], ranks["cp"])))
    for kind, size in (("ep", pc.ep), ("etp", pc.etp), ("edp", pc.edp)):
        if size == 1:
            continue
        # one expert layout per (stage, sharding rank) over the stage's dp x cp x tp ranks: a cp
        # rank holds other tokens, like a dp rank, so it may own other experts (edp spans cp too)
        for p, sh in itertools.product(range(pc.pp), range(pc.sharding)):
            members: dict[tuple[int, ...], list[int]] = {}  # the other two expert ranks -> the group's ranks
            for d, c, t in itertools.product(range(pc.dp), range(pc.cp), range(pc.tp)):
                e = dict(zip(("edp", "ep", "etp"), expert_layout(pc, d, t, c)))
                key = tuple(v for k, v in e.items() if k != kind)
                members.setdefault(key, []).append(_coord_rank(ftopo, me, pipe=p, data=d, model=t, sharding=sh, sep=c))
            for m in (tuple(sorted(m)) for m in members.values()):
                g = groups[existing[m]] if m in existing else dist.new_group(list(m))
                if rank in m:
                    groups[kind] = g
    # Sub-groups of pipeline columns (see Topology.stage_group); every rank creates all, in order.
    stage_sets: list[tuple[int, ...]] = []
    if pc.pp > 2:
        if backend == "gloo":
            stage_sets += [(p, p + 1) for p in range(pc.pp - 1)]
        stage_sets.append((0, pc.pp - 1))
    stage_groups: dict[tuple[int, ...], Any] = {}
    for sh, c, d, t, ss in itertools.product(range(pc.sharding), range(pc.cp), range(pc.dp), range(pc.tp), stage_sets):
        members = [_coord_rank(ftopo, me, pipe=p, data=d, model=t, sharding=sh, sep=c) for p in ss]
        g = dist.new_group(members)
        if rank in members:
            stage_groups[ss] = g
    topo = Topology(pc, rank=rank, backend=backend, groups=groups, ranks=ranks, stage_ranks=stage_ranks, hcg=hcg)
    topo._stage_groups, topo._stage_sets = stage_groups, set(stage_sets)
    set_topology(topo)
    return topo
