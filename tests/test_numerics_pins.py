"""Numbers the logits barely show on short, O(1) inputs, pinned to the reference's values.

- the DSA indexer's `k_norm` is a LayerNorm with eps 1e-6 whatever `rms_norm_eps` is (HF's indexer
  builds `nn.LayerNorm(index_head_dim, eps=1e-6)`; Megatron's GLM setting `k_norm_epsilon=1e-6`;
  PaddleFleet's use of `rms_norm_eps` there is the deviation not to follow). On O(1) activations the
  eps moves no top-k choice; on keys whose mean square is of the eps's order it changes the keys by
  a factor of two.
- rope's inverse frequencies are HF's bit for bit (transformers computes base ** (arange / dim) in
  fp32 with a correctly rounded pow; numpy's fp32 powf is 1 ulp off in 7 of the official 32
  entries, a phase error of 3.9e-3 rad at position 131072). HF's values are committed
  (tests/fixtures/rope/hf_inv_freq.json, tools/make_rope_reference.py).
- the indexer's head weights carry index_n_heads^-0.5 (HF: `weights_proj(x) * n_heads ** -0.5`): the
  top-k cannot see it (a positive constant per query), the KL indexer losses, which softmax the
  index scores, can.
- `MoE._static_routed` (every expert on every token, weighted: the form paddle.jit.to_static exports
  and a captured CUDA graph decodes with) is the eager routed sum.

Expected values come from the fixture or from numpy written from the reference's formulas.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.modeling.indexer import DSAIndexer
from paddleformers_glm.modeling.moe import MoE
from paddleformers_glm.modeling.rope import RotaryEmbedding, rope_inv_freq

from ._tiny import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[1]
HF_ROPE = json.loads((ROOT / "tests" / "fixtures" / "rope" / "hf_inv_freq.json").read_text())["cases"]
INDEXER_K_NORM_EPS = 1e-6  # HF GlmMoeDsaIndexer: nn.LayerNorm(index_head_dim, eps=1e-6)


def _indexer(seed: int = 0, wk_scale: float = 1.0, **changes) -> tuple[DSAIndexer, dict[str, np.ndarray]]:
    """A tiny-config indexer with seeded weights (linear N(0, 1/fan_in), weights_proj x3, k_norm
    weight 1 + 0.1 N, bias 0.1 N; ``wk`` times ``wk_scale``) and those weights as numpy."""
    ix = DSAIndexer(tiny_config(**changes))
    rng = np.random.default_rng(seed)
    raw = {}
    for name, p in ix.named_parameters():
        if name.startswith("k_norm."):
            v = (1.0 if name.endswith("weight") else 0.0) + 0.1 * rng.standard_normal(p.shape)
        else:
            v = rng.standard_normal(p.shape) / np.sqrt(p.shape[0])
            v = v * (3.0 if name.startswith("weights_proj") else wk_scale if name.startswith("wk") else 1.0)
        raw[name] = v.astype("float32")
        p.set_value(paddle.to_tensor(raw[name]))
    return ix, raw


def _inputs(ix: DSAIndexer, S: int, seed: int = 1):
    """x [1, S, hidden], q_latent [1, S, q_lora_rank] ~ N(0, 1), and an identity rope (cos 1, sin 0):
    the numpy side then needs no rotation."""
    cfg_hidden, cfg_q = ix.wk.weight.shape[0], ix.wq_b.weight.shape[0]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, S, cfg_hidden)).astype("float32")
    ql = rng.standard_normal((1, S, cfg_q)).astype("float32")
    cos, sin = paddle.ones([1, S, ix.rope_dim // 2]), paddle.zeros([1, S, ix.rope_dim // 2])
    return x, ql, cos, sin


def _np_layer_norm(h: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    h = h.astype(np.float64)
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) / np.sqrt(var + eps) * w + b


def _np_identity_rope(ix: DSAIndexer, t: np.ndarray) -> np.ndarray:
    """HF's interleaved rope on the first rope dims at angle 0: its pairs (t[2i], t[2i+1]) come out in
    half-split order (t[0::2], then t[1::2]), the rest passes through."""
    r = ix.rope_dim
    if not ix.interleave:
        return t
    return np.concatenate([t[..., 0:r:2], t[..., 1:r:2], t[..., r:]], -1)


def _np_index_scores(ix: DSAIndexer, raw: dict[str, np.ndarray], x: np.ndarray, ql: np.ndarray) -> np.ndarray:
    """[S, S] index scores I[i, j] = sum_h w_h * Hi^-0.5 * relu(q_h,i . k_j * Di^-0.5) (no mask), with
    q = wq_b(q_latent), k = LayerNorm_eps1e-6(wk(x)), w = weights_proj(x), rope the identity."""
    Hi, Di = ix.n_heads, ix.head_dim
    x, ql = x[0].astype(np.float64), ql[0].astype(np.float64)
    q = _np_identity_rope(ix, (ql @ raw["wq_b.weight"]).reshape(len(ql), Hi, Di))
    k = _np_layer_norm(x @ raw["wk.weight"], raw["k_norm.weight"], raw["k_norm.bias"], INDEXER_K_NORM_EPS)
    k = _np_identity_rope(ix, k)
    w = (x @ raw["weights_proj.weight"]) * Hi**-0.5
    s = np.maximum(np.einsum("ihd,jd->ihj", q, k) * Di**-0.5, 0.0)
    return np.einsum("ih,ihj->ij", w, s)


def _np_kl(scores: np.ndarray, p: np.ndarray) -> float:
    """KL(p || softmax(scores)) over one query's keys."""
    z = scores - scores.max()
    log_q = z - np.log(np.exp(z).sum())
    return float((p * (np.log(p) - log_q)).sum())


# --- indexer k_norm eps -------------------------------------------------------------------------


@pytest.mark.parametrize("rms_norm_eps", [1e-5, 1e-3])
def test_indexer_k_norm_eps_is_1e6_whatever_rms_norm_eps(rms_norm_eps):
    """HF's indexer LayerNorm has eps 1e-6 hard-coded; `rms_norm_eps` is the decoder's RMSNorms' only."""
    ix = DSAIndexer(tiny_config(rms_norm_eps=rms_norm_eps))
    assert ix.k_norm.eps == INDEXER_K_NORM_EPS


def test_indexer_keys_of_eps_sized_mean_square_are_normed_with_eps_1e6():
    """wk scaled by 1e-3: the keys before the norm have a mean square of about 1e-6, the eps's order,
    so eps 1e-5 (rms_norm_eps) instead of 1e-6 would shrink the normed keys about 2x. The projected
    keys equal a float64 numpy LayerNorm with eps 1e-6 to fp32 rounding."""
    ix, raw = _indexer(0, wk_scale=1e-3)
    x, ql, cos, sin = _inputs(ix, S=6)
    pre = x[0].astype(np.float64) @ raw["wk.weight"]
    assert 1e-7 < (pre**2).mean() < 1e-5  # the regime where eps matters
    want = _np_identity_rope(ix, _np_layer_norm(pre, raw["k_norm.weight"], raw["k_norm.bias"], INDEXER_K_NORM_EPS))
    with paddle.no_grad():
        _, k, _ = ix.project(paddle.to_tensor(x), paddle.to_tensor(ql), cos, sin)
    np.testing.assert_allclose(k.numpy()[0], want, rtol=0, atol=2e-5)


# --- rope ---------------------------------------------------------------------------------------


def _rope_config(case: str) -> GlmMoeDsaConfig:
    if case == "official":
        return GlmMoeDsaConfig.from_pretrained(ROOT / "configs" / "glm52-744b-a40b")
    if case == "tiny":
        return tiny_config()
    return tiny_config(rope_parameters=dict(HF_ROPE[case]["rope_parameters"]))


@pytest.mark.parametrize("case", sorted(HF_ROPE))
def test_rope_inv_freq_is_hf_bit_for_bit(case):
    """`rope_inv_freq` of the official, tiny and tiny-yarn configs: HF's `inv_freq` (fp32) bitwise,
    and HF's `attention_scaling`."""
    cfg = _rope_config(case)
    want = HF_ROPE[case]
    assert cfg.qk_rope_head_dim == want["qk_rope_head_dim"]
    assert cfg.rope["rope_theta"] == want["rope_parameters"]["rope_theta"]
    inv, factor = rope_inv_freq(cfg)
    hf = np.array(want["inv_freq"], dtype=np.float32)
    assert inv.dtype == np.float32
    np.testing.assert_array_equal(inv.view(np.uint32), hf.view(np.uint32))
    assert factor == pytest.approx(want["attention_scaling"], rel=1e-12)


def test_rope_cos_sin_at_long_positions_follow_hf_inv_freq():
    """The official rope's cos / sin at positions up to 202751 (the official context): HF forms the
    phase as an fp32 product position x inv_freq, so the expected table is cos / sin in float64 of
    float32(position x HF's inv_freq). A 1-ulp error in an inverse frequency moves the phase by
    position x ulp: 3.9e-3 rad at 131072."""
    cfg = _rope_config("official")
    hf = np.array(HF_ROPE["official"]["inv_freq"], dtype=np.float32)
    positions = np.array([0, 4095, 4096, 131071, 131072, 202751], dtype=np.int64)
    phase = (positions.astype(np.float32)[:, None] * hf[None, :]).astype(np.float64)  # fp32 products
    with paddle.no_grad():
        cos, sin = RotaryEmbedding(cfg)(paddle.to_tensor(positions[None]))
    np.testing.assert_allclose(cos.numpy()[0], np.cos(phase), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin.numpy()[0], np.sin(phase), rtol=0, atol=1e-6)


# --- indexer head-weight scale in the KL losses -------------------------------------------------


def test_sparse_kl_loss_uses_the_head_weight_scale():
    """`kl_loss` over each query's selected keys (up to index_topk, -1 padded) equals the mean over
    queries of KL(target || softmax(I)) with I the reference's index scores, n_heads^-0.5 included."""
    ix, raw = _indexer(2)
    S, k = 12, ix.topk
    x, ql, cos, sin = _inputs(ix, S)
    I = _np_index_scores(ix, raw, x, ql)
    rng = np.random.default_rng(3)
    idx = np.full((1, S, k), -1, dtype=np.int64)
    p = np.zeros((1, S, k), dtype=np.float32)
    want = []
    for i in range(S):
        keys = np.arange(i, max(-1, i - k), -1)  # the latest min(k, i + 1) causal keys
        idx[0, i, : len(keys)] = keys
        t = rng.uniform(0.1, 1.0, len(keys))
        p[0, i, : len(keys)] = t / t.sum()
        want.append(_np_kl(I[i, keys], p[0, i, : len(keys)].astype(np.float64)))
    got = ix.kl_loss(paddle.to_tensor(x), paddle.to_tensor(ql), cos, sin, paddle.to_tensor(idx), paddle.to_tensor(p))
    assert float(got) == pytest.approx(np.mean(want), rel=1e-5, abs=1e-6)


def test_dense_kl_loss_uses_the_head_weight_scale():
    """`dense_kl_loss` over every causal key equals the mean over queries of KL(target ||
    softmax(I over keys j <= i)), n_heads^-0.5 included."""
    ix, raw = _indexer(4)
    S = 10
    x, ql, cos, sin = _inputs(ix, S)
    I = _np_index_scores(ix, raw, x, ql)
    rng = np.random.default_rng(5)
    p = np.tril(rng.uniform(0.1, 1.0, (S, S)))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    want = np.mean([_np_kl(I[i, : i + 1], p[i, : i + 1].astype(np.float64)) for i in range(S)])
    got = ix.dense_kl_loss(paddle.to_tensor(x), paddle.to_tensor(ql), cos, sin, paddle.to_tensor(p[None]), None)
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)


# --- MoE graph form -----------------------------------------------------------------------------


def _moe() -> MoE:
    model = tiny_model(0)
    model.eval()
    return next(layer for layer in model.sublayers() if isinstance(layer, MoE))


@pytest.mark.parametrize("grad", [False, True])
def test_static_routed_equals_routed_on_the_routers_choice(grad):
    """On the router's own choice for 10 tokens: the graph form's routed sum is the eager one."""
    moe = _moe()
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((10, moe.gate.weight.shape[0])).astype("float32"))
    with paddle.set_grad_enabled(grad):
        _, w, ids = moe.gate(x)
        want = moe.routed(x, w, ids).numpy()
        got = moe._static_routed(x, w, ids).numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the sums' order differs


def test_static_routed_equals_routed_with_idle_experts():
    """Hand-made routing: experts 3..7 receive no token, one token's two experts share a group, and
    unequal weights; each idle expert must add exactly nothing, each chosen one its weight times its
    output."""
    moe = _moe()
    E = moe.num_experts
    ids = paddle.to_tensor(np.array([[0, 1], [2, 0], [1, 2], [2, 1], [0, 2]], dtype=np.int64))
    assert E > 3
    rng = np.random.default_rng(1)
    w = paddle.to_tensor(rng.uniform(0.1, 2.0, (5, 2)).astype("float32"))
    x = paddle.to_tensor(rng.standard_normal((5, moe.gate.weight.shape[0])).astype("float32"))
    with paddle.no_grad():
        want = moe.routed(x, w, ids).numpy()
        got = moe._static_routed(x, w, ids).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the sums' order differs
