"""A training step whose loss or gradients are not finite stops the run before the optimizer
step (or, with ``--skip-nonfinite-steps N``, is skipped up to N times): weights, optimizer state,
checkpoints and the export never see a NaN (Megatron-LM's ``check_for_nan_in_loss_and_grad``).
How: :func:`loss_flag` folds the loss sums into the gradient norm's all-reduce (no collective of
its own); only then are the reports gathered (docs/failure-modes.md, "Non-finite steps").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from .._io import dumps_json

__all__ = [
    "NonFiniteStep",
    "check_written_state",
    "gather_json",
    "loss_flag",
    "nonfinite_record",
    "state_kind",
]


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm was not finite; ``record`` says where (JSON-ready)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        super().__init__(record["message"])


def loss_flag(sums: Iterable[paddle.Tensor | float]) -> paddle.Tensor:
    """float64 [1]: 0 when every one of this rank's loss sums is finite, NaN otherwise (0 times a
    NaN or an infinity), computed where the sums live, without reading them back."""
    flag = paddle.zeros([1], dtype="float64")
    for s in sums:
        t = s if isinstance(s, paddle.Tensor) else paddle.to_tensor([float(s)], dtype="float64")
        flag = flag + t.detach().astype("float64").reshape([-1])[:1] * 0.0
    return flag


def _value(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def local_report(
    rank: int, loss_sums: Mapping[str, float], grads: Mapping[str, paddle.Tensor], order: Iterable[str]
) -> dict[str, Any]:
    """This rank's part: its non-finite loss terms and its first non-finite gradient (in the
    stage's parameter order) with the number of non-finite gradient tensors."""
    losses = {k: _value(v) for k, v in loss_sums.items() if not math.isfinite(v)}
    bad = [n for n in order if grads.get(n) is not None and not bool(paddle.isfinite(grads[n]).all())]
    first = bad[0] if bad else None
    return {"rank": rank, "losses": losses, "first_nonfinite_grad": first, "nonfinite_grads": len(bad)}


def gather_json(obj: Any, world_size: int) -> list[Any]:
    """``obj`` of every rank, in rank order: strict JSON bytes through two all-gathers (lengths,
    then the padded bytes): no pickle crosses between processes."""
    if world_size == 1:
        return [obj]
    data = np.frombuffer(dumps_json(obj, indent=None).encode(), dtype=np.uint8)
    lens: list[paddle.Tensor] = []
    dist.all_gather(lens, paddle.to_tensor(np.array([data.size], dtype=np.int64)))
    n = max(int(t.numpy()[0]) for t in lens)
    padded = np.zeros(n, dtype=np.uint8)
    padded[: data.size] = data
    parts: list[paddle.Tensor] = []
    dist.all_gather(parts, paddle.to_tensor(padded))
    return [json.loads(p.numpy()[: int(k.numpy()[0])].tobytes()) for p, k in zip(parts, lens)]


def nonfinite_record(step: int, grad_norm: float, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of a non-finite step from every rank's :func:`local_report`: the culprit is the
    first rank with a non-finite loss, else the first with a non-finite gradient."""
    with_loss = [r for r in reports if r["losses"]]
    with_grad = [r for r in reports if r["first_nonfinite_grad"]]
    first_grad = {"rank": with_grad[0]["rank"], "name": with_grad[0]["first_nonfinite_grad"]} if with_grad else None
    culprit = (with_loss or with_grad or reports)[0]
    if first_grad:
        holders = ", ".join(str(r["rank"]) for r in with_grad)
        where = f"first non-finite gradient: {first_grad['name']} on rank {first_grad['rank']} (rank(s) {holders} hold some)"
    else:
        where = "no gradient element is non-finite"
    if with_loss:
        term, value = sorted(culprit["losses"].items())[0]
        quantity = f"{term} loss"
        what = f"non-finite {quantity} ({value}) on rank {culprit['rank']}; {where}; grad norm {_value(grad_norm)}"
    else:  # with no non-finite gradient element: their squared sum overflowed
        value = _value(grad_norm)
        quantity = "grad norm" if with_grad else "grad norm (overflow: every gradient element is finite)"
        # gradients synced over replicas and tensor-parallel ranks: their first rank, not their origin
        what = f"non-finite {quantity} ({value}); {where}"
    message = f"step {step}: {what}; stopped before the optimizer step (no update, no export)"
    return {
        "kind": "nonfinite",
        "rank": culprit["rank"],
        "step": step,
        "quantity": quantity,
        "value": value,
        "grad_norm": _value(grad_norm),
        "first_nonfinite_grad": first_grad,
        "ranks": [r for r in reports if r["losses"] or r["first_nonfinite_grad"]],
        "message": message,
    }


def state_kind(key: str) -> str:
    """What a resume state's tensor ``model/<name>`` or ``optimizer/<name>/<kind>`` is, in words."""
    if not key.startswith("optimizer/"):
        return "weight"
    kind = key.rsplit("/", 1)[-1]
    if kind == "master":
        return "fp32 master weight"
    if kind.startswith("moment"):
        return "optimizer moment"
    return "optimizer beta power" if "pow" in kind else "optimizer state"


def check_written_state(
    tensors: Mapping[str, Any], rank: int, world_size: int, step: int, what: str, flag_hint: str = ""
) -> None:
    """Collective (every rank, with its own ``tensors``): raise the same :class:`NonFiniteStep` on every
    rank when any rank's tensors about to be written as ``what`` ("resume state", "export") after
    ``step`` hold NaN or Inf, naming the first rank's first such tensor; nothing of it is then written.
    One gather of a few bytes per call (a save or an export), besides the test itself."""
    from ..checkpoint.finite import nonfinite_state_counts

    bad = nonfinite_state_counts(tensors)
    local = {"rank": rank, "tensors": [[k, n] for k, n in list(bad.items())[:5]], "count": len(bad)}
    reports = gather_json(local, world_size)
    holders = [r for r in reports if r["count"]]
    if not holders:
        return
    first = holders[0]
    name, n = first["tensors"][0]
    more = sum(r["count"] for r in holders) - 1
    also = f" and {more} more tensor(s) on rank(s) {', '.join(str(r['rank']) for r in holders)}" if more else ""
    kind = state_kind(name) if what == "resume state" else "weight"
    undone = "not saved" if what == "resume state" else "no export written"
    message = (
        f"step {step}: the {what} to be written holds NaN or Inf: {kind} {name} ({n} values) on rank "
        f"{first['rank']}{also}; {undone}{flag_hint}"
    )
    raise NonFiniteStep(
        {
            "kind": "nonfinite",
            "rank": first["rank"],
            "step": step,
            "quantity": f"{what} {kind}",
            "value": "nan or inf",
            "tensor": name,
            "ranks": holders,
            "message": message,
        }
    )
