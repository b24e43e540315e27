"""Block-FP8 checkpoints (the official release format): decode, dequantize lazily, re-quantize
(docs/checkpoints.md, "Block-FP8 checkpoints": a ``W`` stored as E4M3 bytes plus ``W_scale_inv``, one
fp32 scale per block, valued ``float32(q) * scale_inv[block]``). numpy has no float8, so E4M3
(``e4m3fn``) bytes are decoded through an exact 256-entry table and encoded by round-to-nearest-even
against the same table (re-quantizing: :func:`quantize_blocks`).
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
# rounding anything at or past 464 to it gives NaN, as torch's float -> float8_e4m3fn does
_POS = E4M3_TABLE[:128].astype(np.float64)
_POS[127] = 480.0


def decode_e4m3(q: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 bytes (a uint8 array of any shape); exact."""
    return E4M3_TABLE[np.asarray(q, dtype=np.uint8)]


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """E4M3 bytes of float32 values: round to nearest, ties to even; >= 464 in magnitude -> NaN."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)  # fp32 values and E4M3 midpoints are exact in float64
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 1, 127)
    lo = hi - 1
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code[np.isnan(a) | (a >= 480.0)] = 0x7F
    return code | (np.signbit(x).astype(np.uint8) << 7)


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
    out *= scale_inv[ri][:, ci]  # fp32 x fp32 -> fp32, one rounding: the reference's product
    return out


def _quantize_with(w: np.ndarray, s_full: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = encode_e4m3(w / s_full)
    return q, decode_e4m3(q) * s_full


def quantize_blocks(w: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(q, scale_inv)`` for a 2-D fp32 weight: per block ``scale = amax / 448``.

    Blocks whose weights are already the dequantization of some E4M3 block at a scale next to
    ``amax / 448`` (a weight loaded from an FP8 checkpoint) get that scale, so the bytes come back
    unchanged. An all-zero block gets scale 1 (any scale represents it).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise CheckpointError("block-FP8 quantization needs a 2-D weight", actual=tuple(w.shape))
    br, bc = block
    rows, cols = w.shape
    R, C = math.ceil(rows / br), math.ceil(cols / bc)
    padding = ((0, R * br - rows), (0, C * bc - cols))
    amax = np.pad(np.abs(w), padding).reshape(R, br, C, bc).max(axis=(1, 3))
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    scale[amax == 0] = np.float32(1.0)
    ri, ci = np.arange(rows) // br, np.arange(cols) // bc

    def exact_blocks(q_deq: np.ndarray) -> np.ndarray:
        same = np.pad(q_deq.view(np.uint32) == w.view(np.uint32), padding, constant_values=True)
        return same.reshape(R, br, C, bc).all(axis=(1, 3))

    best = scale.copy()
    q, deq = _quantize_with(w, scale[ri][:, ci])
    done = exact_blocks(deq)
    for step in (-np.inf, np.inf):  # the neighbours one ulp down, then up, where amax / 448 is not exact
        if done.all():
            break
        # done ones (all-zero too) stay
        cand = np.where(done, scale, np.nextafter(scale, np.float32(step))).astype(np.float32)
        q2, deq2 = _quantize_with(w, cand[ri][:, ci])
        ok = exact_blocks(deq2) & ~done
        q = np.where(ok[ri][:, ci], q2, q)
        best = np.where(ok, cand, best)
        done |= ok
    return q, best.astype(np.float32)


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


def quantization_of(folder: str, config: Any = None) -> tuple[int, int] | None:
    """The block size of the checkpoint's block-FP8 quantization, from ``quantization_config`` (config.json
    beside the weights, or ``config``); None when there is none. Any other method is refused by name."""
    qc = None
    file = os.path.join(folder, "config.json")
    if os.path.isfile(file):
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
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise CheckpointError(
            "weight_block_size must be two positive integers",
            file=file,
            key="quantization_config.weight_block_size",
            actual=bs,
        )
    return bs[0], bs[1]


def fp8_pairs(ckpt: Any, block: tuple[int, int] | None) -> dict[str, str]:
    """``{weight key: scale key}`` for every F8_E4M3 tensor, each checked against its scale tensor."""
    pairs: dict[str, str] = {}
    for k in ckpt.keys():
        info = ckpt.info(k)
        if not info.dtype.startswith("F8"):
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
        if sinfo.dtype != "F32" or sinfo.shape != want:
            raise CheckpointError(
                f"scale tensor does not match the {block[0]}x{block[1]} blocks of {k}",
                key=sk,
                file=sinfo.file,
                expected=("F32", want),
                actual=(sinfo.dtype, sinfo.shape),
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
        return dequantize(q, scales, self.block, (r0, c0))

    def done(self, key: str) -> None:
        super().done(key)
        if key in self.pairs:
            super().done(self.pairs[key])
