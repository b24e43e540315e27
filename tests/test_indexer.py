"""DSA indexer: scores and top-k against a brute-force numpy reference, chunking, masks, no-grad."""

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling.indexer import DSAIndexer
from paddleformers_glm.modeling.packing import Placement
from paddleformers_glm.modeling.rope import RotaryEmbedding

from ._tiny import tiny_config


def _setup(B=2, S=24, seed=0, **changes):
    cfg = tiny_config(**changes)
    rng = np.random.default_rng(seed)
    idx = DSAIndexer(cfg)
    for p in idx.parameters():
        p.set_value(
            paddle.to_tensor((rng.standard_normal(p.shape) * 0.5 + (1 if len(p.shape) == 1 else 0)).astype("float32"))
        )
    x = paddle.to_tensor(rng.standard_normal((B, S, cfg.hidden_size)).astype("float32"))
    ql = paddle.to_tensor(rng.standard_normal((B, S, cfg.q_lora_rank)).astype("float32"))
    cos, sin = RotaryEmbedding(cfg)(paddle.arange(S, dtype="int64").unsqueeze(0))
    return cfg, idx, x, ql, cos, sin


def _numpy_scores(cfg, idx, x, ql, cos, sin):
    """Independent numpy reference of HF transformers' indexer scores (interleaved rope on the first rope dims)."""
    x, ql, cos, sin = x.numpy(), ql.numpy(), cos.numpy(), sin.numpy()
    Hi, Di, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    W = {n: p.numpy() for n, p in idx.named_parameters()}
    B, S, _ = x.shape
    q = (ql @ W["wq_b.weight"]).reshape(B, S, Hi, Di)
    k = x @ W["wk.weight"]
    mu, var = k.mean(-1, keepdims=True), k.var(-1, keepdims=True)
    k = (k - mu) / np.sqrt(var + 1e-6) * W["k_norm.weight"] + W["k_norm.bias"]

    def rope(t):  # t [..., r], angle per pair = position * inv_freq
        a, b = t[..., 0::2], t[..., 1::2]
        c, s = (cos[:, :, None, :], sin[:, :, None, :]) if t.ndim == 4 else (cos, sin)
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    q = np.concatenate([rope(q[..., :r]), q[..., r:]], -1)
    k = np.concatenate([rope(k[..., :r]), k[..., r:]], -1)
    s = np.maximum(np.einsum("bshd,btd->bsht", q, k) * Di**-0.5, 0)
    w = (x @ W["weights_proj.weight"]) * Hi**-0.5
    return np.einsum("bsh,bsht->bst", w, s)


@pytest.mark.parametrize("chunk", [1024, 5])
def test_topk_matches_bruteforce(chunk):
    cfg, idx, x, ql, cos, sin = _setup(attention_chunk_size=chunk)
    ref = _numpy_scores(cfg, idx, x, ql, cos, sin)
    B, S, _ = ref.shape
    got = idx(x, ql, cos, sin, None).numpy()
    assert got.shape == (B, S, cfg.index_topk) and got.dtype == np.int64
    for b in range(B):
        for i in range(S):
            n_valid = i + 1
            row = got[b, i]
            chosen = set(row[row >= 0].tolist())
            assert len(chosen) == min(n_valid, cfg.index_topk)
            assert (row < 0).sum() == max(cfg.index_topk - n_valid, 0)
            expect = set(np.argsort(-ref[b, i, :n_valid], kind="stable")[: cfg.index_topk].tolist())
            assert chosen == expect, (b, i)


def test_padding_keys_never_selected_and_empty_rows_are_all_minus_one():
    cfg, idx, x, ql, cos, sin = _setup(S=20)
    pad = np.ones((2, 20), dtype="int64")
    pad[0, -4:] = 0  # right padding
    pad[1, :3] = 0  # left padding: rows 0..2 of batch 1 see no key at all
    got = idx(x, ql, cos, sin, paddle.to_tensor(pad)).numpy()
    for b in range(2):
        for i in range(20):
            chosen = got[b, i][got[b, i] >= 0]
            assert np.all(pad[b, chosen] == 1) and np.all(chosen <= i)
            assert len(chosen) == min(int(pad[b, : i + 1].sum()), cfg.index_topk)
    assert np.all(got[1, :3] == -1)


def test_topk_is_min_of_index_topk_and_seq_len():
    cfg, idx, x, ql, cos, sin = _setup(S=5)
    assert idx(x, ql, cos, sin, None).shape == [2, 5, 5]


def test_selection_sends_no_gradient():
    cfg, idx, x, ql, cos, sin = _setup()
    x.stop_gradient = False
    out = idx(x, ql, cos, sin, None)
    assert out.stop_gradient


def test_indexer_rope_interleave_flag_changes_selection():
    cfg, idx, x, ql, cos, sin = _setup(S=32, seed=3)
    a = idx(x, ql, cos, sin, None).numpy()
    idx.interleave = False
    b = idx(x, ql, cos, sin, None).numpy()
    assert not np.array_equal(np.sort(a, -1), np.sort(b, -1))


def test_indexer_kl_loss_trains_only_the_indexer():
    from ._tiny import tiny_model, tokens

    model = tiny_model(seed=11, indexer_loss_coeff=0.001)
    model.train()
    ids = tokens(2, 32, seed=6)
    out = model(ids, labels=ids, compute_mtp=False)
    assert out.indexer_loss is not None and float(out.indexer_loss) > 0
    out.indexer_loss.backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None and float(p.grad.abs().sum()) > 0}
    assert touched, "the KL loss must produce gradients"
    assert all(".core_attention.indexer." in n for n in touched), sorted(touched)[:5]
    full = model.config.full_layer_ids
    assert {int(n.split(".")[2]) for n in touched} == set(full)


def test_indexer_kl_loss_is_zero_when_indexer_matches_attention():
    """KL(p || q) with q == p is 0: feed the indexer's own distribution back as the target."""
    cfg, idx, x, ql, cos, sin = _setup(S=16)
    top = idx(x, ql, cos, sin, None)
    q, k, w = idx.project(x, ql, cos, sin)
    scores = idx.chunk_scores(q, k, w).numpy()
    sel = np.take_along_axis(scores, np.clip(top.numpy(), 0, None), -1)
    sel = np.where(top.numpy() >= 0, sel, -np.inf)
    p = np.exp(sel - sel.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    kl = idx.kl_loss(x, ql, cos, sin, top, paddle.to_tensor(p.astype("float32")))
    assert abs(float(kl)) < 1e-5
    kl2 = idx.kl_loss(
        x,
        ql,
        cos,
        sin,
        top,
        paddle.to_tensor(
            np.where(top.numpy() >= 0, 1.0, 0.0).astype("float32")
            / np.maximum((top.numpy() >= 0).sum(-1, keepdims=True), 1)
        ),
    )
    assert float(kl2) > 1e-3


@pytest.mark.parametrize("chunk", [1024, 5])
def test_unordered_selection_is_the_same_set(chunk):
    """ordered=False (the latent attention's request): same key set per query; the first k queries
    take all their keys without scoring, in ascending order."""
    cfg, idx, x, ql, cos, sin = _setup(attention_chunk_size=chunk)
    K = cfg.index_topk
    ordered = idx(x, ql, cos, sin, None).numpy()
    unordered = idx(x, ql, cos, sin, None, ordered=False).numpy()
    assert unordered.shape == ordered.shape
    np.testing.assert_array_equal(np.sort(unordered, -1), np.sort(ordered, -1))
    for i in range(K):
        np.testing.assert_array_equal(unordered[:, i], np.where(np.arange(K) <= i, np.arange(K), -1)[None].repeat(2, 0))
    assert not np.array_equal(unordered[:, :K], ordered[:, :K])  # the ordered rows really are score-sorted
    # with padding the shortcut does not apply: padded keys must stay out
    pad = paddle.to_tensor(np.r_[np.zeros(3), np.ones(x.shape[1] - 3)][None].repeat(2, 0).astype("int64"))
    np.testing.assert_array_equal(
        np.sort(idx(x, ql, cos, sin, pad, ordered=False).numpy(), -1), np.sort(idx(x, ql, cos, sin, pad).numpy(), -1)
    )


def test_kl_loss_rows_are_exact_for_scores_far_below_the_rows_max():
    """The indexer's KL(p || softmax(scores)) for a key scored 100 below its row's max: Paddle's CPU
    log_softmax clips x - max at -64, so the loss was 25.0 where torch's log_softmax (the torch
    reference's, parity/reference/indexer.py) gives 39.4 for scores [0, -100, -3], p [.5, .4, .1]
    (measured: torch 2.13). The expected values here are the float64 formula; the masked key
    (valid False) adds nothing."""
    from paddleformers_glm.modeling.indexer import _kl_rows

    scores = np.array([[[0.0, -100.0, -3.0, 7.0], [2.0, 1.0, -70.0, 0.0]]], dtype=np.float32)
    p = np.array([[[0.5, 0.4, 0.1, 0.0], [0.2, 0.3, 0.5, 0.0]]], dtype=np.float32)
    valid = np.array([[[True, True, True, False], [True, True, True, False]]])
    x = paddle.to_tensor(scores, stop_gradient=False)
    kl, rows = _kl_rows(x, paddle.to_tensor(p), paddle.to_tensor(valid))
    s = scores[..., :3].astype(np.float64)
    log_q = s - (s.max(-1, keepdims=True) + np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    q = p[..., :3].astype(np.float64)
    want = (q * (np.log(q) - log_q)).sum(-1)
    np.testing.assert_allclose(kl.numpy(), want, rtol=1e-6)
    assert rows.numpy().tolist() == [[1.0, 1.0]]
    kl.sum().backward()  # d KL / d scores = softmax(scores) - p on the valid keys, 0 on the masked one
    grad = np.concatenate([np.exp(log_q) - q, np.zeros((1, 2, 1))], -1)
    np.testing.assert_allclose(x.grad.numpy(), grad, atol=1e-6)


def _overflowing_inputs(S=12):
    """q, k, w whose index scores overflow float32 for keys 3 and 5 (+inf from query 5 on: the head
    sum of scores near 3e38; key 3 +inf for queries 3, 4 too) among finite scores 1..2 elsewhere."""
    cfg = tiny_config()
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    rng = np.random.default_rng(0)
    q = np.zeros((1, S, Hi, Di), "float32")
    q[..., 0] = 1.0
    k = np.zeros((1, S, Di), "float32")
    k[0, :, 0] = rng.uniform(1, 2, S)
    k[0, [3, 5], 0] = 3e38
    w = np.ones((1, S, Hi), "float32")
    return cfg, q, k, w


def test_a_key_whose_score_overflows_to_inf_is_selected_first():
    """HF's rule (transformers 5.23 GlmMoeDsaIndexer: relu(q.k * scale), the head-weighted sum,
    finfo.min above the diagonal, torch.topk) ranks a visible key whose score overflowed to +inf
    first (measured on these tensors: query 9 picks keys [0, 3, 4, 5, 6, 7, 8, 9]); the -inf fill is
    what marks an empty slot. Ours marked every infinite score empty and dropped the key with the
    highest score ([0, 4, 6, 7, 8, 9]), in the prefill, the packed and the decode paths."""
    cfg, q, k, w = _overflowing_inputs()
    S, K = q.shape[1], cfg.index_topk
    Di = cfg.index_head_dim
    with np.errstate(over="ignore"):
        hf = np.einsum("bh,bht->bt", w[0], np.maximum(np.einsum("shd,td->sht", q[0], k[0]) * Di**-0.5, 0))
    assert np.isposinf(hf[9, 3]) and np.isposinf(hf[9, 5])
    want = [set(np.argsort(-hf[i, : i + 1], kind="stable")[:K].tolist()) for i in range(S)]
    idx = DSAIndexer(cfg)
    P = paddle.to_tensor
    pad = paddle.ones([1, S], dtype="int64")
    packed = paddle.ones([1, S], dtype="int64")  # the sequence at offset 4 of a packed row of 20 tokens
    packed.placement = Placement(np.array([4]), np.array([S]), 20)
    decode = [
        idx.select(P(q[:, i : i + 1]), P(k), P(w[:, i : i + 1]), pad, slots=P([i]), n_filled=i + 1) for i in range(S)
    ]
    for name, got in (
        ("prefill", idx.select(P(q), P(k), P(w), None)[0].numpy()),
        ("prefill, padding mask", idx.select(P(q), P(k), P(w), pad)[0].numpy()),
        ("packed", idx.select(P(q), P(k), P(w), packed)[0].numpy()),
        ("decode", np.concatenate([d[0].numpy() for d in decode])),
    ):
        assert [set(r[r >= 0].tolist()) for r in got] == want, name
