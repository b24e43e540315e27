"""Block-FP8 weights wider than one 128-column block: a slice read at a column offset (what a
row-parallel rank of o_proj / down_proj / the experts reads: HF columns split across ranks) takes the
scales of its own column blocks; a scale grid whose column count is not the weight's is refused; an
FP8 variant other than E4M3 is refused; a ``quantization_config`` without ``weight_block_size``
means 128 x 128 blocks. And the writer's bytes are little-endian whatever the array's byte order.

Files are written byte by byte here (header JSON + data, the safetensors format), and the expected
values are an independent numpy dequantization of the stored bytes: the E4M3 table of
tests/_fp8_oracle.py times the fp32 scale of each element's block."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from paddleformers_glm.checkpoint import CheckpointError
from paddleformers_glm.checkpoint.fp8 import Fp8Source, fp8_pairs, quantization_of
from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

from ._fp8_oracle import decode_e4m3

_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F32": 4}


def _write(path: pathlib.Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file: 8-byte little-endian header length, the JSON header, the data."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        assert len(raw) == _BYTES[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _random_e4m3(rng, shape) -> np.ndarray:
    """Random E4M3 bytes, no NaN code (0x7F / 0xFF)."""
    q = rng.integers(0, 256, size=shape, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # 1.0
    return q


def _oracle(q: np.ndarray, s: np.ndarray, block=(128, 128)) -> np.ndarray:
    """decode(q) * scale of each element's block, in fp32 (one rounding, like ``q.float() * scale``)."""
    rows, cols = q.shape
    s_full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return decode_e4m3(q) * s_full


# (rows, cols): three whole column blocks; then a partial last column block (300 = 2 x 128 + 44)
SHAPES = [(200, 384), (200, 300)]
# (offset, shape) of slices: inside one column block, across blocks, into the partial last block,
# the last columns alone; row offsets inside and across the two row blocks
SLICES = [
    ((0, 128), (200, 128)),
    ((0, 130), (200, 40)),
    ((0, 192), (200, 100)),
    ((64, 256), (100, 44)),
    ((130, 130), (70, 170)),
    ((0, 0), (200, 300)),
    ((5, 250), (190, 50)),
    ((0, 299), (200, 1)),
]


@pytest.mark.parametrize("rows,cols", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_a_column_slice_dequantizes_with_its_own_column_blocks_scales(tmp_path, rows, cols):
    """Each column block gets a scale far from the others' (powers of two apart and not powers of
    two themselves), so a slice read with another block's scales is off by a factor, not by a bit."""
    rng = np.random.default_rng(7)
    q = _random_e4m3(rng, (rows, cols))
    R, C = -(-rows // 128), -(-cols // 128)
    s = (np.float32(0.7) * np.float32(4.0) ** np.arange(R * C, dtype=np.float32)).reshape(R, C).astype(np.float32)
    f = tmp_path / "model.safetensors"
    _write(f, {"x.weight": ("F8_E4M3", (rows, cols), q.tobytes()), "x.weight_scale_inv": ("F32", (R, C), s.tobytes())})
    want = _oracle(q, s)
    with Checkpoint(str(f)) as ckpt:
        src = Fp8Source(ckpt, pairs=fp8_pairs(ckpt, (128, 128)), block=(128, 128))
        checked = 0
        for (r0, c0), (nr, nc) in SLICES:
            if c0 + nc > cols:
                continue
            got = src.read_numpy("x.weight", (r0, c0), (nr, nc))
            assert got.dtype == np.float32 and got.shape == (nr, nc)
            exp = want[r0 : r0 + nr, c0 : c0 + nc]
            assert np.array_equal(got.view(np.uint32), exp.view(np.uint32)), f"slice at {(r0, c0)} of {(nr, nc)}"
            checked += 1
        assert checked >= 6


def test_a_scale_grid_with_the_wrong_column_count_is_refused(tmp_path):
    """A 100 x 256 weight has 1 x 2 blocks of 128 x 128. A (1, 4) grid (scales made for 128 x 64
    blocks) or a (1, 3) grid has the right row count; accepted, column block j would take scale j."""
    for grid in ((1, 4), (1, 3), (1, 1)):
        f = tmp_path / f"{grid[1]}.safetensors"
        q = np.full((100, 256), 0x38, np.uint8)
        s = np.ones(grid, np.float32)
        _write(f, {"a.weight": ("F8_E4M3", q.shape, q.tobytes()), "a.weight_scale_inv": ("F32", grid, s.tobytes())})
        with Checkpoint(str(f)) as ckpt, pytest.raises(CheckpointError, match="scale tensor does not match") as e:
            fp8_pairs(ckpt, (128, 128))
        assert e.value.key == "a.weight_scale_inv", grid
    # the control: the right grid is taken
    f = tmp_path / "ok.safetensors"
    s = np.ones((1, 2), np.float32)
    _write(f, {"a.weight": ("F8_E4M3", q.shape, q.tobytes()), "a.weight_scale_inv": ("F32", (1, 2), s.tobytes())})
    with Checkpoint(str(f)) as ckpt:
        assert fp8_pairs(ckpt, (128, 128)) == {"a.weight": "a.weight_scale_inv"}


def test_an_f8_e5m2_weight_is_refused_by_name(tmp_path):
    """E5M2 is the other FP8 format; byte 0x3C is 1.0 there and 1.5 in E4M3. Decoded with the E4M3
    table every value would be wrong, so such a file is refused, naming the variant."""
    f = tmp_path / "model.safetensors"
    _write(
        f,
        {
            "a.weight": ("F8_E5M2", (4, 4), bytes([0x3C]) * 16),
            "a.weight_scale_inv": ("F32", (1, 1), np.ones((1, 1), np.float32).tobytes()),
        },
    )
    with Checkpoint(str(f)) as ckpt, pytest.raises(CheckpointError, match="FP8 variant not supported") as e:
        fp8_pairs(ckpt, (128, 128))
    assert e.value.key == "a.weight"


def test_quantization_config_without_weight_block_size_means_128x128_blocks(tmp_path):
    """transformers' ``FineGrainedFP8Config`` and the official release use 128 x 128 blocks; a
    ``quantization_config`` that leaves ``weight_block_size`` out means those, and a weight with its
    128 x 128 scale grid then loads (a 200 x 300 weight: a 2 x 3 grid)."""
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    block = quantization_of(str(tmp_path))
    assert block == (128, 128)
    rng = np.random.default_rng(3)
    q = _random_e4m3(rng, (200, 300))
    s = np.float32([[0.5, 3.0, 0.01], [7.0, 0.25, 1.5]])
    _write(
        tmp_path / "model.safetensors",
        {"w.weight": ("F8_E4M3", q.shape, q.tobytes()), "w.weight_scale_inv": ("F32", s.shape, s.tobytes())},
    )
    with Checkpoint(str(tmp_path)) as ckpt:
        src = Fp8Source(ckpt, pairs=fp8_pairs(ckpt, block), block=block)
        got = src.read_numpy("w.weight", (0, 0), (200, 300))
    assert np.array_equal(got.view(np.uint32), _oracle(q, s).view(np.uint32))


def test_le_bytes_of_a_big_endian_array_are_little_endian():
    """safetensors stores little-endian bytes: a big-endian float32 1.0 is written as 00 00 80 3f."""
    from paddleformers_glm.checkpoint.safetensors_io import le_bytes

    got = le_bytes(np.array([1.0, -2.0], dtype=">f4")).tobytes()
    assert got == bytes.fromhex("0000803f000000c0")
