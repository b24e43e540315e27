"""The model's compute ops, one function each, every one hiding a compiled CPU kernel and its
Paddle-op fallback (same maths): modeling code calls these and never asks which ran.

`disabled()` makes every op take its fallback inside a ``with`` block; ``GLM52_CPU_KERNELS=0``
does so for the process (kernels.py: build, cache, switches).
"""

from .activation import silu, swiglu
from .experts import routed_experts, routed_rows
from .heads import head_accum_, head_context_, head_scores
from .kernels import cpu_ops, disabled
from .loss import cross_entropy_sum, log_softmax
from .norm import rms_norm
from .projection import head_matmul, latent_out_proj
from .rope import rope_concat, rope_heads
from .router import route
from .selection import bin_counts, candidate_mask, selection_mask, topk, topk_tables
from .softmax import masked_softmax_, softmax_backward

__all__ = [
    "bin_counts",
    "candidate_mask",
    "cpu_ops",
    "cross_entropy_sum",
    "disabled",
    "head_accum_",
    "head_context_",
    "head_matmul",
    "head_scores",
    "log_softmax",
    "latent_out_proj",
    "masked_softmax_",
    "rms_norm",
    "rope_concat",
    "rope_heads",
    "route",
    "routed_experts",
    "routed_rows",
    "selection_mask",
    "silu",
    "softmax_backward",
    "swiglu",
    "topk",
    "topk_tables",
]
