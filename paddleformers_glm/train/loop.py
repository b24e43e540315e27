"""The training loop every rank runs: topology -> stage module -> weights -> steps -> loss.json.

One step: the global batch of the step (same for every layout) -> this data-parallel rank's
micro-batches -> pipeline engine (Fleet's with ``--pp`` > 1; forward + backward; each loss term scaled by its weight over
its *global* normaliser) -> gradient sync over replicas -> true global norm -> clip -> Paddle's AdamW (train/optim.py).
Loss sums are reduced over pipeline stages and data-parallel ranks, so every rank knows the
step's loss; rank 0 logs it and writes ``OUT/loss.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from .. import progress
from .._io import dumps_json, write_record
from ..checkpoint.finite import check_finite_state
from ..cpu_env import math_settings
from ..modeling.model import default_dtype
from ..ops import cpu_bf16
from ..parallel import comm
from ..parallel.context import split_micro_batch
from ..parallel.fleet_pipeline import FleetPipeline, step_optimizer
from ..parallel.grads import GradSynchronizer, clip_main_grads, loss_multiplier
from ..parallel.pipeline import SingleStageEngine, layout_string, rank_spec
from ..parallel.state import shard_full_state
from ..parallel.topology import init_topology, join_default_group, launched_world_size, set_topology
from .adapter import LossSpec, ModelAdapter, make_adapter, token_count
from .data import check_batch_samples, check_eval_samples, micro_batches, open_data
from .indexer_stage import indexer_report, pop_indexer_history
from .job_status import TELL_PEERS, beat
from .memory import MemoryMonitor
from .moe_balance import ExpertBalancer
from .nonfinite import (
    NonFiniteStep,
    check_written_state,
    gather_json,
    local_report,
    loss_flag,
    nonfinite_record,
)
from .optim import AdamW, make_lr_scheduler
from .resume import finish_pruning, load_resume_state, prune_saves, save_resume_state
from .settings import (
    TrainConfig,
    check_resume_run,
    check_run,
    effective_min_lr,
    eval_identity,
    lr_schedule_start,
    recorded_settings,
    resolved_resume,
    run_world,
)
from .state_files import read_meta, reading_step_folder

__all__ = ["TrainConfig", "check_run", "run_training", "run_world"]


def _maybe_fault(spec: str | None, rank: int, step: int) -> bool:
    """Deliberate failure for the fault-handling tests (``--fault rank=1,step=2,kind=raise``,
    several joined by ``;``); ``kind=nan`` returns True: this rank's loss terms are then scaled by
    NaN (on a rank that computes a loss: the last pipeline stage), so its gradients are NaN."""
    if not spec:
        return False
    if ";" in spec:
        return any([_maybe_fault(one, rank, step) for one in spec.split(";") if one])
    kv = dict(part.split("=", 1) for part in spec.split(","))
    if int(kv.get("rank", -1)) != rank or int(kv.get("step", -1)) != step:
        return False
    kind = kv.get("kind", "raise")
    if kind == "nan":
        return True
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind in ("kill", "stop"):  # stop: alive but frozen (SIGSTOP), its peers time out waiting for it
        os.kill(os.getpid(), getattr(signal, f"SIG{kind.upper()}"))
    if kind == "exit":  # code=N: the exit status (3 unless given; 0: a rank that ends early "successfully")
        os._exit(int(kv.get("code", 3)))
    if kind == "hang":
        time.sleep(10_000)
    raise ValueError(f"--fault kind must be raise|kill|exit|hang|stop|nan, got {kind!r}")


def run_training(cfg: TrainConfig, adapter: ModelAdapter | None = None) -> dict[str, Any] | None:
    """Train on this process's rank; returns the loss.json content on rank 0 (None elsewhere).  The
    run works on a copy of ``cfg``: what it resolves (the step folder a ``--resume`` root's ``latest``
    names, the indexer stage a resumed state sets) is this run's, not the next that gets ``cfg``."""
    cfg = replace(cfg)
    cfg.validate()
    world = launched_world_size()  # the launcher's (glm52 train's one-process run sets stale ones aside)
    try:
        adapter = adapter or make_adapter(cfg.model, **cfg.model_args)
        pc, specs = check_run(cfg, adapter, world)  # reads this node's model folder and --resume state
    except Exception as e:
        if world > 1:  # once the worker has recorded the error (worker.py): the telling may wait
            with contextlib.suppress(AttributeError):
                setattr(e, TELL_PEERS, functools.partial(_tell_the_default_group, e))
        raise
    if cfg.dtype == "bfloat16":
        cpu_bf16.install()  # a CPU-only Paddle build gets the bf16 kernels it lacks; no-op elsewhere
    beat(0, "connect")  # at the job's default group: every rank of the job must reach it (launch.still_connecting)
    topo = init_topology(
        pc,
        accumulate_steps=cfg.global_batch_size // (pc.replicas * cfg.micro_batch_size),
        micro_batch_size=cfg.micro_batch_size,
        world=world,
        agree=lambda: _agree(cfg, world),
    )  # the layout against the model's sizes: check_run above
    was_quiet = progress.set_quiet(True) if not cfg.progress else None  # --no-progress: loads/exports too
    try:
        data = open_data(cfg.data, cfg.seq_len, adapter.vocab_size, cfg.seed, data_dtype=cfg.data_dtype)
        check_batch_samples(data, cfg.global_batch_size)
        held_out = None
        if cfg.eval_data is not None:
            held_out = open_data(
                cfg.eval_data, cfg.seq_len, adapter.vocab_size, cfg.seed, data_dtype=cfg.data_dtype, flag="--eval-data"
            )
            check_eval_samples(held_out, cfg.eval_batches, cfg.global_batch_size)
        if world > 1:  # what each node read from its own files, once the groups exist: a rank failing to
            # read them then ends its peers in a failed collective, not in a wait at the default group
            check_same_run(cfg, world, run_inputs(cfg, adapter, data, held_out))
        check_shared_out(cfg, topo)
        return _train(cfg, adapter, topo, specs, data, held_out)
    finally:
        if not cfg.progress:
            progress.set_quiet(was_quiet)
        if world == 1:
            set_topology(None)


# what may differ between the ranks of one job: where each node reads and writes (another mount
# point), the progress bar, the testing aid; everything else is the run itself
_PER_NODE_SETTINGS = ("out", "data", "eval_data", "resume", "resume_folder", "progress", "fault")
_PER_NODE_MODEL_ARGS = ("model_dir", "tokenizer_dir")


# what each rank read from its node's files, compared beside the settings (:func:`run_inputs`)
_INPUT_NAMES = {"data": "data fingerprint", "eval": "evaluation data fingerprint", "checkpoint": "model checkpoint"}
_INPUT_NAMES["resume"] = "resume state"


def run_inputs(cfg: TrainConfig, adapter: ModelAdapter, data: Any, held_out: Any = None) -> dict[str, Any]:
    """What this rank read from its node's per-node paths, for :func:`check_same_run`: the data's
    fingerprint (the one a resume compares: sample count, sequence length, first, middle and last
    samples; the evaluation data's too), the model checkpoint's identity (``adapter.checkpoint_info()`` less its path: the
    config.json hash and REVISION of a model folder) and, with ``--resume``, the state's step and a
    hash of its meta.json (the run's history, settings and data fingerprint).  Nothing but those
    small files is read; the weights themselves are not compared."""
    import hashlib

    found = {"data": data.fingerprint()}
    if held_out is not None:
        found["eval"] = held_out.fingerprint()
    ckpt = {k: v for k, v in adapter.checkpoint_info().items() if k != "path"}
    if ckpt:
        found["checkpoint"] = ckpt
    if cfg.resume:
        folder = resolved_resume(cfg)
        with reading_step_folder(folder):
            with open(os.path.join(folder, "meta.json"), "rb") as f:
                sha = hashlib.sha256(f.read()).hexdigest()[:16]
            found["resume"] = {"step": read_meta(folder)["step"], "meta_sha256": sha}
    return {_INPUT_NAMES[k]: v for k, v in found.items()}


def run_settings(cfg: TrainConfig, inputs: dict[str, Any] | None = None) -> str:
    """The settings every rank of one job must share, as JSON (:func:`check_same_run`), with what
    it read from its node's files (:func:`run_inputs`) when given."""
    mine = {k: v for k, v in cfg.__dict__.items() if k not in _PER_NODE_SETTINGS}
    mine["model_args"] = {k: v for k, v in cfg.model_args.items() if k not in _PER_NODE_MODEL_ARGS}
    mine["dump_steps"] = [int(k) for _, k in cfg.dump_steps]
    mine |= inputs or {}
    return dumps_json(mine, indent=None, default=str)


_FAILED = "failed before the ranks connected"  # what a rank that failed before the default group sends there


def _tell_the_default_group(e: BaseException) -> None:
    """A rank that failed before the job's default group joins it and sends its error in place of its
    settings (:func:`check_same_run` raises it on every rank): the ranks waiting there waited until the
    --job-timeout (measured: 94 s, a node's --resume step folder removed after its launcher checked
    it), told that a node had another --nnodes.  Its worker runs this after recording the error: a
    peer that died before the group never arrives, and the wait then ends with the job."""
    join_default_group()
    gather_settings(dumps_json({_FAILED: f"{type(e).__name__}: {e}"}, indent=None))


def _agree(cfg: TrainConfig, world: int) -> None:
    """At the job's default group, before Fleet builds its sub-groups: the settings (files are read
    and compared after), then the heartbeat that says this rank connected."""
    check_same_run(cfg, world)
    beat(0, "setup")


def gather_settings(text: str) -> list[str]:
    """Every rank's ``text`` in rank order, over the job's default group (collective)."""
    out: list[str] = []
    dist.all_gather_object(out, text)
    return out


def check_same_run(cfg: TrainConfig, world_size: int, inputs: dict[str, Any] | None = None) -> None:
    """Refuse a job whose ranks were given different runs (collective; a no-op on one process).

    Every node of a multi-node job runs its own ``glm52 train`` and each worker reads its node's
    settings; nothing compared them, so a node given another ``--lr`` trained its shards with it
    while every node exited 0 (measured: two nodes at --tp 2, node 1 with --lr 2e-2: loss 4.365 at
    step 2 instead of 4.401, no message), and with a shared --out the nodes' run_config.json was one
    file, last writer wins.  Raised on every rank, naming the settings and the ranks that differ.

    ``inputs`` (:func:`run_inputs`): what each rank read from its node's --data, model folder and
    --resume, which may be other paths but must be the same files: nodes given different data files
    with the same settings trained silently on different samples (each data-parallel rank drew its
    rows from its own node's file).

    Without ``inputs`` it runs on the job's default group before Fleet builds any sub-group
    (``init_topology``'s ``agree``): ranks given different layouts (``--tp 2`` on one node, ``--tp
    1 --pp 2`` on the other) waited for each other there forever, both nodes silent.  With them,
    after the groups exist (run_training)."""
    if world_size == 1:
        return
    runs = gather_settings(run_settings(cfg, inputs))
    for r, text in enumerate(runs):
        if _FAILED in (failed := json.loads(text)):
            raise ValueError(f"rank {r} {_FAILED}: {failed[_FAILED]}")
    first = json.loads(runs[0])
    differ: dict[str, list[int]] = {}
    for r, text in enumerate(runs):
        other = json.loads(text)
        for k in sorted(set(first) | set(other)):
            if first.get(k) != other.get(k):
                differ.setdefault(k, []).append(r)
    if differ:
        what = "; ".join(
            f"{k}: {dumps_json(first.get(k), indent=None)} on rank 0, "
            + ", ".join(f"{dumps_json(json.loads(runs[r]).get(k), indent=None)} on rank {r}" for r in ranks)
            for k, ranks in differ.items()
        )
        files = [k for k in differ if k in _INPUT_NAMES.values()]
        moved = ""
        if (
            _INPUT_NAMES["resume"] in differ
            and cfg.resume
            and os.path.realpath(cfg.resume) != os.path.realpath(cfg.resume_folder or cfg.resume)
        ):  # each node's launcher followed the root's `latest` when it started: it moved in between
            moved = (
                f"; --resume {cfg.resume} is a checkpoint root whose `latest` each node followed when it started "
                "(another run saving there moves it): give every node the step folder itself"
            )
        raise ValueError(
            f"the ranks of this job were given different runs ({what}): run the same glm52 train command on every node"
            + (", each with copies of rank 0's files (--data, the model folder, --resume)" if files else "")
            + moved
        )


def check_shared_out(cfg: TrainConfig, topo: Any) -> None:
    """Refuse a run that saves checkpoints or exports unless every rank sees rank 0's ``--out``
    (collective; a no-op on one process or without ``--save-every`` / ``--export``): every rank
    writes its own files of a checkpoint and rank 0 then completes it (resume.py).  Measured
    before, two nodes with their own --out at --tp 2 --save-every 2 --export: both exited 0, node 0
    announcing ``checkpoints/step_00000004`` without rank 1's files (``--resume`` of it then
    refused: 'rank_00001.json: missing'), node 1 left with ``step_*.tmp`` folders of rank 1's."""
    if topo.world_size == 1 or not (cfg.save_every or cfg.export):
        return
    import uuid

    from ..checkpoint.distributed import all_gather_object

    logs = os.path.join(cfg.out, "logs")
    marker = None
    if topo.rank == 0:
        os.makedirs(logs, exist_ok=True)
        marker = os.path.join(logs, f".shared-out.{uuid.uuid4().hex}")
        with open(marker, "w", encoding="utf-8"):
            pass
    try:
        name = all_gather_object(os.path.basename(marker) if marker else None, topo)[0]
        seen = all_gather_object(os.path.exists(os.path.join(logs, name)), topo)
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                os.remove(marker)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        flags = [f for f, on in (("--save-every", cfg.save_every), ("--export", cfg.export)) if on]
        raise ValueError(
            f"{' and '.join(flags)} need{'s' if len(flags) == 1 else ''} one --out that every node sees (a shared filesystem): rank(s) {', '.join(map(str, blind))} "
            f"do not see the file rank 0 wrote into its --out (this rank's --out: {cfg.out}); each rank writes its own "
            "part of a checkpoint and export"
        )


def _load_initial_weights(cfg: TrainConfig, adapter: ModelAdapter, module: Any, topo: Any, spec: Any) -> None:
    """This rank's weights: straight from the checkpoint when the adapter can (``load_stage``: only
    this rank's slices are read), else sliced from the adapter's full state; what was read goes to
    ``OUT/logs/load/rank<N>.json`` (the per-rank evidence that no rank loaded more than its share).
    A resumed run reads nothing here: its checkpoint holds every state tensor (``load_resume_state``
    refuses one that lacks any), so the pretrained weights would only be overwritten."""
    t0 = time.perf_counter()
    if cfg.resume:
        info: dict[str, Any] = {"method": "resume", "resume": cfg.resume, "resume_folder": resolved_resume(cfg)}
    elif (loaded := adapter.load_stage(module, topo)) is not None:
        info = {"method": "load_stage", **loaded}
    else:
        shard_full_state(module, adapter.full_state(), topo)
        info = {"method": "full_state"}
    state = module.state_dict()
    record = {
        "rank": topo.rank,
        "stage": topo.stage,
        "layers": list(spec.layers),
        **{k: getattr(spec, k) for k in ("has_embedding", "has_head", "has_mtp")},
        "ranks": {g: topo.rank_in(g) for g in ("tp", "pp", "dp", "ep", "etp", "edp")},
        "state_tensors": len(state),  # parameters and persistent buffers (router correction bias)
        "state_elements": int(sum(math.prod(t.shape) for t in state.values())),
        "seconds": time.perf_counter() - t0,
        **info,
    }
    write_record(os.path.join(cfg.out, "logs", "load", f"rank{topo.rank}.json"), record)
    if topo.rank == 0 and "bytes_read" in info:
        print(
            f"[glm52 train] rank 0 loaded {record['state_elements']:,} local elements, read "
            f"{info['bytes_read']:,} checkpoint bytes in {record['seconds']:.2f} s",
            flush=True,
        )


@dataclass
class _Run:
    """One rank's training state, built by :func:`_setup` and advanced by :func:`_step`."""

    cfg: TrainConfig
    adapter: ModelAdapter
    topo: Any
    specs: list[Any]  # the pipeline chunks (one per stage, or pp x vpp)
    module: Any
    sync: GradSynchronizer
    opt: AdamW
    engine: SingleStageEngine | FleetPipeline
    memory: MemoryMonitor
    balancer: ExpertBalancer
    data: Any
    loss_specs: dict[str, LossSpec]
    report_keys: list[str]
    profile: dict[str, Any]  # loss.json's published layout keys
    layout: dict[str, Any]  # the profile plus the sharding degree, recorded in the resume state
    history: dict[str, list[float]]
    start: int  # steps already done (a resumed run's step)
    sched: Any
    loss_mult: float  # see _setup
    opt_bytes: list[int] = field(default_factory=list)  # optimizer-state bytes of every rank
    skipped: list[int] = field(default_factory=list)  # steps skipped for a non-finite loss / grad norm
    skipped_earlier: list[int] = field(default_factory=list)  # those skipped before the resume (loss.json only)
    last_checkpoint: str | None = None  # the newest resume state this run saved
    steps_done: int = 0  # steps finished (a resumed run's earlier ones included)
    steps_written: int = 0  # the steps loss.json holds (rank 0)
    indexer: dict[str, Any] | None = None  # the indexer's training (adapter.indexer_info()), or None
    stage_start: int = 0  # steps done before this indexer stage began (its lr schedule starts there)
    indexer_stages: list[dict[str, Any]] = field(default_factory=list)  # each stage's first and last step
    held_out: Any = None  # --eval-data's source, or None
    eval_record: dict[str, Any] | None = None  # meta.json "eval": the set history["eval"] was evaluated on

    @property
    def rank0(self) -> bool:
        return self.topo.rank == 0


def _build_stage(cfg: TrainConfig, adapter: ModelAdapter, topo: Any, spec: Any) -> Any:
    """This rank's stage module, seeded and created in the run's dtype, with its recompute mode."""
    paddle.seed(cfg.seed)
    np.random.seed(cfg.seed % (2**32))
    with default_dtype(cfg.dtype):
        module = adapter.build_stage(spec, topo)
    if hasattr(module, "recompute"):
        module.recompute = cfg.recompute
    elif cfg.recompute != "none":
        raise ValueError(f"--recompute {cfg.recompute}: the {cfg.model} stage module does not support recompute")
    return module


def _setup(
    cfg: TrainConfig, adapter: ModelAdapter, topo: Any, specs: list[Any], data: Any, held_out: Any = None
) -> _Run:
    """Stage module, pipeline engine, weights (initial or resumed), optimizer and schedule, for the
    run's ``data`` (opened by :func:`run_training`, which compares it across the ranks).

    With ``--pp`` > 1 the engine is Fleet's pipeline (1F1B, or interleaved with ``--vpp``) over
    this rank's chunks; it is built before the weights are loaded, because wrapping broadcasts
    the replicated parameters.  One stage runs on :class:`SingleStageEngine`."""
    spec = rank_spec(specs, topo.pc.pp, topo.stage)
    module = _build_stage(cfg, adapter, topo, spec)
    micro = cfg.global_batch_size // (topo.pc.replicas * cfg.micro_batch_size)
    engine = FleetPipeline(module, specs, topo, micro) if topo.pc.pp > 1 else SingleStageEngine(module)
    _load_initial_weights(cfg, adapter, module, topo, spec)
    sync = GradSynchronizer(module, topo, cfg.expert_update)
    sync.sync_shared_parameters()
    opt = AdamW(
        sync.params,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        topo=topo,
        clip_norm=cfg.clip_grad,
    )
    if cfg.steps > 0:  # (--steps 0 evaluates only: no optimizer state is allocated)
        opt.prepare_state()  # this rank's moments (and masters) now: the state bytes below are all of them
    if opt.sharding is not None:  # Fleet's sharding reduce onto each updater (stage 2: the others release)
        sync.use_sharding(opt.sharding, opt.grad_owners(), topo.pc.sharding_stage)
    memory = MemoryMonitor(module, topo)  # per-rank bytes held, for loss.json "memory"
    # the factor on every local loss that makes Fleet's gradient conventions give the global batch's
    # summed per-token gradient: its sync averages over the dp x sharding replicas (parallel/grads.py),
    # and inside its train_batch the step divides the gradients by the micro-batch count (delay_scale_loss)
    mult = float(loss_multiplier(topo) * (micro if isinstance(engine, FleetPipeline) and opt.hybrid is not None else 1))
    balancer = ExpertBalancer(
        module, topo, cfg.moe_bias_update_rate, cfg.moe_aux_loss_coeff, cfg.global_batch_size, loss_multiplier=mult
    )
    loss_specs = adapter.loss_specs()
    report_keys = sorted({s.report for s in loss_specs.values()} | {"losses", "mtp_losses"})
    profile = {k: getattr(topo.pc, k) for k in ("tp", "pp", "ep", "etp", "sp", "dp", "cp")} | {"world": topo.world_size}
    profile |= {k: getattr(cfg, k) for k in ("micro_batch_size", "global_batch_size", "seq_len", "dtype")}
    # plus what decides which tensors each rank holds beyond the degrees: the pipeline split (its
    # chunks, --pp-layout / --vpp), so a resume with another split reshards through flex/
    layout = {**profile, "sharding": topo.pc.sharding, "pp_layout": layout_string(specs)}
    history: dict[str, list[float]] = {k: [] for k in [*report_keys, "grad_norms", "lrs"]}
    indexer = adapter.indexer_info()
    stage = indexer["stage"] if indexer else None
    start, stage_start, stages, skipped_earlier = 0, 0, [], []
    held = None if held_out is None else eval_identity(cfg, held_out.fingerprint())  # the held-out set
    eval_record = held
    if cfg.resume:
        folder = resolved_resume(cfg)
        check_resume_run(cfg, folder, read_meta(folder), data.fingerprint(), eval_fingerprint=held and held["data"])
        meta = load_resume_state(folder, topo, module, opt, layout, indexer_stage=stage)
        start = int(meta["step"])
        skipped_earlier = [s for s in meta.get("skipped_steps", []) if s <= start]
        for k, v in meta.get("history", {}).items():  # an evaluation's record names its step
            history[k] = [r for r in v if r["step"] <= start] if k == "eval" else list(v)[:start]
        saved_eval = meta.get("eval")  # the set the saved records are of (a state saved before: unknown)
        if held is not None and saved_eval is not None and saved_eval != held:
            history.pop("eval", None)  # another set (--resume-override eval-data / eval-batches): not this one's
        elif held is None:
            eval_record = saved_eval  # no evaluation now: the saved records stay, and so does their set
        saved = meta.get("indexer") or {}
        kept = [st for st in saved.get("stages", []) if st["first_step"] <= start]  # each cut at the resumed step
        stages = [{**st, "last_step": min(st["last_step"], start)} for st in kept]
        # a new stage starts its own learning-rate schedule (train/indexer_stage.py)
        stage_start = lr_schedule_start(meta, stage)
    if not cfg.resume:  # a resume state's tensors (weights, moments, fp32 masters) are tested as they are
        # read, named by its rank file and what each is (load_resume_state)
        check_finite_state(module.state_dict(), cfg.model_args.get("model_dir") or f"the {cfg.model} init")
    min_lr = effective_min_lr(cfg.lr, cfg.min_lr)
    sched = make_lr_scheduler(cfg.lr, min_lr, cfg.warmup_steps, cfg.steps - stage_start)
    return _Run(
        cfg, adapter, topo, specs, module, sync, opt, engine, memory, balancer, data, loss_specs, report_keys,
        profile, layout, history, start, sched, mult, indexer=indexer, stage_start=stage_start, indexer_stages=stages,
        skipped_earlier=skipped_earlier, eval_record=eval_record,
    )  # fmt: skip


def _schedule_name(cfg: TrainConfig) -> str:
    return cfg.schedule if cfg.vpp == 1 else f"interleaved 1f1b (vpp {cfg.vpp})"


def _snapshot(run: _Run, steps_done: int) -> dict[str, Any]:
    """loss.json's content after ``steps_done`` steps."""
    from .. import __version__

    cfg = run.cfg
    out: dict[str, Any] = {k: run.history[k] for k in run.report_keys}
    pop_indexer_history(out)  # per-layer keys, of this run and of an earlier stage's history: the block below
    per_layer = pop_indexer_history(dict(run.history))
    if run.indexer is not None:
        block = indexer_report(per_layer, run.history.get("indexer_steps", []), run.indexer_stages, run.indexer)
        if block is not None:
            out["indexer"] = block
    out.update(
        steps=steps_done,
        profile=run.profile,
        weights_loaded=run.adapter.weights_loaded,
        checkpoint=run.adapter.checkpoint_info(),
        seed=cfg.seed,
        versions={
            "paddleformers_glm": __version__,
            "paddle": paddle.__version__,
            "paddle_commit": str(getattr(paddle.version, "commit", "")),
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        cpu_math=math_settings(),
        grad_norms=run.history["grad_norms"],
        **({"eval": run.history.get("eval", [])} if cfg.eval_data is not None else {}),
        lrs=run.history["lrs"],
        optimizer_state_bytes=run.opt_bytes,
        run={
            "model": cfg.model,
            "pp_layout": layout_string(run.specs),
            "schedule": _schedule_name(cfg),
            "pipeline_engine": run.engine.name,
            "step_engine": _step_engine(run),
            "data": run.data.describe,
            "resumed_from_step": run.start if cfg.resume else None,
            "resumed_from": cfg.resume_folder if cfg.resume else None,  # the step folder read, `latest` followed
            "tokens_per_step": cfg.global_batch_size * cfg.seq_len,
            "sharding": run.topo.pc.sharding,
            "sharding_stage": run.topo.pc.sharding_stage,
            "grad_clip": run.opt.clip_name,
            "recompute": cfg.recompute,
            "settings": recorded_settings(cfg),
            # ops Paddle runs through ops/cpu_bf16's fp32 route here (0: its own kernels, e.g. any GPU build)
            "cpu_bf16_ops": len(cpu_bf16.installed()),
        },
        skipped_steps=run.skipped_earlier + run.skipped,
    )
    out.update(run.balancer.report())
    return out


def _step_engine(run: _Run) -> str:
    """What runs a step: Fleet's ``train_batch`` (pipeline, optimizer wrapped by
    ``fleet.distributed_optimizer``); ``forward_backward_pipeline`` then the trainer's update (pipeline
    with expert layouts, whose clip is the trainer's); the trainer's own loop (one stage)."""
    if not isinstance(run.engine, FleetPipeline):
        return "trainer"
    return "train_batch" if run.opt.hybrid is not None else "forward_backward_pipeline"


def _step(run: _Run, step: int, log: Callable[[str], Any]) -> tuple[float, float]:
    """Update ``step`` (0-based): forward/backward over this replica's micro-batches, gradient sync,
    clip, AdamW; the step's losses are appended to the history. Returns (lr, grad norm).

    With Fleet's ``train_batch`` (:func:`_step_engine`) the same sync, clip and update run inside
    Fleet's step: the sync when every backward is done, the clip and update as the optimizer's
    ``step()`` (parallel/fleet_pipeline.py)."""
    cfg, topo = run.cfg, run.topo
    poison = _maybe_fault(cfg.fault, topo.rank, step + 1)
    dumps = [d for d, k in cfg.dump_steps if int(k) == step + 1]  # --dump-step: train/dump.py after this update
    beat(step + 1, "data")
    # explicit step: Paddle's closed form, a pure function of the step (counted from the indexer stage's start)
    run.sched.step(step + 1 - run.stage_start)
    lr = float(run.sched())
    batch = run.data.global_batch(step, cfg.global_batch_size)
    norms = _norms(run, batch["labels"])
    # each term's weight over its global normaliser, times the factor Fleet's gradient sync expects
    scales = {name: s.weight * run.loss_mult / max(norms[name], 1) for name, s in run.loss_specs.items()}
    if poison:  # --fault kind=nan: this rank's objective (not its reported loss sums) is NaN
        scales = {name: v * float("nan") for name, v in scales.items()}
    mbs = _micro_batch_tensors(run, batch)
    beat(step + 1, "forward")
    # ---- the step engine: sync -> norm -> clip -> update, inline or inside Fleet's train_batch
    done: dict[str, Any] = {}

    def sync() -> None:  # every backward done: gradients synced over replicas (fp32), has-gradient flags
        done["has_grad"] = run.sync.main_grads()[1]

    def update() -> None:
        beat(step + 1, "update")
        grads = run.sync.current_grads()  # as Fleet's train_batch step left them (delay_scale_loss)
        # a copy: the trainer's clip replaces the entries, Fleet's clips the tensors in place
        done["pre_clip"] = {n: g.clone() for n, g in grads.items()} if dumps else None
        # this rank's loss sums (last pipeline stage only; the trainer engine's floats or Fleet's ledger's
        # tensors) flag the norm non-finite on every rank when any rank's loss is (train/nonfinite.py)
        sums = [v[0] for v in done["totals"].values()] if "totals" in done else run.engine.ledger.sums.values()
        done["gnorm"] = run.sync.global_norm(grads, loss_flag(sums))
        done["skipped"] = not math.isfinite(done["gnorm"]) and _nonfinite_step(run, step + 1, done, grads, log)
        if done["skipped"]:
            return
        if not run.opt.clips_itself:
            clip_main_grads(grads, done["gnorm"], cfg.clip_grad)
        run.opt.step(grads, done["has_grad"], lr)
        run.memory.observe(grads, run.sync.before_reduce_bytes)  # before the release below

    with run.memory.track(step == run.start):
        if _step_engine(run) == "train_batch":
            opt = step_optimizer(run.opt.hybrid, update, run.sync.release)
            totals = run.engine.train_batch(mbs, scales, opt, sync)
        else:
            totals = done["totals"] = run.engine.run(mbs, scales)
            sync()
            update()
            run.sync.release()
    # ---- end of the step engine
    if not done["skipped"]:  # a skipped step moves nothing, the router biases included
        try:  # the router biases' update closes the step (before its dump); refused when non-finite
            run.balancer.after_step(step + 1)
        except NonFiniteStep as e:
            raise _stopped(run, e) from None
    else:  # and its routed tokens do not count towards the next step's update
        run.balancer.discard()
    if dumps:
        from .dump import dump_training_state

        for out_dir in dumps:
            dump_training_state(out_dir, run.module, run.opt, done["pre_clip"], topo, run.adapter)
    if not run.opt_bytes:
        run.opt_bytes = gather_json(int(run.opt.state_bytes()), topo.world_size)  # every rank's, in rank order
        log(f"[glm52 train] optimizer state bytes per rank: {run.opt_bytes}")
    _record_losses(run, totals, norms)
    run.history["grad_norms"].append(done["gnorm"])
    run.history["lrs"].append(lr)
    _record_indexer_stage(run, step + 1)
    beat(step + 1, "done")
    return lr, done["gnorm"]


def _micro_batch_tensors(run: _Run, batch: dict[str, np.ndarray]) -> list[dict[str, paddle.Tensor]]:
    """This replica's micro-batches of a global batch, as tensors (under context parallel each
    rank's zigzag slice, labels shifted over whole sequences)."""
    topo = run.topo
    replica = topo.dp_rank * topo.sharding_size + topo.sharding_rank
    mbs = list(micro_batches(batch, replica, topo.pc.replicas, run.cfg.micro_batch_size))
    if topo.cp_size > 1:
        shifts = [s.shift for s in run.loss_specs.values() if s.normalize == "tokens"]
        mbs = [split_micro_batch(mb, topo.cp_size, topo.cp_rank, shifts, max(shifts, default=1) - 1) for mb in mbs]
    return [{k: paddle.to_tensor(v) for k, v in mb.items()} for mb in mbs]


def _norms(run: _Run, labels: np.ndarray) -> dict[str, int]:
    """Each loss term's global normaliser for a global batch of ``labels``: its counted tokens, or
    the batch's micro-batch count."""
    n_micro_global = run.cfg.global_batch_size // run.cfg.micro_batch_size
    return {
        name: (token_count(labels, s.shift) if s.normalize == "tokens" else n_micro_global)
        for name, s in run.loss_specs.items()
    }


def _evaluate(run: _Run, step: int, log: Callable[[str], Any]) -> None:
    """The held-out loss after update ``step`` (1-based; 0: of the loaded weights), collectively:
    the first ``--eval-batches`` global batches of ``--eval-data`` in file order (the same rows at
    every evaluation and in every layout), forward only, in evaluation mode and without gradient, so
    no training state moves (the routers count no load, the indexer records nothing, nothing is
    backpropagated); each token term (LM, MTP) summed over every batch's tokens and divided by their
    count, as a step's loss is. A non-finite one is logged as a warning (loss.json: null)."""
    beat(step, "eval")
    cfg = run.cfg
    tokens = {n for n, s in run.loss_specs.items() if s.normalize == "tokens"}
    scales = {name: 0.0 for name in run.loss_specs}  # the ledger's terms; nothing is backpropagated
    sums: dict[str, list[float]] = {}
    norms = dict.fromkeys(run.loss_specs, 0)
    for b in range(cfg.eval_batches):
        batch = run.held_out.batch_in_order(b, cfg.global_batch_size)
        for name, (s, c) in run.engine.evaluate(_micro_batch_tensors(run, batch), scales).items():
            acc = sums.setdefault(name, [0.0, 0])
            acc[0], acc[1] = acc[0] + s, acc[1] + c
        for name, n in _norms(run, batch["labels"]).items():
            norms[name] += n
    totals = {n: tuple(v) for n, v in sums.items() if n in tokens}
    values = _reduced_losses(run, totals, {n: norms[n] for n in tokens})
    record = {"step": step, "tokens": norms["lm"] if "lm" in norms else None, **values}
    run.history.setdefault("eval", []).append(record)
    shown = " | ".join(f"{k} {v:.6f}" for k, v in values.items())
    log(f"[glm52 train] eval after step {step}: {shown} over {record['tokens']} tokens")
    if not all(math.isfinite(v) for v in values.values()):
        log(f"[glm52 train] warning: non-finite held-out loss after step {step}")


def _nonfinite_step(
    run: _Run, step: int, done: dict[str, Any], grads: dict[str, Any], log: Callable[[str], Any]
) -> bool:
    """The global norm of ``step`` is not finite: gather where (every rank, collectively); skip
    the update (True) while ``--skip-nonfinite-steps`` allows, else raise :class:`NonFiniteStep`."""
    totals = done["totals"] if "totals" in done else run.engine.ledger.totals()
    sums = {name: float(v[0]) for name, v in totals.items()}
    order = [n for n, _ in run.sync.params]
    reports = gather_json(local_report(run.topo.rank, sums, grads, order), run.topo.world_size)
    record = nonfinite_record(step, done["gnorm"], reports)
    record["skipped_before"] = run.skipped_earlier + run.skipped
    record["last_checkpoint"] = run.last_checkpoint
    if len(run.skipped) < run.cfg.skip_nonfinite_steps:
        run.skipped.append(step)
        text = record["message"].split("; stopped before")[0]
        log(
            f"[glm52 train] warning: {text}; step skipped, no update "
            f"({len(run.skipped)} of --skip-nonfinite-steps {run.cfg.skip_nonfinite_steps})"
        )
        return True
    if run.skipped:
        record["message"] += f"; {len(run.skipped)} earlier step(s) skipped: {run.skipped}"
    record["message"] += f"; last checkpoint: {run.last_checkpoint or 'none saved'}"
    raise NonFiniteStep(record)


def _stopped(run: _Run, e: NonFiniteStep) -> NonFiniteStep:
    """``e`` (a non-finite router bias, resume state or export: nothing of it written) with this run's
    last checkpoint, as failure.json names it for a non-finite step."""
    record = {**e.record, "skipped_before": run.skipped_earlier + run.skipped, "last_checkpoint": run.last_checkpoint}
    record["message"] = f"{record['message']}; last checkpoint: {run.last_checkpoint or 'none saved'}"
    return NonFiniteStep(record)


def _overflow_hint(cfg: TrainConfig) -> str:
    """What made weights non-finite although every update's loss and gradient norm were finite."""
    return (
        f" (every update's loss and gradient norm were finite: an update overflowed float32; --lr {cfg.lr:g}, "
        f"--weight-decay {cfg.weight_decay:g})"
    )


def _record_losses(run: _Run, totals: dict[str, tuple[float, int]], norms: dict[str, int]) -> None:
    """Append the step's reported losses (:func:`_reduced_losses`) to the history."""
    for key, value in _reduced_losses(run, totals, norms).items():
        run.history[key].append(value)


def _reduced_losses(run: _Run, totals: dict[str, tuple[float, int]], norms: dict[str, int]) -> dict[str, float]:
    """Sum each loss term of ``norms`` over pipeline stages and data replicas, check the token
    counts against the labels; -> each reported loss (normalised, terms of one key averaged)."""
    topo, loss_specs = run.topo, run.loss_specs
    names = sorted(norms)
    pairs = [totals.get(n, (0.0, 0)) for n in names]
    vec = paddle.to_tensor(np.array([s for s, _ in pairs] + [c for _, c in pairs], dtype=np.float64))
    # summed over pipeline stages, data replicas and context-parallel ranks (each counted its own tokens)
    for group in (topo.pp_group, topo.dp_group, topo.sharding_group, topo.cp_group):
        vec = comm.all_reduce(vec, group)
    vals = vec.numpy().tolist()
    sums, counts = dict(zip(names, vals[: len(names)])), dict(zip(names, vals[len(names) :]))
    for n in names:
        s = loss_specs[n]
        if s.normalize == "tokens" and int(round(counts[n])) != norms[n]:
            raise RuntimeError(
                f"loss term {n!r}: the model counted {int(counts[n])} tokens, labels shifted by {s.shift} give {norms[n]}; "
                "fix the model's count or the LossSpec shift"
            )
    out = {}
    for key in run.report_keys:
        terms = [n for n in names if loss_specs[n].report == key]
        if terms:
            out[key] = sum(sums[n] / max(norms[n], 1) for n in terms) / len(terms)
    return out


def _record_indexer_stage(run: _Run, step: int) -> None:
    """The indexer stage of update ``step`` (1-based): the steps that trained the indexer and each
    stage's first and last step."""
    if run.indexer is None:
        return
    stage = run.indexer["stage"]
    if stage != "none":
        run.history.setdefault("indexer_steps", []).append(step)
    last = run.indexer_stages[-1] if run.indexer_stages else {}
    if last.get("stage") == stage and last.get("last_step") == step - 1:
        last["last_step"] = step
    else:
        run.indexer_stages.append({"stage": stage, "first_step": step, "last_step": step})


def _step_line(run: _Run, step: int, lr: float, gnorm: float, dt: float) -> str:
    """The rank-0 log line of one step."""
    cfg, history = run.cfg, run.history
    parts = [f"step {step + 1}/{cfg.steps}", f"loss {history['losses'][-1]:.6f}"]
    if history["mtp_losses"] and len(history["mtp_losses"]) == len(history["losses"]):
        parts.append(f"mtp {history['mtp_losses'][-1]:.6f}")
    recalls = [v[-1] for k, v in history.items() if k.startswith("indexer_recall@") and v]
    if run.indexer is not None and run.indexer["stage"] != "none" and recalls:
        parts.append(f"indexer kl {history['indexer_losses'][-1]:.5f} recall {sum(recalls) / len(recalls):.4f}")
    tok_s = cfg.global_batch_size * cfg.seq_len / dt
    parts += [f"lr {lr:.3e}", f"grad norm {gnorm:.4f}", f"{tok_s:.0f} tok/s", f"{dt:.2f} s"]
    return " | ".join(parts)


def _finish(run: _Run, log: Callable[[str], Any]) -> dict[str, Any] | None:
    """Final loss.json with the gathered memory report, the optional export, a last barrier."""
    cfg, topo = run.cfg, run.topo
    memory_report = run.memory.gather(run.opt)  # collective
    result = {**_snapshot(run, cfg.steps), "memory": memory_report} if run.rank0 else None
    if result is not None:
        write_record(os.path.join(cfg.out, "loss.json"), result)
    if cfg.export:  # collective: GLM's ranks each write the tensors they own (checkpoint/distributed.py)
        try:  # every rank's weights, tested where they live before any is written
            check_written_state(
                run.module.state_dict(), topo.rank, topo.world_size, cfg.steps, "export", _overflow_hint(cfg)
            )
        except NonFiniteStep as e:
            raise _stopped(run, e) from None
        n_exported = run.adapter.export_trained(run.module, topo, os.path.join(cfg.out, "export"), cfg.export_dtype)
        log(f"[glm52 train] exported {n_exported} tensors to {os.path.join(cfg.out, 'export')}")
    if topo.world_size > 1:
        dist.barrier()
    return result


def _train(
    cfg: TrainConfig, adapter: ModelAdapter, topo, specs, data: Any, held_out: Any = None
) -> dict[str, Any] | None:
    """Setup, the steps (each logged and written to loss.json by rank 0, an evaluation after every
    ``--eval-every`` steps and the last, resume state every ``--save-every`` steps), then finish."""
    beat(0, "setup")
    run = _setup(cfg, adapter, topo, specs, data, held_out)
    run.held_out = held_out
    bar = None
    if run.rank0 and cfg.progress and progress.on_terminal(sys.stderr):  # a piped log gets the step lines only
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=run.start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    log = (bar.write if bar is not None else print) if run.rank0 else (lambda *_: None)
    log(  # a no-op off rank 0
        f"[glm52 train] {topo.describe()} layout {layout_string(specs)} schedule {_schedule_name(cfg)} data {run.data.describe}"
    )
    at_start = cfg.eval_at_start or run.start == cfg.steps  # no step to run (--steps 0): evaluate the weights
    if held_out is not None and at_start and run.start not in [r["step"] for r in run.history.get("eval", [])]:
        _evaluate(run, run.start, log)  # (a resumed run's state saved after that step's evaluation has it)
    loss_json = os.path.join(cfg.out, "loss.json")
    run.steps_done = run.steps_written = run.start
    try:
        _run_steps(run, held_out, bar, log, loss_json)
    finally:  # a run stopped or failed between rewrites: loss.json holds every step it finished
        if run.rank0 and run.steps_done != run.steps_written:
            write_record(loss_json, _snapshot(run, run.steps_done))
    if bar is not None:
        bar.close()
    beat(cfg.steps, "finish")
    return _finish(run, log)


# loss.json holds the whole history (every step's losses and per-layer expert loads), so a rewrite
# after every step costs O(steps) each: rewritten after the first step, then at most this often, and
# at every checkpoint, every evaluation, a non-finite loss and the last step (docs/parallel.md)
LOSS_JSON_SECONDS = 10.0


def _run_steps(run: _Run, held_out: Any, bar: Any, log: Callable[[str], Any], loss_json: str) -> None:
    """The steps: each logged by rank 0, loss.json rewritten as :data:`LOSS_JSON_SECONDS` says, an
    evaluation after every ``--eval-every`` steps and the last, resume state every ``--save-every`` and
    after the last (the oldest beyond ``--save-total-limit`` then deleted by rank 0 in the background:
    resume.prune_saves)."""
    cfg, topo = run.cfg, run.topo
    try:
        written = -math.inf  # the first step is written: a rank that dies without cleanup leaves it
        for step in range(run.start, cfg.steps):
            t0 = time.perf_counter()
            lr, gnorm = _step(run, step, log)
            dt = time.perf_counter() - t0
            run.steps_done = step + 1
            evaluates = held_out is not None and (
                (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps
            )
            # every --save-every steps and after the last (its state is the run's result: a run extended
            # with --resume-override steps continues from it, as Megatron-LM and HF Trainer save at the end)
            saves = bool(cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps))
            if run.rank0:
                log(_step_line(run, step, lr, gnorm, dt))
                finite = math.isfinite(run.history["losses"][-1])
                if not finite:
                    log("[glm52 train] warning: non-finite loss")
                due = time.monotonic() - written >= LOSS_JSON_SECONDS or step + 1 == cfg.steps or saves or not finite
                if due and not evaluates:
                    write_record(loss_json, _snapshot(run, step + 1))
                    written, run.steps_written = time.monotonic(), step + 1
            if evaluates:
                _evaluate(run, step + 1, log)
                if run.rank0:
                    write_record(loss_json, _snapshot(run, step + 1))
                    written, run.steps_written = time.monotonic(), step + 1
            if bar is not None:
                bar.update(1)
            if saves:
                meta = {"profile": run.layout, "history": run.history, "seed": cfg.seed, "config": asdict(cfg)}
                meta["data"] = run.data.fingerprint()  # a resume's data must be these samples (check_resume_run)
                if run.eval_record is not None:  # and its held-out set this one, when both evaluate
                    meta["eval"] = run.eval_record
                meta["skipped_steps"] = run.skipped_earlier + run.skipped
                # a resume's indexer stage: where it began, the stages so far
                stage = None if run.indexer is None else run.indexer["stage"]
                meta["indexer"] = stage and {
                    "stage": stage,
                    "stage_start": run.stage_start,
                    "stages": run.indexer_stages,
                }
                beat(step + 1, "save")
                try:  # refused, on every rank, when a tensor of it holds NaN/Inf (failure.json: the last good one)
                    path = save_resume_state(
                        os.path.join(cfg.out, "checkpoints"), step + 1, topo, run.module, run.opt, meta
                    )
                except NonFiniteStep as e:
                    e.record["message"] += _overflow_hint(cfg)
                    raise _stopped(run, e) from None
                run.last_checkpoint = path
                log(f"[glm52 train] checkpoint {path}")
                if run.rank0 and cfg.save_total_limit:  # the others delete nothing
                    for name in prune_saves(os.path.dirname(path), cfg.save_total_limit, log):
                        log(f"[glm52 train] deleting checkpoint {name} (--save-total-limit {cfg.save_total_limit})")
    finally:  # the deletes of --save-total-limit end with the run (a failing one waits 60 s at most)
        finish_pruning(None if sys.exc_info()[0] is None else 60.0)
