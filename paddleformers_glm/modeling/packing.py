"""Packed sequences: several sequences in one row, told apart by ``position_ids`` that restart
(transformers' ``DataCollatorWithFlattening``). transformers 5.23 then attends (and its DSA indexer
selects) within each sequence only, where the forward has neither an attention_mask nor a cache.

This model runs such a batch as a padded batch of its sequences, one per row (right padding,
their own position_ids): the same block-causal attention and top-k as transformers', through the
one forward every other input takes; the outputs are packed back into the caller's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

__all__ = ["Packing", "packed_sequences"]


@dataclass
class Packing:
    """Where each packed token sits in the batch of sequences: ``to_rows`` [B' * S'] the packed flat
    index of each unpacked slot (B * S: a padding slot), ``to_packed`` [B * S] the unpacked flat
    index of each packed token; ``mask`` [B', S'] int64 (1 real, 0 padding); ``segments`` [B, S]
    the sequence number of each packed token in its row."""

    batch: int
    length: int
    to_rows: np.ndarray
    to_packed: np.ndarray
    mask: paddle.Tensor
    segments: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def bounds(self) -> list[int]:
        """The sequences' bounds over the rows laid end to end (transformers' ``cu_seq_lens``)."""
        lengths = [int(n) for n in self.mask.numpy().sum(axis=1)]
        return [0, *np.cumsum(lengths).tolist()]

    def unpack(self, x: paddle.Tensor, fill: float = 0) -> paddle.Tensor:
        """[B, S, ...] packed -> [B', S', ...] one sequence per row, ``fill`` in the padding."""
        tail = list(x.shape[2:])
        flat = x.reshape([self.batch * self.length, *tail])
        flat = paddle.concat([flat, paddle.full([1, *tail], fill, dtype=x.dtype)], axis=0)
        rows = paddle.gather(flat, paddle.to_tensor(self.to_rows), axis=0)
        return rows.reshape([self.rows, -1, *tail])

    def pack(self, y: paddle.Tensor) -> paddle.Tensor:
        """[B', S', ...] one sequence per row -> [B, S, ...] as the caller packed them."""
        tail = list(y.shape[2:])
        flat = y.reshape([-1, *tail])
        return paddle.gather(flat, paddle.to_tensor(self.to_packed), axis=0).reshape([self.batch, self.length, *tail])

    def same(self, shift: int) -> paddle.Tensor:
        """bool [B, S]: token i + ``shift`` belongs to token i's sequence (False past the row)."""
        S = self.length
        ahead = np.full(self.segments.shape, -1, dtype=np.int64)
        ahead[:, : max(S - shift, 0)] = self.segments[:, shift:]
        return paddle.to_tensor(ahead == self.segments)


def packed_sequences(position_ids: paddle.Tensor) -> Packing | None:
    """The packing of ``position_ids`` [B, S] (or [S]): a new sequence wherever a position does not
    follow the one before by 1 (transformers' ``find_packed_sequence_indices``); None when every row
    is one sequence."""
    pos = position_ids.numpy().reshape([-1, position_ids.shape[-1]]).astype(np.int64)
    B, S = pos.shape
    starts = np.ones([B, S], dtype=bool)
    starts[:, 1:] = np.diff(pos, axis=-1) != 1
    if not starts[:, 1:].any():
        return None
    segments = np.cumsum(starts, axis=-1) - 1  # [B, S]: 0, 0, 0, 1, 1, ...
    spans = [(b, s0, s1) for b in range(B) for s0, s1 in _runs(starts[b])]
    longest = max(s1 - s0 for _, s0, s1 in spans)
    to_rows = np.full([len(spans), longest], B * S, dtype=np.int64)
    to_packed = np.zeros([B * S], dtype=np.int64)
    mask = np.zeros([len(spans), longest], dtype=np.int64)
    for r, (b, s0, s1) in enumerate(spans):
        n = s1 - s0
        to_rows[r, :n] = b * S + np.arange(s0, s1)
        to_packed[b * S + s0 : b * S + s1] = r * longest + np.arange(n)
        mask[r, :n] = 1
    return Packing(B, S, to_rows.reshape(-1), to_packed, paddle.to_tensor(mask), segments)


def _runs(starts: np.ndarray) -> list[tuple[int, int]]:
    """[(start, end)] of the sequences of one row from its start flags."""
    at = [int(i) for i in np.flatnonzero(starts)] + [len(starts)]
    return list(zip(at, at[1:]))
