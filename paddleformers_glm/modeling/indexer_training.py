"""Training the DSA indexer: the stages of DeepSeek-V3.2 / GLM-5 (``none``, ``warmup``, ``sparse``: an
:class:`IndexerTraining`, a run setting), the indexer's targets, its KL losses and its top-k recall,
as docs/indexer.md defines them.

Each attention call in training leaves an :class:`IndexerRecord`; the model's body hands the
records of one forward, in layer order, to :func:`indexer_terms` once every layer that reuses a
top-k has run (with shared supervision a full layer's target also averages the layers reusing its
top-k). Under context parallel each rank's KL and recall are its queries' share of the mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from .indexer import key_validity, query_mean, query_validity
from .indexer_stages import IndexerTraining

__all__ = ["IndexerRecord", "IndexerRun", "IndexerTerms", "causal_selection", "count_real_queries", "indexer_terms"]


def causal_selection(
    batch: int, n_keys: int, positions: np.ndarray, key_padding: paddle.Tensor | None
) -> paddle.Tensor:
    """Every visible key as a selection: int64 [B, S, T], slot j holding key j when query i (at
    ``positions[i]``) sees it (j <= position, not padding), else -1.  The dense warm-up attends with
    it through the same attention forms as a top-k, and its probabilities come back per key."""
    pos = paddle.to_tensor(np.asarray(positions, dtype=np.int64))
    pad = None if key_padding is None else key_padding.astype("bool")
    valid = key_validity(pos, n_keys, pad).expand([batch, len(positions), n_keys])
    keys = paddle.arange(n_keys, dtype="int64").reshape([1, 1, n_keys]).expand(valid.shape)
    return paddle.where(valid, keys, paddle.full(valid.shape, -1, dtype="int64"))


class IndexerRun:
    """The indexer training of one model, shared by its attention layers (like their
    ``SelectionCache``): the stage, and the dense selection of the forward in progress (built once
    for all layers; released when the forward ends)."""

    def __init__(self, training: IndexerTraining | None = None) -> None:
        self.training = training or IndexerTraining()
        self._dense: tuple[tuple, paddle.Tensor] | None = None

    def dense_selection(
        self, batch: int, n_keys: int, positions: np.ndarray, key_padding: paddle.Tensor | None
    ) -> paddle.Tensor:
        key = (batch, n_keys, tuple(int(p) for p in positions), id(key_padding))
        if self._dense is None or self._dense[0] != key:
            with paddle.no_grad():
                self._dense = (key, causal_selection(batch, n_keys, positions, key_padding))
        return self._dense[1]

    def release(self) -> None:
        self._dense = None


@dataclass
class IndexerRecord:
    """What one attention call of a training forward leaves for the indexer's losses.

    ``topk``: the top-k the layer's indexer selected (a shared layer: the one it reused) [B, S, k];
    ``probs``: the head-mean attention probabilities over all heads (TP-reduced, detached): at the
    top-k slots [B, S, k] in the sparse stage, at every key [B, S, T] in the warm-up (slot = key);
    ``dense``: ``(c0, c1) -> [B, c1 - c0, T]``, the head-mean attention over every visible key of
    queries c0..c1 (the sparse stage's recall; computed when asked, chunk by chunk);
    ``indexer`` and ``inputs``: a layer that runs its own indexer, and what its KL needs
    (``x``, ``q_latent``, ``cos``, ``sin``, ``key_padding``, ``positions``, ``all_keys``, ``total``,
    ``query_valid``: 1.0 on the real queries, 0.0 on padding, or None without padding; an MTP layer's
    record also ``dense_query_valid``: see :func:`count_real_queries`).
    """

    topk: paddle.Tensor
    probs: paddle.Tensor | None = None
    dense: Callable[[int, int], paddle.Tensor] | None = None
    indexer: Any = None
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class IndexerTerms:
    """A forward's indexer losses: per layer that ran its own indexer, the KL (with gradient to that
    indexer) and the top-k recall (no gradient), each this rank's share of its mean."""

    kl: dict[int, paddle.Tensor] = field(default_factory=dict)
    recall: dict[int, paddle.Tensor] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.kl)

    def kl_sum(self) -> paddle.Tensor:
        return paddle.add_n([self.kl[i] for i in sorted(self.kl)])


def count_real_queries(rec: IndexerRecord, token_valid: paddle.Tensor) -> None:
    """Make the KL and recall of ``rec`` (an MTP layer's own indexer) count only the queries whose
    inputs are real tokens, ``token_valid`` [B, S_global] (modeling/mtp.py's ``mtp_token_valid``, by
    global position): position i of depth d reads token i + d, which past the window's end (or
    before right padding) is the fill, not a token of the data.  Only the queries are narrowed: the
    keys stay the layer's (its ``key_padding``), so the key before a hole in a row's mask is still a
    key of the queries after it, as in the attention and the torch reference."""
    inp = rec.inputs
    positions = inp["positions"] if inp["positions"] is not None else np.arange(rec.topk.shape[1])
    inp["query_valid"] = inp["dense_query_valid"] = query_validity(token_valid, positions)


def indexer_terms(records: Sequence[tuple[int, IndexerRecord]], training: IndexerTraining) -> IndexerTerms:
    """The KL and recall of every layer in ``records`` (layer id, record; in layer order) that ran its
    own indexer.  With shared supervision a shared layer's record joins the full layer before it in
    ``records`` (the one whose top-k it reused); a shared layer with none before it (a pipeline stage
    that opens on it) supervises nothing here."""
    groups: list[tuple[int, list[IndexerRecord]]] = []
    for layer, rec in records:
        if rec.indexer is not None:
            groups.append((layer, [rec]))
        elif training.shared_supervision and groups:
            groups[-1][1].append(rec)
    out = IndexerTerms()
    for layer, members in groups:
        out.kl[layer], out.recall[layer] = _group_terms(members, training)
    return out


def _mean(ts: list[paddle.Tensor]) -> paddle.Tensor:
    return ts[0] if len(ts) == 1 else paddle.add_n(ts) / float(len(ts))


def _group_terms(members: list[IndexerRecord], training: IndexerTraining) -> tuple[paddle.Tensor, paddle.Tensor]:
    full = members[0]
    inp = full.inputs
    target = _mean([m.probs for m in members])  # [B, S, T] (warm-up) or [B, S, k] (sparse)
    if training.dense:
        kl = full.indexer.dense_kl_loss(
            inp["x"], inp["q_latent"], inp["cos"], inp["sin"], target, inp["key_padding"],
            positions=inp["positions"], all_keys=inp["all_keys"], total=inp["total"],
            query_valid=inp.get("dense_query_valid"),
        )  # fmt: skip
    else:
        kl = full.indexer.kl_loss(
            inp["x"], inp["q_latent"], inp["cos"], inp["sin"], full.topk, target,
            all_keys=inp["all_keys"], total=inp["total"], query_valid=inp["query_valid"],
        )  # fmt: skip
    with paddle.no_grad():
        if training.dense:
            mass = _selected_mass(target, full.topk)
        else:
            mass = _dense_mass([m.dense for m in members], full.topk, inp["chunk"])
        rows = (full.topk >= 0).any(axis=-1).astype("float32")
        if inp["query_valid"] is not None:  # padding queries do not count (they see real keys when right-padded)
            rows = rows * inp["query_valid"]
        recall = query_mean(mass, rows, inp["total"])
    return kl, recall


def _selected_mass(dense: paddle.Tensor, topk: paddle.Tensor) -> paddle.Tensor:
    """[B, S]: the mass of ``dense`` [B, S, T] (per key) on each query's selected keys."""
    valid = topk >= 0
    picked = paddle.take_along_axis(dense, paddle.where(valid, topk, paddle.zeros_like(topk)), axis=-1)
    return paddle.where(valid, picked, paddle.zeros_like(picked)).sum(-1)


def _dense_mass(dense_fns: list[Callable[[int, int], paddle.Tensor]], topk: paddle.Tensor, chunk: int) -> paddle.Tensor:
    """[B, S]: the selected keys' share of the mean dense attention of the layers, chunk by chunk of
    queries (never the whole [B, S, T] at once)."""
    S = topk.shape[1]
    parts = []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        parts.append(_selected_mass(_mean([f(c0, c1) for f in dense_fns]), topk[:, c0:c1]))
    return paddle.concat(parts, axis=1) if len(parts) > 1 else parts[0]
