"""The GLM-5.2 model in Paddle, one concept per module (norms, rope, indexer, attention, moe, decoder, mtp, model)."""

from .model import CausalLMOutput, GlmMoeDsaForCausalLM, GlmMoeDsaModel, GlmMoeDsaStageModel, causal_lm_loss

__all__ = ["CausalLMOutput", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmMoeDsaStageModel", "causal_lm_loss"]
