"""Step dumps (``glm52 train --dump-step DIR K``): the training state after update K, fp32, in the
checkpoint's official names, one folder per :data:`DUMP_KINDS` (what each holds, and how ``glm52
align`` compares them with the torch reference's: docs/parity.md).  :func:`adam_moments` is the only
place that knows the optimizer's storage.  Under sharding every value is first broadcast from the
rank that updates it; rank 0 gathers each full tensor (like ``--export``): meant for the small
models a parity run uses.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle

from .._io import atomic_path

__all__ = ["DUMP_KINDS", "adam_moments", "dump_training_state"]

DUMP_KINDS = ("grads", "exp_avg", "exp_avg_sq", "weights")


def adam_moments(opt: Any, name: str, param: paddle.Tensor) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
    """(first moment, second moment) of one parameter, or (None, None) before its first update:
    the trainer's AdamW keeps them by structured name in ``opt.state[name]`` under Paddle's
    accumulator kinds (``moment1`` / ``moment2``); a bare ``paddle.optimizer.AdamW`` (possibly
    wrapped by ``fleet.distributed_optimizer``) through ``_get_accumulator_master``.  moment2 is the
    plain (not square-rooted) average of g²."""
    state = getattr(opt, "state", None)
    if isinstance(state, Mapping):
        st = state.get(name) or {}
        return tuple(next((v for k, v in st.items() if k.endswith(m)), None) for m in ("moment1", "moment2"))
    inner = getattr(opt, "_inner_opt", opt)
    try:
        return tuple(inner._get_accumulator_master(k, param) for k in (inner._moment1_acc_str, inner._moment2_acc_str))
    except Exception:  # noqa: BLE001 - Paddle raises a bare Exception for a parameter never updated
        return None, None


def dump_training_state(
    out_dir: str, module: paddle.nn.Layer, opt: Any, grads: Mapping[str, paddle.Tensor], topo: Any, adapter: Any
) -> None:
    """Write the four dumps of this step to ``out_dir`` (collective: every rank calls it); ``grads``:
    the synced, not yet clipped gradients by structured name (as ``GradSynchronizer.main_grads``
    returns them)."""
    from ..checkpoint import save_pretrained_state
    from ..parallel import comm
    from ..parallel.layers import get_shard_spec
    from ..parallel.state import gather_full_state

    state = module.state_dict()
    params = dict(module.named_parameters())
    # sharding: the rank that updates a parameter holds its moments (and, at stage 2, its gradient)
    owners = opt.grad_owners() if getattr(opt, "sharding", None) is not None else {}
    for kind in DUMP_KINDS:
        local: dict[str, paddle.Tensor] = {}
        for n, t in state.items():
            p = params.get(n)
            if kind == "weights":  # a frozen parameter (the indexer's warm-up) has no master: its weight
                w = opt.master_weight(n) if p is not None else None
                v = t if w is None else w
            elif kind == "grads":
                v = grads.get(n) if p is not None else None
            else:
                v = adam_moments(opt, n, p)[kind == "exp_avg_sq"] if p is not None else None
            v = paddle.zeros(t.shape, "float32") if v is None else v.detach().astype("float32").clone()
            if n in owners:  # the same names in the same order on every sharding rank of the stage
                comm.broadcast(v, topo.sharding_group.ranks[owners[n]], topo.sharding_group)
            v.shard_spec = get_shard_spec(t)  # how this rank's piece sits in the full tensor
            local[n] = v
        full = gather_full_state(SimpleNamespace(state_dict=lambda s=local: s), topo)  # it reads ``state_dict()``
        if full is None:
            continue
        target = os.path.join(out_dir, kind)
        tensors = {k: paddle.to_tensor(np.ascontiguousarray(v)) for k, v in full.items()}
        save_pretrained_state(tensors, adapter.config, target, layout="hf", dtype="float32", max_shard_size="1000GB")
        model_dir = getattr(adapter, "model_dir", None)
        if model_dir:  # the model's own config, byte for byte, so both sides' dumps carry the same one
            with atomic_path(os.path.join(target, "config.json")) as tmp:
                shutil.copyfile(os.path.join(model_dir, "config.json"), tmp)
