"""A small stand-in transformer with every feature the GLM-5.2 wiring needs (``glm52 train --model toy``):
seconds-long engine tests and smoke runs of every layout.

Per layer: RMSNorm -> attention with heads split over TP (fused q|k|v column-parallel, row-parallel
output) restricted to top-k keys chosen by a no-grad "indexer" on *full* layers and reused by
*shared* layers (the DSA cross-layer sharing) -> RMSNorm -> dense MLP or MoE (fp32 router,
top-k experts through the expert-parallel dispatcher, TP shared expert).  Vocab-parallel
embedding and head, an MTP block on the last stage that reuses the embedding (so the embedding
lives on the first *and* last pipeline stage) and the top-k carried from the main model.

A pipeline stage is built from a StageSpec, a topology and the sizes of a ``ToyConfig``
(train/toy_adapter.py, with the adapter: this module does not import it, the adapter imports this one
when a run builds a stage); it keeps the model's stage contract
(``forward_stage``, the carry (hidden, top-k int64) between stages) and its loss function
(``modeling.model.causal_lm_losses``).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..modeling.model import causal_lm_losses
from ..modeling.moe import RouterBalance
from ..parallel import comm
from ..parallel.experts import ExpertMLP, ExpertParallelDispatcher, LocalExperts
from ..parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
)
from ..parallel.pipeline import Batch, Carry, StageOutput, StageSpec
from ..parallel.recompute import run_core, run_layer
from ..parallel.topology import Topology
from .data import TOY_PADDING

__all__ = ["ToyStage", "init_full_state"]


class RMSNorm(nn.Layer):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([size], default_initializer=nn.initializer.Constant(1.0))
        mark_sequence_parallel(self.weight)  # runs on sequence shards under SP

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.eps) * self.weight


class ToyMLP(nn.Layer):
    def __init__(self, hidden: int, ffn: int, topo: Topology) -> None:
        super().__init__()
        sp = topo.sequence_parallel
        self.up = ColumnParallelLinear(hidden, ffn, has_bias=True, sequence_parallel=sp, topo=topo)
        self.down = RowParallelLinear(
            ffn, hidden, has_bias=True, input_is_parallel=True, sequence_parallel=sp, topo=topo
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down(F.gelu(self.up(x)))


class ToyMoE(nn.Layer):
    def __init__(self, cfg: Any, topo: Topology) -> None:
        super().__init__()
        self.k = cfg.experts_per_token
        self.num_experts = cfg.num_experts
        self.router = self.create_parameter([cfg.hidden_size, cfg.num_experts], dtype="float32")
        self.balance = RouterBalance(topo)  # routed-token counts: the trainer steps the layer if any expert got tokens
        mark_sequence_parallel(self.router)
        self.dispatcher = ExpertParallelDispatcher(cfg.num_experts, topo=topo)
        self.experts = LocalExperts(
            self.dispatcher.local_expert_ids, lambda e: ExpertMLP(cfg.hidden_size, cfg.expert_ffn, topo=topo)
        )
        self.shared = ToyMLP(cfg.hidden_size, cfg.expert_ffn, topo)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])  # [T, H]
        probs = F.softmax(paddle.matmul(flat.astype("float32"), self.router), axis=-1)  # fp32 router
        w, ids = paddle.topk(probs, self.k, axis=-1)  # [T, K]
        w = w / w.sum(axis=-1, keepdim=True)
        if self.training and paddle.is_grad_enabled():
            w = self.balance.track(probs, ids, w, None)
        y = self.dispatcher(flat, ids, w, self.experts)
        return y.reshape(shape) + self.shared(x)


class ToyLayer(nn.Layer):
    """Decoder layer; ``kind`` "full" runs the indexer, "shared" reuses the incoming top-k."""

    def __init__(self, cfg: Any, kind: str, mlp: str, topo: Topology) -> None:
        super().__init__()
        H, sp = cfg.hidden_size, topo.sequence_parallel
        self.kind, self.sp, self.topk, self.tp_group = kind, sp, cfg.index_topk, topo.tp_group
        self.local_heads = cfg.num_heads // topo.tp_size
        self.head_dim = H // cfg.num_heads
        self.input_norm = RMSNorm(H, cfg.rms_eps)
        self.qkv = ColumnParallelLinear(H, 3 * H, sequence_parallel=sp, fuse_chunks=3, topo=topo)
        self.o_proj = RowParallelLinear(H, H, input_is_parallel=True, sequence_parallel=sp, topo=topo)
        if kind == "full":  # replicated over TP, no gradient (as HF's indexer under the main loss)
            self.indexer_q = self.create_parameter([H, cfg.index_dim])
            self.indexer_k = self.create_parameter([H, cfg.index_dim])
        self.post_norm = RMSNorm(H, cfg.rms_eps)
        self.mlp = ToyMoE(cfg, topo) if mlp == "moe" else ToyMLP(H, cfg.ffn_size, topo)

    def forward(self, h: paddle.Tensor, topk: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        x = self.input_norm(h)  # [B, S', H], S' = S/tp under SP
        qkv = self.qkv(x)  # [B, S, 3H/tp]
        B, S = qkv.shape[0], qkv.shape[1]
        q, k, v = (
            t.reshape([B, S, self.local_heads, self.head_dim]).transpose([0, 2, 1, 3])
            for t in paddle.split(qkv, 3, axis=-1)
        )
        xf = x.detach()  # the indexer's input: the full sequence, no gradient (gathered here, not in the core)
        if self.kind == "full" and self.sp:
            with paddle.no_grad():
                xf = comm.gather_from_sp(xf, group=self.tp_group, grad="split")  # [B, S, H]
        o, topk = run_core(self._core, q, k, v, xf, topk)  # [B, S, H/tp]; recomputed under --recompute core
        h = h + self.o_proj(o)
        return h + self.mlp(self.post_norm(h)), topk

    def _core(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, xf: paddle.Tensor, topk: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The attention core: the indexer's top-k on full layers (from the full-sequence ``xf``),
        then softmax attention over it.  No collective inside: its backward replay is local."""
        B, S = q.shape[0], q.shape[2]
        causal = paddle.tril(paddle.ones([S, S], dtype="bool"))
        if self.kind == "full":
            with paddle.no_grad():
                scores = paddle.matmul(
                    paddle.matmul(xf, self.indexer_q), paddle.matmul(xf, self.indexer_k), transpose_y=True
                )
                scores = paddle.where(causal, scores, paddle.full_like(scores, -1e30))  # [B, S, S]
                _, topk = paddle.topk(scores, min(self.topk, S), axis=-1)  # [B, S, k] int64
        if topk.shape[-1] == 0:
            raise RuntimeError("ToyLayer: a shared layer got no top-k (the stage's carry lost it)")
        allowed = paddle.logical_and(F.one_hot(topk, S).sum(axis=-2) > 0, causal)  # [B, S, S]
        att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim)  # [B, h, S, S]
        mask = paddle.where(allowed, paddle.zeros([1], "float32"), paddle.full([1], -1e9, "float32")).unsqueeze(1)
        probs = F.softmax(att.astype("float32") + mask, axis=-1).astype(v.dtype)  # softmax in fp32, as the model
        o = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([B, S, -1])  # [B, S, H/tp]
        return o, topk


class ToyMTP(nn.Layer):
    def __init__(self, cfg: Any, topo: Topology) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = RMSNorm(H, cfg.rms_eps), RMSNorm(H, cfg.rms_eps), RMSNorm(H, cfg.rms_eps)
        self.eh_proj = self.create_parameter([2 * H, H])  # replicated
        mark_sequence_parallel(self.eh_proj)
        self.layer = ToyLayer(cfg, "shared", "moe", topo)  # reuses the main model's last top-k


class ToyStage(nn.Layer):
    """One pipeline stage of the toy model. ``forward_stage(carry, batch) -> StageOutput``."""

    def __init__(self, cfg: Any, spec: StageSpec, topo: Topology) -> None:
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.recompute = "none"  # the trainer sets --recompute
        self.tp_group = topo.tp_group
        sp = topo.sequence_parallel
        if spec.has_embedding or spec.has_mtp:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, sequence_parallel=sp, topo=topo)
        self.layers = nn.LayerDict(
            {str(i): ToyLayer(cfg, cfg.layer_kinds[i], cfg.mlp_kinds[i], topo) for i in spec.layers}
        )
        if spec.has_head:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, sequence_parallel=sp, topo=topo)
        if spec.has_mtp:
            self.mtp = ToyMTP(cfg, topo)

    def carry_topk_width(self, batch: Batch) -> int:
        """The width k of the top-k ``[B, S, k]`` a toy layer carries: ``min(index_topk, S)`` (the toy
        has no context parallelism)."""
        return min(int(self.cfg.index_topk), int(batch["input_ids"].shape[1]))

    def forward_stage(self, carry: Carry | None, batch: Batch, part: StageSpec | None = None) -> StageOutput:
        """``part``: run only that chunk of the stage (a virtual pipeline stage); default all of it."""
        spec = part or self.spec
        ids = batch["input_ids"]  # [B, S]
        mask = batch.get("attention_mask")
        if mask is not None and not bool((mask != 0).all()):  # nothing here reads it: refused, not trained on
            raise ValueError(f"a batch holds padding (attention_mask 0): {TOY_PADDING}")
        if spec.has_embedding:
            h = self.embed_tokens(ids)  # [B, S', H]
            topk = paddle.zeros([ids.shape[0], ids.shape[1], 0], dtype="int64")
        else:
            h, topk = carry
        for i in spec.layers:
            h, topk = run_layer(self.layers[str(i)], h, topk, mode=self.recompute)
        if not spec.has_head:
            return StageOutput(carry=(h, topk))
        hn = self.norm(h)
        logits = [self.lm_head(hn)]  # vocab-parallel
        if spec.has_mtp:
            nxt = paddle.concat([ids[:, 1:], paddle.zeros([ids.shape[0], 1], dtype=ids.dtype)], axis=1)
            e = self.embed_tokens(nxt)
            x = paddle.matmul(paddle.concat([self.mtp.enorm(e), self.mtp.hnorm(hn)], axis=-1), self.mtp.eh_proj)
            hm, _ = self.mtp.layer(x, topk)
            logits.append(self.lm_head(self.mtp.norm(hm)))
        return StageOutput(losses=causal_lm_losses(logits, batch, [], True, self.tp_group))


def init_full_state(cfg: Any, seed: int) -> dict[str, np.ndarray]:
    """Deterministic full weights of the whole (pp=1, tp=1) model, under the names every layout uses:
    independent of Paddle's RNG and of the parallel layout."""
    out = {}
    whole = ToyStage(cfg, StageSpec.whole(cfg.num_layers, cfg.mtp), Topology.single())
    for name, t in whole.state_dict().items():
        shape = list(t.shape)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf == "bias":
            arr = 0.02 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            arr = rng.standard_normal(shape)
        else:
            arr = rng.standard_normal(shape) / math.sqrt(shape[0])
        out[name] = arr.astype(np.float32)
    return out
