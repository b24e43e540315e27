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

__all__ = ["NonFiniteStep", "gather_json", "loss_flag", "nonfinite_record"]


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
