"""The files of a resume state, read as data and never as code (the layout: docs/parallel.md,
"Checkpoints"; every check: docs/failure-modes.md, "Resume state: data only, never code").

A resume folder comes from disk, and a file that deserialises into code (a pickle) would run
whatever it names the moment it is read: the trainer's own state is therefore safetensors plus
JSON.  The one pickle, Paddle's flex-checkpoint metadata, is never handed to Paddle as found:
:func:`read_flex_metadata` unpickles it through :class:`AllowListUnpickler` and checks it, and
:func:`validated_flex_folder` gives Paddle that validated object re-saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._io import NONFINITE_KEY, atomic_path, dumps_json, is_int, read_json, write_record

__all__ = [
    "FORMAT",
    "FLEX_METADATA_CLASSES",
    "AllowListUnpickler",
    "ResumeStateError",
    "StepFolderRemoved",
    "check_resume_state",
    "check_step_folder",
    "model_differences",
    "model_identity",
    "read_flex_metadata",
    "read_meta",
    "read_rank_state",
    "reading_step_folder",
    "resolve_resume_state",
    "restricted_unpickle",
    "rng_state",
    "saved_steps",
    "set_rng_state",
    "sweep_stale_saves",
    "validated_flex_folder",
    "write_rank_state",
]

FORMAT = "glm52-train-state/2"  # meta.json and rank_*.json say which format they are
STEP_NAME = re.compile(r"step_\d{8}")
FLEX_DIR = "flex"
_FLEX_DATA_NAME = re.compile(r"\d+_\d+\.safetensors")
_FLEX_META_NAME = re.compile(r"\d+\.metadata")
_LATEST_MAX_BYTES = 256
_FLEX_MODULE = "paddle.distributed.flex_checkpoint.dcp.metadata"
FLEX_METADATA_CLASSES = frozenset({(_FLEX_MODULE, n) for n in ("Metadata", "LocalTensorMetadata", "LocalTensorIndex")})
_OLD_FORMAT = re.compile(r"rank_\d+\.pdstate(\.rng)?|.*\.distcp")


class ResumeStateError(ValueError):
    """A resume folder or file that cannot be used; the message starts with the file it is about."""


class StepFolderRemoved(ResumeStateError):
    """A step folder that was there when ``--resume`` chose it and is gone while it is read: another
    run saving into the same checkpoint root pruned it (``--save-total-limit`` renames the folder
    ``step_N.tmp``, then deletes it). The state was whole; what follows from its files being absent
    (a rank's JSON or a flex tensor file "missing") would blame the checkpoint instead."""

    def __init__(self, folder: str) -> None:
        root = os.path.dirname(folder)
        super().__init__(
            f"{folder}: removed while it was being read (the step folder is gone; another run may be saving into "
            f"{root} and pruning it with --save-total-limit): resume from a step folder that run does not delete "
            "(a copy of one), or once that run has ended"
        )
        self.folder = folder


@contextlib.contextmanager
def reading_step_folder(folder: str) -> Iterator[None]:
    """Reads of the step folder ``folder``, found there before: an error raised while the folder has
    gone is :class:`StepFolderRemoved` (its files were not missing from the state, the whole folder
    was taken away), any other error is raised as it is (a step folder still there with a file
    missing is a broken state, and said so)."""
    try:
        yield
    except StepFolderRemoved:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the read hit (a missing file, Paddle's load): gone is gone
        if os.path.isdir(folder):
            raise
        raise StepFolderRemoved(folder) from e


def rank_files(folder: str, rank: int) -> tuple[str, str]:
    """(tensor file, JSON file) of ``rank`` in a step folder."""
    stem = os.path.join(folder, f"rank_{rank:05d}")
    return stem + ".safetensors", stem + ".json"


# ---------------------------------------------------------------- JSON
def _require(ok: bool, file: str, key: str, expected: str, actual: Any) -> None:
    if not ok:
        shown = repr(actual)
        raise ResumeStateError(
            f"{file}: `{key}` must be {expected}, got {shown[:80] + '...' if len(shown) > 80 else shown}"
        )


def _read_state_json(file: str, what: str) -> dict[str, Any]:
    """meta.json or rank_N.json: a JSON object (only parsed) in this version's format."""
    doc = read_json(file, f"the {what}", dict, ResumeStateError)
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise ResumeStateError(
            f"{file}: `format` is {fmt!r}, this version reads {FORMAT!r}"
            + (" (a state written before resume files were safetensors + JSON)" if fmt is None else "")
        )
    return doc


# ---------------------------------------------------------------- where the state is
def saved_steps(root: str) -> list[int]:
    """The steps saved in the checkpoint root ``root``: its ``step_<8 digits>`` folders (not a link
    named like one), in step order. An OSError if ``root`` cannot be listed."""
    return sorted(
        int(n[len("step_") :])
        for n in os.listdir(root)
        if STEP_NAME.fullmatch(n) and os.path.isdir(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n))
    )


_STALE = re.compile(r"step_(\d+)\.(tmp|old)")


def sweep_stale_saves(root: str, step: int) -> list[str]:
    """Remove what earlier saves in ``root`` left (returned): ``step_N.tmp`` of a save killed, stopped
    or failed before its rename, or of a ``resume.prune_saves`` delete that failed (nothing names it:
    ``latest`` and a resume read only ``step_N``; at scale it holds a whole optimizer state), and
    ``step_N.old`` whose ``step_N`` is in place (a save killed during the delete). A ``step_N.old``
    without its ``step_N`` is kept: a save killed between its two renames left the earlier state of
    that step only there. ``step``'s own are left to the caller (-1: none is).

    No live process may be writing the others, which the callers hold to: rank 0 of a save
    (``resume.sweep_stale_saves``), before any rank writes into its own ``step_<step>.tmp`` (this job's
    ranks write only the step they save, each save ends at a barrier), and ``glm52 train``'s launcher
    once every process of a one-node job has ended (a save a stop signal cut short: the worker's stop
    handler ends it with ``os._exit``, so the save's own clean-up never runs); another job in the
    same folder is refused by ``glm52 train``'s ``--out`` lock (train/out_lock.py), which both hold.
    No Paddle: the launcher's process does not import it."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:  # no folder yet: nothing left in it
        return removed
    for name in sorted(names):
        m = _STALE.fullmatch(name)
        if m is None or int(m.group(1)) == step:
            continue
        if m.group(2) == "old" and not os.path.isdir(os.path.join(root, name[: -len(".old")])):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


def resolve_resume_state(path: str) -> str:
    """A step folder, or a checkpoint root (its ``latest``), or an output folder (its ``checkpoints/``)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        return _follow_latest(path, latest)
    ckpt = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpt):
        return resolve_resume_state(ckpt)
    raise FileNotFoundError(f"--resume {path}: no meta.json, latest, or checkpoints/ here")


def _follow_latest(root: str, latest: str) -> str:
    """The step folder ``latest`` names: a ``step_NNNNNNNN`` folder directly inside ``root``.  A run
    still saving into ``root`` may save and prune between the read of ``latest`` and the look at its
    folder: a folder gone while ``latest`` has moved on is looked for again under the newer name."""
    for _ in range(8):  # a writer saving every step moves `latest` at most once per step
        name = _latest_name(root, latest)
        folder = os.path.join(root, name)
        if os.path.islink(folder) or os.path.dirname(os.path.realpath(folder)) != os.path.realpath(root):
            raise ResumeStateError(f"{latest}: names {name}, a link that leaves the checkpoint root {root}")
        if os.path.isdir(folder) or _latest_name(root, latest) == name:
            break
    if not os.path.isdir(folder):
        raise ResumeStateError(f"{latest}: names {name}, which is not a folder in {root}")
    return folder


def _latest_name(root: str, latest: str) -> str:
    """The step folder name the file ``latest`` of ``root`` holds."""
    if os.path.islink(latest) or not os.path.isfile(latest):
        raise ResumeStateError(f"{latest}: must be a regular file naming a step folder, not a link or a folder")
    with open(latest, "rb") as f:
        raw = f.read(_LATEST_MAX_BYTES + 1)
    name = raw.decode("utf-8", "replace").strip()  # a replaced byte never matches STEP_NAME
    if len(raw) > _LATEST_MAX_BYTES or not STEP_NAME.fullmatch(name):
        shown = raw[:60].decode("utf-8", "replace").strip()
        raise ResumeStateError(
            f"{latest}: must hold a step folder name such as step_00000004 (a folder inside {root}), got {shown!r}"
        )
    return name


def read_meta(folder: str) -> dict[str, Any]:
    """``meta.json`` of a step folder, its form checked (the old pickle format refused by name); a
    folder removed while it is read is :class:`StepFolderRemoved`."""
    with reading_step_folder(folder):
        return _read_meta(folder)


def _read_meta(folder: str) -> dict[str, Any]:
    for sub in (folder, os.path.join(folder, FLEX_DIR)):
        names = sorted(os.listdir(sub)) if os.path.isdir(sub) else []
        old = [n for n in names if _OLD_FORMAT.fullmatch(n)]
        if old:
            raise ResumeStateError(
                f"{os.path.join(sub, old[0])}: a resume state of the earlier pickle format; resume reads "
                "safetensors + JSON only and does not unpickle it. Start from the model weights instead, "
                "or resume it with the version that wrote it and save again"
            )
    file = os.path.join(folder, "meta.json")
    meta = _read_state_json(file, "resume metadata")
    for key in ("step", "world_size"):
        _require(is_int(meta.get(key)) and meta[key] >= 1, file, key, "an integer >= 1", meta.get(key))
    _require(isinstance(meta.get("profile"), dict), file, "profile", "an object", meta.get("profile"))
    flex = meta.get("flex")
    stepped = flex.get("stepped") if isinstance(flex, dict) else None
    ok = isinstance(stepped, list) and all(isinstance(s, str) for s in stepped)
    _require(ok, file, "flex.stepped", "a list of parameter names", stepped)
    history = meta.get("history", {})
    lists = {k: v for k, v in history.items() if k != "eval"} if isinstance(history, dict) else history
    ok = isinstance(lists, dict) and all(
        isinstance(v, list) and all(isinstance(x, (int, float)) or x is None for x in v) for v in lists.values()
    )
    _require(ok, file, "history", "an object of number lists", history)
    for key in ("losses", "grad_norms", "lrs"):  # one entry per step: the resumed run appends to them
        n = len(lists[key]) if key in lists else meta["step"]
        _require(n == meta["step"], file, f"history.{key}", f"a list of {meta['step']} entries (one per step)", n)
    evals = history.get("eval", [])  # the held-out evaluations' records
    ok = isinstance(evals, list) and all(isinstance(r, dict) and is_int(r.get("step")) for r in evals)
    _require(ok, file, "history.eval", "a list of records with a step", evals)
    skipped = meta.get("skipped_steps", [])
    ok = isinstance(skipped, list) and all(is_int(s) and s >= 1 for s in skipped)
    _require(ok, file, "skipped_steps", "a list of step numbers", skipped)
    model = meta.get("model")
    if model is not None:  # absent in a state saved before the model was recorded
        ok = isinstance(model, dict) and isinstance(model.get("kind"), str) and isinstance(model.get("config"), dict)
        _require(ok, file, "model", '{"kind": ..., "config": {...}, "sha256": ...}', model)
    _restore_nonfinite(meta, file)
    return meta


def _restore_nonfinite(meta: dict[str, Any], file: str) -> None:
    """The non-finite numbers meta.json holds as ``null`` (listed under ``"nonfinite"``, _io.dumps_json)
    made NaN again: a skipped step's loss comes back as the non-finite number the saved run had, so a
    resumed run's loss.json (and its own meta.json) writes it as ``null`` *and lists it*; read back as
    ``None`` it was written as a plain ``null``, unlisted (docs/failure-modes.md, "Strict JSON")."""
    listed = meta.pop(NONFINITE_KEY, [])
    ok = isinstance(listed, list) and all(isinstance(x, str) for x in listed)
    _require(ok, file, NONFINITE_KEY, "a list of JSON paths", listed)
    if not listed:
        return
    wanted = set(listed)

    def restore(obj: Any, path: str) -> Any:  # paths spelled as _io.strict_json_value spells them
        if obj is None:
            return math.nan if path in wanted else None
        if isinstance(obj, dict):
            return {k: restore(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [restore(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return obj

    meta.update(restore(meta, ""))


# ---------------------------------------------------------------- the model a state belongs to
# config.json keys that name the writer, not the model: a copy re-saved by another library version stays the model
_WRITER_KEYS = ("transformers_version", "_name_or_path")


def model_identity(kind: str, model_args: Mapping[str, Any]) -> dict[str, Any]:
    """What a resume state records of its model (meta.json ``model``), so that a resume with another
    ``--model`` is refused (settings.check_resume_run): the adapter ``kind`` and the model's config,
    a checkpoint's config.json as parsed (less :data:`_WRITER_KEYS`) or the toy model's full config,
    with the sha256 of its canonical JSON (sorted keys).  The config, not the folder's path: the
    resumed weights are the state's, but the config decides what the model computes with them
    (routed_scaling_factor, rms_norm_eps, rope_theta ...) and is what ``--export`` ships."""
    if kind == "glm":
        folder = model_args["model_dir"]
        config = read_json(os.path.join(folder, "config.json"), "the model config")
        config = {k: v for k, v in config.items() if k not in _WRITER_KEYS}
    elif kind == "toy":
        from .toy_adapter import toy_config

        config = dataclasses.asdict(toy_config(model_args.get("config")))
    else:  # another adapter: its arguments are all there is to compare
        config = {k: v for k, v in model_args.items() if k != "seed"}
    canonical = dumps_json(config, indent=None, sort_keys=True, default=str)
    config = read_json("<the model config>", "the model config", data=canonical.encode())  # as JSON holds it
    return {"kind": kind, "config": config, "sha256": hashlib.sha256(canonical.encode()).hexdigest()}


# model keys that change nothing the model computes from a state's weights (transformers' re-save writes
# ``head_dim`` as the rope width, which MLA does not read; the BOS/EOS ids; the stored dtype and init scale)
_UNREAD_KEYS = frozenset(("architectures", "head_dim", "bos_token_id", "eos_token_id", "dtype", "initializer_range"))


def _model_view(config: Mapping[str, Any]) -> dict[str, Any]:
    """A glm config.json as this package reads it: each model key's value after parsing (the file's,
    a default, or derived: ``indexer_types`` from a schedule), less :data:`_UNREAD_KEYS`, so that one
    model written by two libraries (transformers adds ``layer_types``, ``mlp_bias`` ...) is one model.
    An unreadable config is compared as it is."""
    from ..configuration import _FILE_DEFAULTS, GlmMoeDsaConfig

    try:
        parsed = GlmMoeDsaConfig.from_dict(dict(config))
    except (ValueError, TypeError):
        return dict(config)
    keys = [k for k in _FILE_DEFAULTS if k not in _UNREAD_KEYS] + ["rope"]
    return {k: getattr(parsed, k, None) for k in keys}


def model_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, this run's)}`` of two :func:`model_identity` records: ``kind`` when the
    adapters differ, else each model key whose value, as this package reads it, differs (a nested one
    dotted: ``rope.rope_theta``; a key one side lacks has the value None there)."""
    if saved["kind"] != now["kind"]:
        return {"kind": (saved["kind"], now["kind"])}
    out: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}" if key else k)
        elif a != b:
            out[key] = (a, b)

    if saved["kind"] == "glm":
        walk(_model_view(saved["config"]), _model_view(now["config"]), "")
    else:
        walk(saved["config"], now["config"], "")
    return out


def check_resume_state(path: str) -> tuple[str, dict[str, Any]]:
    """(step folder, meta.json) of the resume path ``path`` (:func:`resolve_resume_state`), after
    :func:`check_step_folder`."""
    folder = resolve_resume_state(path)
    return folder, check_step_folder(folder)


def check_step_folder(folder: str) -> dict[str, Any]:
    """meta.json of the step folder ``folder`` (already resolved: its ``latest`` is not read again)
    after checking every file of the state: meta.json, each rank's JSON and safetensors header, the
    flex-checkpoint metadata (restricted unpickling) and its tensor files' headers.  Nothing is
    loaded into a model; the launcher calls it before any worker starts.  A folder removed while it
    is checked is :class:`StepFolderRemoved`."""
    with reading_step_folder(folder):
        meta = read_meta(folder)
        for rank in range(meta["world_size"]):
            read_rank_state(folder, rank)[0].close()  # the JSON and the safetensors header (nothing mapped yet)
        read_flex_metadata(os.path.join(folder, FLEX_DIR))
    return meta


# ---------------------------------------------------------------- one rank's state
def _encode_rng_field(x: Any) -> Any:
    if x is None or is_int(x) or isinstance(x, float):
        return x
    if isinstance(x, (list, tuple)) and all(is_int(b) and 0 <= b < 256 for b in x):
        return {"latin1": bytes(x).decode("latin-1")}
    raise TypeError(f"RNG state field of type {type(x).__name__}")


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON values: Paddle's generators (their pickled fields), numpy's
    MT19937 and Python's ``random``."""
    import paddle

    try:
        gens: list[Any] | None = [[_encode_rng_field(f) for f in g.__getstate__()] for g in paddle.get_rng_state()]
    except (TypeError, AttributeError):  # a generator whose state is not plain numbers: not carried
        gens = None
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return {
        "paddle": gens,
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": gauss},
        "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
    }


def _rng_fields(state: Mapping[str, Any], file: str) -> list[list[Any]] | None:
    """The checks of :func:`rng_state`'s output that need no Paddle (the launcher runs them before any
    worker starts): -> Paddle's generator fields decoded, or None when not carried."""

    def field(x: Any, key: str) -> Any:
        if isinstance(x, dict):
            _require(set(x) == {"latin1"} and isinstance(x["latin1"], str), file, key, '{"latin1": text}', x)
            try:
                return list(x["latin1"].encode("latin-1"))
            except UnicodeEncodeError as e:
                raise ResumeStateError(f"{file}: `{key}` is not latin-1 text") from e
        _require(x is None or is_int(x) or isinstance(x, float), file, key, "a number or null", x)
        return x

    gens = state.get("paddle")
    if gens is not None:
        _require(isinstance(gens, list) and all(isinstance(g, list) for g in gens), file, "rng.paddle", "lists", gens)
        gens = [[field(x, f"rng.paddle[{i}]") for x in g] for i, g in enumerate(gens)]
    # numpy's and Python's generators are both MT19937: a list of unsigned 32-bit words and a few scalars
    scalars = {"numpy": ("kind", "pos", "has_gauss", "gauss"), "python": ("version", "gauss_next")}
    for name, words_key, n in (("numpy", "keys", 624), ("python", "state", 625)):
        obj = state.get(name)
        _require(isinstance(obj, dict), file, f"rng.{name}", "an object", obj)
        words = obj.get(words_key)
        ok = isinstance(words, list) and len(words) == n and all(is_int(k) and 0 <= k < 2**32 for k in words)
        _require(ok, file, f"rng.{name}.{words_key}", f"{n} unsigned 32-bit integers", words)
        for key in scalars[name]:
            v = obj.get(key)
            ok = isinstance(v, str) if key == "kind" else v is None or is_int(v) or isinstance(v, float)
            _require(ok and key in obj, file, f"rng.{name}.{key}", "a string" if key == "kind" else "a number", v)
    return gens


def set_rng_state(state: Mapping[str, Any], file: str) -> None:
    """Restore :func:`rng_state`'s output (read from ``file``); a malformed field is named."""
    import paddle

    gens = _rng_fields(state, file)
    if gens is not None:
        restored = []
        for i, g in enumerate(gens):
            st = paddle.base.core.GeneratorState.__new__(paddle.base.core.GeneratorState)
            try:
                st.__setstate__(tuple(g))
            except (TypeError, RuntimeError, ValueError) as e:
                raise ResumeStateError(f"{file}: `rng.paddle[{i}]` is not a Paddle generator state: {e}") from e
            restored.append(st)
        paddle.set_rng_state(restored)
    numpy, python = state["numpy"], state["python"]
    try:
        np.random.set_state((numpy["kind"], np.uint32(numpy["keys"]), numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    except (TypeError, ValueError) as e:
        raise ResumeStateError(f"{file}: `rng.numpy` is not a numpy RNG state: {e}") from e
    try:
        random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    except (TypeError, ValueError) as e:
        raise ResumeStateError(f"{file}: `rng.python` is not a Python RNG state: {e}") from e


def write_rank_state(folder: str, rank: int, tensors: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    """``rank_N.safetensors`` (``tensors``: name -> Paddle tensor, written one at a time) and
    ``rank_N.json`` (``info`` plus the format and the rank), each atomically."""
    from ..checkpoint.safetensors_io import SafetensorsWriter, paddle_to_st_dtype

    st_file, json_file = rank_files(folder, rank)
    entries = [(k, paddle_to_st_dtype(t.dtype), [int(d) for d in t.shape]) for k, t in tensors.items()]
    with atomic_path(st_file) as tmp:
        writer = SafetensorsWriter(tmp, entries, metadata={"format": FORMAT})
        try:
            for (k, dtype, _), t in zip(entries, tensors.values()):
                writer.write(k, np.asarray(t.detach().numpy()), dtype)  # bf16 arrives as its uint16 bits
        except BaseException:
            writer.abort()
            raise
        writer.close()
    write_record(json_file, {"format": FORMAT, "rank": rank, **info})


def read_rank_state(folder: str, rank: int) -> tuple[Any, dict[str, Any], str]:
    """(the strict safetensors reader of ``rank_N.safetensors``, ``rank_N.json``, the tensor file)."""
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.safetensors_io import SafetensorsFile

    st_file, json_file = rank_files(folder, rank)
    if not os.path.isfile(json_file):
        raise ResumeStateError(f"{json_file}: missing (the state of rank {rank})")
    doc = _read_state_json(json_file, "rank state")
    _require(doc.get("rank") == rank, json_file, "rank", str(rank), doc.get("rank"))
    _require(isinstance(doc.get("rng"), dict), json_file, "rng", "an object", doc.get("rng"))
    _rng_fields(doc["rng"], json_file)
    if not os.path.isfile(st_file):
        raise ResumeStateError(f"{st_file}: missing (the tensors of rank {rank})")
    try:
        return SafetensorsFile(st_file), doc, st_file
    except CheckpointError as e:
        raise ResumeStateError(f"{st_file}: {e}") from e


# ---------------------------------------------------------------- restricted unpickling
class AllowListUnpickler(pickle.Unpickler):
    """An unpickler that builds only the classes on its allow-list.

    A pickle runs code by naming a callable (``os.system``, ``builtins.eval``, any class's
    constructor) that the loader imports and calls; every such name goes through ``find_class``,
    so refusing every name but a few plain data classes leaves only the protocol's own values
    (numbers, strings, bytes, tuples, lists, dicts, sets) and those classes. Persistent ids
    (references to objects outside the stream) are refused as well."""

    def __init__(self, data: bytes, allowed: frozenset[tuple[str, str]], file: str) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.file = allowed, file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        raise ResumeStateError(
            f"{self.file}: refused to unpickle `{module}.{name}`: only "
            + ", ".join(sorted(f"{m}.{n}" for m, n in self.allowed))
            + " may be loaded from this file (it would otherwise run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise ResumeStateError(f"{self.file}: refused a persistent reference in a pickle ({str(pid)[:60]!r})")


def restricted_unpickle(file: str, allowed: frozenset[tuple[str, str]]) -> Any:
    """The value pickled in ``file``, built through :class:`AllowListUnpickler`; any refusal or
    malformed stream is a :class:`ResumeStateError` naming the file."""
    try:
        data = Path(file).read_bytes()
    except OSError as e:
        raise ResumeStateError(f"{file}: cannot read the pickled state: {e.strerror}") from e
    if not data:
        raise ResumeStateError(f"{file}: the pickled state is empty (0 bytes)")
    try:
        return AllowListUnpickler(data, allowed, file).load()
    except ResumeStateError:
        raise
    except RecursionError as e:
        raise ResumeStateError(f"{file}: not a readable pickle (nested too deeply)") from e
    except Exception as e:  # noqa: BLE001 - a malformed stream raises anything; it is named, not run
        raise ResumeStateError(f"{file}: not a readable pickle ({type(e).__name__}: {e})") from e


def _int_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and all(is_int(d) and d >= 0 for d in x)


_KINDS = {"t": _int_tuple, "s": lambda x: isinstance(x, str), "b": lambda x: isinstance(x, bool), "n": is_int}
# the fields of flex-checkpoint's metadata classes and what each holds: t a tuple of integers >= 0,
# s a string, b a bool, n an integer; "?": or None
_FLEX_FIELDS = {
    "LocalTensorMetadata": "global_offset:t local_shape:t dtype:s global_shape:t? is_flattened:b flattened_range:t?",
    "LocalTensorIndex": "tensor_key:s global_offset:t is_flattened:b flattened_range:t? replica_id:n? local_shape:t?",
}


def _fields_ok(obj: Any, cls: type) -> bool:
    """``obj`` is a ``cls`` with exactly the dataclass's fields, each holding what :data:`_FLEX_FIELDS` says."""
    if type(obj) is not cls or set(vars(obj)) != {f.name for f in dataclasses.fields(cls)}:
        return False
    kinds = [f.split(":") for f in _FLEX_FIELDS.get(cls.__name__, "").split()]
    return all((k.endswith("?") and getattr(obj, f) is None) or _KINDS[k[0]](getattr(obj, f)) for f, k in kinds)


def _check_pieces(key: str, entries: list[Any], file: str) -> None:
    """The pieces of one flex key tile its global shape exactly, as the trainer's save writes them: at
    least one, none flattened, one ``global_shape`` for all, each of its rank inside it
    (``0 <= offset``, ``offset + local_shape <= global_shape``), no two overlapping and together as
    large as it (so no gap).  A piece reaching past its tensor, or a gap, would load shifted or
    freshly initialised rows into the run without a word."""
    where = f"state_dict_metadata[{key!r}]"
    shapes = {m.global_shape for m in entries}
    ok = bool(entries) and len(shapes) == 1 and None not in shapes and not any(m.is_flattened for m in entries)
    _require(ok, file, where, "pieces (not flattened) of one global_shape", entries)
    (shape,) = shapes
    boxes = []
    for m in entries:
        off, local = m.global_offset, m.local_shape
        ok = len(off) == len(local) == len(shape) and all(
            0 <= o and 0 <= n and o + n <= g for o, n, g in zip(off, local, shape)
        )
        _require(ok, file, where, f"pieces inside the global shape {list(shape)}", m)
        boxes.append([(o, o + n) for o, n in zip(off, local)])
    for i, a in enumerate(boxes):
        for b in boxes[:i]:
            if all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b)):
                _require(False, file, where, "pieces that do not overlap", entries)
    ok = sum(math.prod(n for n in m.local_shape) for m in entries) == math.prod(shape)
    _require(ok, file, where, f"pieces that cover the global shape {list(shape)}", entries)


def _piece_of(sdm: dict[str, list[Any]], idx: Any) -> Any:
    """The piece (``LocalTensorMetadata``) of ``sdm`` the storage index ``idx`` names, or None."""
    for m in sdm.get(idx.tensor_key, []):
        if m.global_offset == idx.global_offset and idx.local_shape in (None, m.local_shape) and not idx.is_flattened:
            return m
    return None


def _check_flex_metadata(md: Any, file: str, folder: str) -> list[str]:
    """The tensor files a validated flex ``Metadata`` points at (each a plain name in ``folder``): every
    field of its type, each key's pieces tiling its global shape (:func:`_check_pieces`), and every
    piece placed in exactly the file its storage index names (no index of a piece it does not list)."""
    from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata

    _require(_fields_ok(md, Metadata), file, "(top level)", "a flex-checkpoint Metadata", type(md).__name__)
    sdm, storage, flat = md.state_dict_metadata, md.storage_metadata, md.flat_mapping
    _require(isinstance(sdm, dict), file, "state_dict_metadata", "a dict", type(sdm).__name__)
    for key, entries in sdm.items():
        ok = isinstance(key, str) and isinstance(entries, list)
        ok = ok and all(_fields_ok(m, LocalTensorMetadata) for m in entries)
        _require(ok, file, f"state_dict_metadata[{key!r}]", "a list of LocalTensorMetadata", entries)
        _check_pieces(key, entries, file)
    _require(isinstance(storage, dict), file, "storage_metadata", "a dict", type(storage).__name__)
    files: set[str] = set()
    placed: set[tuple[str, tuple[int, ...]]] = set()
    for idx, name in storage.items():
        _require(_fields_ok(idx, LocalTensorIndex), file, "storage_metadata", "LocalTensorIndex keys", idx)
        ok = isinstance(name, str) and _FLEX_DATA_NAME.fullmatch(name) is not None
        where = f"storage_metadata[{idx.tensor_key!r}]"
        _require(ok, file, where, "a tensor file name <rank>_<id>.safetensors in the same folder", name)
        piece = _piece_of(sdm, idx)
        _require(piece is not None, file, where, "the index of one of the key's pieces in state_dict_metadata", idx)
        placed.add((idx.tensor_key, piece.global_offset))
        if name not in files:  # each file once (one per rank; the official model has 300k+ keys)
            path = os.path.join(folder, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise ResumeStateError(
                    f"{file}: tensor {idx.tensor_key!r} is stored in {name}, which is not a file in {folder}"
                )
        files.add(name)
    for key, entries in sdm.items():
        for m in entries:
            if (key, m.global_offset) not in placed:
                _require(False, file, f"state_dict_metadata[{key!r}]", "pieces storage_metadata places in a file", m)
    ok = flat is None or (
        isinstance(flat, dict)
        and all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(s, str) for s in v) for k, v in flat.items()
        )
    )
    _require(ok, file, "flat_mapping", "a dict of string tuples", flat)
    return sorted(files)


def read_flex_metadata(folder: str) -> tuple[Any, str, list[str]]:
    """(validated ``Metadata``, its file, the tensor files) of a flex-checkpoint folder written with
    ``safetensors=True``: the metadata pickle through the allow-list, the tensor files' headers by
    the strict reader, every key the metadata places in a file present in that file with the piece's
    shape (read from the header: no tensor data is loaded)."""
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.safetensors_io import parse_header

    if not os.path.isdir(folder):
        raise ResumeStateError(f"{folder}: missing (the flex-checkpoint copy of the state)")
    names = sorted(os.listdir(folder))
    metas = [n for n in names if _FLEX_META_NAME.fullmatch(n)]
    if len(metas) != 1:
        raise ResumeStateError(f"{folder}: expected one <id>.metadata file, found {metas or 'none'}")
    file = os.path.join(folder, metas[0])
    if os.path.islink(file):
        raise ResumeStateError(f"{file}: a link; the metadata must be a file of the checkpoint")
    md = restricted_unpickle(file, FLEX_METADATA_CLASSES)
    files = _check_flex_metadata(md, file, folder)
    keys: dict[str, dict[str, Any]] = {}
    for n in files:
        try:
            keys[n] = parse_header(os.path.join(folder, n))[0]
        except CheckpointError as e:
            raise ResumeStateError(f"{os.path.join(folder, n)}: {e}") from e
    for idx, n in md.storage_metadata.items():
        if idx.tensor_key not in keys[n]:
            raise ResumeStateError(f"{file}: places {idx.tensor_key!r} in {n}, which has no such tensor")
        stored, local = list(keys[n][idx.tensor_key].shape), list(_piece_of(md.state_dict_metadata, idx).local_shape)
        if stored != local:
            raise ResumeStateError(
                f"{file}: the piece of {idx.tensor_key!r} in {n} has shape {local} in the metadata, {stored} in the file"
            )
    return md, file, files


@contextlib.contextmanager
def validated_flex_folder(folder: str) -> Iterator[str]:
    """A private folder for ``paddle.distributed.load_state_dict``: the validated metadata re-saved
    by this process (so what Paddle unpickles is what passed the allow-list, not the file, which
    could change in between) and links to the checkpoint's tensor files."""
    import paddle

    md, file, files = read_flex_metadata(folder)
    real = os.path.realpath(folder)
    with tempfile.TemporaryDirectory(prefix="glm52-resume-flex-") as tmp:
        for n in files:
            os.symlink(os.path.join(real, n), os.path.join(tmp, n))
        paddle.save(md, os.path.join(tmp, os.path.basename(file)))
        yield tmp
