"""Rope: frequencies (default, yarn) and the interleaved / half-split application."""

import math

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling.rope import RotaryEmbedding, apply_rope, rope_inv_freq

from ._tiny import tiny_config


def test_default_inv_freq_uses_qk_rope_head_dim_not_head_dim():
    cfg = tiny_config()
    assert cfg.head_dim != cfg.qk_rope_head_dim
    inv, factor = rope_inv_freq(cfg)
    d = cfg.qk_rope_head_dim
    expect = 1.0 / (8000000.0 ** (np.arange(0, d, 2) / d))
    assert inv.shape == (d // 2,) and factor == 1.0
    np.testing.assert_allclose(inv, expect, rtol=2e-7)


def test_yarn_inv_freq_blends_interpolation_and_extrapolation():
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    cfg = tiny_config(rope_parameters=rope)
    inv, attn_factor = rope_inv_freq(cfg)
    d, base = cfg.qk_rope_head_dim, 10000.0
    pos = base ** (np.arange(0, d, 2) / d)

    def corr(rot):
        return d * math.log(1024 / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    expect = (1 / (4.0 * pos)) * (1 - extra) + (1 / pos) * extra
    np.testing.assert_allclose(inv, expect, rtol=1e-6)
    m = lambda s, ms: 0.1 * ms * math.log(s) + 1  # noqa: E731
    assert attn_factor == pytest.approx(m(4.0, 1.0) / m(4.0, 0.5))
    # first channels extrapolate (high frequency kept), last channels interpolate (divided by factor)
    assert inv[0] == pytest.approx(1.0, rel=1e-6) and inv[-1] == pytest.approx(1 / (4.0 * pos[-1]), rel=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_apply_rope_matches_complex_rotation(interleave):
    rng = np.random.default_rng(0)
    B, S, H, D = 2, 5, 3, 8
    x = rng.standard_normal((B, S, H, D)).astype("float32")
    theta = rng.standard_normal((B, S, D // 2)).astype("float32")
    out = apply_rope(paddle.to_tensor(x), paddle.to_tensor(np.cos(theta)), paddle.to_tensor(np.sin(theta)), interleave)
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : D // 2], x[..., D // 2 :]
    z = (a + 1j * b) * np.exp(1j * theta)[:, :, None, :]
    np.testing.assert_allclose(out.numpy(), np.concatenate([z.real, z.imag], -1), atol=1e-6)


def test_rotation_is_relative_position_only():
    """q.k after rope depends only on the position difference (checks cos/sin tables and layout)."""
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg)
    rng = np.random.default_rng(1)
    q = paddle.to_tensor(rng.standard_normal((1, 1, 1, 16)).astype("float32"))
    k = paddle.to_tensor(rng.standard_normal((1, 1, 1, 16)).astype("float32"))

    def dot(i, j):
        ci, si = rope(paddle.to_tensor([[i]], dtype="int64"))
        cj, sj = rope(paddle.to_tensor([[j]], dtype="int64"))
        return float((apply_rope(q, ci, si, True) * apply_rope(k, cj, sj, True)).sum())

    assert dot(3, 1) == pytest.approx(dot(10, 8), abs=1e-5)
    assert abs(dot(3, 1) - dot(3, 2)) > 1e-4
