"""Context parallel (CP) for DSA attention: every rank of a cp group holds a zigzag slice of each
sequence, as many early (cheap) as late (expensive) causal queries (docs/parallel.md section 9).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import paddle

from ..configuration import IGNORE_INDEX
from . import comm
from .topology import check_seq_len

__all__ = ["gather_sequence", "split_micro_batch", "zigzag_positions"]


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
def gather_sequence(x: paddle.Tensor, group: Any, axis: int = 1) -> paddle.Tensor:
    """All ranks' zigzag slices of ``x`` along ``axis``, in global sequence order (``group``: the
    context-parallel group).

    Differentiable: the backward sums every rank's gradient of the whole sequence and keeps this
    rank's chunks (a reduce-scatter; all-reduce + slice on gloo). Without a gradient it is a plain
    all-gather. Identity at cp size 1.
    """
    n = comm.group_size(group)
    # where global chunk j sits among the all-gathered ones (rank r's chunks r, 2n-1-r, rank by rank)
    gathered = [2 * j if j < n else 2 * (2 * n - 1 - j) + 1 for j in range(2 * n)]

    def fwd(t: paddle.Tensor) -> paddle.Tensor:
        chunks = paddle.split(comm.all_gather(t, group, axis), 2 * n, axis=axis)
        return paddle.concat([chunks[i] for i in gathered], axis=axis)

    def bwd(d: paddle.Tensor) -> paddle.Tensor:
        chunks = paddle.split(d, 2 * n, axis=axis)  # by global position, back to rank by rank
        rank_major = paddle.concat([chunks[i] for r in range(n) for i in (r, 2 * n - 1 - r)], axis=axis)
        return comm.reduce_scatter(rank_major, group, axis)

    return comm._pair(x, group, fwd, bwd)
