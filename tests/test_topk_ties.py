"""Exact ties in a top-k at a row length of exactly 64 k.

paddle.topk and torch.topk (HF's) on CPU run the same std::partial_sort or std::nth_element + sort
on (value, index) pairs, so they give equal values to the same index -- except where the row
length n is exactly 64 k: torch takes partial_sort when k * 64 <= n, Paddle only when k * 64 < n
(measured: on rows of values in {0, 1, 2, 3}, 784 to 800 of 800 rows chose another set at n = 64 k,
none at 64 k +- 1). The indexer's top-k (index_topk 2048 over 131072 = 128K keys; the tiny model's
8 over 512) and the router's (1 of 64 experts, 4 of 256 ...) meet that length, and the relu's exact
zeros make indexer ties common, so the selection must follow torch there too.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops
from paddleformers_glm.modeling.indexer import DSAIndexer
from paddleformers_glm.modeling.moe import TopkRouter

from ._tiny import score_indexer_by_position, tied_index_scores, tiny_config

torch = pytest.importorskip("torch", reason="the reference extra (torch) is not installed")


def _tied_rows(rows: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4, size=(rows, n)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_topk_breaks_ties_as_torch(k, extra):
    n = 64 * k + extra
    v = _tied_rows(64, n, seed=k)
    v[0, : n // 2] = -np.inf
    v[1, 3] = np.nan
    vals, idx = ops.topk(paddle.to_tensor(v), k)
    want_vals, want = torch.topk(torch.from_numpy(v), k, dim=-1)
    np.testing.assert_array_equal(idx.numpy(), want.numpy())
    np.testing.assert_array_equal(vals.numpy(), want_vals.numpy())


def test_indexer_breaks_ties_as_hf_at_a_sequence_of_64_topk():
    """The indexer's selection over S = 64 * index_topk keys, on scores full of exact ties, is HF's:
    torch.topk over the whole row after the additive causal mask (finfo.min). Before ops.topk:
    493 of the 505 rows with k visible keys selected another set."""
    cfg = tiny_config()
    ix = DSAIndexer(cfg)
    k = cfg.index_topk
    B, S = 1, 64 * k
    pos = score_indexer_by_position(ix, B, S)
    got = ix(paddle.zeros([B, S, cfg.hidden_size]), paddle.zeros([B, S, cfg.q_lora_rank]), None, None, None)
    full = torch.from_numpy(tied_index_scores(pos.reshape([S, 1]), pos.reshape([1, S])).numpy())
    causal = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)
    want = (full + causal).topk(k, dim=-1).indices.numpy()
    got = got.numpy()[0]
    rows = np.arange(k - 1, S)  # rows with k visible keys (HF also "selects" masked keys, we give -1)
    assert (got[: k - 1] >= -1).all()
    np.testing.assert_array_equal(np.sort(got[rows], -1), np.sort(want[rows], -1))  # the keys attended
    np.testing.assert_array_equal(got[rows], want[rows])  # and their order (the sums' order)


@pytest.mark.parametrize("grad", [True, False])
def test_router_breaks_ties_as_hf_with_64_experts_per_choice(grad):
    """top 1 of 64 experts (the compiled router without autograd, Paddle's ops with it) on scores
    full of exact ties: HF's router's choice (before: 63 of 64 tokens routed elsewhere, both forms)."""
    hf = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig as HFConfig

    H, E = 64, 64
    W = (np.random.default_rng(5).integers(0, 4, size=(H, E)) * 0.25).astype("float32")
    x = np.eye(H, dtype=np.float32)
    cfg = tiny_config(n_routed_experts=E, n_group=1, topk_group=1, num_experts_per_tok=1)
    router = TopkRouter(cfg)
    router.weight.set_value(paddle.to_tensor(W))
    hf_cfg = HFConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=1, n_group=1, topk_group=1)
    ref = hf.GlmMoeDsaTopkRouter(hf_cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(W.T.copy()))
        _, _, want = ref(torch.from_numpy(x))
    with paddle.set_grad_enabled(grad):
        _, _, got = router(paddle.to_tensor(x))
    np.testing.assert_array_equal(np.sort(got.numpy(), -1), np.sort(want.numpy(), -1))
