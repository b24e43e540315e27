"""Resume state (``--save-every`` / ``--resume``): model, optimizer and RNG state plus run metadata.
Layout, the two copies (``rank_*`` for the same layout, ``flex/`` for another) and guarantees:
docs/parallel.md, "Checkpoints"; file formats: state_files.py.

Every rank writes its own files into ``step_*.tmp``; after a barrier rank 0 writes meta.json and
renames the folder, so a crash never leaves a half checkpoint under a final name.  Multi-node: ROOT
must be on a filesystem every node sees.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from .._io import atomic_write_text, naming_write_errors, write_record
from ..checkpoint import distributed as ckpt_dist
from ..checkpoint.aoa import quiet_paddle_logs, reading_a_share
from ..checkpoint.finite import NonFiniteError, count_nonfinite_raw, listed_nonfinite, nonfinite_state_counts
from ..checkpoint.safetensors_io import paddle_to_st_dtype
from ..parallel.layers import ShardSpec, get_shard_spec
from ..parallel.topology import Topology
from . import state_files
from .nonfinite import check_written_state, state_kind
from .optim import AdamW
from .state_files import (
    FLEX_DIR,
    FORMAT,
    ResumeStateError,
    check_step_folder,
    model_identity,
    rank_files,
    read_rank_state,
    reading_step_folder,
    resolve_resume_state,
    rng_state,
    saved_steps,
    set_rng_state,
    validated_flex_folder,
    write_rank_state,
)

__all__ = [
    "LAYOUT_KEYS",
    "load_resume_state",
    "finish_pruning",
    "prune_saves",
    "resolve_resume_state",
    "save_resume_state",
    "sweep_stale_saves",
]

# profile keys a resume may change (through flex/); the others (batch, sequence, dtype) must match
LAYOUT_KEYS = ("tp", "pp", "dp", "ep", "etp", "sp", "world", "sharding", "pp_layout")


def _model_identity(config: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json ``model`` of the run whose settings (``TrainConfig`` as a dict) are ``config``
    (state_files.model_identity: a small config.json parsed at each save); None when the settings
    name no model."""
    if "model" not in config:
        return None
    return model_identity(config["model"], config.get("model_args") or {})


def save_resume_state(
    root: str, step: int, topo: Topology, model: nn.Layer, optimizer: AdamW, meta: dict[str, Any]
) -> str:
    """Collective. Returns the final folder path.  meta.json records the model's identity
    (``model``: state_files.model_identity) besides ``meta``, so a resume can refuse another model.
    A state whose tensors hold NaN or Inf on any rank is not written: every rank raises the same
    ``NonFiniteStep`` (nonfinite.check_written_state) before anything of it is on disk."""
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    # this rank's model/<name> and optimizer/<name>/<kind> (moments, beta powers, master): tested where
    # they live, one at a time, then written (no copy held in between)
    tensors = {f"model/{k}": v.detach() for k, v in model.state_dict().items()}
    tensors |= {f"optimizer/{n}/{kind}": t for n, st in optimizer.state_dict().items() for kind, t in st.items()}
    check_written_state(tensors, topo.rank, topo.world_size, step, "resume state")
    if topo.rank == 0:  # a save of this step killed before its rename left files (another layout's, even)
        finish_pruning()  # no --save-total-limit delete runs beside this save's own
        shutil.rmtree(tmp, ignore_errors=True)
        sweep_stale_saves(root, step)
    if topo.world_size > 1:
        dist.barrier()
    what = f"the resume state of step {step}"
    try:
        with naming_write_errors(tmp, what):  # the file, the phase and the errno (a full disk: ENOSPC)
            os.makedirs(tmp, exist_ok=True)
            write_rank_state(tmp, topo.rank, tensors, {"rng": rng_state()})
            stepped = _save_flex(os.path.join(tmp, FLEX_DIR), topo, model, optimizer)
            if topo.world_size > 1:
                dist.barrier()
            if topo.rank == 0:
                identity = _model_identity(meta.get("config") or {})
                meta = {
                    "format": FORMAT,
                    **meta,
                    "step": step,
                    "world_size": topo.world_size,
                    "flex": {"stepped": stepped},
                }
                if identity is not None:
                    meta["model"] = identity
                write_record(os.path.join(tmp, "meta.json"), meta)
    except BaseException:
        # a failed or stopped save (a full disk, SIGTERM) leaves no step_N.tmp: rank 0's, whose rename
        # will not come; another rank's failure leaves it to the next save's sweep (rank 0 may still be
        # writing into it)
        if topo.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if topo.rank == 0:
        # a state of this step already there (a run resumed from an earlier step into the same OUT):
        # moved aside by one rename and deleted only once the new one is in place and named, so a
        # process killed during the (long) delete leaves the new state whole, not a half-deleted one
        old = final + ".old"
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        atomic_write_text(os.path.join(root, "latest"), os.path.basename(final) + "\n")
        shutil.rmtree(old, ignore_errors=True)
    if topo.world_size > 1:
        dist.barrier()
    return final


def sweep_stale_saves(root: str, step: int) -> list[str]:
    """``state_files.sweep_stale_saves`` (what earlier saves in ``root`` left, returned) once a delete
    of ``--save-total-limit`` still running in this process has finished (:func:`finish_pruning`).
    Called by rank 0 of a save before any rank writes into its own ``step_<step>.tmp``."""
    finish_pruning()  # a delete of --save-total-limit still running is not left behind
    return state_files.sweep_stale_saves(root, step)


def prune_saves(root: str, keep: int, log: Callable[[str], Any] = print) -> list[str]:
    """``--save-total-limit``: delete the oldest ``step_<8 digits>`` folders of ``root`` beyond the
    newest ``keep`` (by step number; 0: none deleted), never the one ``latest`` names, which counts
    among the ``keep``; returns their names.  Run by rank 0 after a save is in place and ``latest``
    names it (the other ranks delete nothing).  Each folder is renamed ``step_N.tmp`` here (one
    rename: no half-deleted folder is left under a step name), and deleted by a background thread
    while training goes on (at scale a save is the whole optimizer state, and every rank waits for
    rank 0 at the next collective); :func:`finish_pruning` waits for it (the next save's sweep and
    the run's end do). A failure is logged as a warning naming the folder and the OS's words, and
    the run goes on; what a failed delete leaves, the next save's :func:`sweep_stale_saves` removes."""
    if keep <= 0:
        return []
    try:
        latest = os.path.basename(resolve_resume_state(root))
    except (OSError, ValueError):  # no readable `latest`: every step folder is one of the saves
        latest = None
    try:
        names = [f"step_{n:08d}" for n in saved_steps(root)]
    except OSError as e:
        log(f"[glm52 train] warning: --save-total-limit {keep}: cannot list {root}: {e}; nothing deleted")
        return []
    order = [n for n in names if n != latest] + [n for n in names if n == latest]  # latest: kept first
    finish_pruning()  # one delete at a time: an earlier one's folders are not this one's
    renamed = []
    for name in order[: max(0, len(order) - keep)]:
        folder = os.path.join(root, name)
        try:
            shutil.rmtree(folder + ".tmp", ignore_errors=True)  # an earlier failed delete's
            os.replace(folder, folder + ".tmp")
        except OSError as e:
            _delete_failed(keep, name, folder, e, log)
            continue
        renamed.append(name)
    if renamed:
        thread = threading.Thread(
            target=_delete_renamed, args=(root, renamed, keep, log), name="glm52-prune-saves", daemon=True
        )
        thread.start()
        _PRUNING.append(thread)
    return renamed


_PRUNING: list[threading.Thread] = []  # the background deletes started by prune_saves


def finish_pruning(timeout: float | None = None) -> None:
    """Wait for the deletes :func:`prune_saves` started, at most ``timeout`` seconds in all (None:
    until they end). A delete left half done (the time ran out, the process was killed) is a
    ``step_N.tmp``, which the next save sweeps."""
    end = None if timeout is None else time.monotonic() + timeout
    while _PRUNING:
        _PRUNING.pop().join(None if end is None else max(0.0, end - time.monotonic()))


def _delete_renamed(root: str, names: list[str], keep: int, log: Callable[[str], Any]) -> None:
    for name in names:
        folder = os.path.join(root, name)
        try:
            shutil.rmtree(folder + ".tmp")
        except OSError as e:
            _delete_failed(keep, name, folder, e, log)


def _delete_failed(keep: int, name: str, folder: str, e: OSError, log: Callable[[str], Any]) -> None:
    log(
        f"[glm52 train] warning: --save-total-limit {keep}: cannot delete {name} ({e.filename or folder}: "
        f"{e.strerror or e}); the run goes on"
    )


@paddle.no_grad()
def _set_stored(reader: Any, key: str, t: paddle.Tensor) -> None:
    """Set ``t`` from the stored tensor ``key`` (its shape and dtype checked equal: _check_like), bit
    for bit: one tensor's copy on ``t``'s device at a time (bf16 arrives as its uint16 bits), read from
    the mapped file, whose pages are then dropped from this process."""
    v = paddle.to_tensor(reader.numpy(key), place=t.place)
    t.set_value(v if v.dtype == t.dtype else v.view(t.dtype))
    del v
    reader.release(key)


def load_resume_state(
    path: str,
    topo: Topology,
    model: nn.Layer,
    optimizer: AdamW,
    expect_profile: dict[str, Any],
    indexer_stage: str | None = None,
) -> dict[str, Any]:
    """Restore this rank's state from the step folder ``path``; returns meta.json. ``path`` is the
    folder the run resolved its ``--resume`` to once (settings.resolved_resume), never a root whose
    ``latest`` is followed here: a root another run still saves into would give each rank, and the
    launcher's check, a step of its own.  A folder removed while it is read is
    ``state_files.StepFolderRemoved``.

    The saved layout must equal ``expect_profile`` (or differ only in :data:`LAYOUT_KEYS`: then the
    state is resharded from ``flex/``).  Every file of the state is checked first
    (state_files.check_step_folder); nothing is unpickled but flex-checkpoint's metadata, through an
    allow-list.

    ``indexer_stage``: this run's; a state written in another stage keeps optimizer state only for
    the parameters this run trains (docs/indexer.md, "Resuming across stages"). In the same stage
    every saved optimizer entry must belong to this run's parameters."""
    with reading_step_folder(path):
        return _load_step_folder(path, topo, model, optimizer, expect_profile, indexer_stage)


def _load_step_folder(
    path: str,
    topo: Topology,
    model: nn.Layer,
    optimizer: AdamW,
    expect_profile: dict[str, Any],
    indexer_stage: str | None,
) -> dict[str, Any]:
    meta = check_step_folder(path)
    if topo.rank == 0 and "model" not in meta:  # settings.check_resume_run could compare nothing
        print(
            f"[glm52 train] note: --resume {path}: the state records no model identity (saved before it was "
            "recorded); this run's --model is taken to be the saved run's without a check",
            flush=True,
        )
    saved_stage = (meta.get("indexer") or {}).get("stage")
    new_stage = saved_stage is not None and indexer_stage is not None and saved_stage != indexer_stage
    trained = {n for n, _ in optimizer.params}
    saved = meta["profile"]
    saved = {"pp_layout": expect_profile.get("pp_layout"), **saved}  # a state from before the split was recorded
    diff = {k: (saved.get(k), v) for k, v in expect_profile.items() if saved.get(k) != v}
    fixed = {k: d for k, d in diff.items() if k not in LAYOUT_KEYS}
    if fixed:
        raise ValueError(
            f"--resume {path}: checkpoint run settings differ from this run: "
            + ", ".join(f"{k} saved {a!r} vs now {b!r}" for k, (a, b) in sorted(fixed.items()))
        )
    # another parallel layout, or another stage's trained set over sharding ranks (Fleet splits the
    # optimizer's parameter list among them, so each rank file holds another split): through flex-checkpoint
    if diff or (new_stage and int(saved.get("sharding") or 1) > 1):
        stepped = set(meta["flex"]["stepped"])
        _load_flex(os.path.join(path, FLEX_DIR), topo, model, optimizer, stepped & trained if new_stage else stepped)
        return meta
    reader, doc, file = read_rank_state(path, topo.rank)
    with reader:
        tensors = reader.tensors
        state = model.state_dict()
        missing = sorted(f"model/{k}" for k in state if f"model/{k}" not in tensors)
        if missing:
            raise ResumeStateError(f"{file}: model tensors missing: {missing[:5]}")
        bad: dict[str, int] = {}  # NaN/Inf elements by tensor, tested on the stored bytes as they are read
        for k, t in state.items():
            info = tensors[f"model/{k}"]
            _check_like(file, f"model/{k}", info, t)
            if n := count_nonfinite_raw(reader.raw(info.key), info.dtype):
                bad[f"model/{k}"] = n
            _set_stored(reader, info.key, t)
        infos: dict[str, dict[str, Any]] = {}
        for key, info in tensors.items():
            if key.startswith("model/"):
                continue
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "optimizer":
                raise ResumeStateError(f"{file}: unexpected tensor {key!r} (model/<name> or optimizer/<name>/<kind>)")
            infos.setdefault(parts[1], {})[parts[2]] = info
        if new_stage:  # another stage's trained set: keep the state of what this run trains
            infos = {n: st for n, st in infos.items() if n in trained}
        layout = optimizer.state_layout()  # every accumulator and master, created now if not yet
        _check_optimizer_state(file, infos, layout)
        _check_stepped_present(file, infos, optimizer, set(meta["flex"]["stepped"]))
        for n, st in infos.items():  # a NaN moment or fp32 master would poison the first update
            for kind, i in st.items():
                if c := count_nonfinite_raw(reader.raw(i.key), i.dtype):
                    bad[f"optimizer/{n}/{kind}"] = c
                reader.release(i.key)
        _refuse_nonfinite(file, topo.rank, bad)
        # AdamW.set_state_dict's effect, one tensor at a time into the live state (never a whole
        # optimizer state of new tensors beside it): the tensors _check_optimizer_state matched
        for n, st in infos.items():
            for kind, i in st.items():
                _set_stored(reader, i.key, layout[n][kind])
        optimizer._stepped = {n for n, st in infos.items() if set(st) - {"master"}}
        optimizer.sync_masters({n for n, _ in optimizer.params if "master" not in infos.get(n, {})})
    set_rng_state(doc["rng"], rank_files(path, topo.rank)[1])
    return meta


def _refuse_nonfinite(file: str, rank: int, bad: dict[str, int]) -> None:
    """Raise ``NonFiniteError`` naming the resume state's file of this rank (``file``: its
    ``rank_N.safetensors``, or the ``flex/`` folder it was resharded from) and each of its tensors
    that holds NaN or Inf (``bad``: name -> count), with what it is (weight, optimizer moment, fp32
    master weight, beta power): the state cannot continue the run."""
    if not bad:
        return
    names = list(bad)
    listed = listed_nonfinite(bad, names, state_kind)
    err = NonFiniteError(
        f"--resume: {file} (the state of rank {rank}): {len(names)} tensor(s) hold NaN or Inf: {listed}; "
        "the run cannot continue from it (resume from an earlier state)",
        file=file,
        key=names[0],
    )
    err.counts = bad
    raise err


def _check_like(file: str, key: str, info: Any, t: paddle.Tensor) -> None:
    """The stored tensor ``key`` has the shape and the dtype of this run's ``t`` (the run's dtype is
    the state's: checked with the profile), so nothing is cast or reshaped on the way in."""
    if list(info.shape) != [int(d) for d in t.shape]:
        raise ResumeStateError(f"{file}: `{key}` has shape {list(info.shape)}, this run's {list(t.shape)}")
    want = paddle_to_st_dtype(t.dtype)
    if info.dtype != want:
        raise ResumeStateError(f"{file}: `{key}` is {info.dtype}, this run's is {want}")


def _check_optimizer_state(file: str, infos: dict[str, dict[str, Any]], layout: dict[str, dict[str, Any]]) -> None:
    """Every stored optimizer tensor is one this rank's optimizer holds (``layout``, AdamW.state_layout),
    of its shape and dtype, and a parameter with saved moments has all of them (and its fp32 master
    when it has one): a partial entry would restart the missing part silently."""
    unknown = sorted(set(infos) - set(layout))
    if unknown:
        raise ResumeStateError(f"{file}: optimizer state for parameters this run does not update: {unknown[:5]}")
    for n, st in infos.items():
        for kind, info in st.items():
            if kind not in layout[n]:
                raise ResumeStateError(
                    f"{file}: `optimizer/{n}/{kind}`: no such optimizer state ({', '.join(sorted(layout[n]))})"
                )
            _check_like(file, f"optimizer/{n}/{kind}", info, layout[n][kind])
        if set(st) - {"master"}:  # it stepped: every accumulator, and the master it steps
            lacking = sorted(set(layout[n]) - set(st))
            if lacking:
                raise ResumeStateError(
                    f"{file}: `optimizer/{n}` lacks {', '.join(lacking)} (has {', '.join(sorted(st))})"
                )


def _check_stepped_present(file: str, infos: dict[str, dict[str, Any]], optimizer: AdamW, stepped: set[str]) -> None:
    """Every parameter this rank updates (its own share under sharding) that the state says stepped
    (meta.json ``flex.stepped``) has its moments in ``infos``: a parameter whose whole entry is absent
    would restart its moments from zero as silently as one missing moment would."""
    absent = sorted(
        n
        for n, p in optimizer.params
        if n in stepped and p.name in optimizer._own and not set(infos.get(n, {})) - {"master"}
    )
    if absent:
        raise ResumeStateError(
            f"{file}: no optimizer state for {len(absent)} parameter(s) this rank updates that the state says "
            f"stepped (meta.json flex.stepped): {absent[:5]}; their moments would restart from zero"
        )


# ---------------------------------------------------------------- flex-checkpoint (any layout)
def _pieces(key: str, t: paddle.Tensor, spec: ShardSpec, topo: Topology) -> tuple[list[str], dict[str, Any], int]:
    """``(keys, ShardedWeight geometry, axis)`` of one local tensor: one key, or one per fused block
    of a ``chunks`` axis (each block is split over the group on its own, so all share the geometry)."""
    shape = tuple(int(d) for d in t.shape)
    if spec.axis is None:
        return [key], {"local_shape": shape, "global_shape": shape, "global_offset": (0,) * len(shape)}, 0
    axis = spec.axis % len(shape)
    size, rank = topo.size(spec.group), topo.rank_in(spec.group)
    if shape[axis] % spec.chunks:
        raise ValueError(f"resume state: {key!r} axis {axis} of {list(shape)} does not hold {spec.chunks} blocks")
    block = shape[axis] // spec.chunks
    geometry = {
        "local_shape": shape[:axis] + (block,) + shape[axis + 1 :],
        "global_shape": shape[:axis] + (block * size,) + shape[axis + 1 :],
        "global_offset": tuple(rank * block if a == axis else 0 for a in range(len(shape))),
    }
    return [key] if spec.chunks == 1 else [f"{key}#block{i}" for i in range(spec.chunks)], geometry, axis


def _flex_items(model: nn.Layer, optimizer: AdamW, stepped: set[str]) -> list[tuple[str, paddle.Tensor, ShardSpec]]:
    """``(key, local tensor, shard spec)`` of everything this rank holds: model state, then the
    optimizer state of the parameters it updates that have stepped (moments as their parameter,
    beta powers replicated, fp32 masters as their parameter)."""
    items = [(f"model/{n}", t, get_shard_spec(t)) for n, t in model.state_dict().items()]
    acc = getattr(optimizer.opt, "_accumulators", {})
    masters = getattr(optimizer.opt, "_master_weights", {}) or {}
    for n, p in optimizer.params:
        if n not in stepped or p.name not in optimizer._own:
            continue
        spec, key = get_shard_spec(p), optimizer._acc_key(p)
        for kind in sorted(acc):
            if key in acc[kind]:
                t = acc[kind][key]
                items.append((f"optimizer/{n}/{kind}", t, spec if list(t.shape) == list(p.shape) else ShardSpec()))
        if p.name in masters:
            items.append((f"optimizer/{n}/master", masters[p.name], spec))
    return items


def _save_flex(folder: str, topo: Topology, model: nn.Layer, optimizer: AdamW) -> list[str]:
    """Collective: write ``folder`` with ``paddle.distributed.save_state_dict``; returns the names of
    every parameter that has optimizer state on some rank (a resume asks only for those)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    stepped = set().union(*map(set, ckpt_dist.all_gather_object(sorted(optimizer._stepped), topo)))
    sd: dict[str, ShardedWeight] = {}
    for key, t, spec in _flex_items(model, optimizer, stepped):
        keys, geometry, axis = _pieces(key, t, spec, topo)
        blocks = [t.detach()] if len(keys) == 1 else paddle.split(t.detach(), len(keys), axis=axis)
        for k, b in zip(keys, blocks):
            sd[k] = ShardedWeight(key=k, local_tensor=b, **geometry)
    os.makedirs(folder, exist_ok=True)
    quiet_paddle_logs()
    dist.save_state_dict(sd, folder, safetensors=True)  # tensors as safetensors; Paddle's metadata is a pickle
    return sorted(stepped)


def _views_write_through() -> bool:
    """Whether writing into a slice of a column block of a tensor on this process's device, as
    flex-checkpoint's resharder writes a piece into its target (``paddle.assign`` into
    ``paddle.slice`` of it), changes the tensor itself: Paddle's strided views (FLAGS_use_stride_kernel).
    Probed once per load; where they do not, the fused tensors' blocks are read into buffers instead."""
    t = paddle.zeros([2, 4], dtype="float32")
    block = paddle.slice(t, axes=[1], starts=[2], ends=[4])
    paddle.assign(paddle.ones([1, 1], dtype="float32"), paddle.slice(block, axes=[0, 1], starts=[1, 1], ends=[2, 2]))
    paddle.assign(block, block)  # the resharder's last copy of a received target onto itself
    return t.numpy().tolist() == [[0.0] * 4, [0.0, 0.0, 0.0, 1.0]]


def _load_targets(
    t: paddle.Tensor, n: int, axis: int, shape: tuple[int, ...], in_place: bool
) -> tuple[list[paddle.Tensor], bool]:
    """``(the n tensors load_state_dict fills for t, whether they are t's own memory)``: t itself (one
    key) or views of its ``n`` fused blocks along ``axis``; else (``in_place`` false) new zero buffers
    of ``shape``, set into t after the load."""
    if not in_place:
        return [paddle.zeros(list(shape), dtype=t.dtype) for _ in range(n)], False
    own = t.detach()  # the same memory, outside autograd (a parameter is a leaf that needs grad)
    if n == 1:
        return [own], True
    block = shape[axis]
    return [paddle.slice(own, axes=[axis], starts=[i * block], ends=[(i + 1) * block]) for i in range(n)], True


def _load_flex(folder: str, topo: Topology, model: nn.Layer, optimizer: AdamW, stepped: set[str]) -> None:
    """Collective: this rank's slices of every tensor it holds, read and redistributed by
    ``paddle.distributed.load_state_dict`` from a checkpoint of another layout.

    Paddle's resharder writes each piece it reads or receives into a slice of the target it is given
    (``paddle.assign`` into ``paddle.slice`` of ``local_tensor``), so the targets are the live tensors
    themselves (a fused tensor's blocks: strided views of it): the load holds no copy of the state,
    only the resharder's own one-piece buffers.  A tensor off this process's default device (Paddle's
    CPU beta powers on a GPU) is read into a buffer of that device and set after the load, as are the
    fused tensors where views do not write through (:func:`_views_write_through`)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from ..parallel.fleet_gloo import flex_checkpoint_on_cpu

    # a rank holds a part of the model (its pipeline stage, its experts under their global ids): the
    # state is refused for the names no rank of this run holds (the same answer on every rank)
    mine = sorted(stepped - {n for n, _ in optimizer.params})
    unknown = set(mine).intersection(*map(set, ckpt_dist.all_gather_object(mine, topo)))
    if unknown:
        raise KeyError(f"--resume {folder}: optimizer state for parameters this model lacks: {sorted(unknown)[:5]}")
    optimizer.prepare_state()
    items = _flex_items(model, optimizer, stepped)
    home = str(paddle.zeros([1]).place)  # where paddle.zeros (the resharder's buffers) puts a tensor
    views = _views_write_through()
    sd: dict[str, ShardedWeight] = {}
    buffers: list[tuple[paddle.Tensor, int, list[paddle.Tensor]]] = []  # read beside the state: set after
    with paddle.no_grad():
        for key, t, spec in items:
            keys, geometry, axis = _pieces(key, t, spec, topo)
            in_place = str(t.place) == home and (len(keys) == 1 or views)
            targets, own = _load_targets(t, len(keys), axis, geometry["local_shape"], in_place)
            sd.update({k: ShardedWeight(key=k, local_tensor=b, **geometry) for k, b in zip(keys, targets)})
            if not own:
                buffers.append((t, axis, targets))
        with validated_flex_folder(folder) as private, flex_checkpoint_on_cpu(), reading_a_share():
            dist.load_state_dict(sd, private, safetensors=True)
        # the pieces this rank read (a fused tensor's blocks named #block<i>), before the buffers are
        # set; a refused state leaves them in this rank's tensors, and the run stops here
        _refuse_nonfinite(f"{folder} (resharded)", topo.rank, nonfinite_state_counts(sd))
        del sd
        for t, axis, bufs in buffers:
            t.set_value(bufs[0] if len(bufs) == 1 else paddle.concat(bufs, axis=axis))
    optimizer._stepped = {n for n, p in optimizer.params if n in stepped and p.name in optimizer._own}
    optimizer.sync_masters({n for n, _ in optimizer.params} - stepped)  # no master in the state: from the weight
