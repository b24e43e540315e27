"""Rotary position embedding for GLM-5.2: default and yarn frequencies, interleaved or half-split.

The rope dimension is always `qk_rope_head_dim` (the file's `head_dim` is not used). MLA and the
DSA indexer share one table; each applies it with its own interleave flag.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

from ..configuration import GlmMoeDsaConfig, yarn_mscale
from ..ops import rope_concat, rope_heads

__all__ = ["RotaryEmbedding", "apply_rope", "rope_concat", "rope_heads", "rope_inv_freq"]


def rope_inv_freq(config: GlmMoeDsaConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention_factor) for the config's rope settings."""
    rope = config.rope
    dim = config.qk_rope_head_dim
    base = float(rope["rope_theta"])
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # base**e correctly rounded to fp32 (what torch's fp32 pow gives; numpy's powf can be 1 ulp off)
    pos_freqs = np.power(np.float64(base), exponent.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    rtype = rope["rope_type"]
    if rtype == "default":
        return inv_freq, 1.0
    factor = float(rope["factor"])
    if rtype == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    if rtype == "dynamic":
        raise NotImplementedError("dynamic NTK rope is an inference-time scheme; not supported for training")
    # yarn
    orig = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1.0) - ramp).astype(np.float32)
    inv_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (np.float32(1.0) - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


class RotaryEmbedding(paddle.nn.Layer):
    """cos/sin tables [B, S, dim/2] for given position ids (fp32, scaled by yarn's attention factor)."""

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", paddle.to_tensor(inv_freq), persistable=False)

    def forward(self, position_ids: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        # position_ids [B, S] -> freqs [B, S, dim/2]
        freqs = position_ids.astype("float32").unsqueeze(-1) * self.inv_freq
        cos, sin = paddle.cos(freqs), paddle.sin(freqs)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleave: bool) -> paddle.Tensor:
    """Rotate x [B, S, H, dim] by cos/sin [B, S, dim/2].

    interleave=True: pairs are (x0,x1),(x2,x3)...; False: pairs are (x_i, x_{i+dim/2}). The output
    puts the rotated first members then the second members, for both layouts (dot products between
    q and k rotated the same way are unchanged by that fixed permutation).
    """
    cos = cos.unsqueeze(2).astype(x.dtype)
    sin = sin.unsqueeze(2).astype(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
