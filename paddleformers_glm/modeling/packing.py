"""Packed sequences: several sequences in one row, told apart by ``position_ids`` that restart
(transformers' ``DataCollatorWithFlattening``). transformers 5.23 then attends (and its DSA indexer
selects) within each sequence only, where the forward has neither an attention_mask nor a cache.

This model runs such a batch as padded batches of its sequences, one per row (right padding,
their own position_ids): the same block-causal attention and top-k as transformers', through the
one forward every other input takes; the outputs are packed back into the caller's rows. The
sequences are grouped by length (a group's rows are at least half its longest), so that a row
packing one long sequence and many short ones does not pad every short one to the long one's
length: each group is one pass of the layers, and a group costs at most twice its tokens; the
shortest groups then join the group before them while that pads at most a quarter of the batch's
tokens in all (a pass has a cost of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

__all__ = ["Packing", "Placement", "check_pack_offsets", "check_packed_mask", "packed_sequences"]


@dataclass
class Placement:
    """Where the rows of a group's padded batch sat in the packed rows: ``offsets`` [n] int64 each
    sequence's first token in its packed row, ``lengths`` [n] its length, ``width`` the packed rows'
    length S. The group's ``mask`` carries it (its attribute ``placement``) to the DSA indexer, whose
    top-k breaks exact ties as transformers' over the packed row does (modeling/indexer.py,
    ``DSAIndexer.select``); the mask reaches the indexer as the same object in every pass, a
    recomputed layer's replay included."""

    offsets: np.ndarray
    lengths: np.ndarray
    width: int


@dataclass
class Group:
    """Sequences of similar length as the rows of one padded batch: ``to_rows`` [n * S'] the packed
    flat index of each slot (B * S for a padding slot), ``mask`` [n, S'] int64 (1 real, 0 padding;
    its ``placement`` attribute: the rows' `Placement`), ``spans`` each row's (packed row, first
    token, end)."""

    to_rows: np.ndarray
    mask: paddle.Tensor
    spans: list[tuple[int, int, int]]


@dataclass
class Packing:
    """Where each packed token of a [B, S] batch sits in the groups' padded batches: ``to_packed``
    [B * S] its slot in the groups' slots laid end to end; ``segments`` [B, S] the sequence number
    of each token in its row; ``lengths`` the sequences' lengths, rows in order."""

    batch: int
    length: int
    groups: list[Group]
    to_packed: np.ndarray
    segments: np.ndarray
    lengths: list[int]

    def bounds(self) -> list[int]:
        """The sequences' bounds over the rows laid end to end (transformers' ``cu_seq_lens``)."""
        return [0, *np.cumsum(self.lengths).tolist()]

    def unpack(self, x: paddle.Tensor, fill: float = 0) -> list[paddle.Tensor]:
        """[B, S, ...] packed -> per group [n, S', ...], one sequence per row, ``fill`` in the padding."""
        tail = list(x.shape[2:])
        flat = x.reshape([self.batch * self.length, *tail])
        flat = paddle.concat([flat, paddle.full([1, *tail], fill, dtype=x.dtype)], axis=0)
        return [
            paddle.gather(flat, paddle.to_tensor(g.to_rows), axis=0).reshape([g.mask.shape[0], -1, *tail])
            for g in self.groups
        ]

    def pack(self, ys: list[paddle.Tensor]) -> paddle.Tensor:
        """Per group [n, S', ...] -> [B, S, ...] as the caller packed them."""
        return self.pack_slots(paddle.concat([y.reshape([-1, *y.shape[2:]]) for y in ys], axis=0))

    def pack_slots(self, flat: paddle.Tensor) -> paddle.Tensor:
        """The groups' slots laid end to end [sum n * S', ...] -> [B, S, ...]."""
        picked = paddle.gather(flat, paddle.to_tensor(self.to_packed), axis=0)
        return picked.reshape([self.batch, self.length, *flat.shape[1:]])

    def block_diagonal(self, per_group: list[paddle.Tensor]) -> paddle.Tensor:
        """Per group [n, H, S', S'] (each sequence over its own keys) -> [B, H, S, S] over the packed
        rows, 0 between sequences (attention weights, as transformers' eager attention gives them)."""
        H = per_group[0].shape[1]
        out = paddle.zeros([self.batch, H, self.length, self.length], dtype=per_group[0].dtype)
        for weights, group in zip(per_group, self.groups):
            for r, (b, s0, s1) in enumerate(group.spans):
                out[b, :, s0:s1, s0:s1] = weights[r, :, : s1 - s0, : s1 - s0]
        return out

    def same(self, shift: int) -> paddle.Tensor:
        """bool [B, S]: token i + ``shift`` belongs to token i's sequence (False past the row)."""
        S = self.length
        ahead = np.full(self.segments.shape, -1, dtype=np.int64)
        ahead[:, : max(S - shift, 0)] = self.segments[:, shift:]
        return paddle.to_tensor(ahead == self.segments)


def sequence_starts(position_ids: paddle.Tensor) -> np.ndarray:
    """bool [B, S] from ``position_ids`` [B, S] (or [S]): True where a sequence starts, the row's first
    token and wherever a position does not follow the one before by 1 (transformers'
    ``find_packed_sequence_indices``)."""
    pos = position_ids.numpy().reshape([-1, position_ids.shape[-1]]).astype(np.int64)
    starts = np.ones(pos.shape, dtype=bool)
    starts[:, 1:] = np.diff(pos, axis=-1) != 1
    return starts


def packed_sequences(position_ids: paddle.Tensor, grouped: bool = True) -> Packing | None:
    """The packing of ``position_ids`` [B, S] (or [S]) into its sequences (``sequence_starts``); None
    when every row is one sequence. ``grouped=False``: all sequences in one padded batch (one pass)."""
    starts = sequence_starts(position_ids)
    B, S = starts.shape
    if not starts[:, 1:].any():
        return None
    spans = [(b, s0, s1) for b in range(B) for s0, s1 in _runs(starts[b])]
    order = sorted(range(len(spans)), key=lambda r: spans[r][1] - spans[r][2])  # longest first
    lengths = [spans[k][2] - spans[k][1] for k in order]
    cuts = [0]  # where each group starts in ``order``: a sequence under half the group's longest starts one
    for i in range(1, len(order)):
        if grouped and 2 * lengths[i] < lengths[cuts[-1]]:
            cuts.append(i)
    cuts = _merged([*cuts, len(order)], lengths, budget=B * S // 4)
    groups, to_packed, offset = [], np.zeros([B * S], dtype=np.int64), 0
    for i, j in zip(cuts, cuts[1:]):
        longest = lengths[i]
        to_rows = np.full([j - i, longest], B * S, dtype=np.int64)
        mask = np.zeros([j - i, longest], dtype=np.int64)
        for r, k in enumerate(order[i:j]):
            b, s0, s1 = spans[k]
            to_rows[r, : s1 - s0] = b * S + np.arange(s0, s1)
            to_packed[b * S + s0 : b * S + s1] = offset + r * longest + np.arange(s1 - s0)
            mask[r, : s1 - s0] = 1
        members = [spans[k] for k in order[i:j]]
        mask_t = paddle.to_tensor(mask)
        mask_t.placement = Placement(
            np.array([s0 for _, s0, _ in members], np.int64), np.array([s1 - s0 for _, s0, s1 in members], np.int64), S
        )
        groups.append(Group(to_rows.reshape(-1), mask_t, members))
        offset += (j - i) * longest
    segments = np.cumsum(starts, axis=-1) - 1  # [B, S]: 0, 0, 0, 1, 1, ...
    return Packing(B, S, groups, to_packed, segments, [s1 - s0 for _, s0, s1 in spans])


def check_packed_mask(
    position_ids: paddle.Tensor, dense: paddle.Tensor | None = None, startend: paddle.Tensor | None = None
) -> None:
    """A mask that packs sequences (PaddleFormers' collators: a 4-D block-diagonal mask ``dense``
    [B, 1, S, S], 1 / True = visible, or FlashMask's ``startend`` row indices [B, 1, S, 1]: key j is
    seen by the queries j .. startend[j] - 1) must be the block-causal mask of the sequences
    ``position_ids`` restart at, which the forward attends by; the tokens that see and are seen by
    nothing (the collator's padding) are not compared. ValueError naming the row and token otherwise."""
    begins = sequence_starts(position_ids)
    B, S = begins.shape
    index = np.arange(S)
    first = np.maximum.accumulate(np.where(begins, index, 0), axis=-1)  # [B, S]: its sequence's first token
    last = np.minimum.accumulate(
        np.where(np.concatenate([begins[:, 1:], np.ones([B, 1], bool)], 1), index, S)[:, ::-1], axis=-1
    )[:, ::-1]
    if startend is not None:
        ends = startend.numpy().reshape([B, S]).astype(np.int64)
        real = ends > index  # a padding key is seen by no query
        bad = real & (ends != last + 1)
        where, got = "startend row index", ends
    else:
        m = dense.numpy().reshape([B, S, S])
        visible = m if m.dtype == np.bool_ else (m > 0.5 if m.min() >= 0 else m == 0)  # 1/0 or additive 0/-inf
        want_rows = (index[None, None, :] >= first[:, :, None]) & (index[None, None, :] <= index[None, :, None])
        real = visible.any(axis=-1)
        bad = real & (visible != want_rows).any(axis=-1)
        where, got = "first visible key", visible.argmax(axis=-1)
    if bad.any():
        b, i = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"packed attention mask: row {b}, token {i}: {where} {int(got[b, i])}, but position_ids put the token in "
            f"the sequence of tokens {int(first[b, i])}..{int(last[b, i])} (the mask must be block-causal over the "
            "sequences position_ids restart at)"
        )


def check_pack_offsets(position_ids: paddle.Tensor, offsets: paddle.Tensor) -> None:
    """PaddleFormers' ``nbatch_pack_offset`` [B, S] (1 at a packed sequence's last token) must mark
    only tokens that ``position_ids`` end a sequence at (the next one restarts)."""
    starts = sequence_starts(position_ids)
    ends = np.zeros(starts.shape, dtype=bool)
    ends[:, :-1] = starts[:, 1:]
    marked = offsets.numpy().reshape(starts.shape) != 0
    bad = marked & ~ends
    if bad.any():
        b, i = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(f"nbatch_pack_offset: row {b} marks token {i} as a sequence's last, but position_ids go on")


def _merged(cuts: list[int], lengths: list[int], budget: int) -> list[int]:
    """Fewer passes of the layers: the shortest groups join the group before them while the padding
    that adds stays within ``budget`` tokens in all (each pass has a cost of its own, and a short
    group is cheap to pad). ``cuts``: the groups' starts and the end, ``lengths`` longest first."""
    spent, k = 0, len(cuts) - 2
    while k >= 1:
        extra = (cuts[k + 1] - cuts[k]) * (lengths[cuts[k - 1]] - lengths[cuts[k]])
        if spent + extra > budget:
            break
        spent += extra
        del cuts[k]
        k -= 1
    return cuts


def _runs(starts: np.ndarray) -> list[tuple[int, int]]:
    """[(start, end)] of the sequences of one row from its start flags."""
    at = [int(i) for i in np.flatnonzero(starts)] + [len(starts)]
    return list(zip(at, at[1:]))
