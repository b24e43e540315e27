"""Multi-head latent attention (MLA) with DSA sparse attention over the indexer's top-k keys.

    q_latent = q_a_layernorm(q_a_proj(x))                  [B, S, q_lora]
    q        = q_b_proj(q_latent)                          [B, S, H, nope+rope]
    c, k_rot = split(kv_a_proj_with_mqa(x))                [B, S, kv_lora], [B, S, rope]
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)))        [B, S, H, nope], [B, S, H, v]
    rope on q[..., nope:] and the single shared k_rot (interleaved per rope_interleave)
    out      = o_proj(sparse_attention(q, k, v, top-k))    [B, S, hidden]

`sparse_attention` gathers only the selected keys per query, in chunks of queries: memory is
O(S x k) (times a chunk), never an S x S mask. `dense_masked_attention` is the HF-style
formulation (S x S additive mask) kept as the reference the tests compare against.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig
from .indexer import DSAIndexer
from .norms import RMSNorm
from .rope import apply_rope


def gather_keys(t: paddle.Tensor, idx: paddle.Tensor) -> paddle.Tensor:
    """t [B, T, ...] gathered at idx [B, C, k] (-1 -> row 0) -> [B, C, k, ...]."""
    B, T = t.shape[0], t.shape[1]
    C, K = idx.shape[1], idx.shape[2]
    flat = (paddle.clip(idx, min=0) + (paddle.arange(B, dtype="int64") * T).reshape([B, 1, 1])).reshape([-1])
    rest = t.shape[2:]
    return paddle.gather(t.reshape([B * T, -1]), flat).reshape([B, C, K, *rest])


def sparse_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    chunk_size: int = 1024,
    return_probs: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """softmax(q k_sel^T * scale) v_sel over the selected keys only.

    q, k [B, S, H, Dk]; v [B, S, H, Dv]; topk_idx [B, S, k] (-1 = empty slot).
    Returns out [B, S, H, Dv] and, if asked, the head-averaged probabilities [B, S, k].
    A query with no valid key at all (e.g. left padding) gets the mean of all values, which is what
    an additive-mask softmax (HF eager) produces for a fully masked row.
    """
    B, S, H, _ = q.shape
    chunk = max(1, min(S, chunk_size))
    outs, probs_out = [], []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        idx = topk_idx[:, c0:c1]  # [B, C, k]
        valid = idx >= 0
        k_sel = gather_keys(k[:, :c1], paddle.clip(idx, max=c1 - 1))  # [B, C, k, H, Dk]
        v_sel = gather_keys(v[:, :c1], paddle.clip(idx, max=c1 - 1))  # [B, C, k, H, Dv]
        qc = q[:, c0:c1].unsqueeze(3)  # [B, C, H, 1, Dk]
        scores = paddle.matmul(qc, k_sel.transpose([0, 1, 3, 4, 2])).squeeze(3) * scale  # [B, C, H, k]
        scores = scores.astype("float32")
        mask = valid.unsqueeze(2)
        scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
        any_valid = valid.any(axis=-1)  # [B, C]
        # rows with no valid key: keep softmax finite, fixed below
        scores = paddle.where(any_valid.unsqueeze(-1).unsqueeze(-1), scores, paddle.zeros_like(scores))
        probs = nn.functional.softmax(scores, axis=-1).astype(v.dtype)
        out = paddle.matmul(probs.unsqueeze(3), v_sel.transpose([0, 1, 3, 2, 4])).squeeze(3)  # [B, C, H, Dv]
        if not bool(any_valid.all()):
            mean_v = v.mean(axis=1, keepdim=True)  # [B, 1, H, Dv]
            out = paddle.where(any_valid.unsqueeze(-1).unsqueeze(-1), out, mean_v.expand_as(out))
        outs.append(out)
        if return_probs:
            probs_out.append(paddle.where(mask, probs.astype("float32"), paddle.zeros_like(probs, "float32")).mean(2))
    out = paddle.concat(outs, axis=1) if len(outs) > 1 else outs[0]
    probs = (paddle.concat(probs_out, axis=1) if len(probs_out) > 1 else probs_out[0]) if return_probs else None
    return out, probs


def dense_masked_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, topk_idx: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """Reference: full S x S scores with an additive mask that keeps only the selected keys (HF eager)."""
    B, S, H, _ = q.shape
    sel = paddle.zeros([B, S, S + 1], dtype="float32")
    idx = paddle.where(topk_idx >= 0, topk_idx, paddle.full_like(topk_idx, S))
    sel = paddle.put_along_axis(sel, idx, paddle.ones_like(idx, dtype="float32"), axis=-1)[..., :S]
    min_val = paddle.finfo(paddle.float32).min
    mask = paddle.where(sel > 0, paddle.zeros_like(sel), paddle.full_like(sel, min_val)).unsqueeze(1)
    scores = paddle.matmul(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 3, 1])) * scale + mask  # [B, H, S, S]
    probs = nn.functional.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
    return paddle.matmul(probs, v.transpose([0, 2, 1, 3])).transpose([0, 2, 1, 3])


class DSACoreAttention(nn.Layer):
    """The sparse core of the attention: the layer's own indexer (full layers only) + sparse softmax."""

    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool) -> None:
        super().__init__()
        self.indexer = DSAIndexer(config) if has_indexer else None
        self.scale = config.softmax_scale
        self.chunk_size = int(config.attention_chunk_size)


class MLAttention(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.qk_dim = config.qk_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.interleave = bool(config.rope_interleave)
        bias = None if config.attention_bias else False
        H = config.hidden_size
        self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias_attr=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_dim, bias_attr=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora + self.rope_dim, bias_attr=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.num_heads * (self.nope + self.v_dim), bias_attr=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, H, bias_attr=bias)
        self.core_attention = DSACoreAttention(config, has_indexer)
        self.indexer_loss_coeff = float(config.indexer_loss_coeff)

    @property
    def has_indexer(self) -> bool:
        return self.core_attention.indexer is not None

    def forward(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        prev_topk: paddle.Tensor | None,
        reuse_topk: bool = False,
        dense_reference: bool = False,
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
        """x [B, S, hidden] -> (out [B, S, hidden], top-k used [B, S, k], indexer KL loss or None).

        Full layers run their own indexer unless `reuse_topk` (MTP with index sharing); shared layers
        always use `prev_topk`.
        """
        B, S = x.shape[0], x.shape[1]
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, S, q_lora]
        q = self.q_b_proj(q_latent).reshape([B, S, self.num_heads, self.qk_dim])
        q_nope, q_rot = q[..., : self.nope], q[..., self.nope :]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, S, kv_lora + rope]
        c, k_rot = ckv[..., : self.kv_lora], ckv[..., self.kv_lora :]
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).reshape([B, S, self.num_heads, self.nope + self.v_dim])
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        q_rot = apply_rope(q_rot, cos, sin, self.interleave)
        k_rot = apply_rope(k_rot.unsqueeze(2), cos, sin, self.interleave)  # [B, S, 1, rope]
        query = paddle.concat([q_nope, q_rot], axis=-1)  # [B, S, H, qk]
        key = paddle.concat([k_nope, k_rot.expand([B, S, self.num_heads, self.rope_dim])], axis=-1)

        core = self.core_attention
        run_indexer = core.indexer is not None and not reuse_topk
        if run_indexer:
            topk = core.indexer(x, q_latent, cos, sin, key_padding)
        elif prev_topk is None:
            raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
        else:
            topk = prev_topk

        want_kl = run_indexer and self.indexer_loss_coeff > 0 and self.training
        if dense_reference:
            out, probs = dense_masked_attention(query, key, v, topk, core.scale), None
        else:
            out, probs = sparse_attention(query, key, v, topk, core.scale, core.chunk_size, return_probs=want_kl)
        kl = core.indexer.kl_loss(x, q_latent, cos, sin, topk, probs) if want_kl else None
        out = self.o_proj(out.reshape([B, S, self.num_heads * self.v_dim]))
        return out, topk, kl
