"""The checks of the training settings that need no Paddle: ``glm52 train`` runs them (TrainConfig.validate,
IndexerSettings), and so does the torch reference run (parity/reference/train.py), which must not load Paddle."""

from __future__ import annotations

import math
from typing import Any

# counts and their least value
_COUNTS = {"steps": 1, "seq_len": 1, "global_batch_size": 1, "micro_batch_size": 1, "vpp": 1}
_COUNTS.update(save_every=0, skip_nonfinite_steps=0)
# float settings that must be finite numbers and >= 0 (None allowed for min_lr and indexer_loss_coeff)
_NONNEGATIVE_FLOATS = (
    "lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "moe_bias_update_rate", "moe_aux_loss_coeff",
    "indexer_loss_coeff",
)  # fmt: skip


def check_numbers(settings: Any) -> None:
    """The counts and the float settings among ``settings``' attributes (a TrainConfig, or the reference
    run's flags, a subset): finite, since ``--lr nan`` would train on NaN."""
    for k, lo in _COUNTS.items():
        if hasattr(settings, k) and int(getattr(settings, k)) < lo:
            raise ValueError(f"--{k.replace('_', '-')} must be >= {lo}, got {getattr(settings, k)}")
    for k in (*_NONNEGATIVE_FLOATS, "adam_beta1", "adam_beta2"):
        v = getattr(settings, k, None)
        if v is None and (k in ("min_lr", "indexer_loss_coeff") or not hasattr(settings, k)):
            continue
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{flag} must be a finite number, got {v!r}")
        if k in _NONNEGATIVE_FLOATS and v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
        if k.startswith("adam_beta") and not 0 <= v < 1:
            raise ValueError(f"{flag} must be in [0, 1), got {v}")


def indexer_stage_weight(stage: str | None, loss_coeff: float | None, saved_coeff: float) -> tuple[str, float]:
    """(stage, weight of the indexer KL in the objective) from ``--indexer-stage`` / ``--indexer-loss-coeff``
    and the checkpoint's ``indexer_loss_coeff`` (docs/indexer.md): by default the sparse stage when that is
    > 0, else none; the warm-up's weight is 1, the sparse stage's the flag's (default the checkpoint's)."""
    stage = stage or ("sparse" if saved_coeff > 0 else "none")
    weights = {"none": 0.0, "warmup": 1.0, "sparse": saved_coeff if loss_coeff is None else float(loss_coeff)}
    if stage not in weights:
        raise ValueError(f"--indexer-stage must be one of {', '.join(weights)}, got {stage!r}")
    if loss_coeff is not None and stage != "sparse":
        raise ValueError(
            f"--indexer-loss-coeff weighs the sparse stage's KL; --indexer-stage {stage} "
            + ("trains on the dense KL alone (weight 1)" if stage == "warmup" else "has no indexer loss")
        )
    if stage == "sparse" and not weights[stage] > 0:
        raise ValueError(
            "--indexer-stage sparse needs --indexer-loss-coeff > 0 (the checkpoint's indexer_loss_coeff is "
            f"{saved_coeff:g}; PaddleFleet's default is 0.01, the GLM-5 recipe of Megatron-Bridge 0.001)"
        )
    return stage, weights[stage]
