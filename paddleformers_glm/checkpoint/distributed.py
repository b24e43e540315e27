"""Distributed export: every rank writes the official-layout (HF) tensors it owns straight into the
final safetensors files, so no process ever holds more than one merged tensor at a time
(docs/checkpoints.md, "Saving"). The shard plan (each tensor's file and offset) is a pure function of
the config, dtype and shard size, so every rank computes the same one; rank 0 writes the headers,
checks that every tensor was written once and publishes the folder, which every rank must see.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn

from .._io import WriteError
from ..parallel import comm
from ..parallel.layers import get_shard_spec, merge_slices
from ..parallel.state import to_numpy
from ..parallel.topology import Topology
from .aoa import checkpoint_units, quiet_paddle_logs
from .engine import StateDictSource, TargetSpec, run_units
from .errors import CheckpointError
from .layout import fleet_param_specs
from .loader import normalize_dtype
from .safetensors_io import INDEX_NAME, SafetensorsWriter, paddle_to_st_dtype
from .saver import (
    SaveReport,
    clean_stale_saves,
    finish_save,
    parse_size,
    plan_entries,
    plan_shards,
    remove_tree,
    save_target,
    temp_prefix,
)

__all__ = ["all_gather_object", "export_distributed", "save_pretrained_distributed"]

_META = {"format": "pt"}  # what save_pretrained writes by default, and the only metadata this export writes
# where the writer's whole tensors and their converted copies live: they go to the file from the host,
# and Paddle's default device (the GPU of a training run, its model and optimizer still resident)
# would stage each there and back (the fp32 embedding alone is 3.8 GB at the official width)
_HOST = paddle.CPUPlace()


def _group_gathers(spec: Any, topo: Topology) -> bool:
    """Whether this rank's group holds the canonical copy of its tensors (the same answer on every member)."""
    if spec.expert:  # an etp group shares its edp rank (it may span cp ranks)
        return topo.edp_rank == 0
    return topo.dp_rank == 0 and topo.cp_rank == 0  # context-parallel ranks hold dense replicas


def _owner_candidate(spec: Any, topo: Topology) -> bool:
    """A canonical holder: rank 0 of a merging group (a TP-split tensor is merged there); for experts
    edp 0 / etp 0 (the expert grid spans the cp ranks: a cp rank > 0 may own experts no other has)."""
    return _group_gathers(spec, topo) and (topo.etp_rank if spec.expert else topo.tp_rank) == 0


def all_gather_object(obj: Any, topo: Topology) -> list[Any]:
    """``obj`` of every rank, in rank order (collective; the object itself at world size 1)."""
    if topo.world_size == 1:
        return [obj]
    out: list[Any] = []
    dist.all_gather_object(out, obj)
    return out


_GLOO_CHUNK_BYTES = 4 << 20  # on gloo, what one broadcast moves


def _gather_to_writer(t: paddle.Tensor, spec: Any, dst: int, topo: Topology) -> list[np.ndarray] | None:
    """Every group member's piece of a split tensor, as host arrays in group-rank order (bf16/fp16
    widened to fp32, losslessly, as before), on its writer ``dst`` only (None on the others;
    collective over the group).

    A member that does not write the tensor only sends its piece and never holds the whole tensor (an
    all-gather gave every member the whole tensor, twice over on gloo: for the 744B model's embedding
    1.9 GB per rank; docs/scale.md). A group without the writer (the last stage's copy of the
    embedding the first stage writes) moves nothing. On NCCL one ``paddle.distributed.gather`` per
    tensor. On gloo (Paddle 3.3.1) a gather's sender allocates the whole gathered size per call and
    keeps it: a 24 MiB piece sent in 4 MiB gathers rose its sender 41 MiB, so there each member
    broadcasts its piece in flat chunks of at most ``_GLOO_CHUNK_BYTES`` from the tensor itself (its
    sender stays at 0.6 MiB), received into one reused buffer (docs/scale.md)."""
    group = topo.group(spec.group)
    if dst not in group.ranks:  # the same answer on every member: ``dst`` is a global rank
        return None
    flat = t.detach().reshape([-1])
    if not comm.uses_emulation():
        got: list[paddle.Tensor] | None = [] if topo.rank == dst else None
        dist.gather(flat, got, dst=dst, group=group)
        return [to_numpy(p).reshape(t.shape) for p in got] if got is not None else None
    numel = int(flat.shape[0])
    step = max(1, _GLOO_CHUNK_BYTES // t.element_size())
    host = [np.empty(0)] * len(group.ranks)
    buf: paddle.Tensor | None = None
    for i, src in enumerate(group.ranks):
        if src == dst:
            if topo.rank == dst:
                host[i] = to_numpy(flat)
            continue
        for a in range(0, numel, step):
            n = min(step, numel - a)
            if topo.rank == src:
                dist.broadcast(flat[a : a + n], src=src, group=group)
                continue
            if buf is None or int(buf.shape[0]) != n:  # one buffer, and one more for a shorter last chunk
                buf = paddle.empty([n], dtype=t.dtype)
            dist.broadcast(buf, src=src, group=group)
            if topo.rank == dst:
                arr = to_numpy(buf)
                if not host[i].size:
                    host[i] = np.empty(numel, dtype=arr.dtype)
                host[i][a : a + n] = arr
    return [h.reshape(t.shape) for h in host] if topo.rank == dst else None


def _barrier(topo: Topology) -> None:
    if topo.world_size > 1:
        dist.barrier()


def export_distributed(
    module: nn.Layer,
    config: Any,
    out_dir: str,
    topo: Topology | None = None,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    carry_from: str | os.PathLike | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    generation_config: Any = None,
) -> dict[str, Any]:
    """Write ``module``'s weights (every rank's stage module; collective) as an HF-layout checkpoint.

    ``carry_from``: a source folder whose tokenizer / generation-config / chat-template files rank 0
    copies in (as the single-process saver does); ``tokenizer_from``: the folder of the tokenizer the
    weights were trained with, whose tokenizer files are carried instead of ``carry_from``'s.  Returns ``{"tensors": written by this rank,
    "bytes": their bytes, "files": [...]}``."""
    topo = topo or Topology.single()
    quiet_paddle_logs()
    out_dir = save_target(out_dir)  # a link to a folder: the folder (as the single-process save)
    model_dtype = dtype or config.model_dtype
    specs, tgt_dtypes, entries = plan_entries(config, "hf", model_dtype)
    shards = plan_shards(entries, parse_size(max_shard_size))
    file_of = {k: name for name, keys in shards.items() for k in keys}
    plans = {name: [(k, entries[k][1], entries[k][0]) for k in keys] for name, keys in shards.items()}

    # one writer per Fleet tensor: the lowest rank among its canonical holders
    state = module.state_dict()
    mine = [k for k, t in state.items() if _owner_candidate(get_shard_spec(t), topo)]
    writer: dict[str, int] = {}
    for r, keys in enumerate(all_gather_object(mine, topo)):
        for k in keys:
            writer.setdefault(k, r)
    lacking = sorted(set(fleet_param_specs(config)) - set(writer))
    if lacking:
        raise CheckpointError(f"export: no rank holds {len(lacking)} tensors, e.g. {lacking[:3]}")

    # The temporary folder carries rank 0's pid, as a one-process save's does: a later save, convert
    # or export to this target removes it once that process is gone (a killed export's shards are
    # created at their whole size); rank 0 removes it itself on any failure it sees.
    tmp = None
    if topo.rank == 0:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        clean_stale_saves(out_dir)
        remove_tree(os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-export"))  # no pid
        tmp = os.path.join(os.path.dirname(out_dir), temp_prefix(out_dir, "tmp") + "export")
    tmp = all_gather_object(tmp, topo)[0]
    try:
        if topo.rank == 0:
            os.makedirs(tmp)
            for name, plan in plans.items():
                SafetensorsWriter(os.path.join(tmp, name), plan, _META).close(complete=False)
        _barrier(topo)

        writers: dict[str, SafetensorsWriter] = {}
        try:
            for unit in checkpoint_units(config, "hf"):
                keys = [k for k in unit.fleet if k in state]
                if not keys:
                    continue
                if len(keys) != len(unit.fleet):
                    raise CheckpointError(
                        f"export: unit {unit.name} is split over pipeline stages: holds {keys} of {list(unit.fleet)}"
                    )
                full: dict[str, paddle.Tensor] = {}
                owner = all(writer[k] == topo.rank for k in keys)
                if not owner and any(writer[k] == topo.rank for k in keys):
                    raise CheckpointError(f"export: unit {unit.name} has tensors owned by different ranks")
                for k in keys:
                    t = state[k]
                    spec = get_shard_spec(t)
                    size = topo.size(spec.group) if spec.axis is not None else 1
                    if size > 1:
                        parts = _gather_to_writer(t, spec, writer[k], topo)
                        merged = merge_slices(parts, spec) if owner else None
                        del parts  # the pieces go before the merged copy becomes a tensor: two copies at most
                        if owner:
                            full[k] = paddle.to_tensor(merged, place=_HOST)
                        del merged
                    elif owner:
                        full[k] = paddle.to_tensor(to_numpy(t.detach()), place=_HOST)
                if not owner:
                    continue
                targets = {h: TargetSpec(h, tuple(specs[h][0]), tgt_dtypes[h], place=_HOST) for h in unit.hf}
                for key, out in run_units([unit], "fleet_to_hf", StateDictSource(full), targets):
                    name = file_of[key]
                    if name not in writers:
                        writers[name] = SafetensorsWriter(os.path.join(tmp, name), plans[name], _META, create=False)
                    writers[name].write(key, out.numpy(), paddle_to_st_dtype(out.dtype))
                del full
        finally:
            for w in writers.values():
                w.close(complete=False)

        written = {k: w.offsets[k][1] - w.offsets[k][0] for w in writers.values() for k in w.written}  # key -> bytes
        every = all_gather_object(sorted(written), topo)
        if topo.rank == 0:
            seen: dict[str, int] = {}
            for r, keys in enumerate(every):
                for k in keys:
                    if k in seen:
                        raise CheckpointError(f"export: {k} written by ranks {seen[k]} and {r}")
                    seen[k] = r
            missing = sorted(set(entries) - set(seen))
            if missing:
                raise CheckpointError(f"export: {len(missing)} tensors never written, e.g. {missing[:3]}")
            finish_save(
                tmp,
                out_dir,
                config,
                shards,
                entries,
                None,
                carry_from,
                model_dtype,
                tokenizer_from,
                generation_config=generation_config,
            )
    except BaseException as e:
        if topo.rank == 0:
            remove_tree(tmp)
        if isinstance(e, WriteError) and not e.what:  # a full disk: the run's one line says it was the export
            e.what = f"the export to {out_dir}"
        raise
    _barrier(topo)
    files = [*shards, *([INDEX_NAME] if len(shards) > 1 else [])]
    return {"tensors": len(written), "bytes": sum(written.values()), "files": files}


def save_pretrained_distributed(
    model: nn.Layer,
    save_directory: str | os.PathLike,
    *,
    config: Any = None,
    layout: str = "hf",
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    quantization: str | None = None,
    carry_from: str | os.PathLike | None = None,
    metadata: Any = None,
    expert_layout: str = "per-expert",
    topo: Topology | None = None,
    generation_config: Any = None,
) -> Any:
    """``save_pretrained`` for a model split over ranks: collective, every rank calls it with its own part
    of the model, through :func:`export_distributed`. The official layout without quantization only (a
    Fleet-layout or FP8 save of a split model is refused, not silently gathered). Returns the same
    ``SaveReport`` on every rank (``tensors`` counts all ranks')."""
    import time

    dtype = normalize_dtype(dtype)  # names, aliases ("bf16") and Paddle dtypes
    dtype = None if dtype == "auto" else dtype
    if layout != "hf":
        raise ValueError(f"save_pretrained of a model split over ranks writes layout='hf' only, got {layout!r}")
    if quantization not in (None, "none"):
        raise ValueError(f"save_pretrained of a model split over ranks cannot quantize (got {quantization!r})")
    if metadata is not None and dict(metadata) != _META:
        raise ValueError(
            f"save_pretrained of a model split over ranks writes metadata {{'format': 'pt'}}, got {metadata!r}"
        )
    if expert_layout != "per-expert":
        raise ValueError(f"expert_layout {expert_layout!r} applies to the fleet layout only")
    t0 = time.perf_counter()
    config = config if config is not None else model.config
    if generation_config is None and hasattr(model, "_changed_generation_config"):
        generation_config = model._changed_generation_config()  # what the model's save_pretrained writes
    topo = topo or Topology.single()
    out_dir = save_target(save_directory)
    info = export_distributed(
        model,
        config,
        out_dir,
        topo,
        dtype=dtype,
        max_shard_size=max_shard_size,
        carry_from=carry_from,
        generation_config=generation_config,
    )
    counts = all_gather_object([info["tensors"], info["bytes"]], topo)
    files = [os.path.join(out_dir, f) for f in sorted(os.listdir(out_dir))]
    return SaveReport(
        out_dir, "hf", files, sum(c[0] for c in counts), sum(c[1] for c in counts), time.perf_counter() - t0
    )
