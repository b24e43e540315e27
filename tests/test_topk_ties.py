"""Exact ties in a top-k at a row length of exactly 64 k.

paddle.topk and torch.topk (HF's) on CPU run the same std::partial_sort or std::nth_element + sort
on (value, index) pairs, so they give equal values to the same index -- except where the row
length n is exactly 64 k: torch takes partial_sort when k * 64 <= n, Paddle only when k * 64 < n
(measured: on rows of values in {0, 1, 2, 3}, 784 to 800 of 800 rows chose another set at n = 64 k,
none at 64 k +- 1). The indexer's top-k (index_topk 2048 over 131072 = 128K keys; the tiny model's
8 over 512) and the router's (1 of 64 experts, 4 of 256 ...) meet that length, and the relu's exact
zeros make indexer ties common, so the selection must follow torch there too.

torch's indices are committed (tests/fixtures/topk_ties/torch_topk.json, tools/make_topk_reference.py),
so these run without torch; the indexer test compares with HF's scoring directly (reference tier).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops
from paddleformers_glm.modeling.indexer import DSAIndexer
from paddleformers_glm.modeling.moe import TopkRouter

from ._tiny import score_indexer_by_position, tied_index_scores, tiny_config

TORCH = json.loads((Path(__file__).parent / "fixtures" / "topk_ties" / "torch_topk.json").read_text())


def _same_input(a: np.ndarray, want_sha: str) -> None:
    got = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    assert got == want_sha, "numpy drew other inputs than tools/make_topk_reference.py did: regenerate the fixture"


def _tied_rows(k: int, extra: int) -> np.ndarray:
    """As tools/make_topk_reference.py: 64 rows of 64 k + extra values in {0..3}, row 0 half -inf, row 1 a NaN."""
    n = 64 * k + extra
    v = np.random.default_rng(k).integers(0, 4, size=(64, n)).astype(np.float32)
    v[0, : n // 2] = -np.inf
    v[1, 3] = np.nan
    return v


@pytest.mark.parametrize("case", TORCH["topk"], ids=lambda c: f"k{c['k']}_n64k{c['extra']:+d}")
def test_topk_breaks_ties_as_torch(case):
    """torch.topk's indices (and so its values) on tied rows, NaN largest; before ops.topk, 784 to
    800 of 800 rows chose another set at n = 64 k (none at 64 k +- 1)."""
    v = _tied_rows(case["k"], case["extra"])
    _same_input(v, case["input_sha256"])
    vals, idx = ops.topk(paddle.to_tensor(v), case["k"])
    want = np.array(case["indices"])
    np.testing.assert_array_equal(idx.numpy(), want)
    np.testing.assert_array_equal(vals.numpy(), np.take_along_axis(v, want, -1))


def test_indexer_breaks_ties_as_hf_at_a_sequence_of_64_topk():
    """The indexer's selection over S = 64 * index_topk keys, on scores full of exact ties, is HF's:
    torch.topk over the whole row after the additive causal mask (finfo.min). Before ops.topk:
    493 of the 505 rows with k visible keys selected another set."""
    torch = pytest.importorskip("torch", reason="the reference extra (torch) is not installed")
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
    full of exact ties: HF's router's choice, recorded in the fixture (before: 63 of 64 tokens
    routed elsewhere, both forms)."""
    H = E = 64
    W = (np.random.default_rng(5).integers(0, 4, size=(H, E)) * 0.25).astype("float32")
    _same_input(W, TORCH["router"]["weight_sha256"])
    cfg = tiny_config(n_routed_experts=E, n_group=1, topk_group=1, num_experts_per_tok=1)
    router = TopkRouter(cfg)
    router.weight.set_value(paddle.to_tensor(W))
    with paddle.set_grad_enabled(grad):
        _, _, got = router(paddle.to_tensor(np.eye(H, dtype=np.float32)))
    np.testing.assert_array_equal(got.numpy(), np.array(TORCH["router"]["choice"]))
