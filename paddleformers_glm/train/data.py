"""Training data: the same global batches for any parallel layout, addressable by step.

Sources
  * synthetic (default): a deterministic stream from the seed; mostly a fixed random "next token"
    table with some noise, so the loss visibly falls;
  * ``.npy``: a 1-D integer token array (memory-mapped), cut into windows of ``seq_len``;
  * ``.bin``: raw little-endian tokens, ``uint16`` when the vocabulary fits, else ``uint32``
    (``data_dtype`` overrides);
  * ``.jsonl``: one ``{"input_ids": [...]}`` per line (optional ``labels``), truncated or
    right-padded to ``seq_len`` with labels -100 and an ``attention_mask``.

Global batch of step s (0-based) = samples s*G .. s*G+G-1 of an epoch-wise permutation (seeded);
data-parallel rank d takes rows [d*G/dp, (d+1)*G/dp), cut into micro-batches of M rows.  The data
position of a checkpoint is therefore just the step number.  Labels equal input ids (the model
shifts them, HF convention).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

__all__ = ["TokenData", "micro_batches", "open_data"]

IGNORE_INDEX = -100


class TokenData:
    """Sample access: ``sample(i) -> dict`` of int64 arrays [S]; ``num_samples`` (None: unbounded)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int, describe: str) -> None:
        self.seq_len, self.vocab_size, self.seed, self.describe = seq_len, vocab_size, seed, describe
        self.num_samples: int | None = None
        self.has_mask = False

    def sample(self, i: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def global_batch(self, step: int, global_batch_size: int, shuffle: bool = True) -> dict[str, np.ndarray]:
        """Rows of step ``step`` (same on every rank and layout)."""
        rows = []
        for j in range(global_batch_size):
            k = step * global_batch_size + j
            if self.num_samples is None:
                idx = k
            else:
                epoch, pos = divmod(k, self.num_samples)
                idx = int(self._perm(epoch)[pos]) if shuffle else pos
            rows.append(self.sample(idx))
        out = {key: np.stack([r[key] for r in rows]).astype(np.int64) for key in rows[0]}
        bad = (out["input_ids"] < 0) | (out["input_ids"] >= self.vocab_size)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ValueError(
                f"{self.describe}: token {int(out['input_ids'][r, c])} at step {step} row {r} pos {c} "
                f"outside the vocabulary [0, {self.vocab_size})"
            )
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        cache = getattr(self, "_perm_cache", None)
        if cache is None or cache[0] != epoch:
            cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
            self._perm_cache = cache
        return cache[1]


class _Synthetic(TokenData):
    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        super().__init__(seq_len, vocab_size, seed, f"synthetic(seed={seed})")
        self.table = np.random.default_rng([seed, 17]).permutation(vocab_size)

    def sample(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 1, i])
        toks = np.empty(self.seq_len, dtype=np.int64)
        toks[0] = rng.integers(self.vocab_size)
        noise = rng.random(self.seq_len) < 0.25
        rand = rng.integers(self.vocab_size, size=self.seq_len)
        for t in range(1, self.seq_len):
            toks[t] = rand[t] if noise[t] else self.table[toks[t - 1]]
        return {"input_ids": toks, "labels": toks.copy()}


class _Stream(TokenData):
    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, seed: int, describe: str) -> None:
        super().__init__(seq_len, vocab_size, seed, describe)
        if tokens.ndim != 1:
            raise ValueError(f"{describe}: expected a 1-D token array, got shape {tokens.shape}")
        self.tokens = tokens
        self.num_samples = len(tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(f"{describe}: {len(tokens)} tokens, fewer than one sequence of {seq_len}")

    def sample(self, i: int) -> dict[str, np.ndarray]:
        toks = np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len], dtype=np.int64)
        return {"input_ids": toks, "labels": toks.copy()}


class _Jsonl(TokenData):
    def __init__(self, path: str, seq_len: int, vocab_size: int, seed: int, pad_id: int) -> None:
        super().__init__(seq_len, vocab_size, seed, path)
        self.records: list[dict[str, Any]] = []
        with open(path, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{ln}: not JSON: {e}") from e
                if not isinstance(rec, dict) or not isinstance(rec.get("input_ids"), list) or not rec["input_ids"]:
                    raise ValueError(f"{path}:{ln}: expected an object with a non-empty list `input_ids`")
                self.records.append(rec)
        if not self.records:
            raise ValueError(f"{path}: no records")
        self.num_samples = len(self.records)
        self.pad_id, self.has_mask = pad_id, True

    def sample(self, i: int) -> dict[str, np.ndarray]:
        rec, S = self.records[i], self.seq_len
        ids = np.asarray(rec["input_ids"][:S], dtype=np.int64)
        labels = np.asarray(rec.get("labels", rec["input_ids"])[:S], dtype=np.int64)
        n = len(ids)
        out = {
            "input_ids": np.full(S, self.pad_id, dtype=np.int64),
            "labels": np.full(S, IGNORE_INDEX, dtype=np.int64),
            "attention_mask": np.zeros(S, dtype=np.int64),
        }
        out["input_ids"][:n], out["labels"][: len(labels)], out["attention_mask"][:n] = ids, labels, 1
        return out


def open_data(
    path: str | None, seq_len: int, vocab_size: int, seed: int, *, data_dtype: str = "auto", pad_id: int = 0
) -> TokenData:
    """The data source for ``path`` (None: synthetic); see the module doc for formats."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if path is None or path == "synthetic":
        return _Synthetic(seq_len, vocab_size, seed)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data: no file {path}")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected integer tokens, got dtype {arr.dtype}")
        return _Stream(arr, seq_len, vocab_size, seed, path)
    if path.endswith(".bin"):
        dtype = data_dtype if data_dtype != "auto" else ("uint16" if vocab_size <= 65536 else "uint32")
        return _Stream(
            np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r"),
            seq_len,
            vocab_size,
            seed,
            f"{path} ({dtype})",
        )
    if path.endswith(".jsonl"):
        return _Jsonl(path, seq_len, vocab_size, seed, pad_id)
    raise ValueError(f"--data {path}: unknown format (use .npy, .bin, .jsonl, or omit for synthetic)")


def micro_batches(
    batch: dict[str, np.ndarray], dp_rank: int, dp: int, micro_batch_size: int
) -> list[dict[str, np.ndarray]]:
    """This data-parallel rank's share of a global batch, cut into micro-batches (row order kept)."""
    g = batch["input_ids"].shape[0]
    if g % (dp * micro_batch_size):
        raise ValueError(f"global batch size {g} is not divisible by dp {dp} x micro batch size {micro_batch_size}")
    per = g // dp
    lo = dp_rank * per
    return [
        {k: v[lo + i : lo + i + micro_batch_size] for k, v in batch.items()} for i in range(0, per, micro_batch_size)
    ]
