"""The forms of DSA's sparse attention, and `choose_form`, the one policy that picks among them.

All compute softmax(q k_sel^T * scale) v_sel over each query's selected keys (top-k, -1 = empty; a
query with no key gets what HF eager's all-masked softmax gives, `keyless_value`):
``reference`` (`dense_masked_attention`: HF eager's S x S formulation, the tests' yardstick),
``dense`` (`dense_head_attention`: per head against all keys with the top-k as a mask, for short
sequences), ``sparse`` (`sparse_attention`: gathers the per-head keys and values, the association
the HF parity fixtures pin) and ``latent`` (`sparse_latent_attention`, as DeepSeek-V3.2 runs DSA:
against the latent row [c, k_rot] shared by all heads, H x fewer bytes per key; other rounding).

The latent core is a PyLayer chunked over queries (chunks sized to stay in cache). A chunk gathers
the k selected rows per query, or, while the selection covers a large share of the chunk's keys,
runs one GEMM against all of them with the selection as an additive mask. Backward reuses the
gathered keys when they are small and recomputes them otherwise: memory O(S x k), never S x S.
Adding a form: docs/model.md; measured speeds of each: docs/performance.md.
"""

from __future__ import annotations

from typing import NamedTuple

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from .. import ops
from ..configuration import ATTN_IMPLEMENTATIONS as FORMS  # the values of the config key `attn_implementation`
from ..ops.norm import building_graph
from ..ops.norm import cast as _as

# A chunk of queries whose keys (all < c1, causal) number at most this many times k runs "dense":
# one GEMM against all c1 keys with the selection as an additive mask, instead of gathering k keys
# per query. Same result; cheaper while the selection covers a large share of the keys (short
# sequences, early chunks), since a GEMM is far cheaper per score than a gather + batched GEMV.
_DENSE_KEYS_PER_SLOT = 2.0
# Below this much per-head gathering (batch x seq x topk x per-key floats) `auto` keeps the small-
# problem rule: per-head dense for short sequences, else per-head sparse (the association the HF
# parity fixtures pin); above it, the cheapest form by `form_costs`.
LATENT_MIN_ELEMS = 1 << 18
# The per-head dense form runs as one block (no chunks) while its [B, H, S, S] scores stay below
# this many floats; `auto` picks it for short sequences (S <= 2 top-k) within it.
DENSE_MAX_SCORES = 1 << 20
# Every chunked form sizes its chunks so that the largest per-chunk intermediate (gathered key rows
# [rows, k, D], scores [heads, rows, keys]) stays within this many bytes, at any width and length
# (down to one query row): below glibc's mmap threshold, so chunk buffers are reused rather than
# page-faulted in afresh.
CHUNK_BYTES = 8 << 20


def keyless_weight(n_keys: int, dtype: paddle.dtype) -> float:
    """The weight each of ``n_keys`` values gets in the output of a query that sees no key: HF's
    softmax of a fully masked row is uniform, 1 / n in the attention's dtype (bf16(1/48) = 0.02087,
    not 1/48), and its matmul sums the values in fp32 with that weight; so the output is
    ``keyless_weight * sum(values)``, the mean only where 1 / n is exact in the dtype."""
    one = paddle.full([1], 1.0 / n_keys, dtype="float32")
    return float(one.astype(dtype).astype("float32").item()) if dtype != paddle.float32 else 1.0 / n_keys


def keyless_value(v: paddle.Tensor, axis: int = 1) -> paddle.Tensor:
    """The output of a query that sees no key (left padding), kept as dim ``axis`` of ``v``'s values:
    their fp32 sum x :func:`keyless_weight`, in ``v``'s dtype (fp32: their mean, as before)."""
    if v.dtype == paddle.float32:
        return v.mean(axis=axis, keepdim=True)
    w = keyless_weight(v.shape[axis], v.dtype)
    return (v.astype("float32").sum(axis=axis, keepdim=True) * w).astype(v.dtype)


def dense_score_rows(seq_len: int, chunk_size: int, heads: int, keys: int, batch: int = 1) -> int:
    """Query rows per chunk of a dense [batch, rows, heads, keys] fp32 score pass (the indexer's dense
    KL, the sparse stage's recall): within `CHUNK_BYTES`, but never fewer than 16 rows (one matmul per
    row would cost more than the memory saved), nor more than `chunk_size` or the sequence."""
    return max(1, min(seq_len, chunk_size, max(16, CHUNK_BYTES // 4 // max(batch * heads * keys, 1))))


# The per-head dense form's tiles aim at this many query rows before they take more than one head:
# each tile re-reads its heads' key and value prefix (and its backward re-writes their gradients),
# so that traffic falls with the rows per tile, while the GEMMs gain nothing from more heads.
_DENSE_TILE_ROWS = 256
# Cost-model constants, in multiply-adds (MACs) of a large fp32 GEMM (about 46 G MAC/s on one core
# of the development machine; docs/performance.md): gathering one float of key rows, and one
# score's masked softmax (add, exp, sum, scale: memory passes, not MACs).
GATHER_MACS = 10.0
SOFTMAX_MACS = 16.0
_FP32_MIN = paddle.finfo(paddle.float32).min


class AttentionShape(NamedTuple):
    """What the attention form's cost depends on (this rank's heads)."""

    batch: int
    seq: int
    topk: int  # min(index_topk, keys)
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int


def form_costs(shape: AttentionShape) -> dict[str, float]:
    """Estimated multiply-add equivalents of one forward of each chunked form (the projections
    that differ between them included, the shared ones not), from the chunk plans they run:

    * dense: q_b and kv_b, then per head and query one score and one output row against every
      key of its chunk (keys < the chunk's end): H (S + C) / 2 (dk + dv) per query;
    * sparse: the same projections, then k gathered per-head keys and values per query;
    * latent: W_uk folded into the query and W_uv per head, then per query its k latent rows
      (gathered once for all heads, or all keys of a dense chunk), each used twice by every head.
    """
    B, S, K, H = shape.batch, shape.seq, shape.topk, shape.heads
    L, dn, dr, dv, QL = shape.kv_lora, shape.nope, shape.rope, shape.v, shape.q_lora
    dk, Lr = dn + dr, shape.kv_lora + shape.rope
    tokens = B * S
    head_proj = tokens * (QL * H * dk + L * H * (dn + dv))
    latent_proj = tokens * (QL * H * L + QL * H * dr + H * L * dv)
    dense_keys = sum((r1 - r0) * r1 for _b, r0, r1, _g in _dense_plan(1, S, H)) * B  # query x key pairs
    k_avg = (S + 1) / 2 if S <= K else (K * (K + 1) / 2 + (S - K) * K) / S  # mean over the queries of min(K, i + 1)
    latent_pairs = 0.0
    for ch in _plan(1, S, H, Lr, K, S):
        rows = ch.r1 - ch.r0
        if ch.dense:
            latent_pairs += rows * (ch.c1 + 1) * (H * (2 * Lr + SOFTMAX_MACS))
        else:
            latent_pairs += rows * K * (H * (2 * Lr + SOFTMAX_MACS) + GATHER_MACS * Lr)
    return {
        "dense": head_proj + dense_keys * H * (dk + dv + SOFTMAX_MACS),
        "sparse": head_proj + tokens * k_avg * H * ((dk + dv) * (1 + GATHER_MACS) + SOFTMAX_MACS),
        "latent": latent_proj + B * latent_pairs,
    }


def choose_form(implementation: str, shape: AttentionShape) -> str:
    """The attention form one call runs: `implementation` itself unless it is "auto", which keeps
    the HF parity fixtures' rule for small problems (`LATENT_MIN_ELEMS`, `DENSE_MAX_SCORES`) and
    takes the cheapest form by `form_costs` for larger ones."""
    if implementation not in FORMS:
        raise ValueError(f"attn_implementation must be one of {FORMS}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    B, S, K, H = shape.batch, shape.seq, shape.topk, shape.heads
    if B * S * K * (H * (shape.nope + shape.rope + shape.v)) <= LATENT_MIN_ELEMS:  # per-head key + value floats
        if S <= _DENSE_KEYS_PER_SLOT * K and B * H * S * S <= DENSE_MAX_SCORES:
            return "dense"
        return "sparse"
    costs = form_costs(shape)
    return min(costs, key=costs.__getitem__)


# What one dispatched op costs, in floats of weight streamed: ~5 us of dispatch at the ~13 GB/s a
# one-row GEMM reads its weight with on one core (docs/performance.md, decoding).
OP_COST_FLOATS = 1 << 14


def fold_pays(unfolded_floats: int, folded_floats: int, ops_saved: int) -> bool:
    """Whether a product of two weights, precomputed, is cheaper to multiply by than the two
    factors in turn: a decode step streams every weight once per token, so the cost of a form is
    the floats it reads plus `OP_COST_FLOATS` per op it dispatches."""
    return folded_floats <= unfolded_floats + ops_saved * OP_COST_FLOATS


def latent_decode_attention(q: paddle.Tensor, latent: paddle.Tensor, topk: paddle.Tensor) -> paddle.Tensor:
    """The latent form for a decode step: q [B, n, H, D] (scale folded in) over the rows of a
    whole cache latent [B, T, D] that topk [B, n, k] selects (-1 = empty) -> [B, n, H, D].

    One gather of the k selected rows per query (shared by the H heads), two GEMMs and a masked
    softmax; shapes follow T (the capacity), never the filled length. A query without any valid
    slot (only a padding token fed at decode has none) attends uniformly to its k gathered rows
    (its batch's slot 0), as an additive mask of the fp32 minimum gives."""
    B, n, H, D = q.shape
    K = topk.shape[-1]
    kv = gather_keys(latent, topk).reshape([B * n, K, D])
    s = _as(paddle.matmul(q.reshape([B * n, H, D]), kv, transpose_y=True), "float32")  # [B n, H, k]
    mask = (topk < 0).astype("float32").scale_(_FP32_MIN).reshape([B * n, K])  # 0 or the fp32 minimum
    p = ops.masked_softmax_(s, mask)  # fp32 whatever q's dtype, as the prefill's forms
    return paddle.matmul(_as(p, kv.dtype), kv).reshape([B, n, H, D])


class SelectionCache:
    """The index forms derived from one top-k (the latent form's tables, the dense form's S x S mask).

    A shared DSA layer attends with its full layer's top-k, so these are built once per full layer
    rather than once per layer. The model owns one cache for all its layers and releases it when
    its forward ends (`release`); the backward keeps what it needs in its own saved state. It holds
    at most one top-k, matched by identity; nothing is cached while a static graph is built
    (tensors there are symbolic).
    """

    def __init__(self) -> None:
        self._key: paddle.Tensor | None = None
        self._forms: dict[str, object] = {}

    @paddle.jit.not_to_static
    def lookup(self, topk: paddle.Tensor, name: str) -> object:
        """The `name` form stored for exactly this top-k tensor, or None."""
        if building_graph() or self._key is not topk:
            return None
        return self._forms.get(name)

    @paddle.jit.not_to_static
    def store(self, topk: paddle.Tensor, name: str, value: object) -> None:
        if building_graph():
            return
        if self._key is not topk:
            self._key, self._forms = topk, {}
        self._forms[name] = value

    @paddle.jit.not_to_static
    def release(self) -> None:
        """Drop the held top-k and its forms (the end of a forward)."""
        self._key, self._forms = None, {}


def gather_keys(t: paddle.Tensor, idx: paddle.Tensor) -> paddle.Tensor:
    """t [B, T, ...] gathered at idx [B, C, k] (-1 -> row 0) -> [B, C, k, ...]."""
    B, T, C, K = t.shape[0], t.shape[1], idx.shape[1], idx.shape[2]
    rows = paddle.clip(idx, min=0)
    if B > 1:
        rows = rows + (paddle.arange(B, dtype="int64") * T).reshape([B, 1, 1])
    return paddle.gather(t.reshape([B * T, -1]), rows.reshape([-1])).reshape([B, C, K, *t.shape[2:]])


def sparse_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    chunk_size: int = 1024,
    return_probs: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """softmax(q k_sel^T * scale) v_sel over the selected keys only: q, k [B, S, H, Dk]; v [B, S, H, Dv];
    topk_idx [B, S, k] (-1 = empty slot) -> out [B, S, H, Dv] and, if asked, the head-averaged
    probabilities [B, S, k]. A query with no valid key gets `keyless_value` (HF eager's all-masked row)."""
    B, S, H, dk = q.shape
    K = topk_idx.shape[-1]
    per_row = K * H * (dk + v.shape[-1]) * q.element_size()  # the gathered keys and values of one query
    chunk = max(1, min(S, chunk_size, CHUNK_BYTES // max(per_row, 1)))
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
        probs32 = nn.functional.softmax(scores, axis=-1)  # the KL target's (fp32: docs/indexer.md)
        probs = probs32.astype(v.dtype)
        out = paddle.matmul(probs.unsqueeze(3), v_sel.transpose([0, 1, 3, 2, 4])).squeeze(3)  # [B, C, H, Dv]
        # no host sync on "any row empty?": the select is cheap next to the gather
        mean_v = keyless_value(v)  # [B, 1, H, Dv]
        out = paddle.where(any_valid.unsqueeze(-1).unsqueeze(-1), out, mean_v.expand_as(out))
        outs.append(out)
        if return_probs:
            probs_out.append(paddle.where(mask, probs32, paddle.zeros_like(probs32)).mean(2))
    out = paddle.concat(outs, axis=1) if len(outs) > 1 else outs[0]
    probs = (paddle.concat(probs_out, axis=1) if len(probs_out) > 1 else probs_out[0]) if return_probs else None
    return out, probs


# Floats of the largest per-chunk intermediate of the latent form ([rows, k, D] gathered keys or
# [rows, H, keys] scores), from `CHUNK_BYTES`.
_CHUNK_ELEMS = CHUNK_BYTES // 4
# Backward reuses the forward's gathered keys and probabilities when they total at most this many
# elements per call (64 MB); above it they are recomputed per chunk, so saved state stays O(S x k).
SAVE_ELEMS = 1 << 26


class _Prepared(NamedTuple):
    rows: paddle.Tensor  # [B*S, k] int64 table rows (see prepare_topk)
    mask: paddle.Tensor  # [B*S, k] fp32 additive mask for the gathered slots
    sel: paddle.Tensor  # [B*S, k] int64 key positions within the batch, -1 = empty
    has_key: paddle.Tensor  # [B*S] bool: the query has at least one valid key
    masks: dict  # (r0, r1, c1) -> the dense chunk's additive mask, (b, c1) -> its table rows; once per top-k


def prepare_topk(topk_idx: paddle.Tensor, cache: SelectionCache | None = None, n_keys: int | None = None) -> _Prepared:
    """Index forms of a top-k [B, S, k] (-1 = empty) for `sparse_latent_attention`: the table rows
    and masks of `ops.topk_tables` (T = ``n_keys``, default S) and the selection itself. They depend
    on the top-k only, so layers sharing one top-k reuse them through `cache`."""
    name = "latent_tables" if n_keys is None else f"latent_tables_{n_keys}"
    hit = cache.lookup(topk_idx, name) if cache is not None else None
    if hit is not None:
        return hit  # type: ignore[return-value]
    B, S, K = topk_idx.shape
    sel = topk_idx.reshape([B * S, K])
    rows, mask, has_key = ops.topk_tables(topk_idx, n_keys)
    out = _Prepared(rows, mask, sel, has_key, {})
    if cache is not None:
        cache.store(topk_idx, name, out)
    return out


class _Chunk(NamedTuple):
    r0: int  # first query row (flattened B*S)
    r1: int  # one past the last
    b: int  # the batch the rows belong to
    c1: int  # keys < c1 of batch b can be selected (causal)
    dense: bool


def _plan(B: int, S: int, H: int, D: int, K: int, chunk_size: int, n_keys: int | None = None) -> list[_Chunk]:
    """Query chunks (never across batches) and whether each runs dense or gathered.  With
    ``n_keys`` (queries that are a share of a longer key sequence: a context-parallel rank's) every
    chunk is gathered: the dense shortcut assumes queries and keys share positions."""
    rows = max(1, min(S, chunk_size, _CHUNK_ELEMS // max(K * max(D, H), 1)))
    plan = []
    for b in range(B):
        for c0 in range(0, S, rows):
            c1 = min(S, c0 + rows)
            dense = n_keys is None and c1 <= _DENSE_KEYS_PER_SLOT * K and (c1 - c0) * H * (c1 + 1) <= 2 * _CHUNK_ELEMS
            plan.append(_Chunk(b * S + c0, b * S + c1, b, c1 if n_keys is None else n_keys, dense))
    return plan


def _chunk_probs(
    qs: paddle.Tensor, table: paddle.Tensor, prep: _Prepared, ch: _Chunk, S: int, N: int
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(probabilities [C, H, keys], keys [C, k, D] gathered or [c1 + 1, D] dense) for one chunk."""
    q = qs[ch.r0 : ch.r1]
    C, D = q.shape[0], q.shape[2]
    if ch.dense:
        # the candidate keys [c1 + 1, D]: keys < c1 of the chunk's batch, then the batch's mean row
        ks = paddle.concat([table[ch.b * S : ch.b * S + ch.c1], table[N + ch.b : N + ch.b + 1]], axis=0)
        m = prep.masks.get((ch.r0, ch.r1, ch.c1))
        if m is None:  # layers sharing a top-k (and the backward) reuse it
            m = prep.masks[(ch.r0, ch.r1, ch.c1)] = ops.candidate_mask(
                prep.sel[ch.r0 : ch.r1], prep.has_key[ch.r0 : ch.r1], ch.c1
            )
    else:
        rows = prep.rows[ch.r0 : ch.r1]
        ks = paddle.gather(table, rows.reshape([-1])).reshape([C, rows.shape[1], D])
        m = prep.mask[ch.r0 : ch.r1]
    s = _chunk_matmul(q, ks, transpose_y=True)  # [C, H, keys]
    return ops.masked_softmax_(_as(s, "float32"), m), ks  # the softmax in fp32 whatever q's dtype


def _chunk_matmul(a: paddle.Tensor, ks: paddle.Tensor, transpose_y: bool = False) -> paddle.Tensor:
    """a [C, H, n] times a chunk's keys (transposed: scores; else: outputs) -> [C, H, *]: one GEMM
    over all C x H rows for a dense chunk's keys [c1 + 1, D], a batched one for gathered [C, k, D]."""
    C, H, n = a.shape
    if ks.ndim == 2:
        out = paddle.matmul(a.reshape([C * H, n]), ks, transpose_y=transpose_y)
        return out.reshape([C, H, out.shape[-1]])
    return paddle.matmul(a, ks, transpose_y=transpose_y)


def _scatter_rows(table: paddle.Tensor, rows: paddle.Tensor, grad_rows: paddle.Tensor) -> paddle.Tensor:
    """zeros_like(table) with grad_rows [..., D] summed into rows [...]: the embedding backward.

    Paddle's dense embedding-grad kernel does this faster than `index_add`; `index_add` is the
    fallback where that op is not exposed.
    """
    if _EMBEDDING_GRAD is not None:
        return _EMBEDDING_GRAD(rows, table, grad_rows, -1, False)
    return paddle.index_add(paddle.zeros_like(table), rows.reshape([-1]), 0, grad_rows.reshape([-1, table.shape[-1]]))


_EMBEDDING_GRAD = getattr(paddle._C_ops, "embedding_grad", None)


def _needed(needs: tuple[bool, ...], *grads: paddle.Tensor | None) -> tuple[paddle.Tensor | None, ...]:
    """A PyLayer's input gradients, None for the inputs that take none (``stop_gradient``: from
    frozen weights only, as under LoRA); Paddle refuses a gradient for such an input."""
    return tuple(g if need else None for need, g in zip(needs, grads))


class _SparseLatentAttention(PyLayer):
    """softmax(q . keys^T * scale + mask) keys over each query's selected rows of a key table, by the
    chunks of `_plan` (the module docstring); the chunks' keys and probabilities are kept for backward
    when small (`SAVE_ELEMS`), else recomputed: saved state O(S x (H x D + k)), never O(S x k x D)."""

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
        keep = N * K * (D + H) <= SAVE_ELEMS
        outs, probs, kept = [], [], []
        for ch in plan:
            p, ks = _chunk_probs(qs, table, prep, ch, S, N)
            # fp32 probabilities meet bf16 keys in the keys' dtype (HF casts them back)
            outs.append(_chunk_matmul(_as(p, ks.dtype), ks))  # [C, H, D]
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
        ctx.needs = (not q.stop_gradient, not table.stop_gradient)  # a frozen input gets None
        out = paddle.concat(outs, axis=0) if len(outs) > 1 else outs[0]
        pr = (paddle.concat(probs, axis=0) if len(probs) > 1 else probs[0]) if want_probs else paddle.zeros([1])
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
            dp = _chunk_matmul(gc, ks, transpose_y=True)  # [C, H, keys]
            ds = _as(ops.softmax_backward(p, _as(dp, p.dtype)), qc.dtype)
            p = _as(p, qc.dtype)
            dq.append(_chunk_matmul(_as(ds, ks.dtype), ks).scale_(scale))  # [C, H, D]
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
        dq = paddle.concat(dq, axis=0) if len(dq) > 1 else dq[0]
        return _needed(ctx.needs, dq, dtable)


def sparse_latent_attention(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    chunk_size: int = 1024,
    return_probs: bool = False,
    cache: SelectionCache | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """Sparse attention with one key/value row shared by all heads (MLA's latent / MQA form).

    q [B, S, H, D]; kv [B, T, D] serves as both key and value; topk_idx [B, S, k] (-1 = empty).
    T > S where the queries are a context-parallel rank's share (topk_idx then holds positions among
    all T keys, and every chunk gathers). Returns out [B, S, H, D] and, if asked, the head-averaged
    probabilities [B, S, k] (0 on empty slots).
    """
    B, S, H, D = q.shape
    T, K = kv.shape[1], topk_idx.shape[-1]
    n_keys = None if T == S else T
    prep = prepare_topk(topk_idx, cache, n_keys)
    table = paddle.concat([kv.reshape([B * T, D]), keyless_value(kv).reshape([B, D])], axis=0)  # [B*T + B, D]
    plan = _plan(B, S, H, D, K, chunk_size, n_keys)
    out, probs = _SparseLatentAttention.apply(q.reshape([B * S, H, D]), table, prep, plan, T, scale, return_probs)
    # the probabilities (a report and the indexer's KL target) take no gradient: detached here, not
    # marked with ctx.mark_non_differentiable, which in Paddle 3.3.1 keeps the PyLayer's saved state
    # (and the graph it holds) alive whenever backward does not pass through it (docs/performance.md,
    # "Memory between forwards")
    probs = probs.detach()
    out = out.reshape([B, S, H, D])
    if not return_probs:
        return out, None
    return out, paddle.where(topk_idx >= 0, probs.reshape([B, S, K]), paddle.zeros([B, S, K], probs.dtype))


def attention_probabilities(
    q: paddle.Tensor, k: paddle.Tensor, topk_idx: paddle.Tensor, scale: float, dtype: str | paddle.dtype
) -> paddle.Tensor:
    """HF eager's attention weights: q [B, S, H, d], k [B, T, H | 1, d], a top-k over the T keys
    [B, S, K] (-1 = empty) -> softmax(q k^T * scale + mask) [B, H, S, T] in fp32, cast to ``dtype``:
    0 off the selected keys, and (as HF's additive fp32-minimum mask) uniform 1 / T for a query
    without any key (a padded position)."""
    B, S, K = topk_idx.shape
    T = k.shape[1]
    with paddle.no_grad():
        mask = ops.selection_mask(topk_idx.reshape([B * S, K]), T, _FP32_MIN).reshape([B, S, 1, T])
    mask = mask.transpose([0, 2, 1, 3])  # [B, 1, S, T]
    scores = paddle.matmul(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 3, 1])) * scale  # [B, H, S, T]
    probs = nn.functional.softmax(_as(scores, "float32") + mask, axis=-1)  # fp32 softmax
    # exactly 0 off the selection, as torch's exp gives there (Paddle's CPU exp floors at ~1e-28)
    selected = mask == 0
    keep = paddle.logical_or(selected, paddle.logical_not(selected.any(axis=-1, keepdim=True)).expand(selected.shape))
    return paddle.where(keep, probs, paddle.zeros_like(probs)).astype(dtype)


def dense_masked_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, topk_idx: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """Reference: full S x S scores with an additive mask that keeps only the selected keys (HF eager)."""
    probs = attention_probabilities(q, k, topk_idx, scale, v.dtype)
    return paddle.matmul(probs, v.transpose([0, 2, 1, 3])).transpose([0, 2, 1, 3])


def dense_topk_mask(topk_idx: paddle.Tensor, S: int, cache: SelectionCache | None = None) -> paddle.Tensor:
    """Additive mask [B, S, S] from a top-k [B, S, k] (-1 = empty): 0 at the selected keys, the
    fp32 minimum elsewhere (HF's value, so a query without keys gets a uniform softmax: the mean of
    all values). One flat scatter; layers sharing a top-k reuse it through `cache`."""
    hit = cache.lookup(topk_idx, "dense_mask") if cache is not None else None
    if hit is not None:
        return hit  # type: ignore[return-value]
    with paddle.no_grad():
        B, _, K = topk_idx.shape
        m = ops.selection_mask(topk_idx.reshape([B * S, K]), S, _FP32_MIN).reshape([B, S, S])
    if cache is not None:
        cache.store(topk_idx, "dense_mask", m)
    return m


class _DenseHeadAttention(PyLayer):
    """softmax(q k^T * scale + mask) v per head, over all S keys, with a hand-written backward.

    The short-sequence form: while the top-k covers a large share of the causal keys, a few large
    batched GEMMs over every key beat gathering; scores and probabilities are [B, H, S, S], so it
    only runs below DENSE_MAX_SCORES (see choose_form). Same association as HF eager.
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
        # low precision: HF eager's rounding, the product in q's dtype, then scaled (rounded again);
        # fp32: the queries scaled, which costs dk/S of scaling the scores
        low = q.dtype in (paddle.bfloat16, paddle.float16)
        qs = q if low else q * scale
        s = paddle.matmul(qs, k, transpose_y=True)  # [B, H, S, S]
        s = _as(s * scale if low else s, "float32")
        p = ops.masked_softmax_(s, mask)  # fp32 whatever q's dtype
        out = paddle.matmul(p if p.dtype == v.dtype else p.astype(v.dtype), v)  # [B, H, S, dv]
        pm = p.mean(axis=1) if want_probs else paddle.zeros([1])
        ctx.save_for_backward(qs, k, v, p, live)
        ctx.scale, ctx.low = scale, low
        ctx.needs = (not q.stop_gradient, not k.stop_gradient, not v.stop_gradient)  # a frozen input gets None
        return out, pm

    @staticmethod
    def backward(ctx: object, g: paddle.Tensor, g_probs: paddle.Tensor | None = None) -> tuple:
        qs, k, v, p, live = ctx.saved_tensor()
        # A query without keys outputs its uniform row (1/S in v's dtype) times v: a function of v only,
        # so its rows get no score gradient (q, k), as in the sparse forms; v still gets p x g from them.
        g_live = g * live.expand(g.shape)
        dp = _as(paddle.matmul(g_live, v, transpose_y=True), "float32")  # [B, H, S, S]
        ds = ops.softmax_backward(p, dp)
        ds, p = _as(ds, qs.dtype), _as(p, qs.dtype)
        if ctx.low:  # the scale's gradient in q's dtype, before both products (the forward's order)
            ds = ds * ctx.scale
        dq = paddle.matmul(ds, k) if ctx.low else paddle.matmul(ds, k).scale_(ctx.scale)
        dk = paddle.matmul(ds, qs, transpose_x=True)
        dv = paddle.matmul(p, g, transpose_x=True)
        return (*_needed(ctx.needs, dq, dk, dv), None, None)


def _dense_plan(B: int, S: int, H: int) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """The per-head dense form's tiles: (batch, first row, end row, head groups) per query chunk.
    A chunk's rows see the keys before its end (causal); a tile's scores [group heads, rows, keys]
    stay within `CHUNK_BYTES`: as many heads per tile as leave it `_DENSE_TILE_ROWS` rows (one
    head, and fewer rows, at long sequences), balanced groups."""
    elems = CHUNK_BYTES // 4
    g = max(1, min(H, elems // (min(S, _DENSE_TILE_ROWS) * S)))
    n_groups = -(-H // g)
    g = -(-H // n_groups)  # balanced groups
    rows = max(1, min(S, elems // (g * S)))
    groups = [(h, min(H, h + g)) for h in range(0, H, g)]
    return [(b, r0, min(S, r0 + rows), groups) for b in range(B) for r0 in range(0, S, rows)]


class _DenseChunkAttention(PyLayer):
    """softmax(q k^T * scale + mask) v per head, over each query chunk's keys (those before the
    chunk's end), with the selection as an additive mask: the per-head dense form for sequences
    whose [B, H, S, S] scores would not fit one block. Tiles of `_dense_plan` run on q, k, v in
    the projections' [B, S, H, d] layout (`ops.head_scores` / `head_context_` / `head_accum_`),
    so neither a transpose nor a key prefix is copied; the probabilities are kept for backward
    when small (`SAVE_ELEMS`), else recomputed per tile: memory O(chunk), never S x S.

    A query without any key gets `keyless_value` (HF eager's all-masked softmax): its row
    runs with a uniform mask and is replaced afterwards; its gradient reaches only v."""

    @staticmethod
    def forward(
        ctx: object,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        topk: paddle.Tensor,
        live: paddle.Tensor,
        scale: float,
        want_probs: bool,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        B, S, H, _ = q.shape
        K = topk.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the scale goes into the GEMMs
        plan = _dense_plan(B, S, H)
        keep = sum(r1 * (r1 - r0) for _b, r0, r1, _g in plan) * H <= SAVE_ELEMS
        out = paddle.empty([B, S, H, v.shape[-1]], dtype=v.dtype)
        kept, probs = [], []
        for b, r0, r1, groups in plan:
            mask = ops.selection_mask(topk[b, r0:r1], r1, _FP32_MIN).unsqueeze(0)  # [1, C, r1]
            pm = None
            for h0, h1 in groups:
                p = _masked_probs(ops.head_scores(q, k, b, r0, r1, r1, h0, h1, scale), mask)  # [G, C, r1] fp32
                ops.head_context_(_as(p, v.dtype), v, out, b, r0, h0)
                if want_probs:
                    pm = p.sum(axis=0) if pm is None else pm.add_(p.sum(axis=0))
                if keep:
                    kept.append(p)
            if want_probs:  # the head mean at the selected slots [C, K]
                probs.append(paddle.take_along_axis(pm, paddle.clip(topk[b, r0:r1], min=0), axis=1) / H)
        dead = not bool(live.min())  # any query without keys (left padding): one host read
        if dead:
            mean_v = keyless_value(v)  # [B, 1, H, dv]
            out = paddle.where(live.unsqueeze(-1).unsqueeze(-1) > 0, out, mean_v.expand(out.shape))
        ctx.save_for_backward(q, k, v, topk, live)
        ctx.scale, ctx.kept, ctx.dead = scale, kept, dead
        ctx.needs = (not q.stop_gradient, not k.stop_gradient, not v.stop_gradient)  # a frozen input gets None
        pr = paddle.concat(probs, axis=0).reshape([B, S, K]) if want_probs else paddle.zeros([1])
        return out, pr

    @staticmethod
    def backward(ctx: object, g: paddle.Tensor, g_probs: paddle.Tensor | None = None) -> tuple:
        q, k, v, topk, live = ctx.saved_tensor()
        kept, recompute, scale = iter(ctx.kept), not ctx.kept, ctx.scale
        ctx.kept = []
        B, S, H, _ = q.shape
        live4 = live.unsqueeze(-1).unsqueeze(-1)  # [B, S, 1, 1]
        g_live = (g * live4.astype(g.dtype)).contiguous() if ctx.dead else g.contiguous()
        dq, dk, dv = paddle.empty(q.shape, q.dtype), paddle.zeros(k.shape, k.dtype), paddle.zeros(v.shape, v.dtype)
        for b, r0, r1, groups in _dense_plan(B, S, H):
            mask = ops.selection_mask(topk[b, r0:r1], r1, _FP32_MIN).unsqueeze(0) if recompute else None
            for h0, h1 in groups:
                if recompute:
                    p = _masked_probs(ops.head_scores(q, k, b, r0, r1, r1, h0, h1, scale), mask)
                else:
                    p = next(kept)
                dp = _as(ops.head_scores(g_live, v, b, r0, r1, r1, h0, h1), p.dtype)
                ds = _as(ops.softmax_backward(p, dp), q.dtype)  # fp32 probabilities, as the forward's
                ops.head_context_(ds, k, dq, b, r0, h0, scale)
                ops.head_accum_(ds, q, dk, b, r0, h0, scale)
                ops.head_accum_(_as(p, g_live.dtype), g_live, dv, b, r0, h0)
        if ctx.dead:  # a query without keys output keyless_weight x the sum of all values: that much of g to each
            dead = (g * (1 - live4).astype(g.dtype)).sum(axis=1, keepdim=True)  # [B, 1, H, dv]
            dead = dead / S if g.dtype == paddle.float32 else dead * keyless_weight(S, g.dtype)
            dv = dv + dead.expand(dv.shape)
        return (*_needed(ctx.needs, dq, dk, dv), None, None)


def _masked_probs(s: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
    """softmax(s + mask) over the keys for scores s [G, C, n] and a mask [1, C, n] shared by the G
    heads, in fp32 whatever the scores' dtype (as HF's eager softmax)."""
    G, C, n = s.shape
    return ops.masked_softmax_(_as(s, "float32").reshape([1, G, C, n]), mask).reshape([G, C, n])


def dense_head_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    topk_idx: paddle.Tensor,
    scale: float,
    return_probs: bool = False,
    cache: SelectionCache | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """Per-head attention over all keys with the top-k as a mask: q, k [B, S, H, dk], v [B, S, H, dv]
    -> as `sparse_attention`. Scores within `CHUNK_BYTES` run as one block (a few batched GEMMs);
    longer sequences in query chunks (`_DenseChunkAttention`)."""
    B, S, H = q.shape[0], q.shape[1], q.shape[2]
    valid = topk_idx >= 0
    if B * H * S * S * q.element_size() > CHUNK_BYTES:
        live = valid.any(axis=-1).astype("int32")  # [B, S]: 1 = the query has a key
        out, pm = _DenseChunkAttention.apply(q, k, v, topk_idx, live, float(scale), return_probs)
        pm = pm.detach()  # no gradient: as in sparse_latent_attention, not mark_non_differentiable
        if not return_probs:
            return out, None
        return out, paddle.where(valid, pm, paddle.zeros_like(pm))
    mask = dense_topk_mask(topk_idx, S, cache)
    live = valid.any(axis=-1).astype(q.dtype).reshape([B, 1, S, 1])  # 1 = the query has a key
    perm = [0, 2, 1, 3]
    out, pm = _DenseHeadAttention.apply(
        q.transpose(perm), k.transpose(perm), v.transpose(perm), mask, live, float(scale), return_probs
    )
    out, pm = out.transpose(perm), pm.detach()  # (as above)
    if not return_probs:
        return out, None
    probs = paddle.take_along_axis(pm, paddle.where(valid, topk_idx, paddle.zeros_like(topk_idx)), axis=-1)
    return out, paddle.where(valid, probs, paddle.zeros_like(probs))
