"""DSA indexer (the "lightning indexer") of GLM-5.2: which keys each query attends to.

Per full layer it scores every causal key with a few cheap heads and keeps the top-k (-1 = no valid
key); "shared" layers reuse the top-k of the nearest full layer before them. The maths, as HF
computes it, is in docs/model.md ("DSA numerics"). Queries run in chunks scored against the keys
before the chunk's end only, each sized to keep its [C, Hi, keys] scores within
`attention_forms.CHUNK_BYTES`: memory O(S x chunk), never O(S^2). Selection runs without gradient;
the optional KL indexer loss trains it (modeling/indexer_training.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig
from ..ops import log_softmax, topk
from . import attention_forms
from .attention_forms import gather_keys
from .norms import LayerNorm
from .rope import rope_concat

NEG_INF = float("-inf")


def key_validity(query_pos: paddle.Tensor, n_keys: int, key_padding: paddle.Tensor | None) -> paddle.Tensor:
    """bool [B|1, C, T]: key j is visible from query i (j <= i and j not padding)."""
    keys = paddle.arange(n_keys, dtype="int64")
    C = query_pos.shape[0]
    valid = keys.unsqueeze(0).expand([C, n_keys]) <= query_pos.unsqueeze(-1).expand([C, n_keys])  # [C, T]
    valid = valid.unsqueeze(0)
    if key_padding is not None:
        valid = paddle.logical_and(valid, key_padding[:, :n_keys].astype("bool").unsqueeze(1))
    return valid


def _query_chunks(pos: np.ndarray, start: int, chunk: int) -> Iterator[tuple[int, int, int]]:
    """(c0, c1, kend) for the queries start.. at positions ``pos``: the runs of consecutive positions
    (a context-parallel rank holds two) cut into chunks of at most ``chunk``; a chunk's queries see
    the keys < kend, its last query's position + 1 (causal)."""
    S = len(pos)
    breaks = [start] + [r for r in range(start + 1, S) if pos[r] != pos[r - 1] + 1] + [S]
    for lo, hi in zip(breaks, breaks[1:]):
        for c0 in range(lo, hi, chunk):
            c1 = min(hi, c0 + chunk)
            yield c0, c1, int(pos[c1 - 1]) + 1


def query_validity(key_padding: paddle.Tensor | None, positions: np.ndarray) -> paddle.Tensor | None:
    """float32 [B, S]: 1.0 where the query at ``positions[i]`` is a real token, 0.0 where it is padding
    (``key_padding`` [B, T] indexed by position; None: no padding, every query is real).  A right-padded
    query still sees the real keys before it, so only this keeps it out of the indexer's losses."""
    if key_padding is None:
        return None
    pos = paddle.to_tensor(np.asarray(positions, dtype=np.int64))
    return paddle.index_select(key_padding, pos, axis=1).astype("float32")


def query_mean(
    per_query: paddle.Tensor, rows: paddle.Tensor, total: Callable[[paddle.Tensor], paddle.Tensor] | None = None
) -> paddle.Tensor:
    """The mean of ``per_query`` [B, S] over the queries counted (``rows`` 1.0, else 0.0: real queries
    with a visible key);
    ``total`` maps this rank's count of them to the whole sequence's (context parallel)."""
    n = rows.sum() if total is None else total(rows.sum())
    return (per_query * rows).sum() / paddle.clip(n, min=1.0)


def _kl_rows(scores: paddle.Tensor, p: paddle.Tensor, valid: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Per query of scores [B, C, n]: KL(p || softmax(scores)) over its valid keys, and 1.0 if it has
    any (else 0.0)."""
    log_q = log_softmax(paddle.where(valid, scores, paddle.full_like(scores, -1e30)), axis=-1)
    log_p = paddle.log(paddle.clip(p, min=1e-30))
    kl = paddle.where(valid, p * (log_p - log_q), paddle.zeros_like(p)).sum(-1)
    return kl, valid.any(axis=-1).astype("float32")


class DSAIndexer(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleave = bool(config.indexer_rope_interleave)
        self.softmax_scale = self.head_dim**-0.5
        self.chunk_size = int(config.attention_chunk_size)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias_attr=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias_attr=False)
        self.k_norm = LayerNorm(self.head_dim, eps=config.indexer_k_norm_eps)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias_attr=False)

    def project(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """q [B,S,Hi,Di], k [B,S,Di], head weights [B,S,Hi], all fp32."""
        w = self.weights_proj(x.astype(self.weights_proj.weight.dtype))
        return self.finish_projection(self.wq_b(q_latent), self.wk(x), w, cos, sin)

    def finish_projection(
        self, q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """`project` after its three matmuls (wq_b, wk, weights_proj outputs [B, S, Hi*Di], [B, S, Di],
        [B, S, Hi]): the key norm, rope and the head-weight scale. A decode step computes the matmuls
        fused with the attention's own and finishes them here."""
        B, S = q.shape[0], q.shape[1]
        q = q.reshape([B, S, self.n_heads, self.head_dim])
        k = self.k_norm(k).unsqueeze(2)  # [B, S, 1, Di]
        r = self.rope_dim
        q_rot, q_pass = paddle.split(q, [r, self.head_dim - r], axis=-1)
        k_rot, k_pass = paddle.split(k, [r, self.head_dim - r], axis=-1)
        q = rope_concat(q_pass, q_rot, cos, sin, self.interleave, rope_first=True)
        k = rope_concat(k_pass, k_rot, cos, sin, self.interleave, rope_first=True).squeeze(2)
        w = w.astype("float32") * (self.n_heads**-0.5)
        return q.astype("float32"), k.astype("float32"), w

    def chunk_scores(self, q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """index scores [B, C, T] for a chunk of queries q [B,C,Hi,Di] against keys k [B,T,Di].

        One GEMM for all heads of the chunk ([C*Hi, Di] x [Di, T]), relu in place, and the softmax
        scale folded into the head weights (relu(s * a) = a * relu(s) for a > 0).
        """
        B, C, Hi, Di = q.shape
        T = k.shape[1]
        s = paddle.matmul(q.reshape([B, C * Hi, Di]), k, transpose_y=True)  # [B, C*Hi, T]
        s = nn.functional.relu_(s) if s.stop_gradient else nn.functional.relu(s)  # in place when nothing trains
        w = (w * self.softmax_scale).reshape([B * C, 1, Hi])
        return paddle.matmul(w, s.reshape([B * C, Hi, T])).reshape([B, C, T])

    def forward(
        self,
        x: paddle.Tensor,
        q_latent: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        ordered: bool = True,
        **where: object,
    ) -> paddle.Tensor:
        """top-k key indices [B, S, min(index_topk, T)] int64 for the S queries of ``x`` over T keys,
        -1 where the slot holds no valid key: `select` (``where``: its keyword options) after `project`,
        the one selection prefill, decoding and context parallel all run."""
        with paddle.no_grad():
            q, k, w = self.project(x.detach(), q_latent.detach(), cos, sin)
            return self.select(q, k, w, key_padding, ordered, **where)

    def select(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        w: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        ordered: bool = True,
        *,
        positions: np.ndarray | None = None,
        keys: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        slots: paddle.Tensor | None = None,
        n_filled: int | None = None,
    ) -> paddle.Tensor:
        """The selection of `forward` from the projected queries q [B, S, Hi, Di], keys k [B, S, Di]
        and head weights w [B, S, Hi] (`project`), in descending score order (HF's top-k).

        ``positions`` (int64 [S], default arange(S)): each query's position; a query sees the keys at
        positions <= its own (and not ``key_padding`` [B, T]). ``keys`` maps this call's keys to all
        T keys (decoding: its cache; context parallel: the ranks' slices all-gathered).
        `ordered=False` (the caller needs the set only): the first k_out queries of a plain forward
        see at most k_out keys, so they are neither scored nor sorted (keys in ascending order).
        ``slots`` (a decode step's cache slots [S], a tensor): the keys are the whole cache
        [B, capacity, Di]; fixed shapes, no host read, slots past the filled length are -1.
        ``n_filled`` (with ``slots``, eager steps only): the filled slots, this step's included; the
        top-k then runs over those columns only, as HF's over its grown key cache, so exact ties
        break as there (std::nth_element's choice among equal scores depends on the row's length);
        the result is padded back to the capacity's width with -1.
        A ``key_padding`` with a ``placement`` (modeling/packing.py's `Placement`: its rows are
        sequences packed in longer rows) breaks exact ties as HF's top-k over the packed row does
        (`_ties_as_packed`)."""
        with paddle.no_grad():
            placement = getattr(key_padding, "placement", None) if positions is None and keys is None else None
            k = keys(k) if keys is not None else k  # [B, T, Di]
            B, S, T = q.shape[0], q.shape[1], k.shape[1]
            if slots is not None:  # one block of scores [B, S, T]: the visible slots (<= the query's, valid)
                scores = self.chunk_scores(q, k, w)
                width = min(self.topk, T)
                valid = key_padding.astype("bool")
                if n_filled is not None and S == 1:  # one new token: the filled slots are the causal ones
                    scores, visible = scores[:, :, :n_filled], valid[:, :n_filled].unsqueeze(1)
                else:
                    key_ids = paddle.arange(T, dtype="int64")
                    visible = paddle.logical_and(key_ids.unsqueeze(0) <= slots.unsqueeze(1), valid.unsqueeze(1))
                    if n_filled is not None:
                        scores, visible = scores[:, :, :n_filled], visible[:, :, :n_filled]
                scores = paddle.where(visible, scores, paddle.full_like(scores, NEG_INF))
                vals, idx = topk(scores, min(width, scores.shape[-1]))
                # the fill marks an empty slot (-1); a visible key whose score overflowed to +inf is kept, as in HF
                idx = paddle.where(vals == NEG_INF, paddle.full_like(idx, -1), idx)
                if idx.shape[-1] < width:
                    idx = paddle.concat([idx, paddle.full([B, S, width - idx.shape[-1]], -1, idx.dtype)], axis=-1)
                return idx
            pos = np.arange(S, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
            k_out = min(self.topk, T)
            chunk = self.chunk_rows(S, T)
            pad = None if key_padding is None else key_padding.astype("bool")
            pieces = []
            start = 0
            if not ordered and pad is None and positions is None:
                start = k_out  # query i < k_out selects keys 0..i: no scores needed
                j = paddle.arange(k_out, dtype="int64")
                all_keys = paddle.where(j.unsqueeze(0) <= j.unsqueeze(1), j.unsqueeze(0).expand([k_out, k_out]), -1)
                pieces.append(all_keys.unsqueeze(0).expand([B, k_out, k_out]))
            for c0, c1, kend in _query_chunks(pos, start, chunk):
                C = c1 - c0
                scores = self.chunk_scores(q[:, c0:c1], k[:, :kend], w[:, c0:c1])  # [B, C, kend]
                qpos = paddle.arange(c0, c1, dtype="int64") if positions is None else paddle.to_tensor(pos[c0:c1])
                valid = key_validity(qpos, kend, pad).expand([B, C, kend])
                scores = paddle.where(valid, scores, paddle.full([B, C, kend], NEG_INF, scores.dtype))
                if kend < T:  # one top-k over all T keys of a row, as HF takes it: equal scores (relu
                    # zeros) then break the same way whatever the chunking (keys >= kend are masked)
                    scores = paddle.concat([scores, paddle.full([B, C, T - kend], NEG_INF, scores.dtype)], axis=-1)
                vals, idx = topk(scores, k_out)  # ties as HF's torch.topk
                idx = paddle.where(vals == NEG_INF, paddle.full([B, C, k_out], -1, dtype="int64"), idx)
                pieces.append(idx if placement is None else self._ties_as_packed(scores, vals, idx, placement))
            return paddle.concat(pieces, axis=1) if len(pieces) > 1 else pieces[0]

    def _ties_as_packed(
        self, scores: paddle.Tensor, vals: paddle.Tensor, idx: paddle.Tensor, placement: object
    ) -> paddle.Tensor:
        """The top-k ``idx`` [B, C, k] (``vals`` its scores) of a chunk's ``scores`` [B, C, T] (invisible
        keys -inf), each row b a sequence that ``placement`` (modeling/packing.py's `Placement`) puts at
        offset ``offsets[b]`` of a packed row of ``width`` keys, as HF selects it: torch.topk over that
        whole packed row, the other sequences' keys masked. On distinct scores that is the same top-k
        in the same order; among exact ties (the relu's zeros) the choice and order depend on the
        row's length (std::nth_element / partial_sort), so the queries whose top-k holds equal finite
        scores, or leaves out a key scoring as its k-th, are selected again over a row of the packed
        width (their keys at the sequence's offset, -inf elsewhere) and mapped back to the
        sequence's keys. Extra cost only for those queries: a [width] row each, in blocks within
        `CHUNK_BYTES`, and one host read per chunk for which they are."""
        B, C, T = scores.shape
        k = idx.shape[-1]
        finite = paddle.isfinite(vals)
        tied = paddle.zeros([B, C], dtype="bool")
        if k > 1:  # equal scores inside the top-k: their order (the sums' order) depends on the row
            tied = paddle.logical_and(vals[:, :, 1:] == vals[:, :, :-1], finite[:, :, 1:]).any(axis=-1)
        if T > k:  # a key left out that scores as the k-th: the choice depends on the row
            beside = (scores >= vals[:, :, k - 1 :]).astype("int32").sum(axis=-1) > k
            tied = paddle.logical_or(tied, paddle.logical_and(beside, finite[:, :, k - 1]))
        rows = np.flatnonzero(tied.numpy().reshape(-1))
        if rows.size == 0:
            return idx
        width = int(placement.width)
        offsets = np.asarray(placement.offsets, dtype=np.int64)
        lengths = np.asarray(placement.lengths, dtype=np.int64)
        k_full = min(self.topk, width)  # HF's width of the top-k over the packed row
        flat = scores.reshape([B * C, T])
        out = idx.reshape([B * C, k])
        # rows per block: the wide scores, their columns, top-k values and indices within the budget
        block = max(1, attention_forms.CHUNK_BYTES // (24 * width))
        for a in range(0, rows.size, block):
            r = rows[a : a + block]
            off = offsets[r // C]
            j = np.arange(width, dtype=np.int64)[None, :] - off[:, None]  # [m, width]: packed column -> key
            cols = np.where((j >= 0) & (j < lengths[r // C][:, None]), j, T)  # T: the -inf column
            r_t = paddle.to_tensor(r)
            picked = paddle.gather(flat, r_t, axis=0)
            picked = paddle.concat([picked, paddle.full([r.size, 1], NEG_INF, scores.dtype)], axis=-1)
            wide = paddle.take_along_axis(picked, paddle.to_tensor(cols), axis=1)
            v, i = topk(wide, k_full)
            v, i = v[:, :k], i[:, :k]  # k < k_full only where every visible key is already in the first k
            i = i - paddle.to_tensor(off).unsqueeze(-1)
            i = paddle.where(v == NEG_INF, paddle.full_like(i, -1), i)
            out = paddle.scatter(out, r_t, i, overwrite=True)
        return out.reshape([B, C, k])

    def chunk_rows(self, S: int, T: int) -> int:
        """Query rows per chunk of a selection over T keys: at most max(16, S / 4) (a chunk scores
        keys up to its last query only, so smaller chunks skip more of the causal upper triangle),
        and the chunk's scores [rows, Hi, T] within `CHUNK_BYTES` (down to one row, at any length)."""
        budget = attention_forms.CHUNK_BYTES  # read per call: one budget for every form
        return max(1, min(S, self.chunk_size, budget // 4 // (self.n_heads * T), max(16, S // 4)))

    def kl_loss(
        self,
        x: paddle.Tensor,
        q_latent: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        topk_idx: paddle.Tensor,
        target_probs: paddle.Tensor,
        all_keys: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        total: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        query_valid: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """KL(target || indexer) over the selected keys, mean over the real queries that have any
        (``query_valid`` [B, S], `query_validity`: 0.0 on padding queries; None: all real); inputs are
        detached so the gradient reaches only the indexer's parameters. target_probs [B, S, k]: the
        head-mean main attention over the same slots. Context parallel passes `all_keys` (this
        rank's keys -> every key, differentiable) and `total` (the count of queries -> the whole sequence's).
        """
        q, k, w = self.project(x.detach(), q_latent.detach(), cos, sin)
        if all_keys is not None:
            k = all_keys(k)
        k_sel = gather_keys(k, topk_idx)  # [B, S, k, Di]
        s = nn.functional.relu(paddle.matmul(q, k_sel, transpose_y=True) * self.softmax_scale)  # [B, S, Hi, k]
        scores = paddle.matmul(w.unsqueeze(-2), s).squeeze(-2)  # [B, S, k]
        kl, rows = _kl_rows(scores, target_probs.detach().astype("float32"), topk_idx >= 0)
        if query_valid is not None:
            rows = rows * query_valid
        return query_mean(kl, rows, total)

    def dense_kl_loss(
        self,
        x: paddle.Tensor,
        q_latent: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        target_probs: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        *,
        positions: np.ndarray | None = None,
        all_keys: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        total: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        query_valid: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """KL(target || softmax(index scores)) over *every* key a query sees (the dense warm-up),
        mean over the real (not padding) queries that see any. ``target_probs`` [B, S, T]: the head-mean main attention
        per key. Scored chunk by chunk as the selection does (never [S, T] at once), inputs detached;
        ``positions``, ``all_keys`` and ``total`` as in :meth:`select` and :meth:`kl_loss`;
        ``query_valid`` [B, S] (default: the real queries of ``key_padding``) the queries counted."""
        q, k, w = self.project(x.detach(), q_latent.detach(), cos, sin)
        if all_keys is not None:
            k = all_keys(k)  # [B, T, Di]
        B, S, Hi, _ = q.shape
        pos = np.arange(S, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
        T = k.shape[1]
        chunk = attention_forms.dense_score_rows(S, self.chunk_size, Hi, T, B)
        pad = None if key_padding is None else key_padding.astype("bool")
        p_all = target_probs.detach().astype("float32")
        # [B, S]: padding queries (right padding sees real keys) do not count
        real = query_validity(key_padding, pos) if query_valid is None else query_valid
        kl_sum, row_sum = None, None
        for c0, c1, kend in _query_chunks(pos, 0, chunk):
            scores = self.chunk_scores(q[:, c0:c1], k[:, :kend], w[:, c0:c1])  # with gradient
            valid = key_validity(paddle.to_tensor(pos[c0:c1]), kend, pad).expand([B, c1 - c0, kend])
            kl, rows = _kl_rows(scores, p_all[:, c0:c1, :kend], valid)
            if real is not None:
                rows = rows * real[:, c0:c1]
            part, n = (kl * rows).sum(), rows.sum()
            kl_sum = part if kl_sum is None else kl_sum + part
            row_sum = n if row_sum is None else row_sum + n
        n = row_sum if total is None else total(row_sum)
        return kl_sum / paddle.clip(n, min=1.0)
