"""Context parallel (CP) for DSA attention: every rank of a cp group holds a slice of each sequence.

Load balance (zigzag): a sequence of S tokens is cut into 2N chunks of S / 2N (N = cp size);
cp rank r holds chunks r and 2N-1-r, in that order, so every rank holds as many early (cheap)
as late (expensive) causal queries and does the same attention work.

Everything outside the attention core is token-wise (norms, projections, MoE, LM head), so it runs
unchanged on the local tokens. The attention core all-gathers over the cp group only what DSA
needs from the other ranks' tokens:

* the MLA latent row of every key, [c, rope(k_rot)] (kv_lora_rank + qk_rope_head_dim values a
  token, shared by all heads), differentiable: its backward reduce-scatters the key gradients
  back to the owners (`gather_sequence`);
* the indexer keys (no gradient: selection runs without one).

Each rank then scores its own queries against all keys, causal by *global* position
(`zigzag_positions`), takes its top-k (shared indexer layers reuse the carried top-k, which is
per query and so already local), and attends in the latent form (`sparse_latent_attention` over
the whole sequence's latent rows, every chunk gathered). The batch side (`split_micro_batch`)
gives each rank its tokens, their global position ids, the global key-padding mask, and every
label / MTP input already shifted over the *whole* sequence, so a shift that crosses a chunk
boundary reads the neighbouring rank's token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import paddle

from . import comm
from .topology import ParallelConfigError, get_topology

__all__ = [
    "check_seq_len",
    "cp_attention_forward",
    "cp_topk",
    "gather_sequence",
    "split_micro_batch",
    "zigzag_positions",
]

IGNORE_INDEX = -100
# Largest per-chunk indexer score block [C, Hi, S] in elements (as the one-process indexer).
_CHUNK_ELEMS = 1 << 21


def check_seq_len(seq_len: int, cp: int) -> None:
    """The zigzag split needs 2 x cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        raise ParallelConfigError(
            f"--seq-len {seq_len} must be divisible by 2 x cp = {2 * cp} (zigzag: each cp rank holds 2 chunks)"
        )


def zigzag_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Global positions (int64) of cp rank ``rank``'s tokens: chunk r then chunk 2N-1-r of 2N."""
    check_seq_len(seq_len, cp)
    if cp == 1:
        return np.arange(seq_len, dtype=np.int64)
    c = seq_len // (2 * cp)
    return np.concatenate(
        [np.arange(rank * c, (rank + 1) * c), np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def _shift_left(a: np.ndarray, s: int, fill: int) -> np.ndarray:
    """a[:, i + s] at i (fill past the end): the HF shift, over the whole sequence."""
    out = np.full_like(a, fill)
    if s < a.shape[1]:
        out[:, : a.shape[1] - s] = a[:, s:]
    return out


def split_micro_batch(
    mb: Mapping[str, np.ndarray], cp: int, rank: int, label_shifts: Sequence[int], mtp_depths: int
) -> dict[str, np.ndarray]:
    """This cp rank's part of a micro-batch (numpy, [B, S] each).

    ``input_ids``, ``labels``, ``position_ids`` (given or arange: the *global* positions, for rope):
    the rank's tokens. ``attention_mask`` (key padding, indexed by global key position) stays whole.
    ``cp_target_<s>`` for each label shift s: labels shifted by s over the whole sequence, then sliced
    (position i's target is labels[i + s] even when i + s is on another rank). ``cp_ids_<d>``
    for MTP depth d: the input ids shifted by d the same way (0 past the end, as the model pads).
    """
    ids = np.asarray(mb["input_ids"])
    B, S = ids.shape
    idx = zigzag_positions(S, cp, rank)
    pos = mb.get("position_ids")
    pos = np.broadcast_to(np.arange(S, dtype=np.int64)[None], (1, S)) if pos is None else np.asarray(pos)
    out: dict[str, np.ndarray] = {
        "input_ids": ids[:, idx],
        "labels": np.asarray(mb["labels"])[:, idx],
        "position_ids": np.ascontiguousarray(pos[:, idx]),
    }
    if mb.get("attention_mask") is not None:
        out["attention_mask"] = np.asarray(mb["attention_mask"])
    for s in sorted(set(label_shifts)):
        out[f"cp_target_{s}"] = _shift_left(np.asarray(mb["labels"]), s, IGNORE_INDEX)[:, idx]
    for d in range(1, mtp_depths + 1):
        out[f"cp_ids_{d}"] = _shift_left(ids, d, 0)[:, idx]
    return out


# ------------------------------------------------------------------------------ the key gather
def _rank_major_to_global(chunks: list[paddle.Tensor], n: int) -> list[paddle.Tensor]:
    """2n chunks in gathered order (rank r: its chunks r, 2n-1-r) -> in global order."""
    return [chunks[2 * j] if j < n else chunks[2 * (2 * n - 1 - j) + 1] for j in range(2 * n)]


def _global_to_rank_major(chunks: list[paddle.Tensor], n: int) -> list[paddle.Tensor]:
    out = []
    for r in range(n):
        out += [chunks[r], chunks[2 * n - 1 - r]]
    return out


def gather_sequence(x: paddle.Tensor, group: Any = None, axis: int = 1) -> paddle.Tensor:
    """All ranks' zigzag slices of ``x`` along ``axis``, in global sequence order.

    Differentiable: the backward sums every rank's gradient of the whole sequence and keeps this
    rank's chunks (a reduce-scatter; all-reduce + slice on gloo). Without a gradient it is a plain
    all-gather. Identity at cp size 1.
    """
    g = get_topology().cp_group if group is None else group
    if g is None or g.nranks == 1:
        return x
    n = g.nranks

    def fwd(t: paddle.Tensor) -> paddle.Tensor:
        full = comm.all_gather(t, g, axis)
        return paddle.concat(_rank_major_to_global(paddle.split(full, 2 * n, axis=axis), n), axis=axis)

    def bwd(d: paddle.Tensor) -> paddle.Tensor:
        d = paddle.concat(_global_to_rank_major(paddle.split(d, 2 * n, axis=axis), n), axis=axis)
        return comm.reduce_scatter(d, g, axis)

    return comm._apply(x, fwd, bwd)


# ------------------------------------------------------------------------------ selection
def cp_topk(
    indexer: Any,
    x: paddle.Tensor,
    q_latent: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    key_padding: paddle.Tensor | None,
    positions: np.ndarray,
    group: Any = None,
) -> paddle.Tensor:
    """The indexer's top-k [B, S_local, min(index_topk, S)] for this rank's queries over all S keys.

    Key indices are global positions; -1 marks an empty slot, as in `DSAIndexer.forward`. A query
    at global position p sees keys <= p (and not padding); its row holds scores over all S keys
    (-inf where invisible), so `paddle.topk` sees the same row as in one process.
    """
    from ..modeling.indexer import NEG_INF, key_validity

    with paddle.no_grad():
        q, k, w = indexer.project(x.detach(), q_latent.detach(), cos, sin)
        k_all = gather_sequence(k, group)  # [B, S, Di]
        B, S_loc = x.shape[0], x.shape[1]
        S = k_all.shape[1]
        k_out = min(indexer.topk, S)
        chunk = max(1, min(S_loc, indexer.chunk_size, max(16, _CHUNK_ELEMS // (indexer.n_heads * S))))
        pad = None if key_padding is None else key_padding.astype("bool")
        half = S_loc // 2  # the two contiguous runs of global positions
        pieces = []
        for lo, hi in ((0, half), (half, S_loc)):
            for c0 in range(lo, hi, chunk):
                c1 = min(hi, c0 + chunk)
                C = c1 - c0
                kend = int(positions[c1 - 1]) + 1  # causal: keys past the chunk's last query are invisible
                scores = indexer.chunk_scores(q[:, c0:c1], k_all[:, :kend], w[:, c0:c1])  # [B, C, kend]
                qpos = paddle.to_tensor(positions[c0:c1])
                valid = key_validity(qpos, kend, pad).expand([B, C, kend])
                scores = paddle.where(valid, scores, paddle.full([B, C, kend], NEG_INF, scores.dtype))
                if kend < S:
                    scores = paddle.concat([scores, paddle.full([B, C, S - kend], NEG_INF, scores.dtype)], axis=-1)
                vals, idx = paddle.topk(scores, k_out, axis=-1)
                pieces.append(paddle.where(paddle.isinf(vals), paddle.full([B, C, k_out], -1, dtype="int64"), idx))
        return paddle.concat(pieces, axis=1) if len(pieces) > 1 else pieces[0]


# ------------------------------------------------------------------------------ attention
def cp_attention_forward(
    attn: Any,
    x: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    key_padding: paddle.Tensor | None,
    prev_topk: paddle.Tensor | None,
    reuse_topk: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
    """`MLAttention.forward` for this cp rank's tokens x [B, S_local(/tp under SP), hidden].

    The projections run on the local tokens; the latent rows [c, rope(k_rot)] and the indexer keys
    are all-gathered over the cp group; top-k and attention are taken for the local queries. Runs
    in the latent form (the same maths as the per-head forms, other rounding). cos / sin are the
    local tokens' (global positions). The indexer KL loss (when trained) is this rank's queries'
    share of the whole sequence's mean: summed over the cp ranks (as the trainer sums every loss
    term) it is the one-process loss.
    """
    from ..modeling.attention_forms import sparse_latent_attention

    topo = get_topology()
    group = topo.cp_group
    q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
    c, k_rot = paddle.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora, attn.rope_dim], axis=-1)
    c = attn.kv_a_layernorm(c)
    x_full, q_latent_full = attn._replicated_full(x), attn._replicated_full(q_latent)
    q_latent, c, k_rot = attn._enter_tp(q_latent), attn._enter_tp(c), attn._enter_tp(k_rot)  # [B, S_local, ...]
    S_loc = q_latent.shape[1]
    positions = zigzag_positions(S_loc * topo.cp_size, topo.cp_size, topo.cp_rank)
    core = attn.core_attention
    if core.indexer is not None and not reuse_topk:
        topk = cp_topk(core.indexer, x_full, q_latent_full, cos, sin, key_padding, positions, group)
    elif prev_topk is None:
        raise ValueError("a shared DSA layer needs the top-k indices of the previous full layer (prev_topk)")
    else:
        topk = prev_topk

    def attend(q_lat: paddle.Tensor, kv_lat: paddle.Tensor, sel: paddle.Tensor, want: bool) -> tuple:
        # this rank's queries over every key (global positions): the latent form's gathered chunks
        return sparse_latent_attention(q_lat, gather_sequence(kv_lat, group), sel, core.scale, core.chunk_size, want)

    want_kl = core.indexer is not None and not reuse_topk and attn.indexer_loss_coeff > 0 and attn.training
    out, probs = attn._latent_attention(q_latent, c, k_rot, cos, sin, topk, want_kl, attend=attend)
    out = attn._exit_tp(out)
    if attn.o_proj.bias is not None:
        out = out + attn.o_proj.bias
    kl = None
    if want_kl:
        if attn.tp > 1:  # the target is the mean over all heads, this rank holds H / tp of them
            probs = comm.all_reduce(probs.detach() * attn.num_heads, topo.tp_group) / attn.total_heads
        kl = core.indexer.kl_loss(
            x_full, q_latent_full, cos, sin, topk, probs,
            all_keys=lambda k: gather_sequence(k, group),
            total=lambda n: comm.all_reduce(n.detach(), group),
        )  # fmt: skip
    return out, topk, kl
