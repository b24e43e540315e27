"""``load_pretrained_state``: fill a Paddle model's state dict from an official (or Fleet) checkpoint
(docs/checkpoints.md, "Loading"): validate it, detect its layout, check it against the contracts
(:mod:`.layout`), then let Paddle's AOA engine fill each target from lazily read source slices
(:mod:`.engine`). ``backend="paddle"`` (whole-file reads through ``load_state_dict``) shows both agree.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import fleet as fleet_format
from .aoa import MappingUnit, build_statements, checkpoint_units, expand_units, quiet_paddle_logs, relayout_fused
from .engine import CheckpointSource, TargetSpec, dtype_name, run_units
from .errors import CheckpointError
from .fp8 import Fp8Source, fp8_pairs, quantization_of
from .layout import fleet_param_specs, param_specs, resolve_dtype
from .safetensors_io import Checkpoint, st_to_paddle_dtype
from .safetensors_io import folder_identity as folder_identity_of

__all__ = [
    "LoadReport",
    "load_pretrained_state",
    "detect_layout",
    "units_for",
    "format_keys",
    "load_config_for",
    "normalize_dtype",
    "resolve_model_dtype",
]

logger = logging.getLogger("paddleformers_glm.checkpoint")
# the load report's INFO line reaches handlers that ask for it, whatever the root logger's level
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)


@dataclass
class LoadReport(Mapping):
    """What a load did: layout found, keys loaded / missing / unexpected / filtered out, cost.

    Also transformers' loading info (``from_pretrained(..., output_loading_info=True)`` returns a
    dict there): a read-only mapping of its four keys, so ``"missing_keys" in info``, ``list(info)``,
    ``len(info)``, ``info.items()`` and ``info.get(...)`` work as on that dict; the report's own
    fields are attributes."""

    path: str
    layout: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    quantized: list[str] = field(default_factory=list)  # block-FP8 source tensors (dequantized on read)
    initialized: list[str] = field(default_factory=list)  # MTP parameters initialised (no MTP weights)
    dtype_changes: dict[str, str] = field(default_factory=dict)  # stored dtype differs from the config's

    def summary(self) -> str:
        """One line for the log: what was loaded from where, and what needs a look."""
        parts = [
            f"loaded {len(self.loaded)} tensors from {self.path} ({self.layout} layout"
            + (f", {len(self.quantized)} block-FP8" if self.quantized else "")
            + f"), {self.bytes_read / 1e6:.1f} MB read in {self.seconds:.2f}s"
        ]
        for name in ("missing", "unexpected", "initialized"):
            keys = getattr(self, name)
            if keys:
                parts.append(f"{name} {format_keys(keys, 3)}")
        if self.dtype_changes:
            parts.append(f"{len(self.dtype_changes)} tensors in another dtype than the config's")
        if self.warnings:
            parts.append(f"{len(self.warnings)} warning(s)")
        return "; ".join(parts)

    # transformers' loading info (from_pretrained(..., output_loading_info=True) returns a dict of these
    # four): read by key as code written for it reads it; the keys are this report's (checkpoint names
    # for unexpected, the model's for missing)
    _INFO_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")

    def __getitem__(self, key: str) -> Any:
        if key == "missing_keys":
            return set(self.missing)
        if key == "unexpected_keys":
            return set(self.unexpected)
        if key == "mismatched_keys":  # a shape mismatch is refused, never loaded around
            return set()
        if key == "error_msgs":
            return []
        raise KeyError(f"{key!r}: the loading info's keys are {list(self._INFO_KEYS)} (or read the report's fields)")

    def keys(self) -> list[str]:
        return list(self._INFO_KEYS)

    def __iter__(self) -> Iterator[str]:
        return iter(self._INFO_KEYS)

    def __len__(self) -> int:
        return len(self._INFO_KEYS)

    def __contains__(self, key: object) -> bool:
        return key in self._INFO_KEYS


def format_keys(keys: Iterable[str], n: int = 5) -> str:
    """``"12 keys: a, b, c, d, e, ... (+7 more)"`` — the first few and the count."""
    ks = sorted(keys)
    more = f", ... (+{len(ks) - n} more)" if len(ks) > n else ""
    return f"{len(ks)} key{'s' if len(ks) != 1 else ''}: {', '.join(ks[:n])}{more}"


detect_layout = fleet_format.detect_layout
units_for = checkpoint_units  # the mapping units from a checkpoint of ``layout`` to the model


def load_config_for(path: str, model: Any = None, config: Any = None) -> Any:
    """The config to plan with: given, else ``model.config``, else ``config.json`` beside the weights."""
    if config is not None:
        return config
    if model is not None and getattr(model, "config", None) is not None:
        return model.config
    from ..configuration import GlmMoeDsaConfig

    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return GlmMoeDsaConfig.from_pretrained(folder)


def _listing(*named: tuple[str, Sequence[str]]) -> str:
    """'label keys; label keys' for the labelled key lists that are not empty."""
    return "; ".join(f"{label} {format_keys(keys)}" for label, keys in named if keys)


def state_of(model: Any) -> Mapping[str, Any]:
    """A layer's state dict, or the mapping itself."""
    if isinstance(model, Mapping):
        return model
    if hasattr(model, "state_dict"):
        return model.state_dict()
    raise TypeError(f"expected a paddle.nn.Layer or a state dict, got {type(model).__name__}")


_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
_MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")


def normalize_dtype(dtype: Any) -> str | None:
    """A dtype name from a string (``"bf16"``, ``"bfloat16"``, ``"auto"``) or a Paddle/numpy/torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, type) and issubclass(dtype, np.generic):  # a numpy scalar type (np.float32)
        dtype = np.dtype(dtype).name
    name = str(dtype).replace("paddle.", "").replace("torch.", "").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in (*_MODEL_DTYPES, "auto"):
        raise ValueError(f"dtype {dtype!r} is not a model dtype; expected one of {_MODEL_DTYPES} or 'auto'")
    return name


def resolve_model_dtype(dtype: Any, config: Any) -> str:
    """The dtype to build and load a model in. ``"auto"``: the config's dtype where the device computes
    it (an accelerator), else float32 (CPU), said in one info line."""
    name = normalize_dtype(dtype)
    if name is None:
        return "float32"
    if name != "auto":
        return name
    want = normalize_dtype(getattr(config, "model_dtype", None) or "float32") or "float32"
    try:
        import paddle

        device = str(paddle.device.get_device())
    except Exception:  # no usable Paddle device query: assume CPU
        device = "cpu"
    if want == "float32" or not device.startswith("cpu"):
        return want
    logger.info("dtype='auto': the config's %s is not computed on %s here; loading in float32", want, device)
    return "float32"


def check_checkpoint_keys(
    ckpt: Checkpoint, specs: Mapping[str, tuple[tuple[int, ...], str]], fp8: Mapping[str, str], model_dtype: str
) -> tuple[list[str], list[str], dict[str, str]]:
    """Shapes and float dtypes of the checkpoint's tensors vs the contract; returns (missing,
    unexpected, ``{key: "F16 where bfloat16 is expected"}`` for the tensors stored in another dtype
    than the contract's ``model_dtype``).

    ``fp8`` maps block-FP8 weights to their scale tensors: those weights may be F8_E4M3 (listed in
    ``quantized``, not as dtype changes) and their scales are part of them, not unexpected keys.
    """
    present = set(ckpt.keys()) - set(fp8.values())
    changes = {}
    for k in sorted(present & set(specs)):
        info = ckpt.info(k)
        if k not in fp8:
            if info.dtype not in ("F32", "BF16", "F16", "F64"):
                raise CheckpointError(
                    "non-float tensor where a weight is expected",
                    key=k,
                    file=info.file,
                    expected="F32/BF16/F16/F64",
                    actual=info.dtype,
                )
            want = resolve_dtype(specs[k][1], model_dtype)
            if st_to_paddle_dtype(info.dtype) != want:
                changes[k] = f"{info.dtype} where {want} is expected"
        if info.shape != tuple(specs[k][0]):
            raise CheckpointError(
                "shape mismatch", key=k, file=info.file, expected=tuple(specs[k][0]), actual=info.shape
            )
    return sorted(set(specs) - present), sorted(present - set(specs)), changes


def load_pretrained_state(
    model: Any,
    path: str | os.PathLike,
    dtype: str | None = "float32",
    strict: bool = True,
    *,
    config: Any = None,
    keys: Iterable[str] | None = None,
    key_filter: Callable[[str], bool] | None = None,
    backend: str = "engine",
    shard_info: Mapping[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] | None = None,
    init_missing_mtp: bool = True,
    plan_only: bool = False,
    folder_identity: tuple[int, int] | None = None,
) -> LoadReport:
    """Fill ``model.state_dict()`` (Fleet names) from the checkpoint at ``path``; returns a report
    (docs/checkpoints.md, "Loading" and "Partial loads").

    ``dtype``: what the model's "model"-dtype parameters must be; ``None``, or ``strict=False``, fills
    each in its own dtype (named in ``report.warnings``). ``strict`` refuses missing / unexpected
    weights (index bookkeeping is only a warning). ``keys`` / ``key_filter`` restrict the load to some
    Fleet keys; ``shard_info`` (every rank's (local_shape, global_offset) per key) lays fused weights
    out per rank as Fleet does; ``init_missing_mtp`` initialises an absent MTP layer as HF does.
    ``plan_only``: make every check of the checkpoint's keys, shapes and dtypes (the refusals of a
    load before it reads a weight) and return, reading no weight; only the keys of ``model`` are used.
    ``folder_identity``: the checkpoint folder's (device, inode) before its config.json was read
    (``safetensors_io.folder_identity``; taken here when not given): a folder a save published over
    between that read and the weights' is refused, not read as a mix of the two.
    """
    t0 = time.perf_counter()
    quiet_paddle_logs()
    path = os.path.abspath(os.fspath(path))
    if folder_identity is None:
        folder_identity = folder_identity_of(path)
    cfg = load_config_for(path, model if not isinstance(model, Mapping) else None, config)
    if dtype is not None:
        dtype = resolve_model_dtype(dtype, cfg)
    # ``strict`` is about the weights: index bookkeeping (total_size, a stray file the index does not
    # name, trailing bytes after a shard's last tensor) changes no value and is only a warning
    with Checkpoint(path, strict=False, folder_identity=folder_identity) as ckpt:
        block = quantization_of(ckpt.folder, cfg, checkpoint=ckpt)
        fp8 = fp8_pairs(ckpt, block)
        weight_keys = set(ckpt.keys()) - set(fp8.values())
        layout = detect_layout(weight_keys, cfg, lambda k: ckpt.info(k).shape)
        report = LoadReport(path=path, layout=layout, warnings=list(ckpt.warnings), quantized=sorted(fp8))
        for w in ckpt.warnings:
            logger.warning("%s", w)
        if layout == "fleet-legacy":
            warnings.warn(fleet_format.LEGACY_MESSAGE, FutureWarning, stacklevel=2)
            report.warnings.append(fleet_format.LEGACY_MESSAGE)
        expert_layout = fleet_format.detect_expert_layout(weight_keys)
        src_specs = param_specs(cfg, layout, expert_layout)
        missing_src, report.unexpected, report.dtype_changes = check_checkpoint_keys(
            ckpt, src_specs, fp8, getattr(cfg, "model_dtype", "bfloat16")
        )
        if not int(cfg.n_shared_experts):  # transformers builds (and saves) zero-size shared experts then
            report.unexpected = [
                k for k in report.unexpected if not (".mlp.shared_experts." in k and 0 in ckpt.info(k).shape)
            ]
        dropped = _dropped_mtp_layers(cfg, report.unexpected)
        if dropped:  # MTP layers the config does not build: not read, as transformers ignores them
            report.unexpected = [k for k in report.unexpected if k not in dropped]
            msg = (
                f"{path}: {format_keys(dropped, 3)} of MTP layer(s) "
                f"{sorted({_layer_of(k) for k in dropped})} are not read: the config builds "
                f"num_nextn_predict_layers={cfg.num_mtp_layers} (transformers ignores the MTP layer likewise)"
            )
            logger.warning("%s", msg)
            report.warnings.append(msg)
        absent_mtp = fleet_format.absent_mtp_indexer(cfg, layout, missing_src)
        missing_src = [k for k in missing_src if k not in absent_mtp]
        if report.dtype_changes:
            kinds = sorted(set(report.dtype_changes.values()))
            msg = (
                f"{len(report.dtype_changes)} checkpoint tensors are not in the dtype the config states "
                f"({', '.join(kinds)}), e.g. {sorted(report.dtype_changes)[0]}; they are cast on load"
            )
            logger.warning("%s", msg)
            report.warnings.append(msg)
        fleet = fleet_param_specs(cfg)
        state = state_of(model)
        want = wanted_keys(state, fleet, keys, key_filter, strict)
        report.skipped = sorted((set(state) & set(fleet)) - want)
        # --- units: which targets can be produced from what the checkpoint has
        units = units_for(cfg, layout, expert_layout, fleet_format.fused_ffn_shards(ckpt) if layout == "fleet" else 1)
        units = [u for u in units if not absent_mtp & set(u.hf)]
        if layout != "hf" and shard_info:  # fused weights stored [gate | up]; a rank wants [gate_r | up_r]
            # the keys HF's gate/up are fused into with ``fused_ffn``
            fused = {k for u in expand_units(cfg) if any("fused_ffn" in s for s in u.hf_to_fleet) for k in u.fleet}
            units = relayout_fused(units, set(shard_info) & fused)
        usable, missing_targets, needed_missing, mtp_init, n_mtp_src = _plan_units(
            units, want, set(missing_src), cfg, init_missing_mtp
        )
        if strict and (needed_missing or report.unexpected):
            raise CheckpointError(
                f"checkpoint does not match the {layout} layout of this config: "
                + _listing(("missing", needed_missing), ("unexpected", report.unexpected))
                + " (strict=False loads what is there and reports the rest; parameters without weights keep "
                "their values)",
                file=path,
            )
        report.missing = sorted(missing_targets)
        if plan_only:
            report.seconds = time.perf_counter() - t0
            return report
        if absent_mtp & want:
            msg = (
                f"{path}: the MTP layer's indexer is not in this PaddleFleet checkpoint (its writer skipped it): "
                f"{format_keys(absent_mtp & want)}; initialised as transformers does (normal(0, initializer_range), "
                "norm weight 1, bias 0) — train or load them before relying on MTP"
            )
            report.warnings.append(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
        targets = _target_specs(usable, want, state, fleet, dtype, shard_info, strict, report.warnings)
        if backend == "engine":
            source = Fp8Source(ckpt, pairs=fp8, block=block) if block and fp8 else CheckpointSource(ckpt)
            report.loaded = [k for k, _ in run_units(usable, "hf_to_fleet", source, targets, produce=want)]
            report.bytes_read = source.bytes_read
        elif backend == "paddle":
            if any(u.source_splits for u in usable):
                raise ValueError(f"backend='paddle' cannot read tensor-parallel interleaved fused weights ({path})")
            if fp8:
                raise CheckpointError(
                    "backend='paddle' cannot read block-FP8 weights; use the default engine backend", file=path
                )
            report.loaded, files = _load_with_paddle(ckpt, usable, want, targets)
            report.bytes_read = sum(os.path.getsize(f) for f in files)  # whole files: that is what it reads
        else:
            raise ValueError(f"unknown backend {backend!r}; expected 'engine' or 'paddle'")
        # seeded by key name: two loads of the same file give the same model
        init_like_hf({k: state[k] for k in sorted(absent_mtp & want)}, cfg.initializer_range, seeded=True)
        if mtp_init:  # no MTP tensor at all: initialised as HF initialises missing weights, said once
            init_like_hf({k: state[k] for k in mtp_init}, cfg.initializer_range, seeded=True)
            report.initialized = mtp_init
            first, n_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
            layers = f"model.layers.{first}.*" + ("" if n_mtp == 1 else f" .. model.layers.{first + n_mtp - 1}.*")
            msg = (
                f"{path} has no MTP weights (the {n_mtp_src} tensors of {layers} are absent, as in a folder "
                f"written by transformers' save_pretrained) while num_nextn_predict_layers={n_mtp}: the MTP "
                f"layer{'' if n_mtp == 1 else 's'} {'is' if n_mtp == 1 else 'are'} initialised "
                f"like HF initialises missing weights (normal(0, {cfg.initializer_range}), norms 1, biases 0), "
                "so mtp_logits/mtp_loss are untrained until it is trained (num_nextn_predict_layers=0 drops it)"
            )
            logger.warning(msg)
            report.warnings.append(msg)
    report.seconds = time.perf_counter() - t0
    return report


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _dropped_mtp_layers(cfg: Any, unexpected: Iterable[str]) -> list[str]:
    """The unexpected keys of decoder layers past the config's MTP layers (``model.layers.{j}.*``,
    j >= num_hidden_layers + num_nextn_predict_layers): the MTP layers of a checkpoint loaded with
    fewer of them (``num_nextn_predict_layers=0`` drops MTP), in either layout."""
    first = int(cfg.num_hidden_layers) + int(cfg.num_mtp_layers)
    return sorted(k for k in unexpected if (_layer_of(k) or -1) >= first)


def wanted_keys(
    state: Mapping[str, Any],
    fleet: Mapping[str, tuple[tuple[int, ...], str]],
    keys: Iterable[str] | None = None,
    key_filter: Callable[[str], bool] | None = None,
    strict: bool = True,
) -> set[str]:
    """The Fleet keys to fill: the model's keys within the contract, narrowed by ``keys`` /
    ``key_filter`` (a pipeline stage's module need only hold those). ``strict`` refuses a model
    that lacks a selected key or holds one outside the contract."""
    selected = set(fleet)
    if keys is not None:
        keys = set(keys)
        bad = sorted(keys - set(fleet))
        if bad:
            raise CheckpointError(f"keys to load are not Fleet parameter names: {format_keys(bad)}")
        selected &= keys
    if key_filter is not None:
        selected = {k for k in selected if key_filter(k)}
    extra_model = sorted(set(state) - set(fleet))
    lacking_model = sorted(selected - set(state))
    if strict and (extra_model or lacking_model):
        raise CheckpointError(
            "model state_dict does not match the GLM-5.2 Fleet parameter contract: "
            + _listing(("model lacks", lacking_model), ("model has parameters outside the contract,", extra_model))
        )
    return set(state) & selected


def _plan_units(
    units: list[Any], want: set[str], missing_src: set[str], cfg: Any, init_missing_mtp: bool
) -> tuple[list[Any], list[str], list[str], list[str], int]:
    """Which mapping units can run from what the checkpoint has, and what is missing: (units whose
    sources are all there and that produce a wanted key, wanted keys whose unit lacks a source, the
    lacking sources of those units, wanted MTP keys to initialise as HF does, number of MTP sources)."""
    wanted = [u for u in units if want & set(u.fleet)]
    parts = [_present_part(u, missing_src) if missing_src & set(u.hf) else u for u in wanted]
    usable = [p for p in parts if p is not None]
    missing_targets = [
        k for u, p in zip(wanted, parts) for k in u.fleet if k in want and (p is None or k not in p.fleet)
    ]
    needed_missing = sorted({k for u in wanted for k in u.hf} & missing_src)
    # a folder written by transformers' save_pretrained keeps num_nextn_predict_layers but has no
    # MTP tensor at all: load it, and initialise the MTP layer as HF does for missing weights
    mtp_units = [u for u in units if u.layer is not None and u.layer >= cfg.num_hidden_layers]
    mtp_src = {k for u in mtp_units for k in u.hf}
    mtp_init: list[str] = []
    if init_missing_mtp and mtp_src and mtp_src <= missing_src:
        needed_missing = [k for k in needed_missing if k not in mtp_src]
        mtp_init = sorted(k for u in mtp_units for k in u.fleet if k in want)
        missing_targets = [k for k in missing_targets if k not in set(mtp_init)]
    return usable, missing_targets, needed_missing, mtp_init, len(mtp_src)


def _present_part(unit: MappingUnit, missing: set[str]) -> MappingUnit | None:
    """The part of ``unit`` whose sources the checkpoint holds, as a unit of its own: the statements
    (or, in a unit of plain copies, the pairs) that read only present tensors; None when there is
    none, or when a statement reads what another one makes (the unit then goes whole or not at all).
    A unit groups independent statements (a layer's five MLA projections): before, one absent
    tensor left the others unloaded too."""
    if not unit.hf_to_fleet:  # plain copies, hf[i] -> fleet[i]
        pairs = [(h, f) for h, f in zip(unit.hf, unit.fleet) if h not in missing]
        if len(unit.hf) != len(unit.fleet) or not pairs:
            return None
        hf, fleet = (tuple(x) for x in zip(*pairs))
        return dataclasses.replace(unit, hf=hf, fleet=fleet, fleet_to_hf=(), source_splits=())
    kept, hf, fleet, named = [], [], [], set()
    for statement in unit.hf_to_fleet:
        left, _, right = statement.partition("->")
        sources = [name.strip().removesuffix("^T") for name in left.split(",")]
        if not set(sources) <= set(unit.hf):
            return None
        named.update(sources)
        if not set(sources) & missing:
            kept.append(statement)
            hf += sources
            fleet += [name.strip() for name in right.split(",") if name.strip() in unit.fleet]
    # a tensor kept under its own name has no statement (the rules drop ``X -> X``): a present one
    # loads beside the kept statements, as the whole unit loads it (a router's correction bias
    # beside its missing weight, the MTP norms beside a missing eh_proj)
    copies = [h for h in unit.hf if h not in named and h not in missing and h in unit.fleet]
    hf, fleet = hf + copies, fleet + copies
    if not hf:
        return None
    splits = tuple(x for x in unit.source_splits if x[0] in hf)
    return dataclasses.replace(
        unit, hf=tuple(hf), fleet=tuple(fleet), hf_to_fleet=tuple(kept), fleet_to_hf=(), source_splits=splits
    )


def _target_specs(
    usable: list[Any],
    want: set[str],
    state: Mapping[str, Any],
    fleet: Mapping[str, tuple[tuple[int, ...], str]],
    dtype: str | None,
    shard_info: Mapping[str, Any] | None,
    strict: bool,
    warnings_out: list[str],
) -> dict[str, TargetSpec]:
    """Target specs of every output of the usable units: the wanted ones from the model's parameters
    (shape checked against the contract, dtype against ``dtype``), the others (a unit's outputs nobody
    asked for, which the engine's output set still needs) in the model's or the contract's dtype."""
    targets: dict[str, TargetSpec] = {}
    for k in (k for u in usable for k in u.fleet):
        shape, kind = fleet[k]
        value = state.get(k)
        sharded = getattr(value, "local_tensor", None) is not None  # a ShardedWeight: fill its local piece
        tensor = value.local_tensor if sharded else value
        if k not in want:
            have = resolve_dtype(kind, dtype or "float32") if tensor is None else dtype_name(tensor.dtype)
            targets[k] = TargetSpec(k, tuple(shape), have)
            continue
        if not getattr(tensor, "stop_gradient", True):
            # a trainable parameter refuses DLPack; a detached tensor shares its memory and does not,
            # so the copy takes the numpy fast path straight into the parameter
            tensor = tensor.detach()
        global_shape = tuple(int(d) for d in (getattr(value, "global_shape", None) or tensor.shape))
        if global_shape != tuple(shape):
            raise CheckpointError(
                "model parameter shape does not match the contract", key=k, expected=tuple(shape), actual=global_shape
            )
        have = dtype_name(tensor.dtype)
        expected = have if dtype is None else resolve_dtype(kind, dtype)
        if have != expected:
            err = CheckpointError(
                "model parameter dtype differs from the requested dtype", key=k, expected=expected, actual=have
            )
            if strict:
                raise err
            warnings_out.append(f"{err}; loaded as {have}")
        local_shape, offset = (tuple(value.local_shape), tuple(value.global_offset)) if sharded else (None, None)
        shards = list((shard_info or {}).get(k) or [])
        targets[k] = TargetSpec(k, global_shape, have, local_shape, offset, tensor, shards)
    return targets


def init_like_hf(params: Mapping[str, Any], std: float, seeded: bool = False) -> None:
    """HF's init for weights a checkpoint does not have: matrices normal(0, std), biases 0, norms 1.

    Values of ``params`` may be tensors, parameters or ``ShardedWeight``s (their local piece).
    ``seeded``: each matrix is drawn from generators seeded by its key name (numpy, :func:`seeded_normal`):
    the same model on every load and under every layout (a rank's piece of a split matrix is the
    piece of the one matrix a single process draws, replicas are equal), else Paddle's generator."""
    import paddle

    for k, v in params.items():
        t = getattr(v, "local_tensor", v)
        shape = [int(d) for d in t.shape]
        if len(shape) >= 2 and seeded:
            val = paddle.to_tensor(seeded_normal(k, v, std)).astype(t.dtype)
        elif len(shape) >= 2:
            val = paddle.normal(0.0, std, shape).astype(t.dtype)
        else:
            val = paddle.full(shape, 0.0 if k.endswith("bias") else 1.0, dtype=t.dtype)
        paddle.assign(val, output=t)


_SEED_BLOCK = 1 << 20  # elements per seeded block of rows: a rank draws at most one block it does not hold


def _held_indices(value: Any) -> tuple[list[np.ndarray], list[int]]:
    """The global indices, per axis, of the elements this piece holds, and the global shape: a
    ``ShardedWeight`` of a fused split weight (``chunks`` > 1, e.g. gate|up) holds its rank's part of
    every chunk (Fleet's ``[gate_r | up_r]``), any other piece a plain block at its offset."""
    t = getattr(value, "local_tensor", None)
    if t is None:
        return [np.arange(int(d)) for d in value.shape], [int(d) for d in value.shape]
    from ..parallel.layers import get_shard_spec

    local = [int(d) for d in value.local_shape]
    glob = [int(d) for d in value.global_shape]
    off = [int(o) for o in value.global_offset]
    chunks = int(getattr(get_shard_spec(t), "chunks", 1) or 1)
    out = []
    for g, o, n in zip(glob, off, local):
        if n == g or chunks <= 1:
            out.append(np.arange(o, o + n))
        else:  # the rank's slice of each chunk: offset o = rank * n describes it as a plain slice
            width, part, rank = g // chunks, n // chunks, o // n
            out.append(np.concatenate([c * width + rank * part + np.arange(part) for c in range(chunks)]))
    return out, glob


def seeded_normal(key: str, value: Any, std: float) -> np.ndarray:
    """float32 normal(0, std) values of the piece ``value`` (a tensor, or a ``ShardedWeight``'s local
    piece) of the matrix drawn for ``key``: the global matrix is drawn in blocks of whole rows, each
    from a generator seeded by the key and the block, so every layout's pieces are pieces of the same
    matrix and no piece needs the whole matrix drawn."""
    idx, glob = _held_indices(value)
    width = int(np.prod(glob[1:]))
    per = max(1, _SEED_BLOCK // max(1, width))
    rows = idx[0]
    out = np.empty([len(i) for i in idx], dtype=np.float32)
    seed = zlib.crc32(key.encode())
    blocks = rows // per
    for b in np.unique(blocks):
        n = min(per, glob[0] - int(b) * per)
        block = np.random.default_rng([seed, int(b)]).normal(0.0, std, [n, *glob[1:]])
        sel = blocks == b
        out[sel] = block[np.ix_(rows[sel] - int(b) * per, *idx[1:])]
    return out


def _load_with_paddle(
    ckpt: Checkpoint, units: list[MappingUnit], want: set[str], targets: Mapping[str, TargetSpec]
) -> tuple[list[str], set[str]]:
    """Drive ``paddle.distributed.load_state_dict(aoa_config=...)`` from a private folder of links."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import build_sharded_state_dict

    direction = "hf_to_fleet"
    wanted = {k: t for k, t in targets.items() if k in want}
    by_files: dict[frozenset[str], list[MappingUnit]] = defaultdict(list)
    for u in units:  # each produces a wanted key (_plan_units)
        by_files[frozenset(ckpt.info(k).file for k in u.sources(direction))].append(u)
    loaded: list[str] = []
    with tempfile.TemporaryDirectory(prefix="glm52-aoa-") as tmp:
        for i, (files, group) in enumerate(sorted(by_files.items(), key=lambda kv: sorted(kv[0]))):
            folder = os.path.join(tmp, f"group{i:05d}")
            os.mkdir(folder)
            sd_meta: dict[str, list[Any]] = {}
            storage: dict[Any, str] = {}
            for f in sorted(files):
                os.symlink(f, os.path.join(folder, os.path.basename(f)))
                for k, i in ckpt.files[f].tensors.items():
                    zero = (0,) * len(i.shape)
                    sd_meta[k] = [LocalTensorMetadata(zero, i.shape, st_to_paddle_dtype(i.dtype), i.shape, False)]
                    storage[LocalTensorIndex(k, zero, False, None, None, i.shape)] = os.path.basename(f)
            paddle.save(
                Metadata(state_dict_metadata=sd_meta, storage_metadata=storage),
                os.path.join(folder, "private.auto_generated.metadata"),
            )
            src_dtypes = {k: st_to_paddle_dtype(ckpt.info(k).dtype) for u in group for k in u.sources(direction)}
            dst_dtypes = {k: targets[k].dtype for u in group for k in u.targets(direction)}
            stmts = build_statements(group, direction, src_dtypes, dst_dtypes)
            sd = {k: wanted[k].tensor for u in group for k in u.targets(direction) if k in wanted}
            dist.load_state_dict(
                build_sharded_state_dict(sd), folder, aoa_config={"aoa_statements": stmts}, safetensors=True
            )
            loaded.extend(sd)
    return loaded, {f for files in by_files for f in files}
