"""The compiled tiled transpose gives numpy's bytes (same dtype, bf16 -> fp32 widening, strided
destinations, partial tiles), and the engine's numpy path gives the same result with it on or off."""

from __future__ import annotations

import numpy as np
import pytest

from paddleformers_glm.ops import transpose as fast_copy

pytestmark = pytest.mark.skipif(not fast_copy.available(), reason="no C compiler for the fast transpose")


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (130, 48), (300, 1000)])
def test_transpose_equals_numpy(dtype, shape):
    rng = np.random.default_rng(0)
    src = (rng.integers(0, 60000, size=shape) if dtype == np.uint16 else rng.standard_normal(shape)).astype(dtype)
    dst = np.full((shape[1], shape[0]), 7, dtype=dtype)
    assert fast_copy.transpose_into(src, dst)
    assert np.array_equal(dst, src.T)


@pytest.mark.parametrize("shape", [(8, 8), (9, 7), (64, 128), (130, 200)])
def test_bf16_widening_equals_the_bit_shift(shape):
    # full 8 x 8 register blocks, partial ones, whole 64 x 64 tiles and edges of both
    rng = np.random.default_rng(3)
    src = rng.integers(0, 65535, size=shape, dtype=np.uint16)
    dst = np.full((shape[1], shape[0]), 7, dtype=np.float32)
    assert fast_copy.transpose_into(src, dst, widen_bf16=True)
    assert np.array_equal(dst.view(np.uint32), src.T.astype(np.uint32) << 16)


def test_strided_slices_threads_and_bf16_widening():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(1)
    big = rng.integers(0, 65535, size=(500, 300), dtype=np.uint16)
    src = big[10:410, 20:270]  # rows not contiguous with each other
    out = np.zeros((300, 600), dtype=np.uint16)
    dst = out[20:270, 100:500]  # a column block of a wider array
    with ThreadPoolExecutor(2) as pool:
        assert fast_copy.transpose_into(src, dst, run=lambda f, xs: list(pool.map(f, xs)))
    assert np.array_equal(dst, src.T)
    assert not out[:, :100].any() and not out[:, 500:].any() and not out[:20].any()
    wide = np.zeros((250, 400), dtype=np.float32)
    assert fast_copy.transpose_into(src, wide, widen_bf16=True)
    assert np.array_equal(wide.view(np.uint32), src.T.astype(np.uint32) << 16)
    # what it does not handle it says so (the caller keeps its own path)
    assert not fast_copy.transpose_into(src, np.zeros((250, 400), np.float16))
    assert not fast_copy.transpose_into(src[:, ::2], np.zeros((125, 400), np.uint16))


def test_engine_result_is_the_same_with_and_without(monkeypatch):
    from paddleformers_glm.checkpoint.engine import apply_entry_numpy

    rng = np.random.default_rng(2)
    src = rng.integers(0, 65535, size=(192, 48), dtype=np.uint16)
    results = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(fast_copy, "transpose_into", lambda *a, **k: False)
        a = np.zeros((48, 192), np.uint16)
        b = np.zeros((48, 192), np.float32)
        assert apply_entry_numpy(src, "bfloat16", ["[1, 0]"], a)
        assert apply_entry_numpy(src, "bfloat16", ["[1, 0]", "float32"], b)
        results.append((a.copy(), b.copy()))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][0], src.T)
    assert np.array_equal(results[0][1].view(np.uint32), results[1][1].view(np.uint32))
