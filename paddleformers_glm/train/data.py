"""Training data: the same global batches for any parallel layout, addressable by step.

Sources: docs/parallel.md, "The trainer" (the synthetic default is a fixed random "next token"
table with some noise, so the loss visibly falls; ``prepare_jsonl`` writes the ``.npz`` of text or chat).

A finite source of n samples is read in epochs of floor(n/G) global batches of distinct samples:
global batch s (0-based) is rows b*G .. b*G+G-1 of epoch e's permutation (seeded), e, b = divmod(s,
floor(n/G)); the n mod G samples left at the end of an epoch's order are not trained in that epoch (the
next reshuffles all n).  An unbounded (synthetic) source's batch s is samples s*G .. s*G+G-1.
Data-parallel rank d takes rows [d*G/dp, (d+1)*G/dp), cut into micro-batches of M rows.  The data
position of a checkpoint is therefore just the step number.  Labels equal input ids (the model
shifts them, HF convention).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._io import atomic_open, is_int
from ..configuration import IGNORE_INDEX

__all__ = [
    "BIN_DTYPES",
    "TOY_PADDING",
    "TokenData",
    "check_batch_samples",
    "check_data_file",
    "check_token_range",
    "jsonl_kind",
    "micro_batches",
    "open_data",
    "prepare_jsonl",
    "text_jsonl_kind",
]

CHAT_TEMPLATE_INPUTS = ("tools", "documents")  # keys of a chat record passed to the template beside its messages
BIN_DTYPES = ("uint16", "uint32", "int32", "int64")  # .bin token widths --data-dtype may name
# why --model toy refuses padded data: glm52 train before launch (a sample), train/toy.py in a worker (a batch)
TOY_PADDING = (
    "--model toy ignores attention_mask (it attends to padding and routes it as tokens); use a GLM checkpoint "
    "(--model DIR) for padded data"
)


class TokenData:
    """Sample access: ``sample(i) -> dict`` of int64 arrays [S]; ``num_samples`` (None: unbounded)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int, describe: str) -> None:
        self.seq_len, self.vocab_size, self.seed, self.describe = seq_len, vocab_size, seed, describe
        self.num_samples: int | None = None

    def sample(self, i: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def validate(self) -> None:
        """Check every token of the source against the vocabulary now, not when its batch is drawn
        (the launcher calls it once, before any worker starts). Sources checked as they are read
        (jsonl, synthetic) have nothing left to check."""

    def first_padded(self) -> int | None:
        """The first sample whose attention_mask holds a 0 (padding: a record shorter than --seq-len,
        or its own mask's), or None; a token stream has no padding."""
        return None

    def fingerprint(self) -> str:
        """What a resume compares to tell the saved run's data from another file, tokenizer or seed:
        a hash of the sample count, the sequence length and the first, middle and last samples (the
        first of an unbounded source), so a large file is not read whole."""
        n = self.num_samples
        h = hashlib.sha256(f"{n}:{self.seq_len}".encode())
        for i in sorted({0, n // 2, n - 1}) if n else [0]:
            for key, v in sorted(self.sample(i).items()):
                h.update(key.encode() + np.ascontiguousarray(v, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def global_batch(self, step: int, global_batch_size: int) -> dict[str, np.ndarray]:
        """Rows of step ``step`` (same on every rank and layout): of a finite source, batch ``b`` of
        epoch ``e`` (``e, b = divmod(step, n // G)``), rows ``b * G .. (b + 1) * G - 1`` of the epoch's
        order (:meth:`_perm`), so a batch never holds a sample twice (one straddling two epochs' orders
        did, and data-parallel ranks then trained on the same row); the ``n % G`` samples at the end of
        an epoch's order wait for a later epoch's shuffle. With G dividing n the order is the one
        drawn sample by sample over consecutive epochs."""
        G, n = global_batch_size, self.num_samples
        if n is None:
            return self._stacked(range(step * G, (step + 1) * G), f"step {step}")
        check_batch_samples(self, G)  # at least one batch of distinct samples an epoch
        epoch, b = divmod(step, n // G)
        return self._stacked(self._perm(epoch)[b * G : (b + 1) * G], f"step {step}")

    def batch_in_order(self, b: int, global_batch_size: int) -> dict[str, np.ndarray]:
        """Samples ``b * G .. (b + 1) * G - 1`` in the source's own order, unshuffled: an evaluation's
        batch ``b``, the same rows at every evaluation, in every layout."""
        return self._stacked(range(b * global_batch_size, (b + 1) * global_batch_size), f"evaluation batch {b}")

    def _stacked(self, indices: Any, what: str) -> dict[str, np.ndarray]:
        rows = [self.sample(int(k)) for k in indices]
        out = {key: np.stack([r[key] for r in rows]).astype(np.int64) for key in rows[0]}
        check_token_range(out["input_ids"], self.vocab_size, f"{self.describe}: {what}")
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s sample order: ``default_rng([seed, epoch]).permutation(num_samples)``,
        shuffled in place in int32 (the same order, half the memory of the int64 permutation)."""
        if getattr(self, "_perm_cache", (None,))[0] != epoch:
            self._perm_cache = (None,)  # the previous epoch's order goes before the next is drawn
            n = self.num_samples
            order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
            np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._perm_cache = (epoch, order)
        return self._perm_cache[1]


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
    def __init__(
        self, tokens: np.ndarray, seq_len: int, vocab_size: int, seed: int, describe: str, raw: bool = False
    ) -> None:
        super().__init__(seq_len, vocab_size, seed, describe)
        self.raw = raw  # a .bin: its token width is --data-dtype's, not recorded in the file
        if tokens.ndim != 1:
            raise ValueError(f"{describe}: expected a 1-D token array, got shape {tokens.shape}")
        self.tokens = tokens
        self.num_samples = len(tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(f"{describe}: {len(tokens)} tokens, fewer than one sequence of {seq_len}")

    def sample(self, i: int) -> dict[str, np.ndarray]:
        toks = np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len], dtype=np.int64)
        return {"input_ids": toks, "labels": toks.copy()}

    def validate(self) -> None:
        try:
            check_token_range(self.tokens, self.vocab_size, self.describe)
        except ValueError as e:
            if not self.raw:
                raise
            raise ValueError(f"{e} (a .bin of narrower tokens than --data-dtype reads as such ids)") from None


class _Jsonl(TokenData):
    def __init__(self, path: str, seq_len: int, vocab_size: int, seed: int, pad_id: int) -> None:
        super().__init__(seq_len, vocab_size, seed, path)
        # each record's ids (and labels) as an int32 array: 4 B a token where the parsed lists took about 40
        self.records: list[dict[str, np.ndarray]] = []
        for ln, rec in _iter_jsonl(path):
            if not isinstance(rec, dict) or not isinstance(rec.get("input_ids"), list) or not rec["input_ids"]:
                hint = ""
                if isinstance(rec, dict) and ("text" in rec or "messages" in rec):
                    hint = " (text and chat records are tokenized first: `glm52 train` does it, or prepare_jsonl)"
                got = _got(rec.get("input_ids")) if isinstance(rec, dict) and "input_ids" in rec else _got(rec)
                raise ValueError(f"{path}:{ln}: expected an object with a non-empty list `input_ids`, got {got}{hint}")
            _check_ids(rec["input_ids"], vocab_size, f"{path}:{ln}: input_ids")
            for k, v in rec.items():  # per-token data that nothing reads changed nothing, silently
                if k in _PACKED or k in _NOT_NEEDED:
                    continue
                per_token = isinstance(v, list) and len(v) == len(rec["input_ids"]) and all(_is_number(x) for x in v)
                if k in _UNREAD_KEYS or per_token:
                    raise ValueError(f"{path}:{ln}: `{k}` is per-token data that is not read: {_UNREAD}")
            if "labels" in rec:
                _check_ids(rec["labels"], vocab_size, f"{path}:{ln}: labels", allow=IGNORE_INDEX)
                if len(rec["labels"]) != len(rec["input_ids"]):
                    raise ValueError(
                        f"{path}:{ln}: labels has {len(rec['labels'])} entries, input_ids {len(rec['input_ids'])}: "
                        f"one label per input token ({IGNORE_INDEX} to leave a position out of the loss)"
                    )
            row = {k: np.asarray(rec[k], dtype=np.int32) for k in ("input_ids", "labels") if k in rec}
            if "attention_mask" in rec:  # a padded record (a tokenizer's padding="max_length" output)
                mask = rec["attention_mask"]
                if not (isinstance(mask, list) and all(is_int(m) and m in (0, 1) for m in mask)):
                    raise ValueError(f"{path}:{ln}: attention_mask: expected a list of 0 / 1 (1 = a real token)")
                if len(mask) != len(rec["input_ids"]):
                    raise ValueError(
                        f"{path}:{ln}: attention_mask has {len(mask)} entries, input_ids {len(rec['input_ids'])}: "
                        "one per input token"
                    )
                # padding is not attended; without labels it is no target either (HF's language-modeling
                # collator: labels -100 on padding); given labels are taken as they are, as HF's collators do
                row["attention_mask"] = np.asarray(mask, dtype=np.int8)
                if "labels" not in row:
                    row["labels"] = np.where(row["attention_mask"] == 1, row["input_ids"], IGNORE_INDEX).astype(
                        np.int32
                    )
            if "labels" in row:
                _check_targets(row["labels"].tolist(), seq_len, f"{path}:{ln}")
                _check_unshifted(row["input_ids"][None], row["labels"][None], f"{path}:{ln}")
            else:  # the input ids are the labels: a record of one token has no next token to train on
                _check_targets(rec["input_ids"], seq_len, f"{path}:{ln}")
            self.records.append(row)
        if not self.records:
            raise ValueError(f"{path}: no records")
        self.num_samples = len(self.records)
        lengths = [len(r["input_ids"]) for r in self.records]
        self.cut = sum(n > seq_len for n in lengths)  # records --seq-len cuts (the command says so)
        self.longest = max(lengths)
        self.pad_id = pad_id

    def first_padded(self) -> int | None:
        S = self.seq_len
        for i, rec in enumerate(self.records):
            mask = rec.get("attention_mask")
            if len(rec["input_ids"]) < S or (mask is not None and not mask[:S].all()):
                return i
        return None

    def sample(self, i: int) -> dict[str, np.ndarray]:
        rec, S = self.records[i], self.seq_len
        labels, mask = rec.get("labels", rec["input_ids"]), rec.get("attention_mask")
        return _padded(rec["input_ids"][:S], labels[:S], S, self.pad_id, None if mask is None else mask[:S])


def _check_targets(labels: Any, S: int, where: str) -> None:
    """A record must leave a label to train on within its first ``S`` tokens: the loss's targets are
    positions 1..S-1 (position i predicts labels[i + 1]; the rest is cut at --seq-len)."""
    if any(t != IGNORE_INDEX for t in labels[1:S]):
        return
    later = [i for i, t in enumerate(labels) if i >= S and t != IGNORE_INDEX]
    why = f"all of them are past --seq-len {S} (the first at position {later[0]})" if later else "it has none"
    raise ValueError(f"{where}: no label to train on within the first --seq-len {S} tokens: {why}")


def _check_unshifted(ids: np.ndarray, labels: np.ndarray, where: str, first_row: int | None = None) -> None:
    """``labels`` [R, S] are HF's, aligned with ``ids`` (labels[i] = ids[i] or the ignore index; the
    model shifts them, as transformers' ForCausalLMLoss does), not PaddleFormers' / Megatron's already
    shifted ones (labels[i] = ids[i + 1]), which would train every position on the token two ahead.
    A row is refused when each of its (at least 2) labels before the last position equals the next
    input token and not every one equals its own (``first_row``: the file row of ``ids[0]``, to name)."""
    lab, cur, nxt = labels[:, :-1], ids[:, :-1], ids[:, 1:]
    kept = lab != IGNORE_INDEX
    n = kept.sum(axis=1)
    bad = np.flatnonzero((n >= 2) & ((kept & (lab == nxt)).sum(axis=1) == n) & ((kept & (lab == cur)).sum(axis=1) < n))
    if bad.size:
        r = int(bad[0])
        at = where if first_row is None else f"{where}: row {first_row + r}"
        raise ValueError(
            f"{at}: labels are input_ids shifted by one (labels[i] == input_ids[i + 1] at all {int(n[r])} labelled "
            "positions): give labels aligned with input_ids (labels[i] = input_ids[i], or -100 to leave a position "
            "out; the model shifts them, as in transformers), else every position trains on the token two ahead"
        )


def _padded(ids: Any, labels: Any, S: int, pad_id: int, mask: Any = None) -> dict[str, np.ndarray]:
    """One sample of ``S`` tokens: ``ids`` right-padded with ``pad_id``, ``labels`` with the ignore
    index, an ``attention_mask`` of 1 on the tokens (``mask``: the record's own, 0 on its padding)."""
    n = len(ids)
    out = {"input_ids": np.full(S, pad_id, dtype=np.int64), "labels": np.full(S, IGNORE_INDEX, dtype=np.int64)}
    out["attention_mask"] = np.zeros(S, dtype=np.int64)
    out["input_ids"][:n], out["labels"][: len(labels)], out["attention_mask"][:n] = (
        ids,
        labels,
        1 if mask is None else mask,
    )
    return out


_SCAN_CHUNK = 1 << 24  # tokens per vectorised min/max (a bounded temporary whatever the file size)


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str, *, allow: int | None = None) -> None:
    """Every token in [0, ``vocab_size``) (or equal to ``allow``, e.g. the ignore index of labels):
    a chunked min/max over a (memory-mapped) array, so a file is read once and never held whole;
    the first offending token and its position are named."""
    flat = tokens.reshape(-1)
    for lo in range(0, flat.shape[0], _SCAN_CHUNK):
        chunk = np.asarray(flat[lo : lo + _SCAN_CHUNK])
        if chunk.min() >= 0 and chunk.max() < vocab_size:
            continue
        bad = (chunk < 0) | (chunk >= vocab_size)
        if allow is not None:
            bad &= chunk != allow
        hits = np.flatnonzero(bad)
        if not hits.size:
            continue
        pos = lo + int(hits[0])
        at = f"position {pos}" if tokens.ndim == 1 else f"row {pos // tokens.shape[-1]} column {pos % tokens.shape[-1]}"
        raise ValueError(
            f"{where}: token {int(flat[pos])} at {at} is outside the vocabulary [0, {vocab_size})"
            + (f" ({int(bad.sum())} such tokens in this chunk of {chunk.size})" if hits.size > 1 else "")
        )


def _check_ids(ids: Any, vocab_size: int, where: str, allow: int | None = None) -> None:
    """A list of integer token ids in [0, ``vocab_size``); labels pass ``allow`` (the ignore index)."""
    kind = "token id" if allow is None else "label"
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise ValueError(f"{where}: expected a list of integer {kind}s")
    bad = [t for t in ids if (t < 0 or t >= vocab_size) and t != allow]
    if bad:
        what = "outside the vocabulary" if allow is None else f"is neither {allow} nor in the vocabulary"
        raise ValueError(f"{where}: {kind} {bad[0]} {what} [0, {vocab_size})")


_PACKED = ("input_ids", "labels", "attention_mask")
_UNREAD_KEYS = ("loss_mask", "position_ids")  # refused at any length or nesting (a mask over the labels: one less)
_NOT_NEEDED = ("token_type_ids", "special_tokens_mask", "offset_mapping")  # a tokenizer's, meaningless to GLM


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float))  # bool too: a 0 / 1 mask


# what a sample's other per-token data would have to become (a loss mask, position_ids of packed documents)
_UNREAD = (
    "the trainer reads input_ids, labels and attention_mask only (a loss mask: labels -100 where no target; "
    "documents packed in one sample attend to each other: give them as samples of their own)"
)


class _Packed(TokenData):
    """Ready samples from a .npz: input_ids, labels, attention_mask [N, S].  The uncompressed members
    ``np.savez`` (and so ``prepare_jsonl``) writes are memory-mapped, as a .npy / .bin is: a rank
    reads the rows of its batches, not the whole file (a compressed .npz is read whole)."""

    def __init__(self, path: str, seq_len: int, vocab_size: int, seed: int) -> None:
        super().__init__(seq_len, vocab_size, seed, path)
        names, maps = _npz_maps(path)
        missing = set(_PACKED) - set(names)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)} (have {sorted(names)})")
        if unread := sorted(set(names) - set(_PACKED)):
            raise ValueError(f"{path}: arrays {unread} are not read: {_UNREAD}")
        self._crc = maps.pop("_crc", None) if maps is not None else None
        if maps is not None:
            self.arrays = maps
        else:
            with _load_npy(path) as z:
                self.arrays = {k: _integers(_npz_member(z, path, k), path, k) for k in _PACKED}
        shape = self.arrays["input_ids"].shape
        if len(shape) != 2 or shape[1] != seq_len or any(a.shape != shape for a in self.arrays.values()):
            got = [list(a.shape) for a in self.arrays.values()]
            if len(shape) == 2 and all(a.shape == shape for a in self.arrays.values()):  # another length
                raise ValueError(
                    f"{path}: samples of {shape[1]} tokens, not --seq-len {seq_len} (expected arrays [N, {seq_len}], "
                    f"got {got}): a .npz holds samples of one length; prepare it for --seq-len {seq_len} or pass "
                    f"--seq-len {shape[1]}"
                )
            raise ValueError(f"{path}: expected arrays [N, {seq_len}] (--seq-len {seq_len}), got {got}")
        self.num_samples = shape[0]
        if self.num_samples == 0:
            raise ValueError(f"{path}: no samples")

    def sample(self, i: int) -> dict[str, np.ndarray]:
        return {k: np.array(v[i], dtype=np.int64) for k, v in self.arrays.items()}

    def first_padded(self) -> int | None:
        mask = self.arrays["attention_mask"]
        rows = max(1, _SCAN_CHUNK // max(1, mask.shape[1]))
        for lo in range(0, mask.shape[0], rows):
            bare = np.flatnonzero((np.asarray(mask[lo : lo + rows]) == 0).any(axis=1))
            if bare.size:
                return lo + int(bare[0])
        return None

    def validate(self) -> None:
        for name, (lo, size, crc) in (self._crc or {}).items():  # what np.load's zip reader checks
            raw = np.memmap(self.describe, dtype=np.uint8, mode="r", offset=lo, shape=(size,))
            got = 0
            for a in range(0, size, _SCAN_CHUNK):
                got = zlib.crc32(raw[a : a + _SCAN_CHUNK], got)
            if got != crc:
                raise ValueError(f"{self.describe}: member {name} fails its CRC check (a damaged file)")
        check_token_range(self.arrays["input_ids"], self.vocab_size, f"{self.describe}: input_ids")
        check_token_range(self.arrays["labels"], self.vocab_size, f"{self.describe}: labels", allow=IGNORE_INDEX)
        mask = self.arrays["attention_mask"]
        rows = max(1, _SCAN_CHUNK // max(1, mask.shape[1]))
        ids, labels = self.arrays["input_ids"], self.arrays["labels"]
        for lo in range(0, ids.shape[0], rows):
            lab = np.asarray(labels[lo : lo + rows])
            bare = np.flatnonzero((lab[:, 1:] == IGNORE_INDEX).all(axis=1))  # a row must leave a target, as a record
            if bare.size:
                _check_targets(lab[bare[0]].tolist(), self.seq_len, f"{self.describe}: row {lo + int(bare[0])}")
            _check_unshifted(np.asarray(ids[lo : lo + rows]), lab, self.describe, lo)
        for lo in range(0, mask.shape[0], rows):
            m = np.asarray(mask[lo : lo + rows])
            if ((m != 0) & (m != 1)).any():
                raise ValueError(f"{self.describe}: attention_mask holds values other than 0 and 1")


def _npz_member(z: Any, path: str, name: str) -> np.ndarray:
    """Member ``name`` of the open .npz ``z``, read whole (a compressed file, or a header ``_npz_maps``
    does not parse). np.load's zip reader raises zipfile.BadZipFile ("Bad CRC-32") or zlib.error on a
    damaged member, neither a ValueError, which is what the CLI turns into one line: raised as one,
    naming the file and the member."""
    try:
        return z[name]
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise ValueError(f"{path}: member {name}: expected a readable .npy array, got a damaged one ({e})") from e
    except ValueError as e:  # an intact member numpy will not read: an object array (never unpickled), ...
        raise ValueError(f"{path}: member {name}: {e}") from e


def _integers(a: np.ndarray, path: str, name: str) -> np.ndarray:
    """A .npz member read whole, as int64: integers only (a float 7.9 would be cut to 7, a mask 0.6 to 0),
    as a .npy stream is refused."""
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        what = "0 / 1 integers" if name == "attention_mask" else "integer tokens"
        raise ValueError(f"{path}: {name}: expected {what}, got dtype {a.dtype}")
    return np.asarray(a, dtype=np.int64)


def _npz_maps(path: str) -> tuple[list[str], dict[str, Any] | None]:
    """The array names of the .npz at ``path`` and read-only memory maps of ``_PACKED`` (plus "_crc":
    each member's data offset, size and CRC-32, for validate), or None where a member is compressed,
    not a C-order integer array, or has a header this reader does not parse (then it is read whole)."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename[:-4]: i for i in zf.infolist() if i.filename.endswith(".npy")}
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path}: not a readable .npz array file: {e}") from e
    names = sorted(infos)
    maps: dict[str, Any] = {"_crc": {}}
    with open(path, "rb") as f:
        for k in _PACKED:
            info = infos.get(k)
            if info is None or info.compress_type != zipfile.ZIP_STORED:
                return names, None
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                return names, None
            n_name, n_extra = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + n_name + n_extra
            f.seek(start)
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    return names, None
            except ValueError:
                return names, None
            offset = f.tell()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if fortran or not (np.issubdtype(dtype, np.integer) or dtype == np.bool_) or dtype.hasobject:
                return names, None
            if offset - start + nbytes != info.file_size:
                raise ValueError(f"{path}: member {k}: {info.file_size} bytes, its header describes {nbytes} of data")
            maps[k] = (
                np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))
                if nbytes
                else (np.zeros(shape, dtype=dtype))
            )
            maps["_crc"][k] = (start, info.file_size, info.CRC)
    return names, maps


def _iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, record) of every non-empty line, one at a time; a line that is not UTF-8 or not
    JSON is named. A UTF-8 byte-order mark opening the file (Windows editors write one) is skipped,
    as Python's "utf-8-sig" does; json.loads refused the first line ("Unexpected UTF-8 BOM")."""
    with open(path, "rb") as f:
        for ln, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if ln == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{ln}: not UTF-8 text (byte {e.start} of the line)") from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not JSON: {e}") from e
            except RecursionError as e:  # valid JSON nested deeper than Python's recursion limit
                raise ValueError(f"{path}:{ln}: not readable JSON (nested too deeply)") from e
            except ValueError as e:  # json's own: an integer of more digits than Python converts
                raise ValueError(f"{path}:{ln}: not readable JSON ({e})") from e
            yield ln, rec


def _check_unicode(value: Any, where: str, key: str) -> None:
    """Every string in ``value`` (a record's text, messages, tools) is valid Unicode: JSON's ``\\ud800``
    escape without its pair parses to a lone surrogate, which the tokenizer refuses with a bare
    TypeError (transformers' too: "TextEncodeInput must be Union[...]")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: {key} holds an unpaired surrogate \\u{ord(value[e.start]):04x} at character {e.start} "
                "(not valid Unicode: a JSON \\uXXXX escape of half a pair)"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, where, key)
            _check_unicode(v, where, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, where, f"{key}[{i}]")


def _got(value: Any) -> str:
    """What a record held instead, for an error: a short repr of a value, or an object's keys."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:8]}"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_jsonl_kind(path: str | None, flag: str = "--data") -> str | None:
    """ "text" or "messages" when ``path`` is a .jsonl of such records, which ``glm52 train`` tokenizes
    before launch; None for any other data (token-id records are read as they are).  A .jsonl that is
    missing or a folder is refused naming ``flag`` (:func:`check_data_file`)."""
    if path is None or not path.endswith(".jsonl"):
        return None
    check_data_file(path, flag)
    kind = jsonl_kind(path)
    return None if kind == "input_ids" else kind


def jsonl_kind(path: str) -> str:
    """ "input_ids", "text" or "messages": what the file's records hold (one kind per file)."""
    first = ""
    for ln, rec in _iter_jsonl(path):
        kinds = [k for k in ("input_ids", "text", "messages") if isinstance(rec, dict) and k in rec]
        if len(kinds) != 1:
            raise ValueError(
                f'{path}:{ln}: expected an object with exactly one of "input_ids", "text" or "messages", got {_got(rec)}'
            )
        first = first or kinds[0]
        if kinds[0] != first:
            raise ValueError(f'{path}:{ln}: a "{kinds[0]}" record in a file of "{first}" records (one kind per file)')
    if not first:
        raise ValueError(f"{path}: no records")
    return first


_NPZ_DTYPES = {"input_ids": np.int32, "labels": np.int32, "attention_mask": np.int8}  # 9 B a token, not 24


def prepare_jsonl(
    path: str,
    seq_len: int,
    vocab_size: int,
    tokenizer: Any,
    out_path: str,
    min_samples: int = 1,
    stop_ids: Any = (),
) -> dict[str, Any]:
    """Validate and tokenize a text or chat .jsonl into the ``.npz`` at ``out_path`` (atomic); every
    record is checked before anything is written (the checks: docs/parallel.md, "The trainer").  At least
    ``min_samples`` samples (the trainer asks for one global batch) must result.  ``stop_ids``: the
    token ids generation stops on beside the tokenizer's EOS (the checkpoint's generation_config.json
    ``eos_token_id``); a chat record trains the one that ends each assistant turn
    (``encode_chat_for_training``).  Returns a summary (kind, records, tokens, samples; for chat also
    "cut": the conversations longer than ``seq_len``, cut to it, and "longest": the longest's tokens)."""
    from jinja2 import TemplateError  # the chat template's engine (the tokenizer's dependency)

    kind = jsonl_kind(path)
    if kind == "input_ids":
        raise ValueError(f"{path}: holds token ids; open it with open_data directly")
    records = 0  # read one at a time: the launcher holds the tokens (int32), not the parsed file
    S = int(seq_len)
    if kind == "text":
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"{path}: text data needs the tokenizer's eos_token (tokenizer_config.json) between documents"
            )
        stream = array.array("i")  # 4 B a token where a list of ints took 8 to 36
        for ln, rec in _iter_jsonl(path):
            records += 1
            text = rec["text"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f'{path}:{ln}: "text" must be a non-empty string, got {_got(text)}')
            _check_unicode(text, f"{path}:{ln}", '"text"')
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"{path}:{ln}: the text encodes to no tokens")
            _check_ids(ids + [eos], vocab_size, f"{path}:{ln}: tokenized text")
            stream.extend(ids)
            stream.append(eos)
        n = len(stream) // S
        if n < min_samples:
            raise ValueError(
                f"{path}: {len(stream)} tokens (EOS included) make {n} windows of --seq-len {S}; "
                f"{min_samples} are needed ({min_samples * S} tokens) for one global batch"
            )
        ids_arr = np.frombuffer(stream, dtype=np.intc)[: n * S].reshape(n, S)
        arrays = {"input_ids": ids_arr, "labels": ids_arr, "attention_mask": np.ones((n, S), dtype=np.int8)}
        tokens = len(stream)
    else:
        pad = int(tokenizer.pad_token_id or 0)
        # each field a typed stream, row after row (9 B a token: a list of per-record arrays and the
        # np.stack of it held 29 B a token at --seq-len 64)
        streams = {"input_ids": array.array("i"), "labels": array.array("i"), "attention_mask": array.array("b")}
        rows = 0
        cut = longest = 0  # conversations longer than --seq-len, and the longest's tokens
        tokens = 0
        for ln, rec in _iter_jsonl(path):
            records += 1
            msgs = rec["messages"]
            where = f"{path}:{ln}"
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f'{where}: "messages" must be a non-empty list, got {_got(msgs)}')
            for j, m in enumerate(msgs):
                # content as transformers' chat templates take it: a string, a list of parts
                # ([{"type": "text", "text": ...}]), or null / absent (an assistant turn of tool_calls only)
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                    raise ValueError(f'{where}: message {j} must be an object with a string "role"')
                if not (m.get("content") is None or isinstance(m["content"], (str, list))):
                    got = type(m["content"]).__name__
                    raise ValueError(
                        f'{where}: message {j}: "content" must be a string, a list of parts or null, got {got}'
                    )
            if not any(m["role"] == "assistant" for m in msgs):
                raise ValueError(f"{where}: no assistant message, so nothing to train on")
            # the record's tools / documents reach the template as HF's apply_chat_template(messages, tools=...)
            extra = {k: rec[k] for k in CHAT_TEMPLATE_INPUTS if rec.get(k) is not None}
            for k, v in extra.items():
                if not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
                    raise ValueError(f'{where}: "{k}" must be a list of objects')
            for k in ("messages", *extra):
                _check_unicode(rec[k], where, f'"{k}"')
            try:
                ids, mine = tokenizer.encode_chat_for_training(msgs, stop_ids=stop_ids, **extra)
            except ValueError as e:  # the template's own complaint, located
                raise ValueError(f"{where}: {e}") from e
            except (TemplateError, TypeError) as e:  # the template failed on this record (a field it reads is absent)
                raise ValueError(f"{where}: the chat template fails on this record: {type(e).__name__}: {e}") from e
            _check_ids(ids, vocab_size, f"{where}: tokenized conversation")
            if not any(mine[1:S]):  # position 0 is never a target
                raise ValueError(f"{where}: no assistant token within the first --seq-len {S} tokens")
            if len(ids) > S:  # cut: counted, so the command can say how much --seq-len leaves out
                cut, longest = cut + 1, max(longest, len(ids))
            ids, mine = ids[:S], mine[:S]
            labels = np.where(np.asarray(mine, dtype=bool), np.asarray(ids, dtype=np.int64), IGNORE_INDEX)
            # labels -100 on every token but the assistant's and each of its turns' end
            for k, v in _padded(ids, labels, S, pad).items():
                streams[k].frombytes(v.astype(_NPZ_DTYPES[k]).tobytes())
            rows += 1
            tokens += len(ids)
        if rows < min_samples:
            raise ValueError(f"{path}: {rows} conversations; {min_samples} are needed for one global batch")
        arrays = {k: np.frombuffer(v, dtype=_NPZ_DTYPES[k]).reshape(rows, S) for k, v in streams.items()}
    with atomic_open(out_path, "wb") as f:
        _write_npz(f, arrays)
    info = {"kind": kind, "records": records, "tokens": tokens, "samples": int(arrays["input_ids"].shape[0])}
    if kind == "messages":
        info |= {"cut": cut, "longest": longest}
    return info


def _write_npz(f: Any, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez(f, **arrays)`` (the same stored, uncompressed zip of .npy members), each array written
    in slices of its own buffer: np.savez copies a C-contiguous array whole (``tobytes``) into the
    zip, 4 B a token more at the peak of ``prepare_jsonl``."""
    step = 1 << 24
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, np.lib.format.header_data_from_array_1_0(a))
                flat = memoryview(a.reshape(-1)).cast("B")
                for lo in range(0, len(flat), step):
                    member.write(flat[lo : lo + step])


def check_data_file(path: str, flag: str = "--data") -> None:
    """``path`` (given as ``flag``) is a file: a missing path or a folder (``x.jsonl/``) is one error
    naming both, before any reader opens it (a folder raised IsADirectoryError from deep inside)."""
    if os.path.isdir(path):
        raise FileNotFoundError(f"{flag}: {path} is a directory, not a data file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no file {path}")


def _load_npy(path: str, **kw: Any) -> Any:
    """``np.load`` (never unpickling) with its errors naming the file; a damaged zip raises
    zipfile.BadZipFile, which is no ValueError (the CLI would show a traceback), so it is caught too."""
    try:
        return np.load(path, allow_pickle=False, **kw)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable {os.path.splitext(path)[1]} array file: {e}") from e


def open_data(
    path: str | None,
    seq_len: int,
    vocab_size: int,
    seed: int,
    *,
    data_dtype: str = "auto",
    pad_id: int = 0,
    flag: str = "--data",
) -> TokenData:
    """The data source for ``path`` (None: synthetic); see the module doc for formats. ``flag``: the
    option that named it, in errors."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if path is None or path == "synthetic":
        return _Synthetic(seq_len, vocab_size, seed)
    check_data_file(path, flag)
    if path.endswith(".npy"):
        arr = _load_npy(path, mmap_mode="r")
        if not isinstance(arr, np.ndarray):  # np.load reads by content: a .npz archive under a .npy name
            arr.close()
            raise ValueError(f"{path}: expected a .npy array, got a .npz archive (name it .npz)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected integer tokens, got dtype {arr.dtype}")
        return _Stream(arr, seq_len, vocab_size, seed, path)
    if path.endswith(".bin"):
        if data_dtype not in BIN_DTYPES and data_dtype != "auto":
            raise ValueError(f"--data-dtype must be auto or one of {', '.join(BIN_DTYPES)}, got {data_dtype!r}")
        dtype = data_dtype if data_dtype != "auto" else ("uint16" if vocab_size <= 65536 else "uint32")
        item = np.dtype(dtype).itemsize
        size = os.path.getsize(path)
        if size == 0 or size % item:
            raise ValueError(
                f"{path}: {size} bytes is not a whole number of {dtype} tokens ({item} bytes each)"
                + (" (an empty file)" if size == 0 else "; a truncated file, or the wrong --data-dtype")
            )
        tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        _check_bin_width(tokens, dtype, path, vocab_size)
        return _Stream(tokens, seq_len, vocab_size, seed, f"{path} ({dtype})", raw=True)
    if path.endswith(".jsonl"):
        return _Jsonl(path, seq_len, vocab_size, seed, pad_id)
    if path.endswith(".npz"):
        return _Packed(path, seq_len, vocab_size, seed)
    raise ValueError(f"{flag} {path}: unknown format (use .npy, .bin, .jsonl, .npz, or omit for synthetic)")


def data_problem(path: str, model: str, seq_len: int, seed: int, data_dtype: str = "auto") -> str | None:
    """Why ``--data path`` cannot be trained on with the checkpoint folder ``model`` (records with no
    label to train on, a bad .npy, ...), as :func:`open_data` refuses it, else None; for the commands
    that hand the data to another trainer (``glm52 align``, the torch reference) and should refuse it
    in one line before any model loads.  A model config that cannot be read is not the data's
    problem: None, and the model's own checks name it."""
    from ..configuration import GlmMoeDsaConfig

    try:
        vocab = GlmMoeDsaConfig.from_pretrained(model).vocab_size
    except (ValueError, OSError):
        return None
    try:
        open_data(path, seq_len, vocab, seed, data_dtype=data_dtype)
    except (ValueError, OSError) as e:
        why = str(e)  # named by the file, or by the flag at fault (--data-dtype, a --data that is no file)
        return why if why.startswith("--") or path in why else f"{path}: {why}"
    return None


_WIDER = {"uint16": "uint32 (or int32)", "uint32": "int64", "int32": "int64"}
_WIDTH_PROBE = 1 << 16  # leading tokens of a .bin looked at for the signature of a wider token file


def _check_bin_width(tokens: np.ndarray, dtype: str, path: str, vocab_size: int) -> None:
    """A .bin of tokens twice as wide as ``dtype`` (int64 read as uint32, int32 or uint32 as uint16)
    reads as its tokens interleaved with their little-endian high halves, every one of which is at
    most ``(vocab_size - 1) >> bits`` (0 below 2**bits; 2 for GLM's 154880 read as uint16), all
    inside the vocabulary: refused when every second of the leading tokens is within that bound and
    the others are not all 0."""
    head = np.asarray(tokens[:_WIDTH_PROBE])
    if dtype not in _WIDER or head.size < 16:
        return
    high = max(int(vocab_size) - 1, 0) >> (8 * np.dtype(dtype).itemsize)
    pairs = head[: head.size // 2 * 2].reshape(-1, 2)
    if pairs[:, 1].min() >= 0 and pairs[:, 1].max() <= high and pairs[:, 0].any():
        what = "0" if high == 0 else f"at most {high} (the high half of a token below {vocab_size})"
        raise ValueError(
            f"{path}: every second token of the first {pairs.size} read as {dtype} is {what}, the signature of a "
            f"file of {_WIDER[dtype]} tokens: pass --data-dtype {_WIDER[dtype].split()[0]} (or write the file as {dtype})"
        )


def check_batch_samples(data: TokenData, global_batch_size: int) -> None:
    """A finite source holds at least one global batch of distinct samples: an epoch is ``n // G``
    such batches (``TokenData.global_batch``; the ``n % G`` samples left at the end of its order are
    not trained in it), so fewer than G samples make no batch at all (drawn from two epochs' orders
    it repeated samples, and data-parallel ranks trained on the same rows: 2 samples, a global batch
    of 4 over dp 2, both ranks got samples 0 and 1).  The text / chat .jsonl path asks the same of
    ``prepare_jsonl`` (``min_samples``)."""
    n = data.num_samples
    if n is not None and n < global_batch_size:
        raise ValueError(
            f"{data.describe}: {n} samples of --seq-len {data.seq_len}, fewer than one global batch of "
            f"{global_batch_size} (--global-batch-size): a batch would repeat samples, and data-parallel ranks "
            "would train on the same rows; use more data, a smaller --global-batch-size or a shorter --seq-len"
        )


def check_eval_samples(data: TokenData, batches: int, global_batch_size: int) -> None:
    """An evaluation reads ``batches`` global batches of distinct samples: a source holds them all."""
    n, need = data.num_samples, batches * global_batch_size
    if n is not None and n < need:
        raise ValueError(
            f"--eval-data {data.describe}: {n} samples of --seq-len {data.seq_len}, fewer than --eval-batches "
            f"{batches} x --global-batch-size {global_batch_size} = {need}; use fewer --eval-batches or more data"
        )


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
