"""The trainer's side of training the DSA indexer (``glm52 train --indexer-stage``): which stage a
run trains, the loss terms and their weights, the per-layer report in ``loss.json``.  The model's
side (dense warm-up, targets, KL, recall) is modeling/indexer_training.py; the stages, the loss
scaling and what a resume across stages keeps are docs/indexer.md.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..modeling.indexer_stages import (
    INDEXER_STAGES,
    IndexerTraining,
    kl_term,
    objective_weights,
    own_indexer_layers,
    recall_term,
)
from .adapter import LossSpec
from .settings import indexer_stage_weight

__all__ = ["INDEXER_STAGES", "IndexerSettings", "indexer_loss_specs", "indexer_report", "pop_indexer_history"]

_LAYER_KEY = re.compile(r"^indexer_(kl|recall)@(\d+)$")


class IndexerSettings:
    """A run's indexer training, resolved against the model's config: ``stage``, the KL's weight in
    the objective (``weight``) and the LM and MTP losses' (``lm_weight``: 0 in the warm-up), both
    :func:`objective_weights`', as the model's ``out.loss`` weighs them; ``shared_supervision`` and
    the layers that run their own indexer."""

    def __init__(
        self, config: Any, stage: str | None = None, loss_coeff: float | None = None, shared_supervision: bool = False
    ) -> None:
        self.stage, coeff = indexer_stage_weight(
            stage, loss_coeff, float(getattr(config, "indexer_loss_coeff", 0) or 0)
        )
        self.lm_weight, self.weight = objective_weights(self.stage, coeff)
        self.training = IndexerTraining(self.stage, bool(shared_supervision))
        self.shared_supervision = bool(shared_supervision)
        self.layers = own_indexer_layers(config)

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
