"""A training run's settings (:class:`TrainConfig`) and every check of them that needs no Paddle: the
numbers, the choices, the layout against the model's sizes, the batch split, the pipeline split, the
indexer training and a resume's settings (:func:`check_run`).  ``glm52 train`` runs them before it starts
any process (one line and exit 2 for a bad setting, no Paddle loaded), every rank runs them again, ``glm52
plan`` runs them on the layouts it plans, and the torch reference run (parity/reference/train.py) checks
its flags with :func:`check_numbers` and :func:`indexer_stage_weight`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import TYPE_CHECKING, Any

from ..modeling.indexer_stages import INDEXER_STAGES, check_coeff_stage, check_warmup_flags
from ..parallel.pipeline import rank_spec, run_stages, validate_shared_layer_starts
from ..parallel.topology import EXPERT_UPDATES, RECOMPUTE_MODES, ParallelConfig, ParallelConfigError, check_seq_len
from .data import BIN_DTYPES
from .state_files import model_differences, model_identity, read_meta, resolve_resume_state

# The values each setting may take.  ``glm52 train``'s argparse choices (train/command.py, which must
# not import this module: it loads Paddle) spell them again; tests/test_cli.py holds the two equal.
SETTING_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("float32", "bfloat16"),
    "recompute": RECOMPUTE_MODES,
    "expert_update": EXPERT_UPDATES,
    "indexer_stage": INDEXER_STAGES,
    "data_dtype": ("auto", *BIN_DTYPES),
    "export_dtype": ("trained", "auto", "float32", "bfloat16"),
}

if TYPE_CHECKING:
    from .adapter import ModelAdapter

__all__ = [
    "RECORDED_SETTINGS",
    "SETTING_CHOICES",
    "RESUME_SETTINGS",
    "TrainConfig",
    "check_choices",
    "check_numbers",
    "check_resume_model",
    "check_resume_run",
    "effective_min_lr",
    "check_run",
    "eval_identity",
    "lr_schedule_start",
    "warmup_warning",
    "indexer_stage_weight",
    "recorded_settings",
    "parallel_config",
    "pipeline_chunks",
    "resolved_resume",
    "resumed_indexer_stage",
    "run_world",
]

# counts and their least value (--micro-batch-size before --global-batch-size: glm52 plan derives an unset
# global batch from it, so a micro-batch of 0 is named, not the global batch of 0 it makes)
_COUNTS = {"steps": 0, "seq_len": 1, "micro_batch_size": 1, "global_batch_size": 1, "vpp": 1}
_COUNTS.update(save_every=0, save_total_limit=0, skip_nonfinite_steps=0, eval_every=0, eval_batches=1, warmup_steps=0)
# float settings that must be finite numbers and >= 0 (None allowed for min_lr and indexer_loss_coeff)
_NONNEGATIVE_FLOATS = (
    "lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "moe_bias_update_rate", "moe_aux_loss_coeff",
    "indexer_loss_coeff",
)  # fmt: skip
# every float setting reaches the update as float32 (the learning rate, the router-bias step, Adam's
# numbers): a value finite as a Python float but at or above this bound (float32's largest finite value,
# 3.4028235e38, plus half its last unit: what rounds to infinity) is infinite there, and wrote NaN/Inf
# weights and router biases with exit 0 (``--lr 1e39``, ``--moe-bias-update-rate 1e39``)
FP32_MAX = 3.4028234663852886e38
_FP32_OVERFLOW = 2.0**128 - 2.0**103


def check_numbers(settings: Any) -> None:
    """The counts and the float settings among ``settings``' attributes (a TrainConfig, or the reference
    run's flags, a subset): finite, since ``--lr nan`` would train on NaN, and finite in float32 (below
    :data:`FP32_MAX` rounded), since the update computes in float32 (``--lr 1e39`` is infinite there)."""
    for k, lo in _COUNTS.items():
        if hasattr(settings, k) and int(getattr(settings, k)) < lo:
            raise ValueError(f"--{k.replace('_', '-')} must be >= {lo}, got {getattr(settings, k)}")
    if hasattr(settings, "seq_len") and int(settings.seq_len) == 1:
        # after the counts (--seq-len 0 keeps their words): a sample's targets are its tokens shifted by one,
        # so data.py refuses one token, but in its own words ("seq_len must be >= 2") and only at the inputs
        raise ValueError("--seq-len must be >= 2 (a sample's targets are its tokens shifted by one), got 1")
    seed = getattr(settings, "seed", None)
    if hasattr(settings, "seed") and not (
        isinstance(seed, Integral) and not isinstance(seed, bool) and 0 <= seed < 2**64
    ):
        # the data order's numpy.random.default_rng([seed, epoch]) and paddle.seed take no other
        raise ValueError(f"--seed must be an integer in [0, 2**64), got {seed!r}")
    for k in (*_NONNEGATIVE_FLOATS, "adam_beta1", "adam_beta2"):
        v = getattr(settings, k, None)
        if v is None and (k in ("min_lr", "indexer_loss_coeff") or not hasattr(settings, k)):
            continue
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{flag} must be a finite number, got {v!r}")
        if abs(v) >= _FP32_OVERFLOW:  # (an int too: the update takes it as float32)
            raise ValueError(
                f"{flag} must be finite in float32, the precision of the update (|value| <= {FP32_MAX:.8g}), got {v!r}"
            )
        if k in _NONNEGATIVE_FLOATS and v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
        if k.startswith("adam_beta") and not 0 <= v < 1:
            raise ValueError(f"{flag} must be in [0, 1), got {v}")
    lr, min_lr = getattr(settings, "lr", None), getattr(settings, "min_lr", None)
    if lr is not None and min_lr is not None and min_lr > lr:
        # the cosine decays from --lr to --min-lr: a floor above it would raise the rate to the floor
        raise ValueError(
            f"--min-lr {min_lr} is above --lr {lr}: the schedule decays from --lr to --min-lr (equal: a constant rate)"
        )


def indexer_stage_weight(stage: str | None, loss_coeff: float | None, saved_coeff: float) -> tuple[str, float]:
    """(stage, weight of the indexer KL in the objective) from ``--indexer-stage`` / ``--indexer-loss-coeff``
    and the checkpoint's ``indexer_loss_coeff`` (docs/indexer.md): by default the sparse stage when that is
    > 0, else none; the warm-up's weight is 1, the sparse stage's the flag's (default the checkpoint's)."""
    stage = stage or ("sparse" if saved_coeff > 0 else "none")
    weights = {"none": 0.0, "warmup": 1.0, "sparse": saved_coeff if loss_coeff is None else float(loss_coeff)}
    if stage not in weights:
        raise ValueError(f"--indexer-stage must be one of {', '.join(weights)}, got {stage!r}")
    check_coeff_stage(stage, loss_coeff, "--indexer-loss-coeff", f"--indexer-stage {stage}")
    if stage == "sparse" and not weights[stage] > 0:
        raise ValueError(
            "--indexer-stage sparse needs --indexer-loss-coeff > 0 (the checkpoint's indexer_loss_coeff is "
            f"{saved_coeff:g}; PaddleFleet's default is 0.01, the GLM-5 recipe of Megatron-Bridge 0.001)"
        )
    return stage, weights[stage]


@dataclass
class TrainConfig:
    """Everything a run needs; serialisable (the launcher hands it to the workers as JSON)."""

    model: str  # adapter kind (train/adapter.py): "glm" (model_args {"model_dir"}) or "toy" (test stand-in)
    model_args: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (Fleet's interleaved schedule)
    dp: int | None = None  # None: world / (tp * pp * sharding)
    sharding: int = 1  # Fleet's sharding_degree: data replicas splitting the optimizer state
    sharding_stage: int = 1  # 2: gradients sharded too (each kept only on the sharding rank that updates it)
    recompute: str = "none"  # none | full (each decoder layer) | core (attention core + indexer)
    cp: int = 1  # context parallel (parallel/context.py): each cp rank holds a zigzag slice of every sequence
    ep: int = 1
    etp: int = 1
    sp: bool = False
    pp_layout: str | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    schedule: str = "1f1b"
    steps: int = 5
    seq_len: int = 32
    global_batch_size: int = 4
    micro_batch_size: int = 1
    lr: float = 3e-4
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    data: str | None = None
    data_dtype: str = "auto"
    # held-out evaluation (train/loop.py, _evaluate): the first eval_batches global batches of eval_data,
    # after every eval_every steps (0: after the last step only), and before the first with eval_at_start
    eval_data: str | None = None
    eval_every: int = 0
    eval_batches: int = 1
    eval_at_start: bool = False
    out: str = "out"
    export: bool = False
    export_dtype: str = "trained"  # --export's dtype: trained (--dtype), auto (the checkpoint's), or a name
    save_every: int = 0
    save_total_limit: int = 0  # checkpoints/step_* folders kept (0: all); may change on a resume
    resume: str | None = None
    # the step folder `resume` resolved to, once, by the process that started the run (resolved_resume):
    # what every later check and every worker reads, so that all of them read one step
    resume_folder: str | None = None
    resume_override: list = field(default_factory=list)  # RESUME_SETTINGS a resume may change
    dtype: str = "float32"
    progress: bool = True
    moe_bias_update_rate: float = 0.0  # expert-bias update per step (0: frozen; train/moe_balance.py)
    moe_aux_loss_coeff: float = 0.0  # sequence-wise balance loss weight (0: off)
    expert_update: str = "fused"  # fused: every expert of a layer that routed a token | routed-only (grads.py)
    skip_nonfinite_steps: int = 0  # steps with a non-finite loss / grad norm skipped before the run stops
    # the DSA indexer's training (train/indexer_stage.py): none | warmup | sparse (None: the checkpoint's
    # default), the sparse stage's KL weight (None: the checkpoint's indexer_loss_coeff), shared-layer targets
    indexer_stage: str | None = None
    indexer_loss_coeff: float | None = None
    indexer_shared_supervision: bool = False
    fault: str | None = None  # testing aid: "rank=1,step=2,kind=raise|kill|exit|hang|stop|nan"
    dump_steps: list = field(default_factory=list)  # [(DIR, K)]: train/dump.py after update K

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"TrainConfig: unknown keys {sorted(unknown)}")
        return cls(**d)

    def validate(self) -> None:
        check_numbers(self)
        check_choices(self, SETTING_CHOICES)
        if self.export_dtype != "trained" and not self.export:
            raise ValueError(
                f"--export-dtype {self.export_dtype} sets the dtype of --export, which this run does not ask for"
            )
        if self.save_total_limit and not self.save_every:
            raise ValueError(
                f"--save-total-limit {self.save_total_limit} keeps the newest checkpoints of --save-every, which "
                "this run does not ask for (give --save-every K, or leave --save-total-limit out)"
            )
        if self.model == "toy" and self.export_dtype not in ("trained", "float32"):
            raise ValueError(
                f"--export-dtype {self.export_dtype}: --model toy exports its own float32 format (a checkpoint's "
                "release dtype applies to --model DIR)"
            )
        if self.schedule != "1f1b":
            raise ValueError(
                f"--schedule must be 1f1b (Fleet's pipeline engine; --vpp N interleaves it), got {self.schedule!r}"
            )
        check_vpp(self)
        if self.steps == 0 and self.eval_data is None:
            raise ValueError("--steps 0 trains nothing: it evaluates --eval-data only (give it, or --steps >= 1)")
        if self.eval_data is None and (self.eval_every or self.eval_batches != 1 or self.eval_at_start):
            flag = (
                "--eval-every" if self.eval_every else "--eval-batches" if self.eval_batches != 1 else "--eval-at-start"
            )
            raise ValueError(f"{flag} needs --eval-data (the held-out tokens to evaluate on)")


def check_vpp(cfg: Any) -> None:
    """``--vpp`` interleaves pipeline stages, so it needs some (the trainer's settings and the planner's layout)."""
    if cfg.vpp > 1 and cfg.pp < 2:
        raise ValueError(f"--vpp {cfg.vpp} interleaves pipeline stages: it needs --pp >= 2, got --pp {cfg.pp}")


def pipeline_chunks(cfg: Any, pp: int, num_layers: int, has_mtp: bool) -> list[Any]:
    """The pipeline chunks of a run: one per stage, or with ``--vpp N`` pp x N chunks (``--pp-layout``
    and the first / last stage sizes then describe chunks), chunk c on rank c % pp (``rank_spec``).
    ``cfg``: a TrainConfig, or the planner's Layout."""
    try:
        return run_stages(cfg, num_layers, pp * cfg.vpp, has_mtp)
    except ParallelConfigError as e:
        if cfg.vpp == 1:
            raise
        raise ParallelConfigError(
            f"{e} (with --vpp {cfg.vpp} the layout lists --pp {pp} x --vpp {cfg.vpp} chunks)"
        ) from e


def check_choices(settings: Any, choices: dict[str, tuple]) -> None:
    """Each setting named in ``choices`` is one of its values (``indexer_stage`` None: the checkpoint's
    stage); the trainer's settings and the planner's layout."""
    for k, allowed in choices.items():
        v = getattr(settings, k)
        if v not in allowed and not (k == "indexer_stage" and v is None):
            raise ValueError(f"--{k.replace('_', '-')} must be one of {', '.join(map(str, allowed))}, got {v!r}")


def run_world(cfg: TrainConfig) -> int:
    """The processes ``glm52 train`` launches for ``cfg`` (``--dp`` unset: 1 replica); ``glm52 plan``
    checks its layout at this world size too."""
    return cfg.tp * cfg.pp * (cfg.dp or 1) * cfg.sharding * cfg.cp


def parallel_config(cfg: TrainConfig, world: int) -> ParallelConfig:
    """The layout of this run (``dp`` derived from the world size when not given)."""
    return ParallelConfig.from_world(world, **{f.name: getattr(cfg, f.name) for f in fields(ParallelConfig)})


def check_batch(cfg: Any, pc: ParallelConfig) -> None:
    """The global batch splits evenly over the dp x sharding replicas and their micro-batches;
    an interleaved pipeline gets ``pp`` or at least ``2 pp`` micro-batches per replica (Fleet's
    F-then-B and 1F1B interleaved engines).  ``cfg``: a TrainConfig, or the planner's Layout."""
    if cfg.global_batch_size % (pc.replicas * cfg.micro_batch_size):
        raise ParallelConfigError(
            f"--global-batch-size {cfg.global_batch_size} must be divisible by dp {pc.dp} x sharding {pc.sharding} "
            f"x --micro-batch-size {cfg.micro_batch_size}"
        )
    check_seq_len(cfg.seq_len, pc.cp)
    local = cfg.seq_len // pc.cp  # the tokens of a sequence one cp rank holds
    if pc.sp and local % pc.tp:  # Fleet's sequence-parallel ops cut equal slices (they refuse any other)
        held = f" / cp {pc.cp} = {local} tokens per cp rank" if pc.cp > 1 else ""
        raise ParallelConfigError(
            f"--seq-len {cfg.seq_len}{held} must be divisible by tp {pc.tp} under --sp (each tp rank holds an equal "
            "slice of the sequence); change --seq-len or drop --sp"
        )
    micro = cfg.global_batch_size // (pc.replicas * cfg.micro_batch_size)
    if cfg.vpp > 1 and not (micro == pc.pp or micro >= 2 * pc.pp):
        raise ParallelConfigError(
            f"--vpp {cfg.vpp}: each replica runs {micro} micro-batches per step; Fleet's interleaved schedules "
            f"need exactly --pp {pc.pp} or at least 2 x --pp = {2 * pc.pp}; change --global-batch-size or "
            "--micro-batch-size"
        )


def check_warmup_sharding(chunks: list[Any], pc: ParallelConfig, trains: list[int], num_layers: int) -> None:
    """The indexer's warm-up trains the indexers of layers ``trains`` only (MTP layers numbered from
    ``num_layers``), so a pipeline rank whose ``chunks`` hold none of them trains nothing; Fleet's
    sharding optimizer cannot be built over no parameter (DygraphShardingOptimizer reads its first),
    so under ``--sharding`` every pipeline rank needs one.  (Trainer and planner.)"""
    if pc.sharding == 1:
        return
    for stage in range(pc.pp):
        rs = rank_spec(chunks, pc.pp, stage)
        held = set(rs.layers) | ({i for i in trains if i >= num_layers} if rs.has_mtp else set())
        if not held & set(trains):
            raise ParallelConfigError(
                f"--indexer-stage warmup with --sharding {pc.sharding}: pipeline stage {stage} (layers "
                f"{list(rs.layers)}) holds no layer with its own indexer, so it trains nothing, and Fleet's "
                f"sharding optimizer needs a parameter on every rank; give every stage one of the layers "
                f"{sorted(trains)} (--pp-layout) or drop --sharding"
            )


def check_run(cfg: TrainConfig, adapter: ModelAdapter, world: int) -> tuple[ParallelConfig, list[Any]]:
    """Every check of a run's settings against its model and world size, with nothing built or
    started: the settings themselves (``TrainConfig.validate``), the layout and the model sizes it
    must divide, the batch split, context parallel, the pipeline split (a stage may open on a shared
    layer only because the top-k travels in the carry) and the indexer training (handed to the
    adapter here).  ``glm52 train`` runs it before launching any process, so a bad setting costs one
    line and exit 2; every rank runs it again (a run may start without the command, e.g.
    ``run_training`` from Python); ``glm52 plan`` runs it on the layout it plans (plan.check_layout),
    so the two refuse the same runs with the same words.  Returns the layout and the pipeline chunks."""
    cfg.validate()
    try:
        pc = parallel_config(cfg, world)
        pc.validate(world, **adapter.parallel_sizes())
    except ParallelConfigError as e:
        if cfg.sharding > 1 and str(e).startswith("ep "):
            raise ParallelConfigError(
                f"{e}; --sharding {cfg.sharding} ranks are not part of the expert grid (each holds all of it)"
            ) from e
        raise
    adapter.check_layout(pc)
    check_batch(cfg, pc)
    if pc.cp > 1 and not adapter.supports_context_parallel:
        raise ValueError(f"--cp {pc.cp}: the {cfg.model} model does not support context parallel")
    if pc.cp > 1 and cfg.moe_aux_loss_coeff > 0:
        raise ValueError(
            "--cp with --moe-aux-loss-coeff > 0 is not supported (the sequence-wise loss needs whole sequences)"
        )
    specs = pipeline_chunks(cfg, pc.pp, adapter.num_layers, adapter.has_mtp)
    kinds = adapter.layer_kinds()
    if kinds is not None:
        validate_shared_layer_starts(specs, kinds, carry_topk=True)
    if cfg.resume:  # before the indexer training is set: an unset --indexer-stage takes the state's
        folder = resolved_resume(cfg)
        check_resume_run(cfg, folder, read_meta(folder))
    # --indexer-*: the warm-up freezes the backbone (no router-bias updates nor balance loss); shared-layer
    # supervision needs every chunk to start on a full layer (its target includes the shared layers after it)
    # and, when the MTP block reuses the main top-k, the last full layer on the MTP block's chunk
    adapter.set_indexer_training(cfg.indexer_stage, cfg.indexer_loss_coeff, cfg.indexer_shared_supervision)
    info = adapter.indexer_info() or {}
    check_warmup_flags(info.get("stage"), cfg.moe_bias_update_rate, cfg.moe_aux_loss_coeff)
    if info.get("stage") == "warmup":
        check_warmup_sharding(specs, pc, info.get("layers") or [], adapter.num_layers)
    if info.get("shared_supervision") and kinds is not None:
        # the MTP block joins the last full layer's target when it reuses the main model's top-k (its
        # own indexer then does not run: no MTP layer among the layers with their own indexer)
        mtp_reuses = adapter.has_mtp and "layers" in info and all(i < adapter.num_layers for i in info["layers"])
        unit = "virtual pipeline chunk" if cfg.vpp > 1 else "pipeline stage"
        try:
            validate_shared_layer_starts(specs, kinds, carry_topk=False, mtp_reuses_topk=mtp_reuses, unit=unit)
        except ParallelConfigError as e:
            raise ParallelConfigError(
                f"--indexer-shared-supervision: {e} (the shared layers{' and the MTP block' if mtp_reuses else ''} "
                f"that reuse a full layer's top-k must run on its {unit})"
            ) from e
    return pc, specs


def resolved_resume(cfg: Any) -> str:
    """The step folder of ``cfg.resume`` (a step folder, a checkpoint root's ``latest``, an output
    folder's ``checkpoints/``), resolved on the first call and kept in ``cfg.resume_folder``, which
    the launcher hands to its workers (run_config.json).  Resolved once: against a root another run
    is still saving into, ``latest`` moves on, and a launcher that checked one step while its ranks
    followed ``latest`` again resumed another (or one rank another than the next)."""
    folder = cfg.resume_folder
    if folder is None or not _resolved_from(folder, cfg.resume):  # not yet, or for another --resume
        cfg.resume_folder = resolve_resume_state(cfg.resume)
    return cfg.resume_folder


def _resolved_from(folder: str, resume: str) -> bool:
    """Whether the step folder ``folder`` is what ``resume`` resolves to: itself, or a step folder of
    the checkpoint root (or output folder) it names, as :func:`resolve_resume_state` follows them."""
    root = os.path.realpath(resume)
    roots = (root, os.path.realpath(os.path.join(root, "checkpoints")))  # an output folder's may be a link
    return os.path.realpath(os.path.dirname(folder)) in roots or (os.path.realpath(folder) == root)


# the run settings that decide how a resumed run continues (its lr schedule, optimizer, data order,
# loss terms): changed silently, the resumed run would not be the one it continues; ``--resume-override``
# names those changed on purpose (Megatron-LM likewise refuses a changed lr schedule unless overridden)
# the training settings a run records in loss.json (``run.settings``), so that a comparison of finished
# runs (``glm52 align --no-run``) can tell the runs it reads were made with the settings it states
RECORDED_SETTINGS = (
    "lr", "min_lr", "warmup_steps", "weight_decay", "clip_grad", "moe_bias_update_rate", "moe_aux_loss_coeff",
    "expert_update", "indexer_shared_supervision",
)  # fmt: skip


def effective_min_lr(lr: float, min_lr: float | None) -> float:
    """The cosine schedule's floor: ``--min-lr``, unset lr / 10."""
    return min_lr if min_lr is not None else lr / 10


def lr_schedule_start(meta: dict[str, Any] | None, stage: str | None) -> int:
    """The step the lr schedule of a run training indexer stage ``stage`` (None: no indexer) counts
    from (train/indexer_stage.py): 0, or for a run resuming the state of ``meta`` (its meta.json)
    the saved stage's start when it continues that stage, else the resumed step (a new stage starts
    its own schedule), as the trainer's set-up (loop._setup) takes it."""
    if meta is None:
        return 0
    saved = meta.get("indexer") or {}
    return int(saved.get("stage_start", 0)) if saved.get("stage", stage) == stage else int(meta["step"])


def warmup_warning(settings: Any, schedule_start: int = 0, first_step: int = 0) -> str | None:
    """The warning for a ``--warmup-steps`` at or above the steps the lr schedule spans (``--steps``
    less ``schedule_start``, :func:`lr_schedule_start`), naming both values and the lr the last
    step trains at (the warm-up's linear value: ``--lr`` x span / warm-up, the peak when they are
    equal), or None: the rate never decays to ``--min-lr``.  None too when the run trains no step
    (``first_step``: the resumed step) or has no warm-up."""
    warmup, steps = int(settings.warmup_steps), int(settings.steps)
    span = steps - schedule_start
    if warmup <= 0 or steps <= first_step or span < 1 or warmup < span:
        return None
    last = settings.lr * span / warmup
    floor = effective_min_lr(settings.lr, settings.min_lr)
    where = "the peak, --lr" if warmup == span else f"{span}/{warmup} of --lr {settings.lr:g}"
    stage = f" (this indexer stage's schedule starts at step {schedule_start}: {span} steps)" if schedule_start else ""
    return (
        f"[glm52 train] warning: --warmup-steps {warmup} >= --steps {steps}{stage}: the lr warms up to the end "
        f"and never decays to --min-lr {floor:g}; the last step trains at lr {last:.4g} ({where})"
    )


def recorded_settings(settings: Any) -> dict[str, Any]:
    """The :data:`RECORDED_SETTINGS` that ``settings`` (a TrainConfig or parsed arguments) holds, the
    lr floor as it takes effect (:func:`effective_min_lr`)."""
    out = {k: getattr(settings, k) for k in RECORDED_SETTINGS if hasattr(settings, k)}
    if "min_lr" in out and "lr" in out:
        out["min_lr"] = effective_min_lr(out["lr"], out["min_lr"])
    return out


RESUME_SETTINGS = (
    "steps", "lr", "min_lr", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
    "seed", "data", "moe_bias_update_rate", "moe_aux_loss_coeff", "expert_update", "indexer_loss_coeff",
    "indexer_shared_supervision", "model", "eval_data", "eval_batches",
)  # fmt: skip
# compared apart from the saved config: the data by fingerprint, the model by its config, the held-out set by
# meta.json "eval" (:func:`eval_identity`; a run without --eval-data on either side has no set to compare)
_EVAL_SET = ("eval_data", "eval_batches")
_RESUME_APART = ("data", "model", *_EVAL_SET)


def eval_identity(cfg: Any, fingerprint: str) -> dict[str, Any]:
    """What a resume state records of its run's held-out set (meta.json "eval"): the evaluation data's
    fingerprint (``TokenData.fingerprint``) and ``--eval-batches``, so that a resume evaluating
    another set is refused (its loss.json "eval" would mix the records of two sets, and
    ``--eval-at-start`` took the state's record of the other set as this step's evaluation)."""
    return {"data": fingerprint, "batches": int(cfg.eval_batches)}


# the saved run's profile entries a resume must keep (train/resume.py refuses them in each worker too)
RESUME_FIXED = ("seq_len", "global_batch_size", "micro_batch_size", "dtype", "cp")


def resumed_indexer_stage(given: str | None, meta: dict[str, Any]) -> str | None:
    """The indexer stage a run resuming the state of ``meta`` (its meta.json) trains: ``--indexer-stage``
    when ``given``, else the saved run's (not the checkpoint's default: a warm-up resumed without
    the flag stays a warm-up), else None (the checkpoint's default).  ``glm52 train``
    (:func:`check_resume_run`) and ``glm52 plan`` (plan.layout_from_args) both resolve it here."""
    if given is not None:
        return given
    return (meta.get("indexer") or {}).get("stage")


def check_resume_run(
    cfg: Any,
    path: str,
    meta: dict[str, Any],
    data_fingerprint: str | None = None,
    eval_fingerprint: str | None = None,
) -> None:
    """A resume continues the saved run: ``--steps`` is at least the state's step, every
    :data:`RESUME_SETTINGS` entry equals the saved run's unless ``cfg.resume_override`` names it
    (``data``: the data's fingerprint, when given, since a text jsonl is re-tokenized into each
    OUT; ``eval_data`` / ``eval_batches``: the held-out set the state records (meta.json "eval",
    :func:`eval_identity`) against this run's ``--eval-data`` fingerprint, when given, and
    ``--eval-batches``, when both runs evaluate; a state saved without that record is not
    compared), and ``--indexer-stage`` left unset takes the state's stage (not the checkpoint's default).
    A resume into another indexer stage starts a new phase (its own lr schedule, loss terms and
    trained parameters: docs/indexer.md), so its settings are not compared (the held-out set still is:
    its records continue the saved run's loss.json "eval").
    ``model``: the model's config (:func:`check_resume_model`), checked before the rest.
    ``cfg``: the trainer's settings (:class:`TrainConfig`); may set its ``indexer_stage``."""
    if cfg.steps < meta["step"]:
        raise ValueError(
            f"--steps {cfg.steps}: the resume state {path} is at step {meta['step']} already (--steps is the "
            f"run's total, the resumed steps included: --steps {meta['step'] + cfg.steps} trains {cfg.steps} more)"
        )
    override = {k.replace("-", "_") for k in cfg.resume_override}
    unknown = sorted(override - set(RESUME_SETTINGS))
    if unknown:
        raise ValueError(
            f"--resume-override {','.join(unknown)}: not a run setting a resume keeps; one of "
            + ", ".join(k.replace("_", "-") for k in RESUME_SETTINGS)
        )
    check_resume_model(cfg, path, meta, "model" in override)
    profile = meta.get("profile") or {}
    fixed = {k: (profile[k], getattr(cfg, k)) for k in RESUME_FIXED if k in profile and profile[k] != getattr(cfg, k)}
    if fixed:  # what a resume cannot change (the layout degrees can: resharded); a worker would fail on it
        raise ValueError(
            f"--resume {path}: a resume keeps these settings of the saved run: "
            + "; ".join(f"{k.replace('_', '-')} saved {a!r}, now {b!r}" for k, (a, b) in sorted(fixed.items()))
        )
    saved = dict(meta.get("config") or {})
    now = {k: getattr(cfg, k) for k in RESUME_SETTINGS if k not in _RESUME_APART}
    for d in (saved, now):  # the effective floor
        if d.get("lr") is not None:
            d["min_lr"] = effective_min_lr(d["lr"], d.get("min_lr"))
    diff = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
    same_rows = saved.get("seq_len") == cfg.seq_len  # else the layout check names --seq-len (load_resume_state)
    if data_fingerprint is not None and same_rows and meta.get("data") not in (None, data_fingerprint):
        diff["data"] = ("other samples", "these")
    held = meta.get("eval")
    if isinstance(held, dict) and getattr(cfg, "eval_data", None) is not None:  # both runs evaluate
        if held.get("batches") is not None and held["batches"] != cfg.eval_batches:
            diff["eval_batches"] = (held["batches"], cfg.eval_batches)
        if eval_fingerprint is not None and same_rows and held.get("data") not in (None, eval_fingerprint):
            diff["eval_data"] = ("other samples", "these")
    stage = (meta.get("indexer") or {}).get("stage")
    cfg.indexer_stage = resumed_indexer_stage(cfg.indexer_stage, meta)
    new_phase = stage is not None and cfg.indexer_stage != stage  # its own schedule, loss terms, trained set
    changed = {k: d for k, d in diff.items() if k not in override and (not new_phase or k in _EVAL_SET)}
    if changed:
        raise ValueError(
            f"--resume {path}: this run's settings differ from the saved run's: "
            + "; ".join(f"{k.replace('_', '-')} saved {a!r}, now {b!r}" for k, (a, b) in sorted(changed.items()))
            + " (a resumed run continues the saved one; to change them on purpose: --resume-override "
            + ",".join(k.replace("_", "-") for k in sorted(changed))
            + ")"
        )


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_resume_model(cfg: Any, path: str, meta: dict[str, Any], overridden: bool) -> None:
    """A resume continues the saved run's model: the state's recorded model (meta.json ``model``,
    state_files.model_identity) equals this run's ``--model``'s config, unless ``overridden``
    (``--resume-override model``).  The state holds every weight, so another config.json was taken
    silently: its routed_scaling_factor, rms_norm_eps or rope_theta computed other losses, and
    ``--export`` shipped it.  Another kind of model (toy vs a checkpoint) has other tensors: refused
    even overridden (it failed in the workers, or was named as other data).  A state saved before the
    model was recorded is checked for its kind only (load_resume_state notes it)."""
    recorded = meta.get("model")
    if recorded is None:
        kind = (meta.get("config") or {}).get("model")
        diff = {"kind": (kind, cfg.model)} if kind is not None and kind != cfg.model else {}
    else:
        diff = model_differences(recorded, model_identity(cfg.model, cfg.model_args))
    if not diff or (overridden and "kind" not in diff):
        return
    name = cfg.model_args.get("model_dir") or cfg.model
    if "kind" in diff:
        was = {"toy": "the toy model", "glm": "a checkpoint (--model DIR)"}.get(diff["kind"][0], diff["kind"][0])
        raise ValueError(
            f"--resume {path}: the state is of {was}, this run's --model is {name}: its tensors are another "
            "model's and cannot be resumed into this one (resume with the saved run's --model)"
        )
    keys = sorted(diff)
    shown = "; ".join(f"{k} saved {_shown(diff[k][0])}, now {_shown(diff[k][1])}" for k in keys[:6])
    more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
    raise ValueError(
        f"--resume {path}: this run's --model {name} differs from the saved run's model: {shown}{more} (the "
        "state's weights were trained with the saved config, and --export ships this one; to resume with it "
        "on purpose: --resume-override model)"
    )
