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


def _official_ratio_model(tmp_path, index_topk: int):
    """A small model with the official width ratios (nope : rope : v : index_head_dim = 3 : 1 : 4 : 2)
    and 4 indexer heads, whose relu scores are exactly 0 on about 1 key in 16 (ties at the k-th slot
    are common), saved and loaded into HF transformers (eager, fp32)."""
    torch = pytest.importorskip("torch", reason="the reference extra (torch) is not installed")
    transformers = pytest.importorskip("transformers")
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    from ._tiny import randomize

    cfg = tiny_config(
        dtype="float32", num_hidden_layers=4, first_k_dense_replace=1, index_topk_pattern="FSFS",
        num_nextn_predict_layers=0, mlp_layer_types=["dense"] + ["sparse"] * 3, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=32, qk_head_dim=32, head_dim=24, q_lora_rank=64,
        index_head_dim=16, index_n_heads=4, index_topk=index_topk, moe_intermediate_size=16,
    )  # fmt: skip
    model = randomize(GlmMoeDsaForCausalLM(cfg), 0)
    model.eval()
    model.save_pretrained(tmp_path)
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, hf


@pytest.mark.reference
def test_decode_over_a_cache_with_spare_capacity_breaks_ties_as_hf_dynamic_cache(tmp_path):
    """A prompt of 5 tokens (one row left-padded by 3), then 43 tokens one by one, into a cache of
    capacity 78 (generate's: prompt + new tokens): the logits of every real position are HF's with
    its DynamicCache fed the same way. HF's indexer takes its top-k over the keys cached so far;
    std::nth_element picks among equal scores by the row's length, so a top-k over the whole
    capacity (-inf past the filled slots) chose other keys at tied k-th slots. Both paths: the
    model's forward over the cache and `decode_step` (generate's). Before the fix: 8 of 96
    positions off, by up to 0.68 in the logits (each path); after: <= 1e-5."""
    torch = pytest.importorskip("torch", reason="the reference extra (torch) is not installed")
    from transformers import DynamicCache

    from paddleformers_glm.modeling.cache import DSACache

    model, hf = _official_ratio_model(tmp_path, index_topk=16)
    B, P, total = 2, 5, 48
    ids = np.random.default_rng(9).integers(3, 256, size=(B, total))
    mask = np.ones((B, total), "int64")
    mask[1, :3] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)  # HF generate's positions; ours count real tokens alike
    splits = [P] + [1] * (total - P)
    hc, t, want = DynamicCache(config=hf.config), 0, []
    with torch.no_grad():
        for n in splits:
            sl = slice(t, t + n)
            o = hf(torch.tensor(ids[:, sl]), attention_mask=torch.tensor(mask[:, : t + n]),
                   position_ids=torch.tensor(pos[:, sl]), past_key_values=hc, use_cache=True)  # fmt: skip
            want.append(o.logits.numpy())
            t += n
    want = np.concatenate(want, 1)
    for path in ("forward", "decode_step"):
        cache, t, got = DSACache.for_config(model.config, B, capacity=total + 30), 0, []
        with paddle.no_grad():
            for n in splits:
                x = paddle.to_tensor(ids[:, t : t + n])
                if path == "forward" or t == 0:
                    m = paddle.to_tensor(mask[:, : t + n])
                    got.append(model(x, attention_mask=m, past_key_values=cache, use_cache=True).logits.numpy())
                else:  # generate's step
                    positions, _ = cache.begin(None, n)
                    got.append(model.decode_step(x, positions, cache.slots, cache).numpy()[:, None])
                    cache.advance(n)
                t += n
        err = np.abs(np.concatenate(got, 1) - want).max(-1)
        err[1, :3] = 0  # padding queries (they see no key)
        assert err.max() <= 1e-5, f"{path}: {int((err > 1e-4).sum())} positions off, max {err.max():.2g}"
