"""The optimizer and learning-rate schedule, from Paddle: ``paddle.optimizer.AdamW`` (fp32 master
weights via ``multi_precision``) and ``paddle.optimizer.lr`` linear warmup + cosine.  The wrapper
steps them on the trainer's synced, clipped gradients, splits them over sharding ranks and keys the
state by structured parameter name, so a checkpoint does not depend on construction order (the
rules and why: docs/parallel.md, "AdamW" and "Sharding").
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle.optimizer import lr as lr_sched

__all__ = ["AdamW", "fleet_clips", "lr_at", "make_lr_scheduler"]


def make_lr_scheduler(max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> lr_sched.LRScheduler:
    """Paddle's ``LinearWarmup(CosineAnnealingDecay)``: linear from 0 to ``max_lr`` over
    ``warmup_steps``, then cosine to ``min_lr`` at ``total_steps``.  Step it with the 1-based update
    number (``sched.step(step)``): an explicit epoch takes Paddle's closed form, so the value is a
    pure function of the step (a resumed run gets the same learning rates bit for bit)."""
    span = max(1, total_steps - warmup_steps)
    cosine = lr_sched.CosineAnnealingDecay(learning_rate=max_lr, T_max=span, eta_min=min_lr)
    if warmup_steps <= 0 or max_lr == 0:  # LinearWarmup refuses a warm-up from 0 to 0; the rate is 0 throughout
        return cosine
    return lr_sched.LinearWarmup(cosine, warmup_steps, start_lr=0.0, end_lr=max_lr)


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR of update ``step`` (1-based) from :func:`make_lr_scheduler`."""
    if step < 1:
        raise ValueError(f"lr_at: step is 1-based, got {step}")
    sched = make_lr_scheduler(max_lr, min_lr, warmup_steps, total_steps)
    sched.step(step)
    return float(sched())


def fleet_clips(topo: Any) -> bool:
    """Whether ``fleet.distributed_optimizer``'s hybrid-parallel clip computes this layout's true
    global norm: not for expert parameters under ``ep`` / ``etp`` > 1, which its replica rules cannot
    express, nor for tensor-parallel slices under ``cp`` > 1, whose squares it sums over a check group
    that spans the cp ranks (each holding the same synced slice: counted cp times; docs/parallel.md,
    "Clipping"); those layouts (and one process) keep the trainer's clip."""
    if topo is None or topo.world_size == 1 or topo.pc.ep > 1 or topo.pc.etp > 1:
        return False
    return topo.pc.tp == 1 or topo.pc.cp == 1


class AdamW:
    """``paddle.optimizer.AdamW`` over named parameters, stepped with given gradients and lr."""

    def __init__(
        self,
        named_params: list[tuple[str, paddle.Tensor]],
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        topo: Any = None,
        clip_norm: float = 0.0,
    ) -> None:
        self.params = list(named_params)
        # Fleet's hybrid-parallel clip when its replica rules describe the layout (see fleet_clips)
        self.clips_itself = clip_norm > 0 and fleet_clips(topo)
        # weight decay on matrices only (norm weights, biases, router bias stay undecayed; Megatron rule)
        self.decay = {n: p.ndim >= 2 for n, p in self.params}
        decayed = {p.name for n, p in self.params if self.decay[n]}
        self.opt = paddle.optimizer.AdamW(
            learning_rate=1.0,  # set per step
            beta1=betas[0],
            beta2=betas[1],
            epsilon=eps,
            parameters=[p for _, p in self.params],
            weight_decay=weight_decay,
            apply_decay_param_fun=lambda pname: pname in decayed,
            multi_precision=True,
            # else the trainer clips the synced grads by their true global norm (parallel/grads.py)
            grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_norm) if self.clips_itself else None,
        )
        self._stepped: set[str] = set()
        self.sharding = None  # Fleet's DygraphShardingOptimizer when the topology has sharding ranks
        self.hybrid = None  # fleet.distributed_optimizer's HybridParallelOptimizer (fleet_clips layouts)
        self._sharding_group = None
        self._own = {p.name for _, p in self.params}
        if fleet_clips(topo) or (topo is not None and topo.sharding_size > 1):
            from paddle.distributed import fleet
            from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
                DygraphShardingOptimizer,
            )

            if fleet_clips(topo):  # wrapped even without clipping: Fleet's pipeline train_batch steps it
                # the stock wrapper: it builds the sharding optimizer (as below) and swaps the inner
                # AdamW's ClipGradByGlobalNorm (when clipping) for HybridParallelClipGrad, which the
                # update then runs
                self.hybrid = fleet.distributed_optimizer(self.opt)
                inner = getattr(self.hybrid, "_inner_opt", None)
            else:
                # Fleet partitions the parameters over the sharding ranks (largest first, greedy) and
                # narrows the inner AdamW to this rank's part: only that part gets moments / masters
                inner = DygraphShardingOptimizer(self.opt, topo.hcg)
            if isinstance(inner, DygraphShardingOptimizer):
                self.sharding, self._sharding_group = inner, topo.sharding_group
                self._own = {p.name for p in inner._rank2params[topo.sharding_rank]}

    @property
    def clip_name(self) -> str:
        """Which clip runs: Fleet's (the inner optimizer's ``grad_clip`` class) or the trainer's."""
        clip = getattr(self.opt, "_grad_clip", None)
        return type(clip).__name__ if self.clips_itself and clip is not None else "trainer_global_norm"

    def grad_owners(self) -> dict[str, int]:
        """Structured name -> the sharding rank that updates it (every name on rank 0 without sharding);
        sharding stage 2 keeps each gradient there only (parallel/grads.py)."""
        if self.sharding is None:
            return {n: 0 for n, _ in self.params}
        rank_of = {p.name: r for r, ps in self.sharding._rank2params.items() for p in ps}
        return {n: rank_of[p.name] for n, p in self.params}

    @property
    def master(self) -> dict[str, paddle.Tensor]:
        """fp32 master copies of non-fp32 parameters (Paddle's ``multi_precision`` weights)."""
        mw = getattr(self.opt, "_master_weights", {}) or {}
        return {n: mw[p.name] for n, p in self.params if p.name in mw}

    @property
    def state(self) -> dict[str, dict[str, paddle.Tensor]]:
        """Accumulators (moments, beta powers) by structured name, for parameters that stepped."""
        acc = getattr(self.opt, "_accumulators", {})
        keys = {n: self._acc_key(p) for n, p in self.params if n in self._stepped}
        return {n: {kind: table[k] for kind, table in acc.items() if k in table} for n, k in keys.items()}

    def _acc_key(self, p: paddle.Tensor) -> str:
        """Paddle keys a bf16/fp16 parameter's moments by its fp32 master weight's name."""
        mw = getattr(self.opt, "_master_weights", {}) or {}
        return mw[p.name].name if p.name in mw else p.name

    def master_weight(self, name: str) -> paddle.Tensor | None:
        """The fp32 value the update runs on (the parameter itself when it is fp32); None for a
        parameter the optimizer does not update (frozen)."""
        return self.master.get(name, dict(self.params).get(name))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments, beta powers, master weights)."""
        acc = [t for table in getattr(self.opt, "_accumulators", {}).values() for t in table.values()]
        return sum(int(t.size) * t.element_size() for t in [*acc, *self.master.values()])

    @paddle.no_grad()
    def step(self, grads: dict[str, paddle.Tensor], has_grad: dict[str, bool], lr: float) -> None:
        """Update every parameter that got a gradient; ``grads`` are fp32 and already synced and clipped."""
        update = [(n, p) for n, p in self.params if has_grad.get(n, False) and p.name in self._own]
        self._stepped.update(n for n, _ in update)
        # an fp32 gradient stays fp32 for a bf16 parameter: the update runs on its fp32 master (Paddle's
        # adamw takes it, as Fleet's MixPrecisionOptimizer hands it main_grad; torch steps the reference's
        # fp32 masters with fp32 gradients); rounding it to bf16 first moved each element by up to 2^-8
        pairs = [
            (p, grads[n] if grads[n].dtype in (p.dtype, paddle.float32) else grads[n].astype(p.dtype))
            for n, p in update
        ]
        if pairs:
            self.opt.set_lr(lr)
            self.opt._apply_optimize(loss=None, startup_program=None, params_grads=pairs)
        elif self.clips_itself:
            # Fleet's hybrid clip, which the update runs, all-reduces the squared norms over the pipeline,
            # tensor and sharding groups: a rank with nothing to update (a pipeline stage whose layers are
            # all frozen, e.g. only shared-indexer layers in the indexer's warm-up) joins with zeros, else
            # its peers wait in those all-reduces while it runs the step's next collective
            self.opt._grad_clip([])
        if self.sharding is not None:
            self._broadcast_updated(has_grad)

    def _broadcast_updated(self, has_grad: dict[str, bool]) -> None:
        """Every updated parameter from the sharding rank that owns it (Fleet's partition order), by
        the synced ``has_grad``, equal on every rank: not Fleet's own broadcast, whose local-gradient
        rule can differ between ranks (docs/parallel.md, "Sharding")."""
        from ..parallel import comm

        by_name = {p.name: n for n, p in self.params}
        ranks = self._sharding_group.ranks
        for owner, params in sorted(self.sharding._rank2params.items()):
            for p in params:
                if has_grad.get(by_name[p.name], False):
                    comm.broadcast(p, ranks[owner], self._sharding_group)

    def state_dict(self) -> dict[str, dict[str, paddle.Tensor | int]]:
        """``{structured name: {accumulator kind: tensor, "master": fp32 weight}}``."""
        out: dict[str, dict[str, paddle.Tensor | int]] = {n: dict(st) for n, st in self.state.items()}
        for n, w in self.master.items():
            out.setdefault(n, {})["master"] = w
        return out

    def state_layout(self) -> dict[str, dict[str, paddle.Tensor]]:
        """``{structured name: {kind: tensor}}`` of every state tensor :meth:`set_state_dict` may fill on
        this rank (moments, beta powers, ``master``), created now if not yet: what a resume state must match."""
        self.prepare_state()
        acc = getattr(self.opt, "_accumulators", {})
        masters = getattr(self.opt, "_master_weights", {}) or {}
        out: dict[str, dict[str, paddle.Tensor]] = {}
        for n, p in self.params:
            key = self._acc_key(p)
            st = {kind: table[key] for kind, table in acc.items() if key in table}
            if p.name in masters:
                st["master"] = masters[p.name]
            if st:
                out[n] = st
        return out

    def set_state_dict(self, sd: dict[str, dict[str, paddle.Tensor | int]]) -> None:
        names = dict(self.params)
        unknown = set(sd) - set(names)
        if unknown:
            raise KeyError(f"optimizer state has parameters this model lacks: {sorted(unknown)[:5]}")
        stepped = {n for n, st in sd.items() if any(k != "master" for k in st)}
        self.prepare_state()
        acc = self.opt._accumulators
        for n, st in sd.items():
            p = names[n]
            for kind, v in st.items():
                t = v.detach() if isinstance(v, paddle.Tensor) else paddle.to_tensor(v)
                if kind == "master":
                    self.opt._master_weights[p.name].set_value(t.astype("float32"))
                else:
                    dst = acc[kind][self._acc_key(p)]
                    dst.set_value(t.astype(dst.dtype))
        self._stepped = stepped
        self.sync_masters({n for n in names if "master" not in sd.get(n, {})})

    @paddle.no_grad()
    def sync_masters(self, names: set[str]) -> None:
        """Set the fp32 master weights of ``names`` from their (restored) parameters: a parameter whose
        state a resume did not carry (e.g. the backbone after the indexer's warm-up) continues from its
        weight, not from the value its master was created with."""
        mw = getattr(self.opt, "_master_weights", {}) or {}
        for n, p in self.params:
            if n in names and p.name in mw:
                mw[p.name].set_value(p.astype("float32"))

    def prepare_state(self) -> None:
        """Create every accumulator and master weight now (Paddle does it lazily on the first step); restoring state needs them first."""
        block = paddle.static.default_main_program().global_block()
        self.opt._create_accumulators(block, [p for _, p in self.params if p.name in self._own])
