"""check-ckpt of an FP8 checkpoint against an unquantized one compares the dequantized weight in
chunks of whole 128-row blocks; every chunk must count. A tensor spanning three chunks with one
value changed in the first, a middle or the last chunk is a mismatch; the same tensor unchanged is a
match. (The official o_proj, 6144 x 16384, spans about a hundred chunks.)

The reference is written byte by byte (random E4M3 bytes, one fp32 scale per 128 x 128 block); the
candidate is its dequantization rounded to BF16 by numpy (decode with the table of
tests/_fp8_oracle.py, times the scale, round to nearest even), not by the code under test."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from paddleformers_glm.parity import ckpt_check
from paddleformers_glm.parity.ckpt_check import check_checkpoints

from ._fp8_oracle import decode_e4m3
from .conftest import FIXTURES

CONFIG = json.loads((FIXTURES / "tiny_fp8" / "checkpoint" / "config.json").read_text())
ROWS, COLS = 9000, 64  # 3 chunks of 4096 rows at 64 columns (2^18 values a chunk)
_BYTES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


def _write(folder: pathlib.Path, tensors: dict[str, tuple[str, np.ndarray]], config: dict) -> None:
    """One safetensors file (8-byte header length, JSON header, data) and config.json."""
    folder.mkdir()
    header, data, off = {}, b"", 0
    for name, (dtype, a) in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        assert len(raw) == _BYTES[dtype] * a.size
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (folder / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + data)
    (folder / "config.json").write_text(json.dumps(config))


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(11)
    q = rng.integers(0, 256, size=(ROWS, COLS), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # no NaN code
    R = -(-ROWS // 128)
    s = (np.float32(0.003) * (1 + rng.random((R, 1), dtype=np.float32))).astype(np.float32)  # not powers of 2
    deq = decode_e4m3(q) * np.repeat(s, 128, axis=0)[:ROWS]
    return q, s, _bf16_bits(deq)


def _check(tmp_path, q, s, bf) -> dict:
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    _write(ref, {"x.weight": ("F8_E4M3", q), "x.weight_scale_inv": ("F32", s)}, CONFIG)
    _write(cand, {"x.weight": ("BF16", bf)}, {k: v for k, v in CONFIG.items() if k != "quantization_config"})
    return check_checkpoints(str(ref), str(cand))


def test_the_tensor_spans_several_chunks():
    rows = max(1, ckpt_check._DIFF_CHUNK // COLS // 128) * 128
    assert ROWS > 2 * rows, "the test tensor must span at least three row chunks"


def test_identical_values_match(tmp_path, weights):
    q, s, bf = weights
    rep = _check(tmp_path, q, s, bf)
    assert rep["exit_code"] == 0, (rep.get("errors"), rep.get("differences"))


@pytest.mark.parametrize("row", [0, 4000, 5000, ROWS - 1], ids=["first-chunk", "end-of-first", "middle", "last"])
def test_one_value_changed_in_any_chunk_is_a_mismatch(tmp_path, weights, row):
    q, s, bf = weights
    bf = bf.copy()
    bf[row, 5] ^= 0x0001  # the last mantissa bit of one BF16 value
    rep = _check(tmp_path, q, s, bf)
    assert rep["exit_code"] == 1, (row, rep.get("errors"), rep.get("differences"))
