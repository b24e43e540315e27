"""Block-FP8 checkpoints (the official release format): decode, dequantize lazily, re-quantize
(docs/checkpoints.md, "Block-FP8 checkpoints": a ``W`` stored as E4M3 bytes plus ``W_scale_inv``, one
fp32 scale per block, valued ``float32(q) * scale_inv[block]``). numpy has no float8, so E4M3
(``e4m3fn``) bytes are decoded through an exact 256-entry table and encoded by round-to-nearest-even
against the same table, through a look-up table of its results (re-quantizing: :func:`quantize_blocks`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._io import read_json
from .engine import CheckpointSource
from .errors import CheckpointError
from .safetensors_io import FolderReplacedError, bf16_bits_to_float32

__all__ = [
    "E4M3_MAX",
    "E4M3_TABLE",
    "Fp8Source",
    "decode_e4m3",
    "encode_e4m3",
    "dequantize",
    "quantize_blocks",
    "quantization_of",
    "is_fp8_weight",
    "scale_key",
    "FP8_CONFIG",
]

E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
FP8_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _e4m3_table() -> np.ndarray:
    """Value of every E4M3 (fn) byte: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    code = np.arange(256)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7))  # subnormal: man/8 * 2^-6
    out = np.where(code & 0x80, -mag, mag).astype(np.float32)
    out[(code & 0x7F) == 0x7F] = np.nan
    return out


E4M3_TABLE = _e4m3_table()
# the non-negative codes 0x00..0x7F in increasing value; 0x7F stands for "480" (the NaN code) so that
# rounding anything past 464 to it gives NaN (torch 2.13's float -> float8_e4m3fn saturates to 448 there)
_POS = E4M3_TABLE[:128].astype(np.float64)
_POS[127] = 480.0


def decode_e4m3(q: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 bytes (a uint8 array of any shape); exact."""
    return E4M3_TABLE[np.asarray(q, dtype=np.uint8)]


def _encode_search(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes of float32 values by search in the table of E4M3 values (the specification
    :func:`encode_e4m3` is built from): round to nearest, ties to even; above 464 in magnitude
    (Inf, NaN) -> the NaN code, sign kept."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # signalling NaNs quieten in the cast; only isnan is asked
        a = np.abs(x).astype(np.float64)  # fp32 values and E4M3 midpoints are exact in float64
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 1, 127)
    lo = hi - 1
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code[np.isnan(a) | (a >= 480.0)] = 0x7F
    return code | (np.signbit(x).astype(np.uint8) << 7)


def _encode_table() -> np.ndarray:
    """E4M3 byte of every float32 by its top 16 bits and whether its low 16 bits are zero: entry
    ``2 * (bits >> 16) + (bits & 0xFFFF != 0)``. Exact: every rounding boundary of E4M3 (a midpoint
    between two E4M3 values, or 480) is a float32 with 4 significant bits, i.e. zero low 16 bits, so
    the byte is constant over ``(h << 16) + 1 ... (h << 16) + 0xFFFF`` and the table holds it for
    ``h << 16`` and ``(h << 16) + 1``."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    table = np.empty(1 << 17, dtype=np.uint8)
    table[0::2] = _encode_search(high.view(np.float32))
    table[1::2] = _encode_search((high | 1).view(np.float32))
    return table


_ENCODE = _encode_table()


def _encode_into(x: np.ndarray, out: np.ndarray, index: np.ndarray, low: np.ndarray) -> np.ndarray:
    """:func:`encode_e4m3` of the float32 array ``x`` into ``out`` (uint8), with two uint32 scratch
    arrays of its shape (in place, no allocation: at a few MB a chunk that is what keeps it fast)."""
    bits = x.view(np.uint32)
    np.right_shift(bits, 15, out=index)  # (bits >> 16) << 1 | bit 15
    np.bitwise_and(bits, 0x7FFF, out=low)  # | whether bits 0..14 are not all zero
    np.add(low, 0x7FFF, out=low)
    np.right_shift(low, 15, out=low)
    np.bitwise_or(index, low, out=index)
    return np.take(_ENCODE, index, out=out, mode="clip")  # every index is in range


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes of float32 values: round to nearest, ties to even, like torch's float ->
    float8_e4m3fn; above 464 in magnitude (and Inf, NaN) -> the NaN code with the value's sign (there
    torch 2.13 saturates finite values and Inf to +-448 instead).

    One table look-up per value (:func:`_encode_table`), the bytes of :func:`_encode_search`.
    """
    x = np.asarray(x, dtype=np.float32)
    flat, out = x.reshape(-1), np.empty(x.shape, dtype=np.uint8)
    step = _CHUNK_BYTES // 4
    scratch = _Scratch(min(flat.size, step))
    for i in range(0, flat.size, step):
        part = flat[i : i + step]
        _, _, index, low, code = scratch.get(part.shape)
        out.reshape(-1)[i : i + step] = _encode_into(part, code, index, low)
    return out


def _block_index(start: int, stop: int, block: int) -> tuple[int, int, np.ndarray]:
    """For elements ``start:stop`` of a dimension: first/last+1 block and each element's block (relative)."""
    b0, b1 = start // block, (stop - 1) // block + 1 if stop > start else start // block
    return b0, b1, np.arange(start, stop) // block - b0


def dequantize(
    q: np.ndarray, scale_inv: np.ndarray, block: Sequence[int], offset: Sequence[int] = (0, 0)
) -> np.ndarray:
    """fp32 ``decode(q) * scale_inv`` broadcast per block, for a slice ``q`` starting at ``offset``.

    ``scale_inv`` holds the scales of the blocks the slice touches (rows ``offset[0] // br`` ...,
    columns ``offset[1] // bc`` ...), i.e. exactly what a slice read needs.
    """
    br, bc = block
    rows, cols = q.shape
    _, _, ri = _block_index(offset[0], offset[0] + rows, br)
    _, _, ci = _block_index(offset[1], offset[1] + cols, bc)
    out = decode_e4m3(q)
    # a NaN/Inf scale, or a finite one whose product overflows float32, gives NaN/Inf weights, as in
    # the reference; the load's finite check names them (a numpy warning here would name nothing)
    with np.errstate(over="ignore", invalid="ignore"):
        out *= scale_inv[ri][:, ci]  # fp32 x fp32 -> fp32, one rounding: the reference's product
    return out


def _exact(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per value: whether the E4M3 byte of ``w / s`` dequantizes back to ``w`` (bit for bit) at ``s``."""
    deq = decode_e4m3(encode_e4m3(w / s))
    deq *= s
    return deq.view(np.uint32) == w.view(np.uint32)


def _amax_blocks(w: np.ndarray, block: Sequence[int]) -> np.ndarray:
    """Per block, the largest magnitude (NaN where the block has one: which NaN is this reduction's)."""
    br, bc = block
    rows, cols = w.shape
    R, C = math.ceil(rows / br), math.ceil(cols / bc)
    padding = ((0, R * br - rows), (0, C * bc - cols))
    return np.pad(np.abs(w), padding).reshape(R, br, C, bc).max(axis=(1, 3))


_CHUNK_BYTES = 1 << 21  # fp32 bytes of weight per step of quantize_blocks: its scratch stays in cache


class _Scratch:
    """quantize_blocks' work arrays for chunks of up to ``size`` values, reused chunk after chunk (a
    fresh array a chunk costs more in page faults than the arithmetic)."""

    def __init__(self, size: int):
        self.size = size
        self.f32, self.wide = np.empty(size, np.float32), np.empty(size, np.intp)
        self.q8 = np.empty(size, np.uint8)

    def get(self, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """float32, intp, two uint32 (the intp's bytes) and uint8 arrays of ``shape``."""
        n = math.prod(shape)
        u32 = self.wide.view(np.uint32)
        parts = (self.f32[:n], self.wide[:n], u32[:n], u32[self.size : self.size + n], self.q8[:n])
        return tuple(p.reshape(shape) for p in parts)


def _blocks(exact: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per value ``(k, n, cols)`` -> per block ``(k, len(starts))``: whether all of the block's are."""
    return np.logical_and.reduceat(exact.all(axis=1), starts, axis=1)


def _encode_blocks(
    w: np.ndarray, s: np.ndarray, starts: np.ndarray, scratch: _Scratch, check: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """E4M3 bytes of ``w / s`` (``w`` ``(k, n, cols)``, in scratch) and, if ``check``, per block (column
    ``starts``) whether they dequantize to ``w`` exactly at ``s``."""
    x, wide, index, low, q = scratch.get(w.shape)
    _encode_into(np.divide(w, s, out=x), q, index, low)
    if not check:
        return q, None
    np.copyto(wide, q)
    deq = np.take(E4M3_TABLE, wide, out=x, mode="clip")
    deq *= s
    return q, _blocks(deq.view(np.uint32) == w.view(np.uint32), starts)


def _quantize_chunk(wc: np.ndarray, qc: np.ndarray, amax: np.ndarray, bc: int, scratch: _Scratch) -> np.ndarray:
    """:func:`quantize_blocks` of ``wc``, whole row blocks ``(k, n, cols)`` of at most ``bc``-column
    blocks with per-block ``amax`` ``(k, nC)``: writes the bytes to ``qc`` and returns the scales."""
    ci, starts = np.arange(wc.shape[2]) // bc, np.arange(amax.shape[1]) * bc
    tiny = np.nextafter(np.float32(0), np.float32(1))  # a scale is positive: amax / 448 may underflow
    scale = np.maximum(amax / np.float32(E4M3_MAX), tiny).astype(np.float32)
    scale[amax == 0] = np.float32(1.0)
    best = scale.copy()
    # the scales tried, in order: amax / 448, then its fp32 neighbours below and above; first the
    # necessary test of each: is the block's first row exact at it (fresh weights are not)
    below = np.maximum(np.nextafter(scale, np.float32(-np.inf)), tiny)
    scales = [scale, below, np.nextafter(scale, np.float32(np.inf))]
    maybe = [_blocks(_exact(wc[:, :1], s[:, None, ci]), starts) for s in scales]
    q, exact = _encode_blocks(wc, scale[:, None, ci], starts, scratch, bool(maybe[0].any()))
    qc[...] = q
    done = maybe[0] & exact if exact is not None else np.zeros_like(maybe[0])
    for s, m in zip(scales[1:], maybe[1:]):
        need = m & ~done
        if not need.any():
            continue
        ids = np.flatnonzero(need.any(axis=0))  # the column blocks to try, their columns only
        cols = np.isin(ci, ids)
        sub_ci = ci[cols]
        q, exact = _encode_blocks(wc[:, :, cols], s[:, None, sub_ci], np.searchsorted(sub_ci, ids), scratch, True)
        ok = np.zeros_like(need)
        ok[:, ids] = exact
        ok &= need
        qc[:, :, cols] = np.where(ok[:, None, sub_ci], q, qc[:, :, cols])
        best[ok] = s[ok]
        done |= ok
    return best


def quantize_blocks(w: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(q, scale_inv)`` for a 2-D fp32 weight: per block ``scale = amax / 448``.

    Blocks whose weights are already the dequantization of some E4M3 block at a scale next to
    ``amax / 448`` (a weight loaded from an FP8 checkpoint) get that scale, so the bytes come back
    unchanged: ``amax / 448`` if it reproduces the block exactly, else the fp32 one below if that
    does, else the one above. An all-zero block gets scale 1 (any scale represents it).

    Done ~2 MB at a time in reused scratch arrays; whether a block is exact at a scale is asked of
    its first row first, so a fresh block is encoded once and never decoded.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise CheckpointError("block-FP8 quantization needs a 2-D weight", actual=tuple(w.shape))
    br, bc = block
    rows, cols = w.shape
    R, C = math.ceil(rows / br), math.ceil(cols / bc)
    q = np.empty((rows, cols), dtype=np.uint8)
    best = np.ones((R, C), dtype=np.float32)
    if w.size == 0:
        return q, best
    # chunks: kb row blocks x cb column blocks, whole blocks (the partial last row block alone)
    cb = min(C, max(1, _CHUNK_BYTES // (4 * br * bc)))
    kb = max(1, _CHUNK_BYTES // (4 * br * min(cols, cb * bc)))
    full = rows // br
    row_chunks = [(r0, min(full, r0 + kb), br) for r0 in range(0, full, kb)]
    if full < R:
        row_chunks.append((full, R, rows - full * br))
    scratch = _Scratch(max(r1 - r0 for r0, r1, _ in row_chunks) * br * min(cols, cb * bc))
    amax_nan = None  # the whole weight's amax reduced as a whole, where NaNs make the order matter
    for r0, r1, n in row_chunks:
        for c0 in range(0, C, cb):
            c1 = min(C, c0 + cb)
            rs, cs = slice(r0 * br, r0 * br + (r1 - r0) * n), slice(c0 * bc, min(cols, c1 * bc))
            shape = (r1 - r0, n, cs.stop - cs.start)
            wc, qc = w[rs, cs].reshape(shape), q[rs, cs].reshape(shape)
            x = scratch.get(shape)[0]
            amax = np.maximum.reduceat(np.abs(wc, out=x).max(axis=1), np.arange(c1 - c0) * bc, axis=1)
            if np.isnan(amax).any():
                if amax_nan is None:
                    amax_nan = _amax_blocks(w, block)
                amax = amax_nan[r0:r1, c0:c1]
            best[r0:r1, c0:c1] = _quantize_chunk(wc, qc, amax, bc, scratch)
    return q, best


def fp8_config(block: Sequence[int]) -> dict[str, Any]:
    """The official ``quantization_config`` with ``block`` as its ``weight_block_size``."""
    return {**FP8_CONFIG, "weight_block_size": [int(b) for b in block]}


def scale_key(key: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``."""
    return key + SCALE_SUFFIX


_FP8_LINEARS = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def is_fp8_weight(key: str) -> bool:
    """Whether the official release stores this (official-layout) tensor in FP8: the attention and
    indexer projections and every MLP/expert matrix, in all layers including MTP. Embeddings,
    lm_head, norms, the router, ``eh_proj`` and the indexer's ``weights_proj`` stay BF16."""
    return key.startswith("model.layers.") and key.endswith(_FP8_LINEARS)


def quantization_of(folder: str, config: Any = None, *, checkpoint: Any = None) -> tuple[int, int] | None:
    """The block size of the checkpoint's block-FP8 quantization, from ``quantization_config`` (config.json
    beside the weights, or ``config``); None when there is none. Any other method is refused by name.
    ``checkpoint``: the open :class:`Checkpoint` of ``folder``, whose config.json is read from the
    folder its weights are read from (a save publishing over the folder meanwhile changes nothing)."""
    qc = None
    file = os.path.join(folder, "config.json")
    if checkpoint is not None:
        try:
            data = checkpoint.read_json("config.json", "the model config")
        except FolderReplacedError:
            raise
        except ValueError:  # an unreadable config.json is the config loader's to refuse
            data = None
        qc = data.get("quantization_config") if data is not None else None
    elif os.path.isfile(file):
        with contextlib.suppress(ValueError):  # an unreadable config.json is the config loader's to refuse
            qc = read_json(file, "the model config").get("quantization_config")
    if qc is None and hasattr(config, "_extra"):
        qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise CheckpointError("quantization_config must be an object", file=file, actual=type(qc).__name__)
    for key, default, expected in (("quant_method", None, "fp8"), ("fmt", "e4m3", "e4m3")):
        value = qc.get(key, default)
        if value != expected:
            what = "quantization method" if key == "quant_method" else "FP8 format"
            raise CheckpointError(
                f"{what} {value!r} is not supported (only block FP8 e4m3 checkpoints can be loaded)",
                file=file,
                key=f"quantization_config.{key}",
                expected=expected,
                actual=value,
            )
    bs = qc.get("weight_block_size", [128, 128])
    if not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int and b > 0 for b in bs)):
        raise CheckpointError(
            "weight_block_size must be two positive integers",
            file=file,
            key="quantization_config.weight_block_size",
            actual=bs,
        )
    return bs[0], bs[1]


# the scale dtypes read (the official release stores F32); transformers casts a scale to float32 first
SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


def _float32_scales(scales: np.ndarray, dtype: str) -> np.ndarray:
    """Scales as float32, as transformers multiplies by them (BF16 and F16 widen exactly, F64 rounds)."""
    if dtype == "BF16":
        return bf16_bits_to_float32(scales)
    return np.asarray(scales, dtype=np.float32)


def _is_scale_of_fp8(ckpt: Any, key: str) -> bool:
    """Whether ``key`` is the ``*_scale_inv`` of an FP8 tensor of ``ckpt``: that tensor's check covers it,
    so a scale stored in an FP8 dtype is refused as a scale whichever of the two the header lists first."""
    weight = key[: -len(SCALE_SUFFIX)]
    return key.endswith(SCALE_SUFFIX) and weight in ckpt and ckpt.info(weight).dtype.startswith("F8")


def _scale_dtype_message(dtype: str) -> str:
    """The refusal of a scale of dtype ``dtype``. An F8_E8M0 scale is most likely a UE8M0 (power-of-two
    exponent) scale, which transformers reads and this loader does not: said by name."""
    message = "scale tensor of a dtype that is no float"
    if dtype == "F8_E8M0":
        message += " (UE8M0 scales, which transformers reads as 2**(e-127), are not supported)"
    return message


def fp8_pairs(ckpt: Any, block: tuple[int, int] | None) -> dict[str, str]:
    """``{weight key: scale key}`` for every F8_E4M3 tensor, each checked against its scale tensor."""
    pairs: dict[str, str] = {}
    for k in ckpt.keys():
        info = ckpt.info(k)
        if not info.dtype.startswith("F8") or _is_scale_of_fp8(ckpt, k):
            continue
        if info.dtype != "F8_E4M3":
            raise CheckpointError(
                "FP8 variant not supported", key=k, file=info.file, expected="F8_E4M3", actual=info.dtype
            )
        if block is None:
            raise CheckpointError(
                "FP8 tensor in a checkpoint whose config.json has no quantization_config",
                key=k,
                file=info.file,
                expected=f"quantization_config {FP8_CONFIG}",
                actual="none",
            )
        sk = scale_key(k)
        if sk not in ckpt:
            raise CheckpointError(
                "FP8 tensor without its scale tensor", key=k, file=info.file, expected=sk, actual="absent"
            )
        if len(info.shape) != 2:
            raise CheckpointError("FP8 tensor is not 2-D", key=k, file=info.file, actual=info.shape)
        sinfo = ckpt.info(sk)
        want = tuple(math.ceil(d / b) for d, b in zip(info.shape, block))
        if sinfo.shape != want:
            raise CheckpointError(
                f"scale tensor does not match the {block[0]}x{block[1]} blocks of {k}",
                key=sk,
                file=sinfo.file,
                expected=want,
                actual=sinfo.shape,
            )
        if sinfo.dtype not in SCALE_DTYPES:  # transformers takes any float scale, as float32
            raise CheckpointError(
                _scale_dtype_message(sinfo.dtype),
                key=sk,
                file=sinfo.file,
                expected=SCALE_DTYPES,
                actual=sinfo.dtype,
            )
        pairs[k] = sk
    return pairs


@dataclass
class Fp8Source(CheckpointSource):
    """A :class:`CheckpointSource` that presents FP8 weights as fp32, dequantized slice by slice.

    A slice read touches only the FP8 bytes of that slice and the scales of the blocks it overlaps
    (both counted in ``bytes_read``); other tensors read as usual.
    """

    pairs: dict[str, str] = field(default_factory=dict)
    block: tuple[int, int] = (128, 128)

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        if key in self.pairs:
            return self.ckpt.info(key).shape, "float32"
        return super().meta(key)

    def read_numpy(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray | None:
        if key not in self.pairs:
            return super().read_numpy(key, offset, shape)
        (r0, c0), (nr, nc) = tuple(offset), tuple(shape)
        br, bc = self.block
        rb0, rb1, _ = _block_index(r0, r0 + nr, br)
        cb0, cb1, _ = _block_index(c0, c0 + nc, bc)
        q = super().read_numpy(key, offset, shape)
        scales = super().read_numpy(self.pairs[key], (rb0, cb0), (rb1 - rb0, cb1 - cb0))
        assert q is not None and scales is not None
        return dequantize(q, _float32_scales(scales, self.ckpt.info(self.pairs[key]).dtype), self.block, (r0, c0))

    def done(self, key: str) -> None:
        super().done(key)
        if key in self.pairs:
            super().done(self.pairs[key])
