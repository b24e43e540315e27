"""The DSA indexer's training in the torch reference, written from the definitions of docs/indexer.md
on HF transformers' own modules, independently of the Paddle model.

``warmup``: every HF indexer's ``index_topk`` is raised past the sequence, so HF selects every key and
its eager attention runs densely; the indexer's own top-k (for the recall) is HF's indexer called
again with its real ``index_topk``.  ``sparse``: HF's top-k attention.  Index scores are recomputed
with gradient from HF's indexer modules on detached inputs (HF runs its indexer under ``no_grad``).
"""

from __future__ import annotations

import os
from typing import Any

from ..._io import read_json

__all__ = ["ReferenceIndexer", "saved_indexer_coeff"]

_ALL_KEYS = 1 << 30  # an index_topk past any sequence: HF's indexer then selects every key


def saved_indexer_coeff(model_dir: str) -> float:
    """The checkpoint's indexer KL weight (config.json, either spelling), which both trainers read."""
    try:
        raw = read_json(os.path.join(model_dir, "config.json"), "the model config")
    except ValueError:  # no such file, or not a JSON object
        return 0.0
    return float(raw.get("indexer_loss_coeff", raw.get("dsa_indexer_loss_coeff", 0.0)) or 0.0)


class ReferenceIndexer:
    """Hooks on HF attention modules that record what each call needs, and the KL and recall of every
    layer with its own indexer once the forward is done (:meth:`terms`)."""

    def __init__(self, layers: list[tuple[int, Any]], stage: str, shared_supervision: bool) -> None:
        self.stage, self.shared = stage, bool(shared_supervision)
        self.records: list[dict[str, Any]] = []
        # layer -> its queries that are real tokens [B, S] bool, where that is not the attention mask's
        # diagonal: an MTP layer's position i reads token i + d, the fill 0 past the window's end
        # (the caller's rule, modeling/mtp.py's mtp_token_valid); set per forward
        self.query_valid: dict[int, Any] = {}
        self.layers: list[int] = []  # the layers that run their own indexer
        if stage == "none":
            return
        for layer_id, layer in layers:
            attn = layer.self_attn
            own = attn.indexer is not None
            if own:
                self.layers.append(layer_id)
                attn.indexer.real_topk = attn.indexer.index_topk
                if stage == "warmup":
                    attn.indexer.index_topk = _ALL_KEYS
            if own or self.shared:
                attn.register_forward_hook(
                    lambda mod, args, kwargs, out, i=layer_id: self._record(i, mod, kwargs, out), with_kwargs=True
                )

    def _record(self, layer_id: int, attn: Any, kwargs: dict, out: tuple) -> None:
        import torch

        _, probs, topk = out  # eager: probabilities [B, H, S, T]; the selection in effect [B, S, k]
        x = kwargs["hidden_states"].detach()
        if probs.dtype == torch.float32:
            probs = probs.detach()
        else:  # the target in fp32, as Paddle's: HF's softmax before its cast to bf16 (docs/indexer.md)
            with torch.no_grad():
                mask = self._selected_mask(kwargs["attention_mask"], topk, x.dtype)
                probs = self._attention_probs(attn, x, kwargs["position_embeddings"], mask)
        ix = attn.indexer
        if ix is not None and self.stage == "warmup":  # the indexer's own selection (HF's, real k)
            with torch.no_grad():
                q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
                ix.index_topk = ix.real_topk
                try:
                    topk = ix(x, q_resid, kwargs["position_embeddings"], kwargs["attention_mask"][:, 0, :, :], None)
                finally:
                    ix.index_topk = _ALL_KEYS
        rec = {"layer": layer_id, "attn": attn, "x": x, "pe": kwargs["position_embeddings"], "own": ix is not None}
        rec.update(mask=kwargs["attention_mask"], probs=probs, topk=topk.long())
        self.records.append(rec)

    # ------------------------------------------------------------------ after the forward
    def terms(self) -> dict[int, tuple[Any, float]]:
        """layer -> (KL with gradient to its indexer, recall) for this forward's records."""
        groups: list[list[dict]] = []
        for rec in self.records:
            if rec["own"]:
                groups.append([rec])
            elif self.shared and groups:
                groups[-1].append(rec)
        self.records = []
        return {g[0]["layer"]: self._group(g) for g in groups}

    def _group(self, members: list[dict]) -> tuple[Any, float]:
        import torch

        full = members[0]
        mask = full["mask"][:, 0]  # HF's 4D attention mask [B, 1, S, T]: bool, or additive with finfo.min
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # [B, S, T]
        B, S, T = visible.shape
        idx = full["topk"]  # [B, S, k]
        sel_valid = torch.gather(visible.expand(B, S, T), -1, idx)
        # a query counts when it is a real token (it sees its own key; a right-padded query sees the
        # real keys before it but not itself) and has a selected key
        real = torch.diagonal(visible.expand(B, S, T)[:, :, T - S :], dim1=-2, dim2=-1)  # [B, S]
        if full["layer"] in self.query_valid:  # an MTP layer: its input token must be real too
            real = real & self.query_valid[full["layer"]]
        rows = (sel_valid.any(-1) & real).float()
        n = rows.sum().clamp_min(1.0)
        scores = self._index_scores(full)  # [B, S, T], with gradient
        if self.stage == "warmup":  # the target and the KL over every visible key
            valid, s = visible, scores
            p = torch.stack([m["probs"].mean(1) for m in members]).mean(0)  # [B, S, T]
        else:  # over the selected keys
            valid, s = sel_valid, torch.gather(scores, -1, idx)
            p = torch.stack([torch.gather(m["probs"].mean(1), -1, idx) for m in members]).mean(0)
        p = torch.where(valid, p, torch.zeros_like(p))
        log_q = torch.log_softmax(torch.where(valid, s, torch.full_like(s, -1e30)), -1)
        kl = torch.where(valid, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
        with torch.no_grad():  # the recall's dense target: the warm-up's own, else recomputed
            dense = p if self.stage == "warmup" else torch.stack([self._dense_probs(m) for m in members]).mean(0)
        kl = (kl.sum(-1) * rows).sum() / n
        with torch.no_grad():
            mass = torch.where(sel_valid, torch.gather(dense, -1, idx), torch.zeros_like(idx, dtype=dense.dtype))
            recall = float((mass.sum(-1) * rows).sum() / n)
        return kl, recall

    @staticmethod
    def _index_scores(rec: dict) -> Any:
        """HF's index scores [B, S, T] (relu(q . k * scale) weighted over the indexer heads), recomputed
        with gradient to the indexer's parameters from the layer's detached input."""
        import torch
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

        attn, x = rec["attn"], rec["x"]
        ix = attn.indexer
        cos, sin = rec["pe"]
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        B, S, _ = x.shape
        r = ix.qk_rope_head_dim
        q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
        q_rot, q_pass = torch.split(q, [r, ix.head_dim - r], dim=-1)
        k = ix.k_norm(ix.wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [r, ix.head_dim - r], dim=-1)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1).float()  # [B, S, Hi, Di]
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).float()  # [B, T, Di]
        s = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * ix.softmax_scale)  # [B, S, Hi, T]
        w = ix.weights_proj(x).float() * (ix.n_heads**-0.5)  # [B, S, Hi]
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)  # [B, S, T]

    @staticmethod
    def _dense_probs(rec: dict) -> Any:
        """The layer's attention over every visible key, head mean [B, S, T]: HF's eager attention
        recomputed from the layer's own modules with the causal / padding mask alone."""
        return ReferenceIndexer._attention_probs(rec["attn"], rec["x"], rec["pe"], rec["mask"]).mean(1)

    @staticmethod
    def _selected_mask(mask: Any, topk: Any, dtype: Any) -> Any:
        """HF's mask of a top-k attention call: the causal / padding ``mask`` [B, 1, S, T] with every
        key outside ``topk`` [B, S, k] masked, as HF's eager attention builds it."""
        import torch

        B, S, T = mask.shape[0], topk.shape[1], mask.shape[-1]
        unselected = topk.new_ones((B, S, T), dtype=torch.bool).scatter(-1, topk.long(), False).unsqueeze(1)
        if mask.dtype == torch.bool:
            return mask & ~unselected
        return mask.masked_fill(unselected, torch.finfo(dtype).min)

    @staticmethod
    def _attention_probs(attn: Any, x: Any, pe: Any, mask: Any) -> Any:
        """The layer's attention probabilities [B, H, S, T] under ``mask``, in fp32: HF's eager
        attention recomputed from the layer's own modules (its scores in the model's dtype, its
        softmax in fp32), before the cast to the model's dtype that HF's eager output carries: in
        bf16 that cast leaves each row a sum of 1 +- bf16 rounding, which as a KL target is larger
        than the KL itself (2e-4) and can make it negative."""
        import torch
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

        B, S, _ = x.shape
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid).view(B, S, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv = attn.kv_a_proj_with_mqa(x)
        kv_pass, k_rot = torch.split(kv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        k_pass = attn.kv_a_layernorm(kv_pass).view(B, 1, S, attn.kv_lora_rank)
        k_rot = k_rot.view(B, 1, S, attn.qk_rope_head_dim)
        cos, sin = pe
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        key, _ = attn.expand_kv(k_pass, k_rot)
        query = torch.cat((q_pass, q_rot), dim=-1)
        scores = torch.matmul(query, key.transpose(2, 3)) * attn.scaling  # [B, H, S, T]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
