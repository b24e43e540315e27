"""``save_pretrained_state``: write a model's weights as an official-layout (or Fleet-layout) checkpoint
(docs/checkpoints.md, "Saving").

The shard plan and every header are computed up front from the contract and the engine's tensors
written one at a time into their planned places, so the bytes depend only on the weights; it all
goes into a temporary folder beside the target that replaces it only when complete (:func:`publish`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._io import pid_alive, read_json, short_name, write_json_atomic
from ..tokenizer_files import JOURNAL_DIR, SET_FILES, TEMPLATE_DIR, finish_pending_save
from .aoa import checkpoint_units, quiet_paddle_logs
from .engine import StateDictSource, TargetSpec, dtype_name, libc, run_units
from .errors import CheckpointError
from .fp8 import FP8_CONFIG, fp8_config, is_fp8_weight, quantize_blocks, scale_key
from .layout import ParamSpec, fleet_param_specs, param_specs, resolve_dtype
from .loader import normalize_dtype, state_of, wanted_keys
from .safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    ST_DTYPES,
    SafetensorsWriter,
    check_metadata,
    paddle_to_st_dtype,
    shard_file_name,
)

__all__ = [
    "SaveReport",
    "save_pretrained_state",
    "parse_size",
    "plan_shards",
    "plan_entries",
    "finish_save",
    "save_target",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1} | {
    f"{p}{b}": base ** (i + 1) for b, base in (("B", 1000), ("IB", 1024)) for i, p in enumerate("KMGT")
}


@dataclass
class SaveReport:
    out_dir: str
    layout: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_size: int = 0
    seconds: float = 0.0


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units like HF; ``GiB`` binary); ints pass through."""
    if isinstance(size, int):
        n = size
    elif m := _SIZE_RE.match(str(size)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    else:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB', '500MiB' or 1000000")
    if n <= 0:
        raise ValueError(f"max_shard_size must be > 0, got {size!r}")
    return n


def _nbytes(entry: tuple[tuple[int, ...], str]) -> int:
    return ST_DTYPES[entry[1]][0] * math.prod(entry[0])


def plan_shards(entries: Mapping[str, tuple[tuple[int, ...], str]], max_shard_size: int) -> dict[str, list[str]]:
    """File name -> keys: keys in sorted order packed greedily into shards of at most ``max_shard_size``
    tensor bytes. A tensor larger than the limit gets a shard of its own, one shard is a single
    ``model.safetensors`` (as HF does)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(entries):
        n = _nbytes(entries[k])
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    n = len(shards)
    return {SINGLE_NAME if n == 1 else shard_file_name(i + 1, n): keys for i, keys in enumerate(shards)}


def plan_entries(
    config: Any, layout: str, model_dtype: str, expert_layout: str = "per-expert"
) -> tuple[dict[str, ParamSpec], dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    """``(specs, dtype name per key, (shape, safetensors dtype) per key)`` of a checkpoint in ``layout``."""
    specs = param_specs(config, layout, expert_layout)
    dtypes = {k: resolve_dtype(kind, model_dtype) for k, (_, kind) in specs.items()}
    return specs, dtypes, {k: (tuple(shape), paddle_to_st_dtype(dtypes[k])) for k, (shape, _) in specs.items()}


def finish_save(
    tmp: str,
    out_dir: str,
    config: Any,
    shards: Mapping[str, list[str]],
    entries: Mapping[str, tuple[tuple[int, ...], str]],
    quantization_config: Mapping[str, Any] | None,
    carry_from: str | os.PathLike | None,
    model_dtype: str | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    layout: str = "hf",
    generation_config: Mapping[str, Any] | None = None,
) -> tuple[int, list[str]]:
    """Write the index (several shards), ``config.json`` (stating ``model_dtype``, the dtype the
    unquantized weights were written in) and the carried files into ``tmp``, then publish it at
    ``out_dir``; returns (total tensor bytes, the names of the files written). ``tokenizer_from``: the
    folder of the tokenizer the weights were trained with, whose tokenizer files (and only those) are
    carried instead of ``carry_from``'s; ``carry_from`` then gives ``generation_config.json`` alone. An
    official-layout (``layout="hf"``) config.json is ``config.to_transformers_dict()``: what
    transformers reads as this model. ``generation_config``: the model's generation settings when they
    differ from ``carry_from``'s file (changed after loading), written in its place as transformers'
    ``save_pretrained`` writes the model's ``generation_config``."""
    total = sum(_nbytes(e) for e in entries.values())
    if len(shards) > 1:
        weight_map = {k: name for name, keys in shards.items() for k in keys}
        write_json_atomic(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
    config.save_pretrained(tmp)
    if layout == "hf" and (hf := config.to_transformers_dict()) != config.to_dict():
        write_json_atomic(os.path.join(tmp, "config.json"), hf, sort_keys=False)
    set_quantization_config(os.path.join(tmp, "config.json"), quantization_config)
    if model_dtype is not None:  # also where the source config.json stated no dtype (bf16 by default)
        set_config_dtype(os.path.join(tmp, "config.json"), model_dtype)
    written = []
    if generation_config is not None:  # the carried file would be the settings before the change
        write_json_atomic(os.path.join(tmp, GENERATION_CONFIG), dict(generation_config), indent=2, sort_keys=True)
        written = [GENERATION_CONFIG]
    if tokenizer_from is not None:
        carried = carry_files(tokenizer_from, tmp, out_dir, TOKENIZER_FILES)
        carried += carry_files(carry_from, tmp, out_dir, (GENERATION_CONFIG,))
    else:
        carried = carry_files(carry_from, tmp, out_dir)
    carried = written + carried  # carry_files skips a name already in tmp
    # a tokenizer is one unit: carrying one replaces the target's, none of its old files stay behind
    # (nor a tokenizer save of the target's that was cut off, whose files the loader would read)
    publish(tmp, out_dir, (*TOKENIZER_FILES, JOURNAL_DIR) if set(carried) & set(TOKENIZER_FILES) else ())
    return total, [*shards, *([INDEX_NAME] if len(shards) > 1 else []), "config.json", *carried]


def _check_state(state: Mapping[str, Any], config: Any) -> None:
    fleet = fleet_param_specs(config)
    wanted_keys(state, fleet, strict=True)  # every key of the contract and no other
    for k, (shape, _) in fleet.items():
        t = getattr(state[k], "local_tensor", state[k])
        if tuple(int(d) for d in t.shape) != tuple(shape):
            raise CheckpointError(
                "parameter shape does not match the contract", key=k, expected=tuple(shape), actual=tuple(t.shape)
            )
        if not dtype_name(t.dtype).startswith(("float", "bfloat")):
            raise CheckpointError(
                "non-float parameter where a weight is expected",
                key=k,
                expected="a float dtype",
                actual=dtype_name(t.dtype),
            )


def save_pretrained_state(
    model_or_state_dict: Any,
    config: Any,
    out_dir: str | os.PathLike,
    layout: str = "hf",
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
    expert_layout: str = "per-expert",
    quantization: str | None = None,
    carry_from: str | os.PathLike | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> SaveReport:
    """Write the weights (Fleet-named state dict or a model) as a checkpoint at ``out_dir``, all at once
    (:func:`publish`): the official layout (``layout="hf"``) or PaddleFleet's (``"fleet"``, its routed
    experts ``expert_layout`` ``per-expert``, ``grouped`` or ``stacked``). ``dtype`` overrides
    ``config.model_dtype`` for "model"-dtype tensors (the correction bias, and in the Fleet layout the
    router weight, stay float32).
    """
    t0 = time.perf_counter()
    quiet_paddle_logs()
    meta = check_metadata(metadata) if metadata is not None else {"format": "pt"}
    state = state_of(model_or_state_dict)
    _check_state(state, config)
    plan = plan_save(config, out_dir, layout, max_shard_size, dtype, quantization, expert_layout)
    units = checkpoint_units(config, layout, expert_layout)
    tensors = {k: getattr(v, "local_tensor", v) for k, v in state.items()}
    return write_checkpoint(
        plan,
        config,
        meta,
        carry_from,
        lambda writers: write_mapped(units, StateDictSource(tensors), plan, writers),
        t0,
        generation_config=generation_config,
    )


def write_checkpoint(
    plan: SavePlan,
    config: Any,
    metadata: Mapping[str, str],
    carry_from: str | os.PathLike | None,
    write: Callable[[dict[str, SafetensorsWriter]], None],
    t0: float,
    *,
    generation_config: Mapping[str, Any] | None = None,
) -> SaveReport:
    """The atomic write of a planned save, shared by :func:`save_pretrained_state` and the
    layer-by-layer convert: a temporary folder beside the target with one open writer per shard,
    ``write(writers)`` fills them, then :func:`finish_save` publishes the folder; on any failure
    the writers are aborted and the temporary folder removed, the target untouched."""
    out_dir, shards, entries = plan.out_dir, plan.shards, plan.entries
    parent = os.path.dirname(out_dir)
    try:  # the temporary folder goes beside the target: its folder must take one
        os.makedirs(parent, exist_ok=True)
        clean_stale_saves(out_dir)
        tmp = tempfile.mkdtemp(prefix=temp_prefix(out_dir, "tmp"), dir=parent)
    except PermissionError as e:
        raise CheckpointError(
            f"cannot write beside the target: {e.strerror} (a save builds the new folder next to it)", file=out_dir
        ) from e
    writers: dict[str, SafetensorsWriter] = {}
    try:
        for name, keys in shards.items():
            writers[name] = SafetensorsWriter(
                os.path.join(tmp, name), [(k, entries[k][1], entries[k][0]) for k in keys], metadata
            )
        write(writers)
        for w in writers.values():
            w.close()  # refuses a file with a planned tensor missing: every entry is written once
        total, files = finish_save(
            tmp,
            out_dir,
            config,
            shards,
            entries,
            fp8_config(plan.block) if plan.quantization else None,
            carry_from,
            plan.model_dtype,
            layout=plan.layout,
            generation_config=generation_config,
        )
    except BaseException:
        for w in writers.values():
            with contextlib.suppress(OSError):  # closing a file on a full disk fails again: the folder goes anyway
                w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SaveReport(
        out_dir, plan.layout, [os.path.join(out_dir, f) for f in files], len(entries), total, time.perf_counter() - t0
    )


@dataclass
class SavePlan:
    """Where a save puts every tensor (:func:`plan_save`): the target folder and layout, the model dtype, the
    shards' entries (key -> shape, safetensors dtype) and files, each key's file, the engine's
    targets, and the block-FP8 weights (weight -> its scale key) with their block."""

    out_dir: str
    layout: str
    model_dtype: str
    quantization: str | None
    entries: dict[str, tuple[tuple[int, ...], str]]
    shards: dict[str, list[str]]
    file_of: dict[str, str]
    targets: dict[str, TargetSpec]
    fp8: dict[str, str]
    block: tuple[int, ...]


def plan_save(
    config: Any,
    out_dir: str | os.PathLike,
    layout: str,
    max_shard_size: int | str,
    dtype: str | None,
    quantization: str | None,
    expert_layout: str,
    block: Sequence[int] | None = None,
) -> SavePlan:
    """The arguments' checks and the plan of a save, shared by :func:`save_pretrained_state` and the
    layer-by-layer ``convert``: the layout, the target folder (:func:`save_target`), the shard size,
    the quantization and expert layout, then every tensor's shard, dtype and FP8 scale (``block``:
    the FP8 blocks, default the official 128 x 128; ``convert`` keeps an FP8 source's own)."""
    if layout not in ("hf", "fleet"):
        raise ValueError(f"unknown layout {layout!r}; expected 'hf' or 'fleet'")
    out_dir = save_target(out_dir)
    limit = parse_size(max_shard_size)
    if quantization in (None, "none"):
        quantization = None
    elif quantization != "fp8":
        raise ValueError(f"unknown quantization {quantization!r}; expected 'fp8' or 'none'")
    if quantization and layout != "hf":
        raise ValueError("quantization='fp8' writes the official layout only (layout='hf')")
    if layout == "hf" and expert_layout != "per-expert":
        raise ValueError(f"expert_layout {expert_layout!r} applies to the fleet layout only")
    dtype = normalize_dtype(dtype)  # names, aliases ("bf16") and Paddle dtypes
    if dtype not in (None, "auto", "float32", "bfloat16", "float16"):  # what a checkpoint's config may state
        raise ValueError(f"save: dtype {dtype!r} is not a checkpoint dtype; expected float32, bfloat16 or float16")
    model_dtype = config.model_dtype if dtype in (None, "auto") else dtype
    specs, tgt_dtypes, entries = plan_entries(config, layout, model_dtype, expert_layout)
    fp8 = {k: scale_key(k) for k in specs if quantization and is_fp8_weight(k)}
    block = tuple(block or FP8_CONFIG["weight_block_size"])
    for k, sk in fp8.items():
        shape = entries[k][0]
        tgt_dtypes[k] = "float32"  # quantized from the exact fp32 value of the parameter
        entries[k] = (shape, "F8_E4M3")
        entries[sk] = (tuple(math.ceil(d / b) for d, b in zip(shape, block)), "F32")
    shards = plan_shards(entries, limit)
    file_of = {k: name for name, keys in shards.items() for k in keys}
    targets = {k: TargetSpec(k, tuple(shape), tgt_dtypes[k]) for k, (shape, _) in specs.items()}
    return SavePlan(out_dir, layout, model_dtype, quantization, entries, shards, file_of, targets, fp8, block)


def write_mapped(units: Any, source: Any, plan: SavePlan, writers: Mapping[str, SafetensorsWriter]) -> None:
    """Run ``units`` over ``source`` into the official layout and write each tensor at its planned
    place, one at a time; a block-FP8 weight of the plan is quantized first. Shared by
    ``save_pretrained_state`` and the layer-by-layer ``convert``."""
    file_of, fp8 = plan.file_of, plan.fp8
    for key, t in run_units(units, "fleet_to_hf", source, plan.targets):
        if key in fp8:
            q, scale = quantize_blocks(t.numpy(), plan.block)
            writers[file_of[key]].write(key, q, "F8_E4M3")
            writers[file_of[fp8[key]]].write(fp8[key], scale, "F32")
            del q, scale
        else:
            writers[file_of[key]].write(key, t.numpy(), paddle_to_st_dtype(t.dtype))
        del t


def set_quantization_config(path: str, qc: Mapping[str, Any] | None) -> None:
    """config.json says how its weights are stored: add ``quantization_config`` for an FP8 save,
    remove one inherited from an FP8 source for a plain save."""
    cfg = read_json(path, "the model config")
    if qc is None and "quantization_config" not in cfg:
        return
    if qc is None:
        cfg.pop("quantization_config")
    else:
        cfg["quantization_config"] = dict(qc)
    write_json_atomic(path, cfg, sort_keys=False)


def set_config_dtype(path: str, dtype: str) -> None:
    """config.json states the dtype its weights are written in, as transformers' ``save_pretrained``
    does (it writes ``dtype: float32`` for a float32 model, and loads ``dtype="auto"`` in it): under the
    file's spelling (``dtype`` and/or ``torch_dtype``), ``dtype`` where it has neither."""
    cfg = read_json(path, "the model config")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    if all(cfg.get(k) == dtype for k in keys):
        return
    for key in keys:
        cfg[key] = dtype
    write_json_atomic(path, cfg, sort_keys=False)


GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (*SET_FILES, TEMPLATE_DIR)  # TEMPLATE_DIR: transformers' named chat templates, NAME.jinja each
CARRIED_FILES = (*TOKENIZER_FILES[:4], GENERATION_CONFIG, *TOKENIZER_FILES[4:])
_OWN_WEIGHT_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def carry_files(
    src: str | os.PathLike | None, tmp: str, out_dir: str, names: tuple[str, ...] = CARRIED_FILES
) -> list[str]:
    """Copy the source folder's non-weight files (``names``) into the new checkpoint (not onto themselves);
    a tokenizer save of the source that was cut off after its commit is finished first, where its
    process is gone, so that the files copied are one tokenizer's."""
    if src is None:
        return []
    src = os.path.abspath(os.fspath(src))
    if not os.path.isdir(src) or os.path.realpath(src) == os.path.realpath(out_dir):
        return []  # saving over the source (also through a link to it): those files are kept as they are
    if set(names) & set(TOKENIZER_FILES):
        finish_pending_save(src)
    out = []
    for name in names:
        f = os.path.join(src, name)
        if os.path.exists(os.path.join(tmp, name)):
            continue
        if os.path.isfile(f):
            shutil.copy2(f, os.path.join(tmp, name))
            out.append(name)
        elif name == TEMPLATE_DIR and os.path.isdir(f):
            shutil.copytree(f, os.path.join(tmp, name))
            out.append(name)
    return out


def save_target(out_dir: str | os.PathLike) -> str:
    """The folder a save to ``out_dir`` replaces: ``out_dir``, or where it leads when it is a symbolic
    link (``~/ckpt -> /big/ckpt``), as transformers' ``save_pretrained`` writes through the link; the
    temporary folder is then made beside the target, on its filesystem, and the link is kept. A target
    that is not a folder is refused here, before any tensor is produced (not after the whole model)."""
    if not os.fspath(out_dir):  # transformers' save fails on it too (os.makedirs(""))
        raise CheckpointError("the output path is empty ('')")
    out_dir = os.path.abspath(os.fspath(out_dir))
    out_dir = os.path.realpath(out_dir) if os.path.islink(out_dir) else out_dir
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError("output path exists and is not a folder", file=out_dir)
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # a working directory already gone: nothing a save could replace
        here = ""
    if here == os.path.realpath(out_dir) or here.startswith(os.path.realpath(out_dir) + os.sep):
        raise CheckpointError(
            "output folder holds this process's working directory; a save replaces the whole folder, which "
            "would leave the process in a deleted one: save to another folder",
            file=out_dir,
        )
    return out_dir


def temp_prefix(out_dir: str, kind: str) -> str:
    """``.<name>.<kind>-<pid>-``: the pid lets a later save tell a killed save's leftovers from a live one."""
    return f".{short_name(os.path.basename(out_dir))}.{kind}-{os.getpid()}-"


def remove_tree(path: str) -> None:
    """``shutil.rmtree`` that also empties read-only folders (a save into a 0555 folder moves its old
    checkpoint into one); best effort, as a temporary folder's removal."""
    for root, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) | stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


def clean_stale_saves(out_dir: str) -> None:
    """Remove temporary folders that killed saves to ``out_dir`` left beside it (their process is
    gone); if a save was killed between moving the old checkpoint aside and moving the new one in
    (only on filesystems without an atomic exchange), put the old checkpoint back first."""
    parent, base = os.path.dirname(out_dir), short_name(os.path.basename(out_dir))
    pat = re.compile(rf"^\.{re.escape(base)}\.(tmp|old)-(\d+)-")
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return
    for name in names:
        m = pat.match(name)
        if not m or pid_alive(int(m.group(2))) and int(m.group(2)) != os.getpid():
            continue
        path = os.path.join(parent, name)
        if m.group(1) == "old" and not os.path.exists(out_dir):
            os.rename(path, out_dir)
            continue
        remove_tree(path)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes
    import errno

    fn = getattr(libc(), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def publish(tmp: str, out_dir: str, replaces: tuple[str, ...] = ()) -> None:
    """Put the finished checkpoint folder ``tmp`` in place of ``out_dir``, all or nothing, keeping the
    target's entries this save does not replace (docs/checkpoints.md, "Saving"): its own weight files,
    index and config.json, what ``tmp`` holds, and the names in ``replaces``."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    if os.path.isdir(out_dir) and not os.path.islink(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        return
    if not os.path.isdir(out_dir):
        raise CheckpointError("output path exists and is not a folder", file=out_dir)
    new = set(os.listdir(tmp))
    for name in sorted(os.listdir(out_dir)):
        if name in new or name in (SINGLE_NAME, INDEX_NAME, "config.json", *replaces) or _OWN_WEIGHT_RE.match(name):
            continue  # what this save replaces
        _link_or_copy(os.path.join(out_dir, name), os.path.join(tmp, name))
    os.chmod(tmp, os.stat(out_dir).st_mode & 0o7777)
    if _exchange(tmp, out_dir):
        remove_tree(tmp)  # tmp now holds the old checkpoint
        return
    old = tempfile.mkdtemp(prefix=temp_prefix(out_dir, "old"), dir=os.path.dirname(out_dir))
    os.rmdir(old)
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    remove_tree(old)
