"""``glm52 plan``: what one rank of a parallel layout holds, before any GPU is touched.

Parameters, gradients and optimizer state are counted from lazily built probe stages of the model
code (:func:`layer_counts`) by :func:`train.memory.state_bytes`, the rule the trainer's measured
numbers are compared with; activations are an estimate (:func:`activation_bytes`).  Method,
formulas and measurements: docs/scale.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .._io import dumps_json, write_record
from ..parallel.topology import ParallelConfig
from .command import (
    TRAIN_DEFAULTS,
    add_indexer_loss_arguments,
    add_layout_arguments,
    add_moe_aux_argument,
    add_moe_bias_argument,
    add_train_arguments,
)

__all__ = [
    "LayerCounts",
    "active_params",
    "state_items",
    "activation_bytes",
    "layer_counts",
    "plan_layout",
    "register_plan",
    "search_layouts",
]

GiB = 1024**3


@dataclass(frozen=True)
class Layout(ParallelConfig):
    """A parallel layout: the trainer's own type (``ParallelConfig``: the sizes ``glm52 train`` lays a
    run out by) plus the run settings the planner needs; ``sharding_stage`` 3 is the planner's only."""

    vpp: int = 1
    sharding_partition: str = "even"  # "fleet": whole tensors, Fleet's DygraphShardingOptimizer
    recompute: str = "none"
    seq_len: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 0  # 0: one micro-batch per data-parallel rank per pipeline stage
    dtype: str = "bfloat16"
    attention: str = "eager"
    pp_layout: str | None = None
    first_stage_layers: int | None = None  # decoder layers on the first / last pipeline stage
    last_stage_layers: int | None = None
    # the indexer's training (train/indexer_stage.py; "warmup" freezes all but the indexers: docs/scale.md);
    # None: the checkpoint's default (sparse when its indexer_loss_coeff > 0, else none)
    indexer_stage: str | None = None
    # run settings the trainer checks against the layout (settings.check_run), as glm52 train's flags
    indexer_loss_coeff: float | None = None  # None: the checkpoint's
    indexer_shared_supervision: bool = False
    moe_bias_update_rate: float = 0.0
    moe_aux_loss_coeff: float = 0.0
    # a glm52 train line's flags that plan has not ((dest, value) given): not planned, but checked as
    # glm52 train checks them (--lr nan, --steps 0, --nnodes 3 of 8 ranks ...), files excepted
    train_only: tuple = ()

    @property
    def local_seq(self) -> int:
        """Tokens of a sequence one rank holds (its zigzag slice under context parallel)."""
        return self.seq_len // self.cp

    def _parts(self) -> list[tuple[str, str]]:
        """(summary, glm52 train flags) of each setting shown: tp, pp, dp, ep, recompute always,
        the others where they are not the default."""
        s, st = self.sharding, self.sharding_stage
        sizes = [(k, getattr(self, k)) for k in ("tp", "pp", "dp", "ep", "etp", "vpp")]
        parts = [(k in ("tp", "pp", "dp", "ep") or n > 1, f"{k.upper()}{n}", f"--{k} {n}") for k, n in sizes]
        parts += [(s > 1, f"SHARD{s}/s{st}", f"--sharding {s} --sharding-stage {st}")]
        parts += [(self.cp > 1, f"CP{self.cp}", f"--cp {self.cp}"), (self.sp, "SP", "--sp")]
        parts += [(True, f"recompute={self.recompute}", f"--recompute {self.recompute}")]
        return [(summary, flags) for shown, summary, flags in parts if shown]

    def describe(self) -> str:
        return " ".join(summary for summary, _ in self._parts())

    def flags(self) -> str:
        """The ``glm52 train`` flags that run what was planned: the layout's, then the run settings
        the plan assumed (glm52 train's own defaults differ: a shorter sequence, float32 ...)."""
        import shlex

        batch = self.global_batch_size or self.pp * self.replicas * self.micro_batch_size
        run = [("seq-len", self.seq_len), ("micro-batch-size", self.micro_batch_size)]
        run += [("global-batch-size", batch), ("dtype", self.dtype), ("indexer-stage", self.indexer_stage)]
        run += [("pp-layout", self.pp_layout), ("first-stage-layers", self.first_stage_layers)]
        run += [("last-stage-layers", self.last_stage_layers)]
        given = [f"--{k} {shlex.quote(str(v))}" for k, v in run if v is not None]
        return " ".join([*(flags for _, flags in self._parts()), *given])


# --------------------------------------------------------------------------- exact state counts
@dataclass
class LayerCounts:
    """Per-rank parameter lists ``[(name, numel, dtype, trainable, full_numel)]`` of each part of a
    stage, and per part the sums a plan needs (:meth:`totals`), computed once: a stage is the sum
    of its parts, so a plan never walks the parameters of every layer."""

    parts: dict[Any, list[tuple[str, int, str, bool, int]]]
    memo: dict[Any, Any] = field(default_factory=dict)

    def part(self, key: Any) -> list[tuple[str, int, str, bool, int]]:
        return self.parts.get(key, [])

    def totals(self, key: Any) -> dict[str, int]:
        """Unsharded :func:`train.memory.state_bytes` of part ``key`` (all its tensors, and its
        routed experts' optimizer bytes), its parameter counts (this rank's, routed experts', the
        whole model's)."""
        if ("totals", key) not in self.memo:
            from .memory import state_bytes

            params = self.part(key)
            items = state_items(params)
            expert = [it for it, (name, *_) in zip(items, params) if _is_expert(name)]
            self.memo[("totals", key)] = state_bytes(items) | {
                "expert_optimizer_bytes": state_bytes(expert)["optimizer_bytes"],
                "num_params": sum(n for _, n, *_ in params),
                "expert_params": sum(n for name, n, *_ in params if _is_expert(name)),
                "full_params": sum(f for *_, f in params),
            }
        return self.memo[("totals", key)]


def indexer_stage(config: Any, lay: Layout) -> str:
    """The layout's indexer stage, the checkpoint's default resolved (as the trainer resolves it)."""
    from ..modeling.indexer_stages import IndexerTraining

    return lay.indexer_stage or IndexerTraining.from_config(config).stage


def _layer_key(config: Any, i: int) -> Any:
    if i >= config.num_hidden_layers:
        return ("mtp", i)
    return (config.mlp_layer_types[i], config.indexer_types[i])


# the probes built, keyed by the config's values (not its id: a config changed in place, or a new one
# where a freed one was, is another model) and the layout's shapes; emptied when it holds _CACHE_MAX
_CACHE: dict[tuple, LayerCounts] = {}
_CACHE_MAX = 64
# id(config) -> its values as JSON while one plan or search runs (:func:`_one_model`): read once there,
# not per probe lookup (a search looks up thousands; the JSON of the official config is ~0.2 ms)
_KEYS: dict[int, str] = {}


def _config_key(config: Any) -> str:
    """The config's values as the probes' key (a value JSON cannot hold by its repr)."""
    key = _KEYS.get(id(config))
    return key if key is not None else dumps_json(config.to_dict(), default=repr)


def _one_model(fn: Any) -> Any:
    """``fn(config, ...)`` plans one model: its config's key is read once for the whole call."""

    @functools.wraps(fn)
    def planned(config: Any, *args: Any, **kwargs: Any) -> Any:
        if id(config) in _KEYS:  # inside an outer plan of the same config
            return fn(config, *args, **kwargs)
        _KEYS[id(config)] = dumps_json(config.to_dict(), default=repr)
        try:
            return fn(config, *args, **kwargs)
        finally:
            _KEYS.pop(id(config), None)

    return planned


_EXPERT_INDEX = re.compile(r"\.mlp\.experts\.(\d+)\.")  # a routed expert's local index


def layer_counts(config: Any, lay: Layout) -> LayerCounts:
    """Build (lazily) one probe stage for this layout's TP/EP/ETP/SP shapes and split its parameters
    into parts: ``"embedding"``, ``"head"`` (final norm + LM head), and one entry per layer kind."""
    import paddle

    from ..modeling.model import GlmMoeDsaForCausalLM
    from ..parallel.layers import get_shard_spec
    from ..parallel.pipeline import StageSpec
    from ..parallel.topology import Topology
    from .memory import dtype_name

    stage_name = indexer_stage(config, lay)
    key = (_config_key(config), lay.tp, lay.ep, lay.etp, lay.sp, lay.dtype, stage_name)
    if key in _CACHE:
        return _CACHE[key]
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    if lay.ep > 1 and config.n_routed_experts % lay.ep == 0:
        # an EP rank holds experts 0 .. E/ep - 1 of the ep = 1 probe (same shapes, local numbering;
        # tests/test_plan.py compares with building the stage): no second probe per ep
        base, keep = layer_counts(config, replace(lay, ep=1)), config.n_routed_experts // lay.ep
        parts = {
            part: [
                (name, n, d, tr, full * lay.ep if m else full)
                for name, n, d, tr, full in items
                for m in [_EXPERT_INDEX.search(name)]
                if m is None or int(m.group(1)) < keep
            ]
            for part, items in base.parts.items()
        }
        return _CACHE.setdefault(key, LayerCounts(parts))
    reps = {_layer_key(config, i): i for i in reversed(range(config.num_hidden_layers))}  # each kind's first layer
    # shapes depend on tp / ep / etp / sp only; dp is any size that makes the expert grid valid
    pc = ParallelConfig(tp=lay.tp, pp=1, dp=lay.ep * lay.etp, ep=lay.ep, etp=lay.etp, sp=lay.sp)
    topo = Topology(pc, rank=0)  # rank 0 of every group: TP/EP ranks hold equal shapes
    spec = StageSpec(0, 1, tuple(sorted(reps.values())), True, True, config.num_mtp_layers > 0)
    with paddle.LazyGuard():
        stage = GlmMoeDsaForCausalLM(config, lay.dtype, topology=topo, stage=spec)
    stage.set_indexer_training(stage_name)  # the warm-up's frozen parameters, as the trainer builds them
    sizes = {"tp": lay.tp, "etp": lay.etp}
    parts: dict[Any, list[tuple[str, int, str, bool, int]]] = {}
    for name, p in stage.named_parameters():
        s = get_shard_spec(p)
        numel = int(math.prod(p.shape))
        # a split tensor's whole; the other EP ranks hold the other experts, same shapes
        full = numel * (sizes[s.group] if s.axis is not None else 1) * (lay.ep if s.expert else 1)
        part = "embedding" if name.startswith("model.embedding.") else "head"
        if name.startswith("model.layers."):
            part = _layer_key(config, int(name.split(".")[2]))
        parts.setdefault(part, []).append((name, numel, dtype_name(p.dtype), not p.stop_gradient, full))
    return _CACHE.setdefault(key, LayerCounts(parts))


def _stage_layer_ids(config: Any, spec: Any) -> list[int]:
    """The decoder layers of a stage, then its MTP layers (numbered after the decoder's)."""
    L = config.num_hidden_layers
    return list(spec.layers) + (list(range(L, L + config.num_mtp_layers)) if spec.has_mtp else [])


def stage_params(config: Any, lay: Layout, spec: Any) -> list[tuple[str, int, str, bool, int]]:
    """The parameters one rank of pipeline stage ``spec`` holds (from :func:`layer_counts`)."""
    lc = layer_counts(config, lay)
    out = []
    if spec.has_embedding or spec.has_mtp:
        out += lc.part("embedding")
    for i in _stage_layer_ids(config, spec):  # the representative layer's parameters under layer i's name
        for name, *rest in lc.part(_layer_key(config, i)):
            model, layers, _, tail = name.split(".", 3)
            out.append((f"{model}.{layers}.{i}.{tail}", *rest))
    if spec.has_head:
        out += lc.part("head")
    return out


def state_items(params: list[tuple[str, int, str, bool, int]]) -> list[tuple[int, str, bool]]:
    """``(numel, dtype, trainable)`` for :func:`train.memory.state_bytes`: the trainer creates Paddle
    AdamW's accumulators for every trainable parameter it owns before the first step."""
    return [(n, d, tr) for _, n, d, tr, _ in params]


def total_params(config: Any, lay: Layout) -> int:
    """Distinct parameters of the whole model (each layer once, the embedding once)."""
    lc = layer_counts(config, lay)
    parts = Counter(_layer_key(config, i) for i in range(config.num_hidden_layers + config.num_mtp_layers))
    parts.update(["embedding", "head"])
    return sum(lc.totals(k)["full_params"] * m for k, m in parts.items())


def active_params(config: Any, lay: Any) -> int:
    """Parameters one token runs through (what its matmul FLOPs scale with; N_active of
    docs/scale.md), from the planner's probe counts."""
    lc = layer_counts(config, lay)
    key = ("active_params", id(config))
    if key in lc.memo:  # the same for every layout of this probe
        return lc.memo[key]
    share = config.num_experts_per_tok / config.n_routed_experts
    n = 0.0
    for i in range(config.num_hidden_layers + config.num_mtp_layers):
        for name, _, _, _, full in lc.part(_layer_key(config, i)):
            n += full * share if _is_expert(name) else full  # routed experts: k of E per token
    n += sum(full for *_, full in lc.part("head"))  # final norm + LM head
    lm_head = sum(full for name, _, _, _, full in lc.part("head") if "lm_head" in name)
    lc.memo[key] = int(n + lm_head * config.num_mtp_layers)  # each MTP depth runs the shared head again
    return lc.memo[key]


# --------------------------------------------------------------------------- activation estimate
def layer_activation_elems(config: Any, lay: Layout, kind: Any) -> dict[str, float]:
    """Bytes one micro-batch leaves saved for backward in one layer of ``kind`` (no recompute),
    split into ``core`` (attention probabilities and scaled queries: what core recompute drops)
    and ``other``.  Formula and assumptions: docs/scale.md."""
    from ..modeling.attention_forms import SAVE_ELEMS  # the sparse attention's cap on kept keys + probabilities

    c = config
    a = 2 if lay.dtype in ("bfloat16", "float16") else 4
    b, s, h, t = lay.micro_batch_size, lay.local_seq, c.hidden_size, lay.tp
    sb = s * b
    s_all = lay.seq_len  # keys: under context parallel the latent rows of the whole sequence are gathered
    sig = t if lay.sp else 1  # sequence-sharded tensors (norm inputs, residual) under SP
    nh = c.num_attention_heads // t
    dq, dn, dv, r = c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.qk_rope_head_dim
    ql, kl = c.q_lora_rank, c.kv_lora_rank
    mtp = kind[0] == "mtp"
    has_indexer = mtp or kind[1] == "full"
    # the indexer's queries, keys and head weights (kept when its KL trains)
    indexer_inputs = a * (sb * c.index_n_heads * c.index_head_dim + sb * c.index_head_dim + sb * c.index_n_heads)
    # attention block: norm input, normed input, latents and their norms, head projections,
    # roped q / k, v, output
    other = sb * h / sig + sb * h
    other += 2 * sb * ql + sb * (kl + r) + sb * kl
    other += sb * nh * dq + sb * nh * (dn + dv) + 2 * sb * nh * dq + sb * nh * dv + sb * nh * dv
    other *= a
    keys = min(s_all, int(c.index_topk)) if c.index_topk else s_all
    if lay.attention == "eager":
        # scaled queries and the latent key table; the gathered keys and fp32 probabilities are
        # kept for backward only up to the attention's save cap, else recomputed per chunk
        lat = kl + r
        core = a * sb * nh * dq + a * s_all * b * lat + 4.0 * min(sb * keys * (lat + nh), SAVE_ELEMS)
    else:  # a fused kernel keeps the queries and the log-sum-exp only
        core = a * sb * nh * dq + 4.0 * sb * nh
    stage = indexer_stage(c, lay)
    if stage == "warmup":
        # the backbone is frozen: autograd keeps nothing of it; a layer that runs its indexer keeps
        # the dense KL's inputs (queries, keys, head weights), per chunk of queries its fp32 head
        # scores over the keys up to the chunk (index_n_heads x S^2 / 2 in all), the log-softmax and
        # the target over every key
        if not has_indexer:
            return {"core": 0.0, "other": 0.0}
        return {"core": 0.0, "other": indexer_inputs + 4.0 * b * s * s_all * (c.index_n_heads / 2 + 2)}
    if has_indexer and stage == "sparse":
        # the indexer is trained (KL loss): its queries, keys, head weights and fp32 scores over
        # all keys are saved; without the loss its top-k is a non-differentiable selection
        other += indexer_inputs
        other += 4.0 * b * s * s_all
    # MLP block
    other += a * (sb * h / sig + sb * h)
    if not mtp and kind[0] == "dense":  # an MTP layer's MLP is MoE
        i = c.intermediate_size // t
        other += a * sb * 3 * i
    else:
        k, E, I = c.num_experts_per_tok, c.n_routed_experts, c.moe_intermediate_size
        routed = sb * k / t  # each rank computes its share of the routed token copies
        other += 4.0 * 2 * sb * E / sig  # router logits and scores (fp32)
        other += a * routed * (2 * h + 3 * I)  # dispatched inputs, gate|up, act, outputs
        i_sh = I * c.n_shared_experts // t
        other += a * sb * 3 * i_sh
    if mtp:  # MTP: embedding norm, hidden norm, their concatenation and projection input
        other += a * sb * (2 * h + 2 * h)
    return {"core": core, "other": other}


def activation_bytes(config: Any, lay: Layout, spec: Any, micro_batches: int, chunks: Any = None) -> int:
    """Estimated peak activation bytes of one rank of stage ``spec`` (see docs/scale.md); under
    ``--vpp``, ``chunks``: the rank's pipeline chunks (``spec`` is their union), whose micro-batches
    in flight differ (:func:`_in_flight_peak`)."""
    a = 2 if lay.dtype in ("bfloat16", "float16") else 4
    sb, h = lay.local_seq * lay.micro_batch_size, config.hidden_size
    sig = lay.tp if lay.sp else 1
    # the indexer's warm-up recomputes nothing of the frozen layers: the KLs are kept
    recompute = "none" if indexer_stage(config, lay) == "warmup" else lay.recompute

    def held(part: Any) -> tuple[float, float]:
        """(bytes a micro-batch leaves saved in ``part``'s layers, embedding and heads; the most
        one of its layers needs while it is rebuilt under recompute)."""
        per = [layer_activation_elems(config, lay, _layer_key(config, i)) for i in _stage_layer_ids(config, part)]
        if recompute == "full":  # each layer keeps its input; one layer is rebuilt at a time
            kept = len(per) * a * sb * h / sig
            extra = max((p["core"] + p["other"] for p in per), default=0.0)
        elif recompute == "core":
            kept, extra = sum(p["other"] for p in per), max((p["core"] for p in per), default=0.0)
        else:
            kept, extra = sum(p["core"] + p["other"] for p in per), 0.0
        if part.has_embedding:
            kept += a * sb * h / sig
        if part.has_head:  # each LM head (main + MTP): its input and fp32 vocab-parallel logits (and their softmax)
            kept += (1 + config.num_mtp_layers) * (a * sb * h + 2 * 4.0 * sb * (config.vocab_size // lay.tp))
        return kept, extra

    if lay.vpp > 1 and chunks is None:  # the rank's chunks, as the trainer splits the layers
        from .settings import pipeline_chunks

        chunks = pipeline_chunks(lay, lay.pp, config.num_hidden_layers, config.num_mtp_layers > 0)[spec.stage :: lay.pp]
    if lay.vpp == 1:
        kept, extra = held(spec)
        # 1F1B: stage p holds min(pp - p, micro-batches) micro-batches at its peak
        return int(kept * float(max(1, min(lay.pp - spec.stage, micro_batches))) + extra)
    parts = [held(c) for c in chunks]
    return int(_in_flight_peak(lay, spec.stage, micro_batches, [k for k, _ in parts]) + max(e for _, e in parts))


def _in_flight_peak(lay: Layout, stage: int, micro_batches: int, chunk_bytes: list[float]) -> float:
    """Peak saved bytes of pipeline rank ``stage`` under Fleet's interleaved schedules (``--vpp`` V),
    ``chunk_bytes[c]``: one micro-batch's in the rank's c-th chunk.  With fewer than 2 pp
    micro-batches Fleet runs F-then-B (every forward, then every backward: all micro-batches of every
    chunk held); else ``PipelineParallelWithInterleave``: 2 (pp - 1 - stage) + (V - 1) (pp + m % pp)
    warm-up forwards, then one forward and one backward at a time, forwards taking the chunks in
    groups of pp micro-batches (the first group pp + m % pp), backwards the chunks in reverse."""
    pp, v, m = lay.pp, lay.vpp, micro_batches
    if m < 2 * pp:
        return m * sum(chunk_bytes)
    first = m % pp + pp  # Fleet's first_chunk_acc

    def chunk(step: int, forward: bool) -> int:
        c = step // first if step < first * v else (step - first * v) % (pp * v) // pp
        return c if forward else v - 1 - c

    steps = m * v
    startup = min(2 * (pp - 1 - stage) + (v - 1) * first, steps)
    cur = peak = 0.0
    for f in range(steps):  # forward f; after the warm-up, backward f - startup follows it
        cur += chunk_bytes[chunk(f, True)]
        peak = max(peak, cur)
        if f >= startup:
            cur -= chunk_bytes[chunk(f - startup, False)]
    return peak


# --------------------------------------------------------------------------- the plan
# train-only settings plan does not check: what they name is read from disk (glm52 train checks them before
# it launches, after the settings: command.check_inputs_before_launch, the --out folder, a --resume state's
# files); a --resume gives an unset --indexer-stage the saved run's all the same (layout_from_args)
_FILE_SETTINGS = ("data", "out", "resume", "resume_override")
_LAUNCH_SETTINGS = ("job_timeout", "comm_timeout", "nnodes")


def train_config(lay: Layout) -> Any:
    """The ``glm52 train`` settings of ``lay`` (its shared fields by name, a train line's other settings
    from ``train_only``; a global batch of 0: pp micro-batches per replica; sharding stage 3, the
    planner's only, checked as stage 2).  Sizes below 1 derive no batch: 1 stands in, so that the
    trainer's check names the size (``--pp 0`` was blamed on a global batch of 0 the line never gave)."""
    from .settings import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    given = {k: getattr(lay, k) for k in names if hasattr(lay, k)}
    given |= {k: v for k, v in lay.train_only if k in names and k not in _FILE_SETTINGS}
    sizes = (lay.pp, lay.dp, lay.sharding, lay.micro_batch_size)
    derived = lay.pp * lay.replicas * lay.micro_batch_size if min(sizes) >= 1 else 1
    stage = min(lay.sharding_stage, 2) if lay.sharding > 1 else lay.sharding_stage  # refused as given at sharding 1
    given.update(sharding_stage=stage, global_batch_size=lay.global_batch_size or derived)
    return TrainConfig(model="glm", **given)


def check_layout(config: Any, lay: Layout) -> list[Any]:
    """Refuse a layout the trainer would refuse: its own check (``command.check_settings``, every
    refusal of ``glm52 train`` before it launches that needs no file but the config), with the flag
    and the numbers; return its pipeline chunks (pp x vpp of them), as the trainer splits the layers."""
    from .command import check_settings
    from .glm_adapter import GlmAdapter
    from .settings import check_choices, run_world

    check_choices(lay, {"sharding_stage": (1, 2, 3)})  # the planner's own choices; the rest as the trainer's
    given = dict(lay.train_only)
    _check_ignored_flags(given)
    cfg = train_config(lay)
    if dump := given.get("dump_step"):  # a train line's --dump-step DIR K: K within its --steps
        from .command import dump_steps

        dump_steps(argparse.Namespace(dump_step=dump, steps=cfg.steps, model="glm"))
    launch = {k: v for k, v in lay.train_only if k in _LAUNCH_SETTINGS}
    _, chunks = check_settings(cfg, GlmAdapter.for_config(config), run_world(cfg), **launch)
    return chunks


def _check_ignored_flags(given: dict[str, Any]) -> None:
    """``command.config_from_args``' first refusals, in its words: flags a checkpoint run would ignore
    (plan's --model is always a checkpoint or config folder, never the toy model)."""
    if given.get("resume_override") and not given.get("resume"):
        raise ValueError("--resume-override names what a --resume may change; this run has no --resume")
    if given.get("model_config"):
        raise ValueError("--model-config sets the toy model's config; a checkpoint's is its config.json")


def check_nodes(lay: Layout) -> None:
    """A multi-node train line's rendezvous and node rank (``command.node_rank_of``), train's defaults
    for what the line leaves out.  glm52 train checks them after ``check_args``, before it launches;
    the command runs this after :func:`check_layout` likewise, which stays ``check_args``' twin."""
    from .command import node_rank_of

    given = dict(lay.train_only)
    defaults = {"nnodes": 1, "master": None, "node_rank": None, "launcher_args": "", "rendezvous_timeout": None}
    node_rank_of(argparse.Namespace(**{k: given.get(k, v) for k, v in defaults.items()}))


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _fleet_sharded_state_bytes(lay: Layout, params: list, sharding_rank: int) -> dict[str, int]:
    """Sharding as the trainer runs it (Fleet's ``DygraphShardingOptimizer``): every trainable
    tensor of the stage, experts included (every sharding rank holds the same expert grid), in the
    optimizer's order, partitioned whole (``fleet_sharding_partition``); the rank holds optimizer
    state for its own tensors only, and after stage 2's reduce only their fp32 gradients (the
    backward holds them all: the reduce comes after it)."""
    from .memory import fleet_sharding_partition, state_bytes

    items = state_items(params)
    trainable = [i for i, it in enumerate(items) if it[2]]
    part = fleet_sharding_partition([items[i][0] for i in trainable], lay.sharding)
    owned = {trainable[j] for j in part[sharding_rank]}
    full = state_bytes(items)
    mine = state_bytes([it for i, it in enumerate(items) if i in owned])
    mine_e = state_bytes([it for i, it in enumerate(items) if i in owned and _is_expert(params[i][0])])
    return {
        "grads_bytes": mine["grads_bytes"] if lay.sharding_stage >= 3 else full["grads_bytes"],
        "grads_after_reduce_bytes": mine["grads_bytes"] if lay.sharding_stage >= 2 else full["grads_bytes"],
        "optimizer_bytes": mine["optimizer_bytes"],
        "expert_optimizer_bytes": mine_e["optimizer_bytes"],
    }


def _sharded_state_bytes(config: Any, lay: Layout, spec: Any) -> dict[str, int]:
    """:func:`train.memory.state_bytes` of stage ``spec`` with sharding applied (an even split over
    the sharding degree), summed from its parts' totals.  Expert tensors divide like dense ones:
    every sharding rank holds the whole expert grid (docs/scale.md)."""
    from .memory import shard_totals

    lc = layer_counts(config, lay)
    parts = Counter(_layer_key(config, i) for i in _stage_layer_ids(config, spec))  # how often each part
    parts.update(k for k, held in (("embedding", spec.has_embedding or spec.has_mtp), ("head", spec.has_head)) if held)
    raw: Counter = Counter()
    for part, m in parts.items():
        raw.update({k: v * m for k, v in lc.totals(part).items() if k != "full_params"})
    raw["grads_after_reduce_bytes"] = raw["grads_bytes"]
    return shard_totals(raw, lay.sharding, lay.sharding_stage)


def rank_coords(lay: Layout, rank: int) -> dict[str, int]:
    """Fleet's hybrid order (data, pipe, sharding, sep = context parallel, model; model fastest)."""
    r, tp = divmod(rank, lay.tp)
    r, cp = divmod(r, lay.cp)
    r, sharding = divmod(r, lay.sharding)
    return {"tp": tp, "cp": cp, "sharding": sharding, "pp": r % lay.pp, "dp": r // lay.pp}


@_one_model
def plan_layout(
    config: Any, lay: Layout, gpu_mem_gb: float = 80.0, reserve_gb: float = 0.0, per_rank: bool = True
) -> dict[str, Any]:
    """Per-rank bytes of ``lay`` and whether every rank fits ``gpu_mem_gb`` (GiB, minus
    ``reserve_gb``); ``per_rank=False`` leaves out the row of every rank (``--search`` needs the
    verdict and the stages only), as does a world of more than ``RANK_ROWS_MAX`` ranks."""
    from ..parallel.pipeline import rank_spec

    chunks = check_layout(config, lay)
    specs = [rank_spec(chunks, lay.pp, s) for s in range(lay.pp)]  # each pipeline rank's chunks, as one stage
    micro = (lay.global_batch_size // (lay.replicas * lay.micro_batch_size)) if lay.global_batch_size else lay.pp
    kinds = []
    for spec in specs:
        st = _sharded_state_bytes(config, lay, spec)
        act = activation_bytes(config, lay, spec, micro, chunks[spec.stage :: lay.pp])
        row = {
            "stage": spec.stage,
            "layers": [spec.layers[0], spec.layers[-1]] if spec.layers else [],
            "layer_ids": list(spec.layers),  # under --vpp a rank's chunks are not contiguous
            "embedding": spec.has_embedding,
            "head": spec.has_head,
            "mtp": spec.has_mtp,
            "num_params": st.pop("num_params"),
            "expert_params": st.pop("expert_params"),
            **st,
            "activations_bytes": act,
        }
        by_sd = [row]  # the stage's sharding ranks: they differ under Fleet's partition
        if lay.sharding_partition == "fleet" and lay.sharding > 1:
            params = stage_params(config, lay, spec)
            by_sd = [_fleet_sharded_state_bytes(lay, params, r) for r in range(lay.sharding)]
            for f in ("grads_bytes", "grads_after_reduce_bytes", "optimizer_bytes", "expert_optimizer_bytes"):
                row[f + "_by_sharding_rank"] = [b[f] for b in by_sd]
                row[f] = max(row[f + "_by_sharding_rank"])
        # the stage's largest rank
        row["total_bytes"] = row["params_bytes"] + max(b["grads_bytes"] + b["optimizer_bytes"] for b in by_sd) + act
        kinds.append(row)
    limit = (gpu_mem_gb - reserve_gb) * GiB
    ranks = []
    rows = per_rank and lay.world_size <= RANK_ROWS_MAX
    for rank in range(lay.world_size if rows else 0):
        xy = rank_coords(lay, rank)
        k = kinds[xy["pp"]]
        fields = ("expert_params", "params_bytes", "grads_bytes", "grads_after_reduce_bytes", "optimizer_bytes")
        fields += ("expert_optimizer_bytes",)
        r = {"rank": rank, "stage": k["stage"]} | {f: k[f] for f in (*fields, "activations_bytes")}
        r |= {f: k[f + "_by_sharding_rank"][xy["sharding"]] for f in fields if f + "_by_sharding_rank" in k}
        r["total_bytes"] = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activations_bytes"]
        ranks.append(r)
    worst = max(k["total_bytes"] for k in kinds)
    return {
        "model": getattr(config, "name_or_path", None),
        # edp: replicas of an expert shard inside one sharding rank's expert grid (tp x dp x cp /
        # (ep x etp)); its gradient sums over those and the sharding ranks (expert_replicas)
        "layout": lay.__dict__
        | {
            "world": lay.world_size,
            "micro_batches_per_step": micro,
            "edp": lay.edp,
            "expert_replicas": lay.edp * lay.sharding,
        },
        "total_params": total_params(config, lay),
        "gpu_mem_gb": gpu_mem_gb,
        "reserve_gb": reserve_gb,
        "fits": bool(worst <= limit),
        "max_rank_bytes": worst,
        "kinds": kinds,
        "ranks": ranks,
        **(
            {"ranks_left_out": f"world {lay.world_size} > {RANK_ROWS_MAX}: a rank holds its stage's kinds row"}
            if per_rank and not rows
            else {}
        ),
    }


# a rank's row repeats its stage's (and sharding rank's) numbers: past this many ranks the rows are
# left out of the plan (a world of a million ranks ran out of memory building them)
RANK_ROWS_MAX = 16384


def stage_ranks(lay: Layout, stage: int) -> tuple[int, int, int]:
    """(count, first, last) of the ranks of pipeline stage ``stage`` (:func:`rank_coords`' order),
    computed, not listed: a large world's table has no row per rank to count."""
    block = lay.tp * lay.cp * lay.sharding  # the ranks of one (dp, pp) coordinate, consecutive
    first = stage * block
    return lay.world_size // lay.pp, first, first + (lay.dp - 1) * lay.pp * block + block - 1


_RECOMPUTE_ORDER = ("none", "core", "full")  # the search tries the least recompute first


@_one_model
def search_layouts(
    config: Any,
    gpus: int,
    base: Layout,
    gpu_mem_gb: float,
    reserve_gb: float = 0.0,
    limit: int = 20,
    hardware: Any = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Layouts of ``gpus`` ranks that fit, the least estimated time per token first (pipeline
    bubble, compute, communication: ``plan_cost.step_estimate``), then least recompute.
    ``progress(line)`` is told after each tensor-parallel size how far the search is."""
    from .plan_cost import comm_parts, step_estimate

    def pow2(n: int) -> list[int]:
        return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]

    def fitting(lay: Layout) -> dict[str, Any] | None:  # the layout's row if it fits
        try:
            p = plan_layout(config, lay, gpu_mem_gb, reserve_gb, per_rank=False)
        except ValueError:  # ParallelConfigError too
            return None
        if not p["fits"]:
            return None
        micro = p["layout"]["micro_batches_per_step"]
        big = max(p["kinds"], key=lambda k: k["num_params"])
        active = active_params(config, lay)
        est = step_estimate(config, lay, micro, big["num_params"], active, hardware, expert_params=big["expert_params"])
        return {
            "layout": lay.describe(),
            "flags": lay.flags(),
            "max_rank_gib": p["max_rank_bytes"] / GiB,
            "comm_bytes": sum(comm_parts(config, lay).values()),  # per micro-batch
            "micro_batches": micro,
            **est,
            "recompute_rank": _RECOMPUTE_ORDER.index(lay.recompute),
        }

    @functools.cache
    def splits(pp: int) -> bool:
        """The trainer splits the layers into pp (x --vpp) chunks: its own rule (``settings.pipeline_chunks``),
        which lets the first and last chunk hold the embedding or the head alone (requiring a layer per
        chunk dropped such layouts under --vpp)."""
        from .settings import pipeline_chunks

        try:
            pipeline_chunks(replace(base, pp=pp, vpp=base.vpp if pp > 1 else 1), pp, L, config.num_mtp_layers > 0)
        except ValueError:  # ParallelConfigError
            return False
        return True

    L = config.num_hidden_layers
    found = []
    t0, checked = time.perf_counter(), 0
    tps = [t for t in pow2(gpus) if t <= 8]
    for tp_i, tp in enumerate(tps):
        if progress is not None and tp_i:
            progress(
                f"tp {tps[tp_i - 1]} done ({tp_i}/{len(tps)}): {checked} layouts checked, {len(found)} fit, "
                f"{time.perf_counter() - t0:.1f} s"
            )
        for pp in [p for p in pow2(gpus // tp) if splits(p)]:
            if (gpus // (tp * pp)) % base.cp:
                continue
            dpt = gpus // (tp * pp * base.cp)  # data-parallel ranks (dp x sharding); --cp is kept as given
            eps = [e for e in pow2(config.n_routed_experts) if (tp * dpt * base.cp) % e == 0]
            # every split of the data-parallel ranks into dp x sharding: the expert grid spans
            # tp x dp x cp, not the sharding ranks (the trainer's layout), so a large ep needs dp
            for ep, sharding in itertools.product(eps, pow2(dpt)):
                for rc in _RECOMPUTE_ORDER:
                    lay = replace(
                        base, tp=tp, pp=pp, ep=ep, etp=1, recompute=rc, sharding=sharding, dp=dpt // sharding,
                        sp=tp > 1, vpp=base.vpp if pp > 1 else 1,  # --vpp: interleave every pipeline tried
                        sharding_stage=base.sharding_stage if sharding > 1 else 1,  # no stage without ranks
                    )  # fmt: skip
                    if lay.global_batch_size % (lay.replicas * lay.micro_batch_size):
                        break  # the global batch does not split over this layout's replicas
                    checked += 1
                    row = fitting(lay)
                    if row is not None:
                        found.append(row)
                        break  # the least recompute that fits
    if progress is not None:
        progress(f"searched {checked} layouts of {gpus} GPUs in {time.perf_counter() - t0:.1f} s: {len(found)} fit")
    found.sort(key=lambda r: (r["s_per_token"], r["recompute_rank"], r["max_rank_gib"]))
    return found[:limit]


def _runs(ids: list[int]) -> str:
    """Layer ids as runs: ``0-1,4-5`` (a rank's chunks under --vpp), ``0-8``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _table(plan: dict[str, Any], lay: Layout) -> str:
    rows = [
        f"{'stage':>5} {'layers':>9} {'params':>14} {'params GiB':>10} {'grads GiB':>9} {'optim GiB':>9} "
        f"{'activ GiB':>9} {'total GiB':>9}  ranks"
    ]
    for k in plan["kinds"]:
        n, first, last = stage_ranks(lay, k["stage"])
        layers = _runs(k["layer_ids"]) or "-"
        tags = "".join(t for t, on in (("E", k["embedding"]), ("H", k["head"]), ("M", k["mtp"])) if on)
        rng = f"{n} ranks ({first}..{last})" if n > 1 else f"[{first}]"
        rows.append(
            f"{k['stage']:>5} {layers + tags:>9} {k['num_params']:>14,} {k['params_bytes'] / GiB:>10.2f} "
            f"{k['grads_bytes'] / GiB:>9.2f} {k['optimizer_bytes'] / GiB:>9.2f} {k['activations_bytes'] / GiB:>9.2f} "
            f"{k['total_bytes'] / GiB:>9.2f}  {rng}"
        )
    return "\n".join(rows)


def _check_budget(args: argparse.Namespace) -> None:
    """The planner's own numbers: a GPU's memory and the --search assumptions are positive and
    finite, the reserve and --gpus are not negative, --top lists at least one layout (a zero speed
    divided by zero; --top -1 dropped the last fitting layout; a negative memory was "does NOT fit"),
    and the reserve leaves some of the GPU's memory (a reserve of all of it fitted nothing)."""
    positive = ("gpu_mem_gb", "gpu_tflops", "tp_bw_gbs", "net_bw_gbs", "top")
    for name in (*positive, "reserve_gb", "gpus"):
        value = getattr(args, name)
        low_ok = value > 0 if name in positive else value >= 0
        if not (low_ok and math.isfinite(value)):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be {'> 0' if name in positive else '>= 0'} and finite, got {value}")
    if args.reserve_gb >= args.gpu_mem_gb:  # nothing left to plan into: every layout "does NOT fit"
        raise ValueError(
            f"--reserve-gb {args.reserve_gb:g} must be below --gpu-mem-gb {args.gpu_mem_gb:g}: it leaves no memory"
        )


def _budget(args: argparse.Namespace) -> str:
    """The memory a rank may use, as the verdict weighs it (the reserve was left out of the line)."""
    return f"{args.gpu_mem_gb:g} GiB" + (f" less {args.reserve_gb:g} reserved" if args.reserve_gb else "")


def run_plan(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from ..cli._common import checkpoint_files, model_folder_error, output_file_error

    if bad := model_folder_error(args.model):  # before Paddle is imported: a typo is answered at once
        print(f"glm52 plan: error: {bad}", file=sys.stderr)
        return 2
    # a folder there, or under a file, was a traceback after the work; MODEL/config.json was replaced
    if args.json and (bad := output_file_error(args.json, "--json", checkpoint_files(args.model))):
        print(f"glm52 plan: error: {bad}", file=sys.stderr)
        return 2
    from ..cpu_env import apply_mkl_default

    apply_mkl_default()
    if note := _train_line_note(args):
        print(f"glm52 plan: note: {note}", file=sys.stderr)
    try:
        from ..configuration import GlmMoeDsaConfig

        _check_budget(args)
        config = GlmMoeDsaConfig.from_pretrained(args.model)
        lay = layout_from_args(args)
        if args.search:
            check_nodes(lay)
            if not args.gpus:
                raise ValueError("--search needs --gpus N")
            from .plan_cost import Hardware

            hw = Hardware(args.gpu_tflops * 1e12, args.tp_bw_gbs * 1e9, args.net_bw_gbs * 1e9)
            say = functools.partial(print, "[glm52 plan]", file=sys.stderr, flush=True)
            found = search_layouts(config, args.gpus, lay, args.gpu_mem_gb, args.reserve_gb, args.top, hw, progress=say)
            print(f"layouts of {args.gpus} GPUs ({_budget(args)}) that fit, least estimated time per token first:")
            for r in found:
                print(
                    f"  {r['layout']:<44} max {r['max_rank_gib']:6.1f} GiB  bubble {r['bubble']:5.1%}  "
                    f"step {r['step_s']:9.4g} s  comm {r['comm_bytes'] / GiB:6.2f} GiB/mb  {r['flags']}"
                )
            if not found:
                print("  none")
            if args.json:
                record = {
                    "gpus": args.gpus,
                    "gpu_mem_gb": args.gpu_mem_gb,
                    "reserve_gb": args.reserve_gb,
                    "layouts": found,
                }
                if bad := _write_plan(args.json, record):
                    print(f"glm52 plan: error: {bad}", file=sys.stderr)
                    return 2
            return 0 if found else 1
        plan = plan_layout(config, lay, args.gpu_mem_gb, args.reserve_gb)
        check_nodes(lay)
    except (ValueError, FileNotFoundError) as e:  # a ParallelConfigError is a ValueError
        print(f"glm52 plan: error: {e}", file=sys.stderr)
        return 2
    plan["seconds"] = time.perf_counter() - t0
    plan["model"] = plan["model"] or os.path.abspath(args.model)  # the config has no name_or_path: null before
    print(f"{lay.describe()}  world {lay.world_size}  total params {plan['total_params']:,}")
    print(_table(plan, lay))
    verdict = "fits" if plan["fits"] else "does NOT fit"
    print(
        f"max per rank {plan['max_rank_bytes'] / GiB:.2f} GiB: {verdict} in {_budget(args)} ({plan['seconds']:.1f} s)"
    )
    if args.json and (bad := _write_plan(args.json, plan)):
        print(f"glm52 plan: error: {bad}", file=sys.stderr)
        return 2
    return 0


def _write_plan(path: str, record: dict) -> str | None:
    """Write ``record`` to ``--json path``; None, or the line saying why it could not be written (a
    read-only place, a full disk: the plan printed above stands)."""
    try:
        write_record(path, record)
    except OSError as e:
        return f"--json {path}: cannot write the plan: {e.strerror or e}"
    return None


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The layout of plan's flags (by name; their defaults resolved by :func:`_train_line_note`), with
    the other settings a glm52 train line gives (``train_only``).  A train line's ``--resume`` without
    ``--indexer-stage`` plans the stage the resumed run trains, the saved run's, as train resolves it
    (settings.resumed_indexer_stage; only the state's meta.json is read)."""
    given = getattr(args, "_train_only_flags", {})
    train_only = tuple(
        (dest.removeprefix("train_only_"), getattr(args, dest)) for dest in given if getattr(args, dest) is not None
    )
    mine = {f.name: getattr(args, f.name) for f in fields(Layout) if f.name != "train_only"}
    resume = dict(train_only).get("resume")
    if resume is not None and mine["indexer_stage"] is None:
        from .settings import resumed_indexer_stage
        from .state_files import read_meta, resolve_resume_state

        mine["indexer_stage"] = resumed_indexer_stage(None, read_meta(resolve_resume_state(resume)))
    return Layout(**mine, train_only=train_only)


def _train_line_note(args: argparse.Namespace) -> str | None:
    """Resolve the defaults of the flags both commands have but default differently (TRAIN_DEFAULTS:
    plan's, the Layout's, describe a production run; a glm52 train command line planned as it is
    keeps the trainer's) and say what a glm52 train command line leaves out."""
    given = sorted(
        flag for dest, flag in getattr(args, "_train_only_flags", {}).items() if getattr(args, dest) is not None
    )
    unset = [k for k in TRAIN_DEFAULTS if getattr(args, k) is None]
    for k in unset:
        setattr(args, k, TRAIN_DEFAULTS[k] if given else Layout.__dataclass_fields__[k].default)
    if not given:
        return None
    used = ", ".join(f"--{k.replace('_', '-')} {TRAIN_DEFAULTS[k]}" for k in unset)
    what = "not planned (they do not change a rank's memory; checked as glm52 train checks them)"
    return f"a glm52 train command line: {', '.join(given)} {what}" + (
        f"; unset flags take glm52 train's defaults: {used}" if used else ""
    )


def register_plan(sub: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the glm52 CLI (see cli.COMMANDS)."""
    p = sub.add_parser(
        "plan",
        help="per-rank memory of a parallel layout (exact state, estimated activations)",
        description="Per-rank parameter, gradient, optimizer and activation bytes of a glm52 train layout and "
        "whether it fits. A whole glm52 train command line is accepted as it is (swap 'train' for 'plan'): its "
        "layout flags are planned; the others (--steps, --lr, ...) are not, but are checked as glm52 train checks "
        "them before it launches. The files they name (--data, --out, --resume) are not read, but for a --resume "
        "state's meta.json: with --indexer-stage unset, the saved run's stage is planned, as glm52 train takes it.",
    )
    p.add_argument("--model", required=True, help="checkpoint or config folder with config.json")
    g = p.add_argument_group("layout (as glm52 train)")
    add_layout_arguments(g, sharding_stages=(1, 2, 3))
    g.add_argument(
        "--sharding-partition",
        default="even",
        choices=["even", "fleet"],
        help="stage-1 state split: even (sharding V2 / Megatron style) or fleet (whole tensors, Fleet's "
        "DygraphShardingOptimizer, what glm52 train's --sharding uses)",
    )
    g.add_argument(
        "--recompute", default="none", choices=_RECOMPUTE_ORDER, help="activation recompute, as glm52 train --recompute"
    )
    g.add_argument(
        "--indexer-stage",
        choices=["none", "warmup", "sparse"],
        help="as glm52 train --indexer-stage: warmup holds gradients and optimizer state for the indexers only "
        "(default: the checkpoint's, sparse when its indexer_loss_coeff > 0)",
    )
    g.add_argument("--seq-len", type=int, help="default 4096 (glm52 train's 64 for a train line)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument(
        "--global-batch-size", type=int, help="default 0: pp micro-batches per step (glm52 train's 4 for a train line)"
    )
    g.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="default bfloat16 (glm52 train's float32 for a train line)"
    )
    g.add_argument(
        "--attention",
        default="eager",
        choices=["eager", "flash"],
        help="eager: this package's attention (fp32 probabilities saved); flash: a fused kernel",
    )
    g = p.add_argument_group("budget")
    g.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU (GiB)")
    g.add_argument("--reserve-gb", type=float, default=0.0, help="kept free for the allocator, NCCL and buffers")
    g.add_argument("--search", action="store_true", help="list layouts of --gpus ranks that fit")
    g.add_argument("--gpus", type=int, default=0)
    g.add_argument("--top", type=int, default=20, help="layouts listed by --search")
    # --search ranking assumptions (train/plan_cost.py, docs/scale.md)
    g.add_argument("--gpu-tflops", type=float, default=400.0, help="--search: sustained bf16 TFLOP/s per GPU")
    g.add_argument("--tp-bw-gbs", type=float, default=160.0, help="--search: GB/s inside a node (TP collectives)")
    g.add_argument("--net-bw-gbs", type=float, default=40.0, help="--search: GB/s per GPU between nodes (EP, PP, DP)")
    g.add_argument("--json", help="write the plan here")
    g = p.add_argument_group(
        "run settings (as glm52 train)",
        "settings glm52 train checks against the layout before it launches: a layout it would refuse is refused",
    )
    add_moe_bias_argument(g)
    add_moe_aux_argument(g)
    add_indexer_loss_arguments(g)
    _accept_train_flags(p)
    p.set_defaults(func=run_plan)


def _accept_train_flags(p: argparse.ArgumentParser) -> None:
    """Every glm52 train flag plan lacks, accepted and recorded (not shown in help): a train command
    line can be planned as it is."""
    import copy

    ours = {s for a in p._actions for s in a.option_strings}
    train = add_train_arguments(argparse.ArgumentParser(add_help=False))
    seen: dict[str, str] = {}
    for a in train._actions:
        if not a.option_strings or any(s in ours for s in a.option_strings):
            continue
        extra = copy.copy(a)
        extra.dest, extra.required, extra.default, extra.help = "train_only_" + a.dest, False, None, argparse.SUPPRESS
        p._add_action(extra)
        seen[extra.dest] = a.option_strings[0]
    p.set_defaults(_train_only_flags=seen)
