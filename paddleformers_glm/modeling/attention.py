"""Multi-head latent attention (MLA) with DSA sparse attention over the indexer's top-k keys (its
projections and shapes: docs/model.md, "Data flow and shapes"; rope on q's rope part and the one
k_rot all heads share, interleaved: `rope_interleave` false is refused, docs/config.md).

The sparse softmax itself has several forms (attention_forms.py); the config key
`attn_implementation` (auto | reference | dense | sparse | latent) and `choose_form` pick one per
call. The latent form folds kv_b_proj into the neighbouring weights:

    q_lat  = q_latent [W_q_nope[h] W_uk[h]^T]_h  ++  rope(q_rot)    [B, S, H, kv_lora + rope]
    o_lat  = softmax(q_lat . [c, k_rot]_sel^T * scale) [c, k_rot]_sel      (k selected keys)
    out    = o_lat [W_uv[h] W_o[h]; 0]_h                              [B, S, hidden]

so every activation-sized op is a GEMM on contiguous data (`ops.latent_out_proj` may run W_uv per
head instead, where that is cheaper). Decoding (`forward_decode`) always reads the latent cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn

from .. import ops
from ..configuration import GlmMoeDsaConfig
from ..ops.norm import building_graph, capturing_cuda_graph
from ..parallel import comm
from ..parallel.context import gather_sequence, zigzag_positions
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel
from ..parallel.recompute import recomputing, run_core
from ..parallel.topology import Topology
from .attention_forms import (
    AttentionShape,
    SelectionCache,
    attention_probabilities,
    choose_form,
    dense_head_attention,
    dense_masked_attention,
    dense_score_rows,
    fold_pays,
    latent_decode_attention,
    sparse_attention,
    sparse_latent_attention,
)
from .cache import LayerCache
from .indexer import DSAIndexer, key_validity, query_validity
from .indexer_stages import IndexerTraining
from .indexer_training import IndexerRecord, IndexerRun
from .norms import RMSNorm
from .rope import rope_concat, rope_heads


class DSACoreAttention(nn.Layer):
    """The sparse core of the attention: the layer's own indexer (full layers only) and the
    settings of the sparse softmax (the form is chosen per call, see `attention_forms.choose_form`)."""

    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool) -> None:
        super().__init__()
        self.indexer = DSAIndexer(config) if has_indexer else None
        self.scale = config.softmax_scale
        self.chunk_size = int(config.attention_chunk_size)
        self.topk = int(config.index_topk)


class MLAttention(nn.Layer):
    """MLA + DSA. Under tensor parallel the heads are split (column-parallel q_b_proj / kv_b_proj,
    row-parallel o_proj); the latent projections, their norms and the indexer are replicated. With
    sequence parallel the latents are computed on this rank's tokens and all-gathered before the
    head-split part; the output is reduce-scattered back to the shard."""

    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool, topo: Topology) -> None:
        super().__init__()
        config.check_model_support()
        self.tp, self.sp, self.tp_group = topo.tp_size, topo.sequence_parallel, topo.tp_group
        # context parallel: this rank holds a zigzag slice of every sequence (parallel/context.py)
        self.cp, self.cp_rank, self.cp_group = topo.cp_size, topo.cp_rank, topo.cp_group
        self.total_heads = config.num_attention_heads
        self.num_heads = config.num_attention_heads // self.tp  # this rank's heads
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.qk_dim = config.qk_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.interleave = bool(config.rope_interleave)
        bias = None if config.attention_bias else False
        H, nH = config.hidden_size, config.num_attention_heads
        self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias_attr=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, nH * self.qk_dim, topo=topo)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora + self.rope_dim, bias_attr=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, nH * (self.nope + self.v_dim), topo=topo)
        self.o_proj = RowParallelLinear(
            nH * self.v_dim, H, has_bias=bool(config.attention_bias), sequence_parallel=self.sp, topo=topo
        )
        mark_sequence_parallel(
            [self.q_a_proj, self.q_a_layernorm, self.kv_a_proj_with_mqa, self.kv_a_layernorm], enabled=self.sp
        )
        self.core_attention = DSACoreAttention(config, has_indexer)
        self.config = config  # read per call: `attn_implementation` picks the attention form
        # Index forms of the top-k, shared by the layers of one model (it replaces this one with its
        # own and releases it after each forward); a layer used on its own keeps this private one.
        self.selections = SelectionCache()
        # how a training forward trains the indexer (modeling/indexer_training.py); the model shares one
        self.indexer_run = IndexerRun(IndexerTraining.from_config(config))
        # output_attentions: where each call hands its attention weights [B, H, S, T] (the model
        # sets it for one forward, modeling/model.py), None otherwise
        self.keep_attention: Callable[[paddle.Tensor], None] | None = None

    def _enter_tp(self, t: paddle.Tensor) -> paddle.Tensor:
        """Into the head-split region: the full sequence on every rank; the gradients coming back
        from this rank's heads are partial, so they are summed (all-reduce, or reduce-scatter to the
        sequence shard under SP)."""
        if self.tp == 1:
            return t
        g = self.tp_group
        return comm.gather_from_sp(t, group=g, grad="reduce_scatter") if self.sp else comm.copy_to_tp(t, g)

    def _exit_tp(self, t: paddle.Tensor) -> paddle.Tensor:
        """Out of the head-split region: sum the heads' partial outputs (to the sequence shard under SP)."""
        if self.tp == 1:
            return t
        return comm.reduce_scatter_to_sp(t, group=self.tp_group) if self.sp else comm.reduce_from_tp(t, self.tp_group)

    def _check_cache_layout(self) -> None:
        """A cache holds every token's latent rows on each rank and a decode step's few tokens cannot
        be split over ranks: tensor parallel without sequence parallel only (each rank attends with
        its heads over the replicated cache, the outputs summed as in a forward)."""
        if self.cp > 1 or self.sp:
            raise NotImplementedError(
                f"decoding with a cache runs without context and sequence parallel (cp={self.cp}, "
                f"sequence_parallel={self.sp}): build the model with sequence_parallel off to generate"
            )

    def _all_keys(self, t: paddle.Tensor) -> paddle.Tensor:
        """Every key of the sequence [B, S, ...] from this rank's keys: the cp ranks' zigzag slices
        all-gathered in sequence order (differentiable: the key gradients go back to their owners)."""
        return gather_sequence(t, self.cp_group) if self.cp > 1 else t

    def _replicated_full(self, t: paddle.Tensor) -> paddle.Tensor:
        """The full sequence for the replicated indexer (no gradient flows back through it)."""
        return comm.gather_from_sp(t.detach(), group=self.tp_group, grad="split") if self.tp > 1 and self.sp else t

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
        cache: LayerCache | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor, IndexerRecord | None]:
        """x [B, S, hidden] -> (out [B, S, hidden], top-k used [B, S, k], what the indexer's training
        needs from this call or None: modeling/indexer_training.py).

        Full layers run their own indexer unless `reuse_topk` (MTP with index sharing); shared layers
        always use `prev_topk`. With `cache` (a prefill) the layer also stores its latent rows and
        indexer keys there. Under context parallel x is this rank's zigzag slice: the latent rows
        and indexer keys of every token are all-gathered over the cp group and the local queries
        attend in the latent form (docs/parallel.md section 9); the indexer's losses are this rank's
        share of the whole sequence's mean. In the indexer's dense warm-up the layer attends to
        every causal key; its record still carries the indexer's own top-k.
        """
        if cache is not None:
            self._check_cache_layout()
        if self.training:
            self.config.check_training_support()
        H = self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, S_local, q_lora]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, S_local, kv_lora + rope]
        c, k_rot = paddle.split(ckv, [self.kv_lora, self.rope_dim], axis=-1)
        c = self.kv_a_layernorm(c)
        x_full, q_latent_full = self._replicated_full(x), self._replicated_full(q_latent)
        q_latent, c, k_rot = self._enter_tp(q_latent), self._enter_tp(c), self._enter_tp(k_rot)  # [B, S, ...]
        if cache is not None:
            cache.put_latent(rope_concat(c, k_rot, cos, sin, self.interleave))  # [B, S, kv_lora + rope]
            if cache.decode_weights is None:  # here, eagerly: the decode steps may be a traced graph
                with paddle.no_grad():
                    cache.decode_weights = prepare_decode_weights(self)

        core = self.core_attention
        run_indexer = core.indexer is not None and not reuse_topk
        if not run_indexer and prev_topk is None:
            raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
        train = self.indexer_run.training
        record_it = train.active and self.training and cache is None and (run_indexer or train.shared_supervision)
        S = q_latent.shape[1]
        positions = zigzag_positions(S * self.cp, self.cp, self.cp_rank) if self.cp > 1 else np.arange(S)
        dense_sel = None
        if train.dense and self.training and cache is None:  # the warm-up: every causal key
            dense_sel = self.indexer_run.dense_selection(q_latent.shape[0], S * self.cp, positions, key_padding)
        # the core (indexer + sparse attention) is the one hook of --recompute core
        out, topk, probs = run_core(
            self._core, q_latent, c, k_rot, (cos, sin), x_full, q_latent_full, key_padding, prev_topk,
            run_indexer, record_it, cache, dense_sel, active=cache is None,
        )  # fmt: skip
        if self.keep_attention is not None:  # HF eager's weights, over what the attention read; in
            # the autograd graph as HF's (a loss on them trains the projections that made them), but
            # not inside a recomputed layer, whose graph Fleet's recompute rebuilds without them
            with paddle.no_grad() if recomputing() else contextlib.nullcontext():
                query, key, _ = self._heads(q_latent, c, k_rot, (cos, sin))
                sel = topk if dense_sel is None else dense_sel
                self.keep_attention(attention_probabilities(query, key, sel, core.scale, x.dtype))
        out = self._exit_tp(out)  # [B, S_local, hidden]
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        if not record_it:
            return out, topk, None
        if probs is None:
            raise ValueError(
                f"attn_implementation {self.config.attn_implementation!r} returns no attention probabilities, "
                "which the indexer's training needs; use another form"
            )
        if self.tp > 1:  # the target is the mean over all heads, this rank holds H / tp of them
            probs = comm.all_reduce(probs.detach() * H, self.tp_group) / self.total_heads
        rec = IndexerRecord(topk=topk, probs=probs.detach())
        if not train.dense:  # the recall needs the dense attention the sparse stage does not compute
            rec.dense = self._dense_probs_fn(q_latent, c, k_rot, (cos, sin), positions, key_padding)
        if run_indexer:
            cp = self.cp > 1
            rec.indexer = core.indexer
            rec.inputs = {
                "x": x_full, "q_latent": q_latent_full, "cos": cos, "sin": sin, "key_padding": key_padding,
                "positions": positions if cp else None, "all_keys": self._all_keys if cp else None,
                "total": (lambda n: comm.all_reduce(n.detach(), self.cp_group)) if cp else None,
                # the recall's dense [B, rows, H, T] scores per chunk of queries (the sparse stage)
                "chunk": dense_score_rows(S, core.chunk_size, self.num_heads, S * self.cp, q_latent.shape[0]),
                "query_valid": query_validity(key_padding, positions),
            }  # fmt: skip
        return out, topk, rec

    def _core(
        self,
        q_latent: paddle.Tensor,
        c: paddle.Tensor,
        k_rot: paddle.Tensor,
        rope: tuple[paddle.Tensor, paddle.Tensor],
        x_full: paddle.Tensor,
        q_latent_full: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        prev_topk: paddle.Tensor | None,
        run_indexer: bool,
        want_kl: bool,
        cache: LayerCache | None,
        dense_sel: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
        """The attention core -> (this rank's heads' o_proj output [B, S, hidden], top-k, probabilities
        or None): the indexer's selection (full layers) and the sparse attention over it, in the form
        `attention_forms.choose_form` picks. ``rope``: the (cos, sin) tables of the queries' positions.
        ``dense_sel`` (the indexer's warm-up): attend over it (every causal key) instead of the top-k,
        which is still selected and returned."""
        cos, sin = rope
        B, S, H = q_latent.shape[0], q_latent.shape[1], self.num_heads
        core = self.core_attention
        k_sel = min(core.topk, S) if dense_sel is None else dense_sel.shape[-1]
        positions, keys = None, None
        if self.cp > 1:  # the latent form: the only one over a longer key table
            form, positions = "latent", zigzag_positions(S * self.cp, self.cp, self.cp_rank)
            keys = self._all_keys
        else:
            shape = AttentionShape(
                B, S, k_sel, H, q_latent.shape[-1], self.kv_lora, self.nope, self.rope_dim, self.v_dim
            )
            form = choose_form(self.config.attn_implementation, shape)
        if cache is not None:  # a prefill keeps the indexer keys for decoding
            keys = cache.index_keys_through
        if run_indexer:  # the latent and dense forms need the selected set, not its score order
            ordered = form in ("sparse", "reference") or self.cp > 1
            topk = core.indexer(x_full, q_latent_full, cos, sin, key_padding, ordered, positions=positions, keys=keys)
        else:
            topk = prev_topk
        sel = topk if dense_sel is None else dense_sel  # what the attention reads
        if form == "latent":  # k_rot un-roped: the latent form ropes it into [c, k_rot] in one kernel
            q_lat, kv_lat, w_uv = self._latent_qk(q_latent, c, k_rot, rope)
            out, probs = sparse_latent_attention(
                q_lat, kv_lat, sel, core.scale, core.chunk_size, return_probs=want_kl, cache=self.selections
            )
            out = ops.latent_out_proj(out, w_uv, self.o_proj.weight)  # this rank's heads' part
        else:
            query, key, v = self._heads(q_latent, c, k_rot, rope)
            if form == "reference":
                out, probs = dense_masked_attention(query, key, v, sel, core.scale), None
            elif form == "dense":
                out, probs = dense_head_attention(
                    query, key, v, sel, core.scale, return_probs=want_kl, cache=self.selections
                )
            else:
                out, probs = sparse_attention(query, key, v, sel, core.scale, core.chunk_size, return_probs=want_kl)
            out = nn.functional.linear(out.reshape([B, S, H * self.v_dim]), self.o_proj.weight)
        return out, topk, probs

    def _heads(
        self, q_latent: paddle.Tensor, c: paddle.Tensor, k_rot: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor]
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """Per-head query and key [B, S, H, qk] (roped) and value [B, S, H, v] from the latents:
        q_latent [B, S, q_lora], c [B, S, kv_lora] (normed), k_rot [B, S, rope] (before rope)."""
        cos, sin = rope
        B, S, H = q_latent.shape[0], q_latent.shape[1], self.num_heads
        k_rot = rope_heads(k_rot.unsqueeze(2), cos, sin, self.interleave)  # [B, S, 1, rope]
        q = nn.functional.linear(q_latent, self.q_b_proj.weight).reshape([B, S, H, self.qk_dim])
        # split, not slices: a slice's gradient is Paddle's slow strided set
        q_nope, q_rot = paddle.split(q, [self.nope, self.rope_dim], axis=-1)
        q_rot = rope_heads(q_rot, cos, sin, self.interleave)  # apply_rope's arithmetic, cached expansion
        kv = nn.functional.linear(c, self.kv_b_proj.weight).reshape([B, S, H, self.nope + self.v_dim])
        k_nope, v = paddle.split(kv, [self.nope, self.v_dim], axis=-1)
        query = paddle.concat([q_nope, q_rot], axis=-1)  # [B, S, H, qk]
        key = paddle.concat([k_nope, k_rot.expand([B, S, H, self.rope_dim])], axis=-1)
        return query, key, v

    def _latent_qk(
        self, q_latent: paddle.Tensor, c: paddle.Tensor, k_rot: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor]
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """The latent form's queries q_lat [B, S, H, L + rope] (W_uk folded into q_b_proj), the key
        rows kv_lat [B, T, L + rope] (every cp rank's) and W_uv [H, L, v]. c [B, S, kv_lora] is normed,
        k_rot [B, S, rope] before rope (roped here, fused into [c, k_rot]). kv_b_proj is folded into
        the neighbouring weights once per step (products of small weight matrices)."""
        w_abs, w_rot, w_uv = self._latent_q_weights()
        q_lat = self._latent_q(q_latent, rope, w_abs, w_rot)  # [B, S, H, L + rope]
        return q_lat, self._latent_kv(c, k_rot, rope), w_uv

    def _latent_kv(
        self, c: paddle.Tensor, k_rot: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor]
    ) -> paddle.Tensor:
        """The key rows kv_lat [B, T, L + rope]: [c, rope(k_rot)] of every cp rank's tokens."""
        return self._all_keys(rope_concat(c, k_rot, rope[0], rope[1], self.interleave))

    def _latent_q_weights(self) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """W_uk folded into q_b_proj: the latent queries' weights [QL, H L] and [QL, H rope], and W_uv [H, L, v]."""
        H, L, dn, dr, dv = self.num_heads, self.kv_lora, self.nope, self.rope_dim, self.v_dim
        QL = self.q_b_proj.weight.shape[0]
        wq_nope, wq_rot = paddle.split(self.q_b_proj.weight.reshape([QL, H, dn + dr]), [dn, dr], axis=-1)
        wkv = self.kv_b_proj.weight.reshape([L, H, dn + dv]).transpose([1, 0, 2])  # [H, L, dn + v]
        w_uk, w_uv = paddle.split(wkv, [dn, dv], axis=-1)  # [H, L, dn], [H, L, v]
        w_q = paddle.matmul(wq_nope.transpose([1, 0, 2]), w_uk, transpose_y=True)  # [H, QL, L]
        return w_q.transpose([1, 0, 2]).reshape([QL, H * L]), wq_rot.reshape([QL, H * dr]), w_uv

    def _latent_q(
        self,
        q_latent: paddle.Tensor,
        rope: tuple[paddle.Tensor, paddle.Tensor],
        w_abs: paddle.Tensor,
        w_rot: paddle.Tensor,
    ) -> paddle.Tensor:
        """The latent queries [B, S, H, L + rope] of ``q_latent`` [B, S, QL] at the positions of ``rope``."""
        B, S, H = q_latent.shape[0], q_latent.shape[1], self.num_heads
        q_abs = paddle.matmul(q_latent, w_abs).reshape([B, S, H, self.kv_lora])
        q_rot = paddle.matmul(q_latent, w_rot).reshape([B, S, H, self.rope_dim])
        return rope_concat(q_abs, q_rot, rope[0], rope[1], self.interleave)

    def _dense_probs_fn(
        self,
        q_latent: paddle.Tensor,
        c: paddle.Tensor,
        k_rot: paddle.Tensor,
        rope: tuple[paddle.Tensor, paddle.Tensor],
        positions: np.ndarray,
        key_padding: paddle.Tensor | None,
    ) -> Callable[[int, int], paddle.Tensor]:
        """``(c0, c1) -> [B, c1 - c0, T]``: the head-mean attention of queries c0..c1 over every key
        they see (all heads: this rank's summed over the tensor-parallel group), computed when called
        (the indexer's recall in the sparse stage, which attends over the top-k only). Inputs are
        detached now; the latent queries and scores are formed per chunk of queries, never [S, T] nor
        [S, H, L] at once; the key rows and folded weights are made at the first chunk and dropped
        after the last, so one layer's are held at a time (a layer group's, under shared supervision)."""
        q_latent, c, k_rot = q_latent.detach(), c.detach(), k_rot.detach()
        rope = (rope[0].detach(), rope[1].detach())
        pad = None if key_padding is None else key_padding.detach().astype("bool")
        S = q_latent.shape[1]
        cache: list = []

        def probs(c0: int, c1: int) -> paddle.Tensor:
            with paddle.no_grad():
                if not cache:
                    w_abs, w_rot, _ = self._latent_q_weights()
                    cache.extend([w_abs, w_rot, self._latent_kv(c, k_rot, rope).astype("float32")])
                w_abs, w_rot, kv_lat = cache
                rows = (rope[0][:, c0:c1], rope[1][:, c0:c1])
                q_lat = self._latent_q(q_latent[:, c0:c1], rows, w_abs, w_rot).astype("float32")
                if c1 >= S:  # the last chunk
                    cache.clear()
                B, C, H, D = q_lat.shape
                T = kv_lat.shape[1]
                s = paddle.matmul(q_lat.reshape([B, C * H, D]), kv_lat, transpose_y=True)
                s = s.reshape([B, C, H, T]) * self.core_attention.scale
                valid = key_validity(paddle.to_tensor(np.asarray(positions[c0:c1])), T, pad)  # [B|1, C, T]
                valid = valid.unsqueeze(2).expand([B, C, H, T])
                p = nn.functional.softmax(paddle.where(valid, s, paddle.full_like(s, float("-inf"))), axis=-1)
                p = paddle.where(valid, p, paddle.zeros_like(p)).sum(2)  # [B, C, T]: a query without keys gets 0
                if self.tp > 1:
                    p = comm.all_reduce(p, self.tp_group)
                return p / self.total_heads

        return probs

    # ------------------------------------------------------------------ decoding
    def forward_decode(
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
        """n new tokens x [B, n, hidden] against the cache's past -> (out [B, n, hidden], top-k [B, n, k]).
        ``reuse_topk``: attend with ``prev_topk`` even on a layer with its own indexer (an MTP layer
        with index_share_for_mtp_iteration, as `forward`'s ``reuse_topk``).

        ``slots`` [n]: the new tokens' cache slots (default the cache's, from its ``begin``); key_valid
        [B, capacity] marks real tokens. The indexer scores the whole cache and keeps
        min(index_topk, capacity) slots (-1 = empty), as HF's indexer over its key cache; the
        attention reads only the k selected latent rows with kv_b_proj absorbed
        (`prepare_decode_weights`, see the module docstring), O(k) per step. All shapes follow the
        capacity and nothing is read back to the host, so the step can be traced or captured once.
        """
        self._check_cache_layout()
        w = cache.decode_weights  # prepared by the prefill, once per cache
        if w is None:
            raise RuntimeError("a decode step needs a prefilled cache (run the prompt through the model first)")
        slots = cache.owner.slots if slots is None else slots
        B, n = x.shape[0], x.shape[1]
        H, L, dr = w.heads, w.kv_lora, w.rope_dim
        xa = paddle.matmul(x, w.x_proj)  # q_a | c | k_rot (| indexer key | indexer head weights)
        if w.x_bias is not None:
            xa = xa + w.x_bias
        parts = paddle.split(xa, w.x_split, axis=-1)
        q_latent = ops.rms_norm(parts[0], w.q_norm, w.q_norm_eps)
        c = ops.rms_norm(parts[1], w.kv_norm, w.kv_norm_eps)
        latent = cache.write_slots("latent", rope_concat(c, parts[2], cos, sin, self.interleave), slots)  # [B, cap, D]
        q_parts = paddle.split(paddle.matmul(q_latent, w.q_proj), w.q_split, axis=-1)
        indexer = None if reuse_topk else w.indexer
        if indexer is not None:  # the new queries over every cached key
            iq, ik, iw = indexer.finish_projection(q_parts[2], parts[3], parts[4], cos, sin)
            keys = cache.write_slots("index_keys", ik.astype("float32"), slots)  # [B, capacity, Di]
            # an eager step over the cache's own slots knows the filled length: the top-k runs over
            # those keys only, so ties break as HF's over its grown cache; a traced or captured step
            # keeps the capacity's shapes (ties may then break as over HF's static cache)
            eager = slots is cache.owner.slots and not (building_graph() or capturing_cuda_graph())
            n_filled = cache.owner.length + n if eager else None
            topk = indexer.select(iq, keys, iw, key_valid, slots=slots, n_filled=n_filled)
        elif prev_topk is None:
            raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
        else:
            topk = prev_topk
        if w.w_uk is None:  # W_uk folded into q_proj
            q_abs = q_parts[0].reshape([B, n, H, L])
        else:
            q_abs = ops.head_matmul(q_parts[0].reshape([B * n, H, w.nope]), w.w_uk).reshape([B, n, H, L])
        q_lat = rope_concat(q_abs, q_parts[1].reshape([B, n, H, dr]), cos, sin, self.interleave)
        o = latent_decode_attention(q_lat, latent, topk)  # [B, n, H, L + rope]
        if self.keep_attention is not None:  # over the filled slots, as HF's over its grown cache
            with paddle.no_grad():
                T = cache.owner.length + n  # the scale is folded into q_lat
                probs = attention_probabilities(q_lat, latent[:, :T].unsqueeze(2), topk, 1.0, x.dtype)
                self.keep_attention(probs)
        if w.w_uv is None:  # W_uv folded into o_proj (zero rows for the rope columns)
            out = paddle.matmul(o.reshape([B, n, H * (L + dr)]), w.o_proj)
        else:
            out = ops.latent_out_proj(o, w.w_uv, w.o_proj)
        out = self._exit_tp(out)  # this rank's heads' share summed over the TP group
        if w.o_bias is not None:
            out = out + w.o_bias
        return out, topk


@dataclass
class DecodeWeights:
    """What one attention layer's decode step multiplies by (`prepare_decode_weights`). A
    dataclass, not a NamedTuple: paddle.jit.to_static's bytecode tracer reads a NamedTuple as a
    plain tuple and loses its field names."""

    heads: int
    kv_lora: int
    rope_dim: int
    nope: int
    x_proj: paddle.Tensor  # [hidden, q_lora + kv_lora + rope (+ Di + Hi)]: everything computed from x
    x_bias: paddle.Tensor | None
    x_split: list[int]
    q_norm: paddle.Tensor
    q_norm_eps: float
    kv_norm: paddle.Tensor
    kv_norm_eps: float
    q_proj: paddle.Tensor  # [q_lora, H (kv_lora or nope) + H rope (+ Hi Di)]: everything from q_latent
    q_split: list[int]
    w_uk: paddle.Tensor | None  # [H, nope, kv_lora] (scaled), or None when folded into q_proj
    o_proj: paddle.Tensor  # [H (kv_lora + rope), hidden] with W_uv folded in, or W_o [H v, hidden]
    w_uv: paddle.Tensor | None  # [H, kv_lora, v], or None when folded into o_proj
    o_bias: paddle.Tensor | None
    indexer: DSAIndexer | None


def prepare_decode_weights(attn: MLAttention) -> DecodeWeights:
    """A decode step's weights from the layer's parameters, made when a cache starts decoding and
    kept by it (a generation's weights do not change; Paddle's in-place version counters do not
    move on `set_value` or an optimizer step, so a copy kept across generations could go stale
    unnoticed). The projections that read the same input are concatenated (one GEMM where there
    were up to four), the softmax scale is folded into the query side, and kv_b_proj's halves
    W_uk / W_uv are either folded into the query and output projections or kept per head,
    whichever `attention_forms.fold_pays` finds cheaper (a folded weight saves the per-head GEMMs
    and their dispatch but can hold many more floats: at the official widths W_uk folded into q
    would more than double the query weights, so there they stay apart)."""
    core = attn.core_attention
    H, L, dn, dr, dv = attn.num_heads, attn.kv_lora, attn.nope, attn.rope_dim, attn.v_dim
    hidden, QL = attn.q_a_proj.weight.shape[0], attn.q_a_proj.weight.shape[1]
    scale = float(core.scale)
    indexer = core.indexer
    x_w = [attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]
    if indexer is not None:
        x_w += [indexer.wk.weight, indexer.weights_proj.weight.astype(x_w[0].dtype)]
    x_split = [QL, L, dr] + ([indexer.head_dim, indexer.n_heads] if indexer is not None else [])
    x_bias = None
    if attn.q_a_proj.bias is not None:
        x_bias = paddle.concat(
            [attn.q_a_proj.bias, attn.kv_a_proj_with_mqa.bias, paddle.zeros([sum(x_split[3:])], x_w[0].dtype)]
        )
    wq = attn.q_b_proj.weight.reshape([QL, H, dn + dr])
    wq_nope, wq_rot = paddle.split(wq, [dn, dr], axis=-1)
    wkv = attn.kv_b_proj.weight.reshape([L, H, dn + dv]).transpose([1, 0, 2])  # [H, L, dn + v]
    w_uk, w_uv = paddle.split(wkv, [dn, dv], axis=-1)  # [H, L, dn], [H, L, v]
    w_uk = (w_uk.transpose([0, 2, 1]) * scale).contiguous()  # [H, dn, L], the softmax scale folded in
    q_w = [wq_rot.reshape([QL, H * dr]) * scale]
    if fold_pays(QL * H * dn + H * dn * L, QL * H * L, ops_saved=1):
        q_w.insert(0, paddle.matmul(wq_nope.transpose([1, 0, 2]), w_uk).transpose([1, 0, 2]).reshape([QL, H * L]))
        w_uk = None
    else:
        q_w.insert(0, wq_nope.reshape([QL, H * dn]))
    if indexer is not None:
        q_w.append(indexer.wq_b.weight.astype(q_w[0].dtype))
    w_o = attn.o_proj.weight  # [H v, hidden]
    if fold_pays(H * L * dv + H * dv * hidden, H * (L + dr) * hidden, ops_saved=1):
        folded = paddle.matmul(w_uv, w_o.reshape([H, dv, hidden]))  # [H, L, hidden]
        o_w = paddle.concat([folded, paddle.zeros([H, dr, hidden], folded.dtype)], axis=1)
        o_w, w_uv = o_w.reshape([H * (L + dr), hidden]), None
    else:
        o_w, w_uv = w_o, w_uv.contiguous()
    qn, kvn = attn.q_a_layernorm, attn.kv_a_layernorm
    return DecodeWeights(
        H, L, dr, dn, paddle.concat(x_w, axis=1), x_bias, x_split, qn.weight, float(qn.eps), kvn.weight,
        float(kvn.eps), paddle.concat(q_w, axis=1), [t.shape[1] for t in q_w], w_uk, o_w, w_uv,
        attn.o_proj.bias, indexer,
    )  # fmt: skip
