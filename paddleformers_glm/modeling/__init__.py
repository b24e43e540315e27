"""The GLM-5.2 model in Paddle, one concept per module (norms, rope, indexer, attention, moe, decoder,
mtp, cache), one stage-aware model (model.py) and transformers' PreTrainedModel API it is built on
(pretrained.py: loading, saving, embeddings, generate).  The model's names are imported on first use, so that
the modules without Paddle (``indexer_stages``: what the trainer checks before it starts a process) load
without it."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CausalLMOutput",
    "GlmMoeDsaForCausalLM",
    "GlmMoeDsaModel",
    "GlmMoeDsaPreTrainedModel",
    "GlmMoeDsaStageModel",
    "causal_lm_loss",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".model", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
