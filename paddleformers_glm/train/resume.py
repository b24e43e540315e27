"""Resume state: per-rank model / optimizer / RNG state plus run metadata, saved atomically.

(Model weights in a release layout are paddleformers_glm/checkpoint/; this is the trainer's own
state for ``--save-every`` / ``--resume``, valid for the same parallel layout only.)

Layout: ``ROOT/step_00000004/{meta.json, rank_00000.pdstate, ...}`` and ``ROOT/latest`` naming the
newest complete step.  Every rank writes its own file into ``step_*.tmp``; after a barrier rank 0
writes meta.json and renames the folder, so a crash never leaves a half checkpoint under a
final name.  Resuming needs the same parallel layout (the files hold local shards); the data
position is the step number (data.py addresses batches by step).
Multi-node: ROOT must be on a filesystem every node sees.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn

from .._io import atomic_path, atomic_write_bytes, atomic_write_text
from ..parallel.topology import Topology
from .optim import AdamW

__all__ = ["load_resume_state", "resolve_resume_state", "save_resume_state"]


def _barrier(topo: Topology) -> None:
    if topo.world_size > 1:
        dist.barrier()


def _rng_state() -> bytes:
    return pickle.dumps({"paddle": paddle.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()})


def _set_rng_state(blob: bytes) -> None:
    st = pickle.loads(blob)
    paddle.set_rng_state(st["paddle"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])


def save_resume_state(
    root: str, step: int, topo: Topology, model: nn.Layer, optimizer: AdamW, meta: dict[str, Any]
) -> str:
    """Collective. Returns the final folder path."""
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    blob = {
        "model": {k: v.detach() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "rank": topo.rank,
    }
    path = os.path.join(tmp, f"rank_{topo.rank:05d}.pdstate")
    with atomic_path(path) as tmp_file:  # paddle.save writes to a file name only
        paddle.save(blob, tmp_file)
    atomic_write_bytes(path + ".rng", _rng_state())  # paddle.save takes no bytes; RNG states are pickled apart
    _barrier(topo)
    if topo.rank == 0:
        atomic_write_text(
            os.path.join(tmp, "meta.json"), json.dumps({**meta, "step": step, "world_size": topo.world_size}, indent=1)
        )
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(os.path.join(root, "latest"), os.path.basename(final) + "\n")
    _barrier(topo)
    return final


def resolve_resume_state(path: str) -> str:
    """A step folder, or a checkpoint root (its ``latest``)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            return os.path.join(path, f.read().strip())
    ckpt = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpt):
        return resolve_resume_state(ckpt)
    raise FileNotFoundError(f"--resume {path}: no meta.json, latest, or checkpoints/ here")


def load_resume_state(
    path: str, topo: Topology, model: nn.Layer, optimizer: AdamW, expect_profile: dict[str, Any]
) -> dict[str, Any]:
    """Restore this rank's state; returns meta.json. The saved layout must equal ``expect_profile``."""
    path = resolve_resume_state(path)
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    saved = meta.get("profile", {})
    diff = {k: (saved.get(k), v) for k, v in expect_profile.items() if saved.get(k) != v}
    if diff:
        raise ValueError(
            f"--resume {path}: checkpoint layout differs from this run: "
            + ", ".join(f"{k} saved {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
        )
    file = os.path.join(path, f"rank_{topo.rank:05d}.pdstate")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--resume {path}: no state for rank {topo.rank} ({file})")
    blob = paddle.load(file)
    state = model.state_dict()
    missing = set(state) - set(blob["model"])
    if missing:
        raise KeyError(f"--resume {file}: model tensors missing: {sorted(missing)[:5]}")
    for k, t in state.items():
        v = blob["model"][k]
        t.set_value((v if isinstance(v, paddle.Tensor) else paddle.to_tensor(v)).astype(t.dtype))
    optimizer.set_state_dict(blob["optimizer"])
    with open(file + ".rng", "rb") as f:
        _set_rng_state(f.read())
    return meta
