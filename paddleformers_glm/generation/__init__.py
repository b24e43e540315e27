"""Text generation for GlmMoeDsaForCausalLM with transformers' ``generate`` contract: a prefill into
the decoding cache, then one token per step. Options, defaults, padding and the on-device draw are
described in docs/model.md ("Decoding"); HF options not implemented here are refused by name, never
silently ignored.

``config`` holds the settings (``GenerationConfig``, ``resolve_settings``), ``logits_process`` what turns
a step's logits into scores (HF's processors, warpers and stopping criteria), ``decoders`` the model's
side (the cache, drafts), ``search`` the loop (``generate``: greedy, sampling, beam search), ``launched``
one rank of ``glm52 generate --tp``. Nothing here imports Paddle at import time: the CLI imports this
package at start-up.
"""

from .config import (
    GENERATION_CONFIG_FILE,
    GenerationConfig,
    check_generation_length,
    derived_from_model_config,
    derived_generation_file,
    generation_config_of,
    generation_config_to_save,
    resolve_settings,
)
from .decoders import CudaGraphDecodeStep
from .search import GenerateDecoderOnlyOutput, compute_transition_scores, generate, generate_speculative

__all__ = [
    "GENERATION_CONFIG_FILE",
    "GenerateDecoderOnlyOutput",
    "CudaGraphDecodeStep",
    "GenerationConfig",
    "check_generation_length",
    "compute_transition_scores",
    "derived_from_model_config",
    "derived_generation_file",
    "generate",
    "generation_config_of",
    "generation_config_to_save",
    "generate_speculative",
    "resolve_settings",
]
