"""paddleformers_glm: GLM-5.2 (`glm_moe_dsa`) for PaddlePaddle."""

from .configuration import GlmMoeDsaConfig

__version__ = "0.1.0"
__all__ = ["GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmMoeDsaPreTrainedModel", "GlmTokenizer"]


def __getattr__(name: str):
    # Paddle is imported lazily so that config tools work without it.
    if name in ("GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmMoeDsaPreTrainedModel", "CausalLMOutput"):
        from . import modeling

        return getattr(modeling, name)
    if name == "GlmTokenizer":  # needs the tokenizers library, not Paddle
        from .tokenizer import GlmTokenizer

        return GlmTokenizer
    raise AttributeError(name)
