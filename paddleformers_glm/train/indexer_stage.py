"""The trainer's side of training the DSA indexer (``glm52 train --indexer-stage``): which stage a
run trains, the loss terms and their weights, the per-layer report in ``loss.json``.  The model's
side (dense warm-up, targets, KL, recall) is modeling/indexer_training.py; the stages, the loss
scaling and what a resume across stages keeps are docs/indexer.md.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..modeling.indexer_training import INDEXER_STAGES, IndexerTraining, kl_term, recall_term
from .adapter import LossSpec

__all__ = ["INDEXER_STAGES", "IndexerSettings", "indexer_loss_specs", "indexer_report", "pop_indexer_history"]

_LAYER_KEY = re.compile(r"^indexer_(kl|recall)@(\d+)$")


class IndexerSettings:
    """A run's indexer training, resolved against the model's config: ``stage``, the KL's weight in
    the objective, ``shared_supervision`` and the layers that run their own indexer."""

    def __init__(
        self, config: Any, stage: str | None = None, loss_coeff: float | None = None, shared_supervision: bool = False
    ) -> None:
        saved = float(getattr(config, "indexer_loss_coeff", 0.0) or 0.0)
        stage = stage or IndexerTraining.from_config(config).stage  # None: the checkpoint's default
        self.training = IndexerTraining(stage, bool(shared_supervision))  # checks the stage
        if loss_coeff is not None and stage != "sparse":
            raise ValueError(
                f"--indexer-loss-coeff weighs the sparse stage's KL; --indexer-stage {stage} "
                + ("trains on the dense KL alone (weight 1)" if stage == "warmup" else "has no indexer loss")
            )
        coeff = saved if loss_coeff is None else float(loss_coeff)
        if stage == "sparse" and not coeff > 0:
            raise ValueError(
                "--indexer-stage sparse needs --indexer-loss-coeff > 0 (the checkpoint's indexer_loss_coeff is "
                f"{saved:g}; PaddleFleet's default is 0.01, the GLM-5 recipe of Megatron-Bridge 0.001)"
            )
        self.stage = stage
        self.weight = {"none": 0.0, "warmup": 1.0, "sparse": coeff}[stage]
        self.shared_supervision = bool(shared_supervision)
        L = int(config.num_hidden_layers)
        own = [i for i, k in enumerate(config.indexer_types) if k == "full"]
        if not bool(getattr(config, "index_share_for_mtp_iteration", False)):
            own += list(range(L, L + int(getattr(config, "num_mtp_layers", 0) or 0)))
        self.layers = own

    def describe(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "loss_weight": self.weight,
            "shared_supervision": self.shared_supervision,
            "layers": list(self.layers),
        }


def indexer_loss_specs(settings: IndexerSettings) -> dict[str, LossSpec]:
    """The indexer's loss terms: ``indexer_kl`` (the objective's, weight per stage) and per layer its
    KL and recall (weight 0: reports), each a per-micro-batch mean (see the module docstring)."""
    if settings.stage == "none":
        return {}
    specs = {"indexer_kl": LossSpec("micro_batches", weight=settings.weight, report="indexer_losses")}
    for i in settings.layers:
        specs[kl_term(i)] = LossSpec("micro_batches", weight=0.0, report=kl_term(i))
        specs[recall_term(i)] = LossSpec("micro_batches", weight=0.0, report=recall_term(i))
    return specs


def pop_indexer_history(values: dict[str, Any]) -> dict[str, dict[int, list[float]]]:
    """Take the per-layer report keys (``indexer_kl@<id>``, ``indexer_recall@<id>``) out of a flat
    loss dict: ``{"kl": {layer: [per step]}, "recall": {...}}``."""
    out: dict[str, dict[int, list[float]]] = {"kl": {}, "recall": {}}
    for key in [k for k in values if _LAYER_KEY.match(k)]:
        kind, layer = _LAYER_KEY.match(key).groups()
        out[kind][int(layer)] = list(values.pop(key))
    return out


def indexer_report(
    per_layer: dict[str, dict[int, list[float]]], steps: list[int], stages: list[dict[str, Any]], settings: dict
) -> dict[str, Any] | None:
    """loss.json's ``indexer`` block: the stage settings, the steps that trained the indexer and per
    step the KL and the top-k recall of every layer (``[step][layer]``, layers in ``layers`` order),
    the mean recall per step, and each stage's first and last step."""
    layers = sorted(per_layer["recall"])
    if not layers and not stages:
        return None
    n = len(steps)
    kl = [[per_layer["kl"][i][s] for i in layers] for s in range(n)]
    recall = [[per_layer["recall"][i][s] for i in layers] for s in range(n)]
    return {
        **settings,
        "layers": layers,
        "steps": list(steps),
        "kl": kl,
        "recall": recall,
        "mean_recall": [sum(r) / len(r) if r else math.nan for r in recall],
        "stages": stages,
    }
