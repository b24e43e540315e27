"""paddleformers_glm: GLM-5.2 (`glm_moe_dsa`) for PaddlePaddle."""

from .configuration import GlmMoeDsaConfig

__version__ = "0.1.0"
__all__ = ["GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "GlmTokenizer", "register_auto_classes"]


def __getattr__(name: str):
    # Paddle is imported lazily so that config tools work without it.
    if name in ("GlmMoeDsaForCausalLM", "GlmMoeDsaModel", "CausalLMOutput"):
        from . import modeling

        return getattr(modeling, name)
    if name == "GlmTokenizer":  # needs the tokenizers library, not Paddle
        from .tokenizer import GlmTokenizer

        return GlmTokenizer
    if name == "register_auto_classes":  # the one place registration with PaddleFormers happens
        from .auto import register_auto_classes

        return register_auto_classes
    raise AttributeError(name)
