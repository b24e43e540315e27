"""paddleformers_glm: GLM-5.2 (`glm_moe_dsa`) for PaddlePaddle."""

from .configuration import GlmMoeDsaConfig

__version__ = "0.1.0"
__all__ = ["GlmMoeDsaConfig"]
