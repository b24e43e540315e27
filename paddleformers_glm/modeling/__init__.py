"""The GLM-5.2 model in Paddle, one concept per module (norms, rope, indexer, attention, moe, decoder, mtp, model)."""

from .model import CausalLMOutput, GlmMoeDsaForCausalLM, GlmMoeDsaModel, GlmMoeDsaStageModel, causal_lm_loss

__all__ = ["CausalLMOutput", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmMoeDsaStageModel", "causal_lm_loss"]

from ..auto import register_if_installed as _register_if_installed  # noqa: E402

_register_if_installed()
