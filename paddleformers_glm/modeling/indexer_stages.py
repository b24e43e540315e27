"""The DSA indexer's training stages (``none``, ``warmup``, ``sparse``: docs/indexer.md), the layers each
trains and the names of their report terms.  No Paddle: ``glm52 train`` checks a run's indexer settings
with these before it starts any process (indexer_training.py computes the stages' losses)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INDEXER_STAGES",
    "IndexerTraining",
    "check_coeff_stage",
    "check_warmup_flags",
    "kl_term",
    "objective_weights",
    "own_indexer_layers",
    "recall_term",
    "trains_in_warmup",
]

INDEXER_STAGES = ("none", "warmup", "sparse")


def own_indexer_layers(config: Any) -> list[int]:
    """The layers that run their own indexer: the full layers, and the MTP layers unless they reuse
    the main model's top-k (``index_share_for_mtp_iteration``: their indexer weights are kept in the
    checkpoint but never run, so nothing trains them)."""
    own = [i for i, k in enumerate(config.indexer_types) if k == "full"]
    if not bool(getattr(config, "index_share_for_mtp_iteration", False)):
        L = int(config.num_hidden_layers)
        own += list(range(L, L + int(getattr(config, "num_mtp_layers", 0) or 0)))
    return own


def trains_in_warmup(name: str, own_layers: Sequence[int]) -> bool:
    """Whether the dense warm-up trains parameter ``name`` (``model.layers.<i>....``): a DSA indexer's
    parameter (``...self_attn.core_attention.indexer.*``) of a layer in ``own_layers``."""
    parts = name.split(".")
    layer = parts[parts.index("layers") + 1] if "layers" in parts[:-1] else ""
    return ".indexer." in name and layer.isdigit() and int(layer) in own_layers


def objective_weights(stage: str, kl_weight: float) -> tuple[float, float]:
    """(weight of the LM and MTP losses, weight of the indexer KL) in ``stage``'s objective
    (docs/indexer.md, "The stages"): ``none`` (1, 0); ``warmup`` (0, 1: the dense KL alone, the LM and
    MTP losses reported only); ``sparse`` (1, ``kl_weight``), which needs ``kl_weight`` > 0.  The
    trainer's loss terms (train/indexer_stage.py) and the model's ``out.loss`` weigh with it."""
    if stage not in INDEXER_STAGES:
        raise ValueError(f"indexer stage must be one of {', '.join(INDEXER_STAGES)}, got {stage!r}")
    if stage == "warmup":
        return 0.0, 1.0
    if stage == "sparse" and not (math.isfinite(float(kl_weight)) and float(kl_weight) > 0):
        raise ValueError(
            f"the sparse indexer stage weighs its KL by a finite coefficient > 0, got {float(kl_weight):g}"
        )
    return 1.0, float(kl_weight) if stage == "sparse" else 0.0


def check_coeff_stage(stage: str, loss_coeff: float | None, name: str, label: str | None = None) -> None:
    """A KL coefficient (``name``: the flag or keyword that gave it) weighs the sparse stage's KL only:
    given with another stage (``label``: how the message names it) it is refused (the trainer's
    ``--indexer-loss-coeff`` and the model's ``set_indexer_training(loss_coeff=...)`` alike)."""
    if loss_coeff is not None and stage != "sparse":
        raise ValueError(
            f"{name} weighs the sparse stage's KL; {label or f'the {stage} stage'} "
            + ("trains on the dense KL alone (weight 1)" if stage == "warmup" else "has no indexer loss")
        )


def check_warmup_flags(stage: str | None, moe_bias_update_rate: float, moe_aux_loss_coeff: float) -> None:
    """The warm-up changes nothing but the indexers: no router-bias updates, no balance loss
    (``glm52 train``, ``glm52 align`` and the torch reference trainer refuse them with these words)."""
    if stage == "warmup" and (float(moe_bias_update_rate) > 0 or float(moe_aux_loss_coeff) > 0):
        raise ValueError(
            "--indexer-stage warmup freezes every parameter but the indexers: --moe-bias-update-rate and "
            "--moe-aux-loss-coeff must be 0"
        )


@dataclass(frozen=True)
class IndexerTraining:
    """How a training forward trains the indexer (see the module docstring)."""

    stage: str = "none"
    shared_supervision: bool = False

    def __post_init__(self) -> None:
        if self.stage not in INDEXER_STAGES:
            raise ValueError(f"indexer stage must be one of {', '.join(INDEXER_STAGES)}, got {self.stage!r}")
        if self.shared_supervision and self.stage == "none":
            raise ValueError("shared-layer supervision needs an indexer stage (warmup or sparse), got none")

    @property
    def active(self) -> bool:
        return self.stage != "none"

    @property
    def dense(self) -> bool:
        """Attention runs over every causal key (the warm-up)."""
        return self.stage == "warmup"

    @classmethod
    def from_config(cls, config: Any) -> IndexerTraining:
        """The default of a model: the sparse stage when its config sets ``indexer_loss_coeff`` > 0."""
        return cls("sparse" if float(getattr(config, "indexer_loss_coeff", 0.0) or 0.0) > 0 else "none")


def kl_term(layer: int) -> str:
    """The loss-term name of a layer's indexer KL report (``causal_lm_losses``)."""
    return f"indexer_kl@{layer}"


def recall_term(layer: int) -> str:
    """The loss-term name of a layer's top-k recall (``causal_lm_losses``)."""
    return f"indexer_recall@{layer}"
