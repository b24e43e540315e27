"""The loader applies each AOA engine entry with numpy (zero-copy source, blocked transpose); it must
give exactly what Paddle's own ``assign_sharded_slice`` gives, and fall back to it for rounding casts."""

from __future__ import annotations

import os

import numpy as np
import pytest

from paddleformers_glm.checkpoint import engine as E


def _paddle_reference(src_np, src_dtype, pp, dst_shape, dst_dtype, region_offset):
    """What Paddle's engine writes: assign_sharded_slice on a full source into a slice of a target."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight, ShardedWeightDesc
    from paddle.distributed.flex_checkpoint.dcp.utils import assign_sharded_slice

    src_t = paddle.to_tensor(src_np)
    if src_dtype == "bfloat16":
        assert str(src_t.dtype) == "paddle.bfloat16"
    s_desc = ShardedWeightDesc("s", src_np.shape, src_np.shape, (0,) * src_np.ndim, src_dtype)
    out_shape = (
        tuple(src_np.shape[int(i)] for i in pp[0].strip("[]").split(","))
        if pp and pp[0].startswith("[")
        else src_np.shape
    )
    t_desc = ShardedWeightDesc("t", out_shape, dst_shape, region_offset, dst_dtype)
    dst = paddle.zeros(list(dst_shape), dtype=dst_dtype)
    dst_sw = ShardedWeight("t", dst, dst_shape, dst_shape, (0,) * len(dst_shape))
    src_sw = ShardedWeight("s", src_t, src_np.shape, src_np.shape, (0,) * src_np.ndim)
    assign_sharded_slice(s_desc, src_sw, t_desc, dst_sw, pp)
    return dst


def _bf16_bits(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize(
    "shape, pp, src_dtype, dst_dtype, dst_shape, offset",
    [
        ((300, 40), ["[1, 0]"], "bfloat16", "bfloat16", (40, 300), (0, 0)),
        ((300, 40), ["[1, 0]", "float32"], "bfloat16", "float32", (40, 300), (0, 0)),
        ((70, 9000), ["[1, 0]"], "bfloat16", "bfloat16", (9000, 140), (0, 70)),  # many row blocks, into a fused half
        ((70, 9000), ["[1, 0]", "float32"], "bfloat16", "float32", (9000, 140), (0, 0)),
        ((17,), ["float32"], "bfloat16", "float32", (17,), (0,)),
        ((6, 5), None, "float32", "float32", (6, 5), (0, 0)),
        ((4, 5, 6), ["[2, 0, 1]"], "float32", "float32", (6, 4, 5), (0, 0, 0)),
    ],
)
def test_numpy_application_equals_paddle(shape, pp, src_dtype, dst_dtype, dst_shape, offset):
    import paddle

    rng = np.random.default_rng(0)
    src = _bf16_bits(rng, shape) if src_dtype == "bfloat16" else rng.standard_normal(shape).astype(np.float32)
    want = _paddle_reference(src, src_dtype, pp, dst_shape, dst_dtype, offset)
    got = paddle.zeros(list(dst_shape), dtype=dst_dtype)
    view = E.numpy_view(got)
    assert view is not None
    perm_shape = (
        tuple(src.shape[int(i)] for i in pp[0].strip("[]").split(",")) if pp and pp[0].startswith("[") else src.shape
    )
    region = tuple(slice(o, o + n) for o, n in zip(offset, perm_shape))
    assert E.apply_entry_numpy(src, src_dtype, pp, view[region]) is True
    assert got.numpy().tobytes() == want.numpy().tobytes()


def test_rounding_cast_is_left_to_paddle():
    """fp32 -> bf16 rounds: the numpy path declines, so Paddle's cast kernel decides the bits."""
    import paddle

    src = np.array([[1.0 + 2**-9, 3.0]], dtype=np.float32)
    dst = paddle.zeros([2, 1], dtype="bfloat16")
    assert E.apply_entry_numpy(src, "float32", ["[1, 0]", "bfloat16"], E.numpy_view(dst)) is False
    assert not dst.astype("float32").numpy().any()  # untouched


def test_large_plain_copies_split_over_threads_give_the_same_bytes():
    """A copy above the split size runs in row chunks on the load threads (bf16 kept, bf16 -> fp32
    widened, a destination region of a wider array); every element lands once, nothing else moves."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 65535, size=(1100, 2100), dtype=np.uint16)  # 4.4 MB, above the split size
    assert src.nbytes >= E._PARALLEL_BYTES
    same = np.zeros((1100, 2200), dtype=np.uint16)
    assert E.apply_entry_numpy(src, "bfloat16", None, same[:, 50:2150]) is True
    assert np.array_equal(same[:, 50:2150], src) and not same[:, :50].any() and not same[:, 2150:].any()
    wide = np.full((1100, 2100), 7.0, dtype=np.float32)
    assert E.apply_entry_numpy(src, "bfloat16", ["float32"], wide) is True
    assert np.array_equal(wide.view(np.uint32), src.astype(np.uint32) << 16)


@pytest.mark.parametrize("raw, threads", [("abc", None), ("2.5", None), ("", 4), ("  ", 4), ("1", 1), ("3", 3)])
def test_load_threads_setting_is_a_whole_number_named_when_it_is_not(monkeypatch, raw, threads):
    """GLM52_LOAD_THREADS: a value that is no whole number was "invalid literal for int()", naming
    neither the variable nor its value (a run's failure record the same); empty, as an unset shell
    variable exports it, was refused too. Empty reads as unset (the CPU count up to 8) now."""
    monkeypatch.setenv("GLM52_LOAD_THREADS", raw)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    E._pool.cache_clear()
    try:
        if threads is None:
            with pytest.raises(ValueError, match=f"GLM52_LOAD_THREADS must be a whole number of threads.*got '{raw}'"):
                E._pool()
        else:
            pool = E._pool()
            assert (pool._max_workers if pool is not None else 1) == threads
    finally:
        E._pool.cache_clear()  # the next load reads the environment as it is


def test_huge_page_advice_is_only_advice():
    import os
    import sys

    big = np.arange(3 << 20, dtype=np.float32)  # 12 MB
    want = big.copy()
    took = E.advise_huge_pages(big)
    # a Linux kernel with transparent huge pages accepts the advice; elsewhere it is declined
    assert took is (sys.platform == "linux" and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"))
    assert np.array_equal(big, want)
    assert E.advise_huge_pages(np.zeros(16, np.float32)) is False  # small arrays: not worth a call


def test_numpy_view_writes_through():
    import paddle

    for dtype in ("float32", "bfloat16"):
        t = paddle.zeros([2, 3], dtype=dtype)
        v = E.numpy_view(t)
        v[1, 2] = 0x3F80 if dtype == "bfloat16" else 1.0  # bf16 bits of 1.0
        assert float(t.astype("float32")[1, 2]) == 1.0


def test_plan_cache_gives_the_same_tensors_with_fewer_engines(monkeypatch):
    import pathlib

    from paddle.distributed.flex_checkpoint.aoa import aoa_engine

    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.checkpoint.layout import fleet_param_specs
    from paddleformers_glm.checkpoint.loader import units_for
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

    fixture = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny" / "checkpoint"
    if not fixture.exists():
        pytest.skip("HF fixture checkpoint not present")
    cfg = GlmMoeDsaConfig.from_pretrained(fixture)
    built = []
    real_init = aoa_engine.AOAEngine.__init__

    def counting_init(self, *a, **kw):
        built.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(aoa_engine.AOAEngine, "__init__", counting_init)
    results = {}
    for cache in (False, True):
        built.clear()
        targets = {k: E.TargetSpec(k, s, "float32") for k, (s, _) in fleet_param_specs(cfg).items()}
        with Checkpoint(fixture) as ck:
            got = {
                k: t.numpy().tobytes()
                for k, t in E.run_units(
                    units_for(cfg, "hf"), "hf_to_fleet", E.CheckpointSource(ck), targets, plan_cache=cache
                )
            }
        results[cache] = (got, len(built))
    assert results[True][0] == results[False][0]
    # without the cache: global + one per layer (8 decoder layers + MTP). With it, one engine per
    # distinct unit program up to names: embedding, final norm, lm_head; the dense layer's norms,
    # MLA, indexer and MLP (every routed expert's program is the dense MLP's: same shapes here);
    # the MoE router and shared expert; the MTP layer's norms, MLA, router, shared expert and
    # wrapper (its shapes or key sets differ) — 14, however many layers or experts there are
    n_units = len(units_for(cfg, "hf"))
    assert results[False][1] == 10 and results[True][1] == 14 < n_units
