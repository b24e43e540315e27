"""The block-FP8 quantizer as it was before the fast one (commit 30cc0ad), kept verbatim as the oracle
its replacement must match byte for byte (tests/test_fp8.py, bench/bench_fp8_quantize.py): E4M3
encoding by search in the sorted table of E4M3 values, every block encoded at ``amax / 448``, then
all blocks not yet exact again at the fp32 scale one below, then one above."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    code = np.arange(256)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    out = np.where(code & 0x80, -mag, mag).astype(np.float32)
    out[(code & 0x7F) == 0x7F] = np.nan
    return out


E4M3_TABLE = _e4m3_table()
_POS = E4M3_TABLE[:128].astype(np.float64)
_POS[127] = 480.0


def decode_e4m3(q: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[np.asarray(q, dtype=np.uint8)]


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 1, 127)
    lo = hi - 1
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code[np.isnan(a) | (a >= 480.0)] = 0x7F
    return code | (np.signbit(x).astype(np.uint8) << 7)


def _quantize_with(w: np.ndarray, s_full: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = encode_e4m3(w / s_full)
    return q, decode_e4m3(q) * s_full


def quantize_blocks(w: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(all="ignore"):
        return _quantize_blocks(w, block)


def _quantize_blocks(w: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(w, dtype=np.float32)
    br, bc = block
    rows, cols = w.shape
    R, C = math.ceil(rows / br), math.ceil(cols / bc)
    padding = ((0, R * br - rows), (0, C * bc - cols))
    amax = np.pad(np.abs(w), padding).reshape(R, br, C, bc).max(axis=(1, 3))
    # a scale is positive: amax / 448 underflowing to 0 takes the smallest float32 (and so does the
    # neighbour below it), never the negative neighbour of 0
    tiny = np.nextafter(np.float32(0), np.float32(1))
    scale = np.maximum(amax / np.float32(E4M3_MAX), tiny).astype(np.float32)
    scale[amax == 0] = np.float32(1.0)
    ri, ci = np.arange(rows) // br, np.arange(cols) // bc

    def exact_blocks(q_deq: np.ndarray) -> np.ndarray:
        same = np.pad(q_deq.view(np.uint32) == w.view(np.uint32), padding, constant_values=True)
        return same.reshape(R, br, C, bc).all(axis=(1, 3))

    best = scale.copy()
    q, deq = _quantize_with(w, scale[ri][:, ci])
    done = exact_blocks(deq)
    for step in (-np.inf, np.inf):
        if done.all():
            break
        cand = np.where(done, scale, np.maximum(np.nextafter(scale, np.float32(step)), tiny)).astype(np.float32)
        q2, deq2 = _quantize_with(w, cand[ri][:, ci])
        ok = exact_blocks(deq2) & ~done
        q = np.where(ok[ri][:, ci], q2, q)
        best = np.where(ok, cand, best)
        done |= ok
    return q, best.astype(np.float32)
