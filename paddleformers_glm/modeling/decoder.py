"""One GLM-5.2 decoder layer: pre-norm MLA (+DSA) and pre-norm dense MLP or MoE, residuals in model dtype."""

from __future__ import annotations

import paddle
from paddle import nn

from .. import ops
from ..configuration import GlmMoeDsaConfig
from ..parallel.layers import mark_sequence_parallel
from ..parallel.topology import Topology
from .attention import MLAttention
from .cache import LayerCache
from .indexer_training import IndexerRecord
from .moe import MoE, SwiGLUMLP
from .norms import RMSNorm


class DecoderLayer(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool, mlp_type: str, topo: Topology) -> None:
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn = MLAttention(config, has_indexer, topo)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.mlp_type = mlp_type
        self.mlp = MoE(config, topo) if mlp_type == "sparse" else SwiGLUMLP(H, config.intermediate_size, topo)
        self.fp32_residual = bool(config.fp32_residual_connection)
        # under sequence parallel the norms see this rank's tokens only: their gradients are summed over TP
        mark_sequence_parallel([self.input_layernorm, self.post_attention_layernorm], enabled=topo.sequence_parallel)

    def forward(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        prev_topk: paddle.Tensor | None,
        reuse_topk: bool = False,
        cache: LayerCache | None = None,
        token_valid: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor, IndexerRecord | None]:
        """x [B, S, H] -> (x [B, S, H], top-k used by this layer [B, S, k], the indexer-training record
        of its attention or None: modeling/indexer_training.py).

        With `cache`: an empty cache is filled by this (prefill) forward; a cache holding past
        tokens makes x the new tokens only, attended against the past (`MLAttention.forward_decode`).
        `token_valid` [B, S_global] (1 = a real token, by global position; default `key_padding`):
        the tokens a MoE layer's training-time load counts and balance loss take in (the MTP layer
        passes its own, aligned with its shifted inputs).
        """
        if cache is not None and cache.owner.length > 0:
            x, topk = self.decode(x, cos, sin, key_padding, prev_topk, cache, reuse_topk=reuse_topk)
            return x, topk, None
        h, topk, rec = self.self_attn(
            self.input_layernorm(x), cos, sin, key_padding, prev_topk, reuse_topk=reuse_topk, cache=cache
        )
        x = self._residual(x, h, x.dtype)
        if self.mlp_type == "sparse":
            valid = None if cache is not None else key_padding if token_valid is None else token_valid
            h = self.mlp(self.post_attention_layernorm(x), valid)
        else:
            h = self.mlp(self.post_attention_layernorm(x))
        return self._residual(x, h, h.dtype), topk, rec

    def decode(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_valid: paddle.Tensor,
        prev_topk: paddle.Tensor | None,
        cache: LayerCache,
        slots: paddle.Tensor | None = None,
        reuse_topk: bool = False,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """A decode step of this layer: the new tokens x [B, n, H] at cache ``slots`` (default the
        cache's current ones) against the past -> (x [B, n, H], top-k used). ``reuse_topk``: a
        layer with an indexer attends with ``prev_topk`` instead (MTP with index sharing)."""
        h = ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        h, topk = self.self_attn.forward_decode(h, cos, sin, key_valid, prev_topk, cache, slots, reuse_topk)
        x = self._residual(x, h, x.dtype)
        h = self.mlp(ops.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps))
        return self._residual(x, h, h.dtype), topk

    def _residual(self, x: paddle.Tensor, h: paddle.Tensor, dtype: paddle.dtype) -> paddle.Tensor:
        """x + h in fp32 with `fp32_residual_connection`, else in x's dtype; the sum cast to ``dtype``."""
        residual = x.astype("float32") if self.fp32_residual else x
        return (residual + h.astype(residual.dtype)).astype(dtype)
