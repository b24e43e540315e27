"""Multi-head latent attention (MLA) with DSA sparse attention over the indexer's top-k keys.

    q_latent = q_a_layernorm(q_a_proj(x))                  [B, S, q_lora]
    q        = q_b_proj(q_latent)                          [B, S, H, nope+rope]
    c, k_rot = split(kv_a_proj_with_mqa(x))                [B, S, kv_lora], [B, S, rope]
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)))        [B, S, H, nope], [B, S, H, v]
    rope on q[..., nope:] and the single shared k_rot (interleaved per rope_interleave)
    out      = o_proj(sparse_attention(q, k, v, top-k))    [B, S, hidden]

Three forms of the same sparse attention, chosen per call by `DSACoreAttention.use_dense` /
`use_latent`:

* per-head dense (`dense_head_attention`), for short sequences (S <= 2 x top-k and B·H·S² within
  DENSE_MAX_SCORES): scores against all S keys with the top-k as an additive mask, exactly HF
  eager's association; a few batched GEMMs beat any gathering there (S = 64: 7.8x the per-head
  sparse step, docs/performance.md);
* per-head (`sparse_attention`): gathers the H per-head keys and values of each selected key; the
  association HF uses, so the HF parity fixtures (small S) run it and pin it at 1e-5;
* latent ("MQA", `sparse_latent_attention`), as DeepSeek-V3.2 runs DSA: since k_nope = W_uk c and
  v = W_uv c, scores and outputs are taken against the single shared latent row [c, k_rot] of each
  key (kv_lora + rope floats, H x fewer bytes than per-head keys and values):

    q_lat  = q_latent [W_q_nope[h] W_uk[h]^T]_h  ++  rope(q_rot)    [B, S, H, kv_lora + rope]
    o_lat  = softmax(q_lat . [c, k_rot]_sel^T * scale) [c, k_rot]_sel      (k selected keys)
    out    = o_lat [W_uv[h] W_o[h]; 0]_h                              [B, S, hidden]

  kv_b_proj is folded into q_b_proj and o_proj (products of small weights, once per step), so
  all activation-sized work is GEMMs on contiguous data; on fp32 CPU tensors W_uv instead runs
  per head on the latent output (the compiled strided GEMMs of ops/projection.py) before a plain
  o_proj, 2.5x fewer flops than the fold at the bench shapes. It runs once the per-head gather would
  pass LATENT_MIN_ELEMS; same maths, other rounding (tests/test_perf_paths.py holds it to the
  per-head and dense forms, gradients included).

The latent core is a PyLayer chunked over queries (chunks sized to stay in cache). A chunk gathers
the k selected rows per query, or, while the selection covers a large share of the chunk's keys
(all < the chunk's end: causal), runs one GEMM against all of them with the selection as an
additive mask. Backward reuses the gathered keys when they are small and recomputes them
otherwise: memory O(S x k), never S x S. `dense_masked_attention` is the HF-style formulation
(S x S additive mask) kept as the reference the tests compare against.
"""

from __future__ import annotations

from typing import NamedTuple

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .. import ops
from ..configuration import GlmMoeDsaConfig
from ..parallel import comm
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel
from ..parallel.topology import get_topology
from .cache import LayerCache
from .indexer import DSAIndexer, key_validity, rope_concat, rope_heads
from .norms import RMSNorm, _as, building_graph


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
        # no host sync on "any row empty?": the select is cheap next to the gather
        mean_v = v.mean(axis=1, keepdim=True)  # [B, 1, H, Dv]
        out = paddle.where(any_valid.unsqueeze(-1).unsqueeze(-1), out, mean_v.expand_as(out))
        outs.append(out)
        if return_probs:
            probs_out.append(paddle.where(mask, probs.astype("float32"), paddle.zeros_like(probs, "float32")).mean(2))
    out = paddle.concat(outs, axis=1) if len(outs) > 1 else outs[0]
    probs = (paddle.concat(probs_out, axis=1) if len(probs_out) > 1 else probs_out[0]) if return_probs else None
    return out, probs


# Elements of the largest per-chunk intermediate ([rows, k, D] gathered keys or [rows, H, keys]
# scores): 2M floats = 8 MB keeps each chunk's tensors in cache and below glibc's mmap threshold,
# so they are neither streamed from DRAM nor page-faulted in afresh on every op.
_CHUNK_ELEMS = 1 << 21
# Backward reuses the forward's gathered keys and probabilities when they total at most this many
# elements per call (64 MB); above it they are recomputed per chunk, so saved state stays O(S x k).
_SAVE_ELEMS = 1 << 26
# A chunk of queries whose keys (all < c1, causal) number at most this many times k runs "dense":
# one GEMM against all c1 keys with the selection as an additive mask, instead of gathering k keys
# per query. Same result; cheaper while the selection covers a large share of the keys (short
# sequences, early chunks), since a GEMM is far cheaper per score than a gather + batched GEMV.
_DENSE_KEYS_PER_SLOT = 2.0


class _Prepared(NamedTuple):
    rows: paddle.Tensor  # [B*S, k] int64 table rows (see prepare_topk)
    mask: paddle.Tensor  # [B*S, k] fp32 additive mask for the gathered slots
    sel: paddle.Tensor  # [B*S, k] int64 key positions within the batch, -1 = empty
    has_key: paddle.Tensor  # [B*S] bool: the query has at least one valid key
    masks: dict  # (r0, r1, c1) -> the dense chunk's additive mask, (b, c1) -> its table rows; once per top-k


_PREPARED: dict[str, object] = {}


def prepare_topk(topk_idx: paddle.Tensor) -> _Prepared:
    """Index forms of a top-k [B, S, k] (-1 = empty) for `sparse_latent_attention`.

    `rows` index the table [B*S keys; B mean rows]: a selected key j of batch b is row b*S + j; an
    empty slot points at any key of its batch and gets mask -inf; a query with no key at all (left
    padding) points all its slots at its batch's mean row with mask 0, so its softmax is uniform and
    it gets the mean of all values, as an all-masked additive-mask softmax (HF eager) gives.
    The result depends on the top-k only, so layers sharing one top-k reuse it (identity cache).
    """
    hit = _cached_for(_PREPARED, topk_idx)
    if hit is not None:
        return hit  # type: ignore[return-value]
    B, S, K = topk_idx.shape
    sel = topk_idx.reshape([B * S, K])
    rows, mask, has_key = ops.topk_tables(topk_idx)
    out = _Prepared(rows, mask, sel, has_key, {})
    _cache_for(_PREPARED, topk_idx, out)
    return out


class _Chunk(NamedTuple):
    r0: int  # first query row (flattened B*S)
    r1: int  # one past the last
    b: int  # the batch the rows belong to
    c1: int  # keys < c1 of batch b can be selected (causal)
    dense: bool


def _plan(B: int, S: int, H: int, D: int, K: int, chunk_size: int) -> list[_Chunk]:
    """Query chunks (never across batches) and whether each runs dense or gathered."""
    rows = max(1, min(S, chunk_size, max(16, _CHUNK_ELEMS // max(K * max(D, H), 1))))
    plan = []
    for b in range(B):
        for c0 in range(0, S, rows):
            c1 = min(S, c0 + rows)
            dense = c1 <= _DENSE_KEYS_PER_SLOT * K and (c1 - c0) * H * (c1 + 1) <= 2 * _CHUNK_ELEMS
            plan.append(_Chunk(b * S + c0, b * S + c1, b, c1, dense))
    return plan


def _dense_keys(table: paddle.Tensor, ch: _Chunk, S: int, N: int) -> paddle.Tensor:
    """The chunk's candidate keys [c1 + 1, D]: keys < c1 of its batch, then the batch's mean row."""
    return paddle.concat([table[ch.b * S : ch.b * S + ch.c1], table[N + ch.b : N + ch.b + 1]], axis=0)


def _chunk_probs(
    qs: paddle.Tensor, table: paddle.Tensor, prep: _Prepared, ch: _Chunk, S: int, N: int
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(probabilities [C, H, keys], keys [C, k, D] gathered or [c1 + 1, D] dense) for one chunk."""
    q = qs[ch.r0 : ch.r1]
    C, H, D = q.shape
    if ch.dense:
        ks = _dense_keys(table, ch, S, N)
        T = ch.c1 + 1
        s = paddle.matmul(q.reshape([C * H, D]), ks, transpose_y=True).reshape([C, H, T])
        m = prep.masks.get((ch.r0, ch.r1, ch.c1))
        if m is None:  # layers sharing a top-k (and the backward) reuse it
            m = prep.masks[(ch.r0, ch.r1, ch.c1)] = ops.candidate_mask(
                prep.sel[ch.r0 : ch.r1], prep.has_key[ch.r0 : ch.r1], ch.c1
            )
    else:
        rows = prep.rows[ch.r0 : ch.r1]
        T = rows.shape[1]
        ks = paddle.gather(table, rows.reshape([-1])).reshape([C, T, D])
        s = paddle.matmul(q, ks, transpose_y=True)  # [C, H, k]
        m = prep.mask[ch.r0 : ch.r1]
    return ops.masked_softmax_(s, m), ks


def _chunk_out(p: paddle.Tensor, ks: paddle.Tensor, dense: bool) -> paddle.Tensor:
    C, H, T = p.shape
    if dense:
        return paddle.matmul(p.reshape([C * H, T]), ks).reshape([C, H, ks.shape[-1]])
    return paddle.matmul(p, ks)


def _scatter_rows(table: paddle.Tensor, rows: paddle.Tensor, grad_rows: paddle.Tensor) -> paddle.Tensor:
    """zeros_like(table) with grad_rows [..., D] summed into rows [...]: the embedding backward.

    Paddle's dense embedding-grad kernel does this ~4x faster than `index_add`; `index_add` is the
    fallback where that op is not exposed.
    """
    if _EMBEDDING_GRAD is not None:
        return _EMBEDDING_GRAD(rows, table, grad_rows, -1, False)
    return paddle.index_add(paddle.zeros_like(table), rows.reshape([-1]), 0, grad_rows.reshape([-1, table.shape[-1]]))


_EMBEDDING_GRAD = getattr(paddle._C_ops, "embedding_grad", None)


class _SparseLatentAttention(PyLayer):
    """softmax(q . keys^T * scale + mask) keys over each query's selected rows of a key table.

    Chunked over queries; each chunk gathers its k keys per query or, when the selection covers a
    large share of the chunk's keys, runs dense against all of them with the selection as a mask
    (see _plan). When small (_SAVE_ELEMS) the chunks' keys and probabilities are kept for
    backward; otherwise backward recomputes them, so the saved state is O(S x (H x D + k)), never
    the O(S x k x D) gathered keys.
    """

    @staticmethod
    def forward(
        ctx: object,
        q: paddle.Tensor,
        table: paddle.Tensor,
        prep: _Prepared,
        plan: list[_Chunk],
        S: int,
        scale: float,
        want_probs: bool,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        N, H, D = q.shape
        K = prep.rows.shape[1]
        qs = q * scale  # scaling the queries costs D/k of scaling the scores
        keep = N * K * (D + H) <= _SAVE_ELEMS
        outs, probs, kept = [], [], []
        for ch in plan:
            p, ks = _chunk_probs(qs, table, prep, ch, S, N)
            outs.append(_chunk_out(p, ks, ch.dense))  # [C, H, D]
            if want_probs:
                pm = p.mean(axis=1)
                if ch.dense:  # back to the k slots
                    sel = prep.sel[ch.r0 : ch.r1]
                    pm = paddle.take_along_axis(pm, paddle.where(sel >= 0, sel, paddle.zeros_like(sel)), axis=1)
                probs.append(pm)
            if keep:
                kept.append((p, ks))
        ctx.save_for_backward(qs, table)
        ctx.prep, ctx.plan, ctx.S, ctx.scale, ctx.kept = prep, plan, S, scale, kept
        out = paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
        pr = (paddle.concat(probs, axis=0) if len(probs) > 1 else probs[0]) if want_probs else paddle.zeros([1])
        if paddle.in_dynamic_mode():  # not implemented for static graphs (to_static)
            ctx.mark_non_differentiable(pr)
        return out, pr

    @staticmethod
    def backward(ctx: object, g: paddle.Tensor, g_probs: paddle.Tensor | None = None) -> tuple:
        qs, table = ctx.saved_tensor()
        prep, plan, S, scale, kept = ctx.prep, ctx.plan, ctx.S, ctx.scale, ctx.kept
        ctx.kept = []
        N, H, D = qs.shape
        dq, dtable = [], None
        for i, ch in enumerate(plan):
            p, ks = kept[i] if kept else _chunk_probs(qs, table, prep, ch, S, N)
            qc, gc = qs[ch.r0 : ch.r1], g[ch.r0 : ch.r1]
            C, T = ch.r1 - ch.r0, p.shape[-1]
            if ch.dense:
                dp = paddle.matmul(gc.reshape([C * H, D]), ks, transpose_y=True).reshape([C, H, T])
            else:
                dp = paddle.matmul(gc, ks, transpose_y=True)  # [C, H, k]
            ds = ops.softmax_backward(p, dp)
            dq.append(_chunk_out(ds, ks, ch.dense).scale_(scale))  # [C, H, D]
            # d(keys) = ds^T qs + p^T g
            if ch.dense:  # the result [c1 + 1, D] is small: two GEMMs beat stacking their inputs
                dks = paddle.matmul(ds.reshape([C * H, T]), qc.reshape([C * H, D]), transpose_x=True)
                dks.add_(paddle.matmul(p.reshape([C * H, T]), gc.reshape([C * H, D]), transpose_x=True))
                ids = prep.masks.get((ch.b, ch.c1))
                if ids is None:  # the table rows of the candidates: keys < c1 of batch b, its mean row
                    ids = prep.masks[(ch.b, ch.c1)] = paddle.concat(
                        [paddle.arange(ch.b * S, ch.b * S + ch.c1, dtype="int64"), paddle.full([1], N + ch.b, "int64")]
                    )
                part = _scatter_rows(table, ids, dks)
            else:  # one batched matmul over the stacked heads: the [C, k, D] result is written once
                dks = paddle.matmul(paddle.concat([ds, p], axis=1), paddle.concat([qc, gc], axis=1), transpose_x=True)
                part = _scatter_rows(table, prep.rows[ch.r0 : ch.r1], dks)
            dtable = part if dtable is None else dtable.add_(part)
        return (paddle.concat(dq, axis=0) if len(dq) > 1 else dq[0]), dtable


def sparse_latent_attention(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    chunk_size: int = 1024,
    return_probs: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """Sparse attention with one key/value row shared by all heads (MLA's latent / MQA form).

    q [B, S, H, D]; kv [B, S, D] serves as both key and value; topk_idx [B, S, k] (-1 = empty).
    Returns out [B, S, H, D] and, if asked, the head-averaged probabilities [B, S, k] (0 on empty
    slots). A query with no valid key gets the mean of all values (HF eager's all-masked softmax).
    """
    B, S, H, D = q.shape
    K = topk_idx.shape[-1]
    prep = prepare_topk(topk_idx)
    table = paddle.concat([kv.reshape([B * S, D]), kv.mean(axis=1)], axis=0)  # [B*S + B, D]
    plan = _plan(B, S, H, D, K, chunk_size)
    out, probs = _SparseLatentAttention.apply(q.reshape([B * S, H, D]), table, prep, plan, S, scale, return_probs)
    out = out.reshape([B, S, H, D])
    if not return_probs:
        return out, None
    probs = paddle.where(topk_idx >= 0, probs.reshape([B, S, K]), paddle.zeros([B, S, K], probs.dtype))
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


_DENSE_MASK: dict[str, object] = {}


@paddle.jit.not_to_static
def _cached_for(store: dict, key: paddle.Tensor) -> object:
    """The value stored for exactly this tensor object, or None (always None while a static graph
    is built: tensors there are symbolic, an eager cache cannot serve them)."""
    if building_graph() or store.get("key") is not key:
        return None
    return store["value"]


@paddle.jit.not_to_static
def _cache_for(store: dict, key: paddle.Tensor, value: object) -> None:
    if not building_graph():
        store["key"], store["value"] = key, value


def dense_topk_mask(topk_idx: paddle.Tensor, S: int) -> paddle.Tensor:
    """Additive mask [B, S, S] from a top-k [B, S, k] (-1 = empty): 0 at the selected keys, the
    fp32 minimum elsewhere (HF's value, so a query without keys gets a uniform softmax: the mean of
    all values). One flat scatter; cached by identity, so layers sharing a top-k (and the backward)
    reuse it."""
    hit = _cached_for(_DENSE_MASK, topk_idx)
    if hit is not None:
        return hit  # type: ignore[return-value]
    with paddle.no_grad():
        B, _, K = topk_idx.shape
        sel, fill = topk_idx.reshape([B * S, K]), float(paddle.finfo(paddle.float32).min)
        m = ops.selection_mask(sel, S, fill).reshape([B, S, S])
    _cache_for(_DENSE_MASK, topk_idx, m)
    return m


class _DenseHeadAttention(PyLayer):
    """softmax(q k^T * scale + mask) v per head, over all S keys, with a hand-written backward.

    The short-sequence form: while the top-k covers a large share of the causal keys, a few large
    batched GEMMs over every key beat gathering; scores and probabilities are [B, H, S, S], so it
    only runs below DSACoreAttention.DENSE_MAX_SCORES. Same association as HF eager.
    """

    @staticmethod
    def forward(
        ctx: object,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        mask: paddle.Tensor,
        live: paddle.Tensor,
        scale: float,
        want_probs: bool,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        B, H, S, _ = q.shape
        qs = q * scale  # scaling the queries costs dk/S of scaling the scores
        s = _as(paddle.matmul(qs, k, transpose_y=True), "float32")  # [B, H, S, S]
        p = ops.masked_softmax_(s, mask)
        out = paddle.matmul(p if p.dtype == v.dtype else p.astype(v.dtype), v)  # [B, H, S, dv]
        pm = p.mean(axis=1) if want_probs else paddle.zeros([1])
        if paddle.in_dynamic_mode():  # not implemented for static graphs (to_static)
            ctx.mark_non_differentiable(pm)
        ctx.save_for_backward(qs, k, v, p, live)
        ctx.scale = scale
        return out, pm

    @staticmethod
    def backward(ctx: object, g: paddle.Tensor, g_probs: paddle.Tensor | None = None) -> tuple:
        qs, k, v, p, live = ctx.saved_tensor()
        # A query without keys outputs the mean of all values: a function of v only, so its rows
        # get no score gradient (q, k), as in the sparse forms; v still gets g / S from them.
        g_live = g * live.expand(g.shape)
        dp = _as(paddle.matmul(g_live, v, transpose_y=True), "float32")  # [B, H, S, S]
        ds = ops.softmax_backward(p, dp)
        if ds.dtype != qs.dtype:
            ds, p = ds.astype(qs.dtype), p.astype(qs.dtype)
        dq = paddle.matmul(ds, k).scale_(ctx.scale)
        dk = paddle.matmul(ds, qs, transpose_x=True)
        dv = paddle.matmul(p, g, transpose_x=True)
        return dq, dk, dv, None, None


def dense_head_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    return_probs: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """Per-head attention over all keys with the top-k as a mask: q, k [B, S, H, dk], v [B, S, H, dv].

    Returns out [B, S, H, dv] and, if asked, the head-averaged probabilities at the selected slots
    [B, S, k] (0 on empty slots), as `sparse_attention` does.
    """
    B, S = q.shape[0], q.shape[1]
    mask = dense_topk_mask(topk_idx, S)
    valid = topk_idx >= 0
    live = valid.any(axis=-1).astype(q.dtype).reshape([B, 1, S, 1])  # 1 = the query has a key
    perm = [0, 2, 1, 3]
    out, pm = _DenseHeadAttention.apply(
        q.transpose(perm), k.transpose(perm), v.transpose(perm), mask, live, float(scale), return_probs
    )
    out = out.transpose(perm)
    if not return_probs:
        return out, None
    probs = paddle.take_along_axis(pm, paddle.where(valid, topk_idx, paddle.zeros_like(topk_idx)), axis=-1)
    return out, paddle.where(valid, probs, paddle.zeros_like(probs))


class DSACoreAttention(nn.Layer):
    """The sparse core of the attention: the layer's own indexer (full layers only) + sparse softmax."""

    # Which sparse form runs: True = latent (MQA) over [c, k_rot]; False = per-head keys and values;
    # None (default) = per-head while its gathered keys/values are tiny (it is the association HF
    # uses, which the parity fixtures pin at 1e-5), latent once they pass LATENT_MIN_ELEMS: the
    # per-head gather was never the faster one (S = 48 / top-k 8: 0.233 vs 0.160 s per step;
    # S = 96 / top-k 32: 1.07 vs 0.19 s; docs/performance.md).
    latent: bool | None = None
    LATENT_MIN_ELEMS = 1 << 18
    # The per-head dense form (`dense_head_attention`) runs instead, whatever `latent` says unless
    # it is True, while the top-k covers at least 1 / _DENSE_KEYS_PER_SLOT of the last query's
    # keys (seq <= that many x topk) and its [B, H, S, S] scores stay below this many floats.
    dense: bool | None = None
    DENSE_MAX_SCORES = 1 << 20

    def use_latent(self, batch: int, seq: int, topk: int, per_key: int) -> bool:
        """Latent form when the per-head form would gather more than LATENT_MIN_ELEMS floats."""
        if self.latent is not None:
            return bool(self.latent)
        return batch * seq * topk * per_key > self.LATENT_MIN_ELEMS

    def use_dense(self, batch: int, seq: int, topk: int, heads: int) -> bool:
        """Per-head dense form for short sequences (see `dense`); never when `latent` is forced on."""
        if self.latent:
            return False
        if self.dense is not None:
            return bool(self.dense)
        return seq <= _DENSE_KEYS_PER_SLOT * topk and batch * heads * seq * seq <= self.DENSE_MAX_SCORES

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

    def __init__(self, config: GlmMoeDsaConfig, has_indexer: bool) -> None:
        super().__init__()
        topo = get_topology()
        self.tp, self.sp = topo.tp_size, topo.sequence_parallel
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
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, nH * self.qk_dim)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora + self.rope_dim, bias_attr=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, nH * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(
            nH * self.v_dim, H, has_bias=bool(config.attention_bias), sequence_parallel=self.sp
        )
        mark_sequence_parallel(
            [self.q_a_proj, self.q_a_layernorm, self.kv_a_proj_with_mqa, self.kv_a_layernorm], enabled=self.sp
        )
        self.core_attention = DSACoreAttention(config, has_indexer)
        self.indexer_loss_coeff = float(config.indexer_loss_coeff)

    def _enter_tp(self, t: paddle.Tensor) -> paddle.Tensor:
        """Into the head-split region: the full sequence on every rank; the gradients coming back
        from this rank's heads are partial, so they are summed (all-reduce, or reduce-scatter to the
        sequence shard under SP)."""
        if self.tp == 1:
            return t
        return comm.gather_from_sp(t, grad="reduce_scatter") if self.sp else comm.copy_to_tp(t)

    def _exit_tp(self, t: paddle.Tensor) -> paddle.Tensor:
        """Out of the head-split region: sum the heads' partial outputs (to the sequence shard under SP)."""
        if self.tp == 1:
            return t
        return comm.reduce_scatter_to_sp(t) if self.sp else comm.reduce_from_tp(t)

    def _replicated_full(self, t: paddle.Tensor) -> paddle.Tensor:
        """The full sequence for the replicated indexer (no gradient flows back through it)."""
        return comm.gather_from_sp(t.detach(), grad="split") if self.tp > 1 and self.sp else t

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
        cache: LayerCache | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
        """x [B, S, hidden] -> (out [B, S, hidden], top-k used [B, S, k], indexer KL loss or None).

        Full layers run their own indexer unless `reuse_topk` (MTP with index sharing); shared layers
        always use `prev_topk`. With `cache` (a prefill: the cache is empty) the layer also stores
        its latent rows and indexer keys there; the computation itself is unchanged.
        """
        H = self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, S_local, q_lora]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, S_local, kv_lora + rope]
        c, k_rot = paddle.split(ckv, [self.kv_lora, self.rope_dim], axis=-1)
        c = self.kv_a_layernorm(c)
        x_full, q_latent_full = self._replicated_full(x), self._replicated_full(q_latent)
        q_latent, c, k_rot = self._enter_tp(q_latent), self._enter_tp(c), self._enter_tp(k_rot)  # [B, S, ...]
        B, S = q_latent.shape[0], q_latent.shape[1]
        if cache is not None:
            if self.tp > 1:
                raise NotImplementedError("decoding with a cache runs with tensor parallel size 1")
            cache.put_latent(rope_concat(c, k_rot, cos, sin, self.interleave))  # [B, S, kv_lora + rope]

        core = self.core_attention
        k_sel, per_key = min(core.topk, S), H * (self.qk_dim + self.v_dim)
        dense = not dense_reference and core.use_dense(B, S, k_sel, H)
        latent = not dense_reference and not dense and core.use_latent(B, S, k_sel, per_key)
        run_indexer = core.indexer is not None and not reuse_topk
        if run_indexer:  # the latent and dense forms need the selected set, not its score order
            keys = [] if cache is not None else None
            topk = core.indexer(
                x_full, q_latent_full, cos, sin, key_padding, ordered=not (latent or dense), keys_out=keys
            )
            if keys:
                cache.put_index_keys(keys[0])
        elif prev_topk is None:
            raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
        else:
            topk = prev_topk

        want_kl = run_indexer and self.indexer_loss_coeff > 0 and self.training
        if latent:  # k_rot un-roped: the latent form ropes it into [c, k_rot] in one kernel
            out, probs = self._latent_attention(q_latent, c, k_rot, cos, sin, topk, want_kl)
        else:
            k_rot = rope_heads(k_rot.unsqueeze(2), cos, sin, self.interleave)  # [B, S, 1, rope]
            q = nn.functional.linear(q_latent, self.q_b_proj.weight).reshape([B, S, H, self.qk_dim])
            # split, not slices: a slice's gradient is Paddle's slow strided set (~5 ms at S = 512)
            q_nope, q_rot = paddle.split(q, [self.nope, self.rope_dim], axis=-1)
            q_rot = rope_heads(q_rot, cos, sin, self.interleave)  # apply_rope's arithmetic, cached expansion
            kv = nn.functional.linear(c, self.kv_b_proj.weight).reshape([B, S, H, self.nope + self.v_dim])
            k_nope, v = paddle.split(kv, [self.nope, self.v_dim], axis=-1)
            query = paddle.concat([q_nope, q_rot], axis=-1)  # [B, S, H, qk]
            key = paddle.concat([k_nope, k_rot.expand([B, S, H, self.rope_dim])], axis=-1)
            if dense_reference:
                out, probs = dense_masked_attention(query, key, v, topk, core.scale), None
            elif dense:
                out, probs = dense_head_attention(query, key, v, topk, core.scale, return_probs=want_kl)
            else:
                out, probs = sparse_attention(query, key, v, topk, core.scale, core.chunk_size, return_probs=want_kl)
            out = nn.functional.linear(out.reshape([B, S, H * self.v_dim]), self.o_proj.weight)
        out = self._exit_tp(out)  # [B, S_local, hidden]
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        kl = None
        if want_kl:
            if self.tp > 1:  # the target is the mean over all heads, this rank holds H / tp of them
                probs = comm.all_reduce(probs.detach() * H, get_topology().tp_group) / self.total_heads
            kl = core.indexer.kl_loss(x_full, q_latent_full, cos, sin, topk, probs)
        return out, topk, kl

    def _latent_attention(
        self,
        q_latent: paddle.Tensor,
        c: paddle.Tensor,
        k_rot: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        topk: paddle.Tensor,
        want_probs: bool,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """The latent form (see the module doc) -> (o_proj output [B, S, hidden], probabilities or None).
        c [B, S, kv_lora] normed, k_rot [B, S, rope] before rope (roped here, fused into [c, k_rot]).

        kv_b_proj is folded into the neighbouring weights once per step (products of small weight
        matrices), so every activation-sized op is a plain GEMM on contiguous data:
        W_uk into q_b_proj (q_lat = q_latent [W_q_nope[h] W_uk[h]^T]_h) and W_uv into o_proj
        (out = o_lat [W_uv[h] W_o[h]]_h, with zero rows for the rope part of o_lat). With the
        compiled CPU kernels W_uv runs per head instead: out = [o_lat[h, :L] W_uv[h]]_h W_o.
        """
        B, S, H = q_latent.shape[0], q_latent.shape[1], self.num_heads
        L, dn, dr, dv = self.kv_lora, self.nope, self.rope_dim, self.v_dim
        QL = q_latent.shape[-1]
        wq_nope, wq_rot = paddle.split(self.q_b_proj.weight.reshape([QL, H, dn + dr]), [dn, dr], axis=-1)
        wkv = self.kv_b_proj.weight.reshape([L, H, dn + dv]).transpose([1, 0, 2])  # [H, L, dn + v]
        w_uk, w_uv = paddle.split(wkv, [dn, dv], axis=-1)  # [H, L, dn], [H, L, v]
        w_q = paddle.matmul(wq_nope.transpose([1, 0, 2]), w_uk, transpose_y=True)  # [H, QL, L]
        q_abs = paddle.matmul(q_latent, w_q.transpose([1, 0, 2]).reshape([QL, H * L])).reshape([B, S, H, L])
        q_rot = paddle.matmul(q_latent, wq_rot.reshape([QL, H * dr])).reshape([B, S, H, dr])
        q_lat = rope_concat(q_abs, q_rot, cos, sin, self.interleave)  # [B, S, H, L + rope]
        kv_lat = rope_concat(c, k_rot, cos, sin, self.interleave)  # [B, S, L + rope]
        core = self.core_attention
        o, probs = sparse_latent_attention(q_lat, kv_lat, topk, core.scale, core.chunk_size, return_probs=want_probs)
        # this rank's heads' part (bias added by the caller)
        return ops.latent_out_proj(o, w_uv, self.o_proj.weight), probs

    # ------------------------------------------------------------------ decoding
    def forward_decode(
        self,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_valid: paddle.Tensor,
        prev_topk: paddle.Tensor | None,
        cache: LayerCache,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """n new tokens x [B, n, hidden] against the cache's past -> (out [B, n, hidden], top-k [B, n, k]).

        key_valid [B, T] (T = past + n) marks real tokens. The new latent rows and indexer keys are
        appended first; the indexer scores the T cached keys (causal within the new tokens, padding
        masked) and keeps min(index_topk, T), as HF's indexer does over its key cache; a shared
        layer uses `prev_topk`, the full layer's selection of this same step. The attention then
        reads only the k selected latent rows, with kv_b_proj absorbed:

            q_lat = [q_nope[h] W_uk[h]^T, rope(q_rot[h])]           [B, n, H, kv_lora + rope]
            o_lat = softmax(q_lat . kv_sel^T * scale) kv_sel          kv_sel [B, n, k, kv_lora + rope]
            out   = o_proj([o_lat[h, :kv_lora] W_uv[h]]_h)

        so a step costs O(k) in the attention (the indexer's O(T) scoring is its purpose).
        """
        B, n, H = x.shape[0], x.shape[1], self.num_heads
        L, dn, dr, dv = self.kv_lora, self.nope, self.rope_dim, self.v_dim
        start = cache.owner.length
        T = start + n
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, n, q_lora]
        c, k_rot = paddle.split(self.kv_a_proj_with_mqa(x), [L, dr], axis=-1)
        cache.put_latent(rope_concat(self.kv_a_layernorm(c), k_rot, cos, sin, self.interleave))
        core = self.core_attention
        if core.indexer is not None:
            with paddle.no_grad():
                qi, ki, wi = core.indexer.project(x, q_latent, cos, sin)
                cache.put_index_keys(ki)
                scores = core.indexer.chunk_scores(qi, cache.keys_upto(T), wi)  # [B, n, T]
                valid = key_validity(paddle.arange(start, T, dtype="int64"), T, key_valid).expand([B, n, T])
                scores = paddle.where(valid, scores, paddle.full_like(scores, float("-inf")))
                kk = min(core.topk, T)
                vals, idx = paddle.topk(scores, kk, axis=-1)
                topk = paddle.where(paddle.isinf(vals), paddle.full_like(idx, -1), idx)
        elif prev_topk is None:
            raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
        else:
            topk = prev_topk

        q = nn.functional.linear(q_latent, self.q_b_proj.weight).reshape([B * n, H, dn + dr])
        q_nope, q_rot = paddle.split(q, [dn, dr], axis=-1)
        wkv = self.kv_b_proj.weight.reshape([L, H, dn + dv]).transpose([1, 0, 2])  # [H, L, dn + v]
        w_uk, w_uv = paddle.split(wkv, [dn, dv], axis=-1)  # [H, L, dn], [H, L, v]
        q_abs = paddle.matmul(q_nope.transpose([1, 0, 2]), w_uk, transpose_y=True)  # [H, B*n, L]
        q_abs = q_abs.transpose([1, 0, 2]).reshape([B, n, H, L])
        q_lat = rope_concat(q_abs, q_rot.reshape([B, n, H, dr]), cos, sin, self.interleave)  # [B, n, H, L + rope]
        valid = topk >= 0  # [B, n, k]
        kv_sel = gather_keys(cache.latent_upto(T), topk)  # [B, n, k, L + rope]
        s = paddle.matmul(q_lat, kv_sel, transpose_y=True).astype("float32") * core.scale  # [B, n, H, k]
        any_valid = valid.any(axis=-1, keepdim=True).unsqueeze(2)  # [B, n, 1, 1]
        s = paddle.where(valid.unsqueeze(2), s, paddle.full_like(s, float("-inf")))
        s = paddle.where(any_valid, s, paddle.zeros_like(s))  # a query without keys: kept finite
        p = nn.functional.softmax(s, axis=-1).astype(kv_sel.dtype)
        o_lat = paddle.matmul(p, kv_sel)  # [B, n, H, L + rope]
        o = o_lat[..., :L].reshape([B * n, H, L]).transpose([1, 0, 2])  # [H, B*n, L]
        v = paddle.matmul(o, w_uv).transpose([1, 0, 2]).reshape([B, n, H * dv])
        out = nn.functional.linear(v, self.o_proj.weight)
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        return out, topk
