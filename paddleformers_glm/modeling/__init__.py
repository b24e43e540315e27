"""The GLM-5.2 model in Paddle, one concept per module (norms, rope, indexer, attention, moe, decoder,
mtp, cache) and one stage-aware model (model.py)."""

from .model import CausalLMOutput, GlmMoeDsaForCausalLM, GlmMoeDsaModel, GlmMoeDsaStageModel, causal_lm_loss

__all__ = ["CausalLMOutput", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmMoeDsaStageModel", "causal_lm_loss"]
