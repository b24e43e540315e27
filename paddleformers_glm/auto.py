"""Optional registration with PaddleFormers' Auto classes, so that `AutoConfig.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` resolve `model_type: glm_moe_dsa` to this package's classes.

PaddleFormers is not a dependency, and importing this package registers nothing: registration is
the one explicit call `paddleformers_glm.register_auto_classes()`. PaddleFormers' Auto classes follow the HF API
(`AutoConfig.register(model_type, config_class, exist_ok=...)`,
`AutoModelForCausalLM.register(config_class, model_class, exist_ok=...)`); any registry with that API
can be passed explicitly.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .configuration import GlmMoeDsaConfig


def register_auto_classes(auto_config: Any = None, auto_model_for_causal_lm: Any = None) -> bool:
    """Register `glm_moe_dsa` with the given Auto classes (default: PaddleFormers'). Returns False
    when no registry is given and PaddleFormers is not installed. Ours replace a registration
    PaddleFormers may already have for the same model type (`exist_ok=True`)."""
    if auto_config is None or auto_model_for_causal_lm is None:
        if importlib.util.find_spec("paddleformers") is None:
            return False
        from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

        auto_config = auto_config or AutoConfig
        auto_model_for_causal_lm = auto_model_for_causal_lm or AutoModelForCausalLM
    from .modeling import GlmMoeDsaForCausalLM

    auto_config.register(GlmMoeDsaConfig.model_type, GlmMoeDsaConfig, exist_ok=True)
    auto_model_for_causal_lm.register(GlmMoeDsaConfig, GlmMoeDsaForCausalLM, exist_ok=True)
    return True
