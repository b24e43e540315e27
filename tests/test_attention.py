"""Sparse attention over gathered keys equals the dense masked (HF-style) computation; memory is O(S x k)."""

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling.attention import dense_masked_attention, sparse_attention

from ._tiny import tiny_model, tokens


def _random_case(B=2, S=40, H=3, D=12, Dv=10, K=7, seed=0, empty_rows=0):
    rng = np.random.default_rng(seed)
    q = paddle.to_tensor(rng.standard_normal((B, S, H, D)).astype("float32"))
    k = paddle.to_tensor(rng.standard_normal((B, S, H, D)).astype("float32"))
    v = paddle.to_tensor(rng.standard_normal((B, S, H, Dv)).astype("float32"))
    idx = np.full((B, S, K), -1, dtype="int64")
    for b in range(B):
        for i in range(empty_rows, S):
            n = min(K, i + 1)
            idx[b, i, :n] = rng.choice(i + 1, size=n, replace=False)
    return q, k, v, paddle.to_tensor(idx)


@pytest.mark.parametrize("chunk", [1024, 7, 1])
def test_sparse_equals_dense_masked(chunk):
    q, k, v, idx = _random_case(empty_rows=3)
    dense = dense_masked_attention(q, k, v, idx, 0.3).numpy()
    sparse, _ = sparse_attention(q, k, v, idx, 0.3, chunk_size=chunk)
    np.testing.assert_allclose(sparse.numpy(), dense, atol=2e-6)


def test_empty_row_gets_mean_of_all_values_like_an_all_masked_softmax():
    q, k, v, idx = _random_case(empty_rows=2)
    out, _ = sparse_attention(q, k, v, idx, 0.3)
    np.testing.assert_allclose(out.numpy()[:, 0], v.numpy().mean(1), atol=1e-6)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), back as float32: numpy only."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_a_keyless_row_in_bf16_is_what_hfs_masked_softmax_gives():
    """HF's eager attention gives a query that sees no key (left padding) a fully masked softmax row:
    every weight 1/T rounded to the dtype, bf16(1/40) = 0.025024 here, then its matmul sums the values
    in fp32.  So in bf16 the output is bf16(bf16(1/T) x sum(v)), not the values' mean; the mean moved a
    left-padded row's logits by 0.8 and the loss from HF's 4.2360482 to 4.2244663 on a fuzzed model
    (T = 9).  Every form gives HF's value (fp32 keeps the mean, which equals it to rounding)."""
    from paddleformers_glm.modeling.attention_forms import dense_head_attention, sparse_latent_attention
    from paddleformers_glm.ops import cpu_bf16

    cpu_bf16.install()
    q, k, v, idx = _random_case(empty_rows=2)
    T = v.shape[1]
    vb = v.astype("bfloat16")
    v32 = _bf16(v.numpy())
    weight = _bf16(np.float32([1.0 / T]))[0]
    assert weight != np.float32(1.0 / T)  # 1/40 is not a bf16 number: the case tells the two apart
    want = _bf16((v32.astype(np.float64).sum(1) * weight).astype(np.float32))  # [B, H, Dv]
    for fn in (sparse_attention, dense_head_attention):
        out, _ = fn(q.astype("bfloat16"), k.astype("bfloat16"), vb, idx, 0.3)
        got = out.astype("float32").numpy()[:, 0]
        np.testing.assert_array_equal(got, want, err_msg=fn.__name__)
    kv = v[:, :, 0]  # [B, T, Dv]: the latent form's rows are keys and values at once
    out, _ = sparse_latent_attention(q[:, :, :, : kv.shape[-1]].astype("bfloat16"), kv.astype("bfloat16"), idx, 0.3)
    kv32 = _bf16(kv.numpy())
    want = _bf16((kv32.astype(np.float64).sum(1) * weight).astype(np.float32))  # [B, Dv]
    got = out.astype("float32").numpy()[:, 0]  # [B, H, Dv]: every head the same row
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


def test_probs_sum_to_one_over_valid_slots():
    q, k, v, idx = _random_case()
    _, probs = sparse_attention(q, k, v, idx, 0.3, return_probs=True)
    p = probs.numpy()
    assert p.shape == (2, 40, 7)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    assert np.all(p[idx.numpy() < 0] == 0)


def test_whole_model_sparse_equals_dense_reference_with_padding():
    model = tiny_model(seed=1)
    model.eval()
    ids = tokens(2, 32, seed=2)
    mask = np.ones((2, 32), dtype="int64")
    mask[0, -6:] = 0
    mask[1, :5] = 0
    mask = paddle.to_tensor(mask)
    a = model(ids, attention_mask=mask, labels=ids, compute_mtp=True)
    model.set_attn_implementation("reference")
    b = model(ids, attention_mask=mask, labels=ids, compute_mtp=True)
    np.testing.assert_allclose(a.logits.numpy(), b.logits.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.mtp_logits[0].numpy(), b.mtp_logits[0].numpy(), rtol=1e-5, atol=1e-5)


def test_sparse_path_memory_is_linear_in_sequence_length():
    """The gathered keys are [B, chunk, k, H, D]: no tensor of S x S elements is created."""
    B, S, H, D, K = 1, 512, 2, 8, 16
    q, k, v, idx = _random_case(B=B, S=S, H=H, D=D, Dv=D, K=K)
    seen = []
    orig = paddle.matmul

    def spy(x, y, *a, **kw):
        out = orig(x, y, *a, **kw)
        seen.append(int(np.prod(out.shape)))
        return out

    paddle.matmul = spy
    try:
        sparse_attention(q, k, v, idx, 0.3, chunk_size=64)
    finally:
        paddle.matmul = orig
    assert seen and max(seen) <= 64 * K * H * D
    assert max(seen) < S * S


@pytest.mark.parametrize("form", ["dense", "dense-chunked", "latent", "sparse"])
@pytest.mark.parametrize("trained", ["q_b_proj", "kv_b_proj"])
def test_backward_with_frozen_attention_inputs(form, trained, monkeypatch):
    """Training only some weights (LoRA adapters, PaddleFormers' LoRAModel or any `stop_gradient`
    freeze): the attention's queries or its keys/values then come from frozen weights only. Before,
    the dense and latent forms' backward returned a gradient for them anyway and Paddle refused it
    (ValueError "_DenseHeadAttention's backward function should return None at 1 position, because
    it's forward Tensor's stopgradient is true"); torch's autograd, which transformers' model trains
    on, takes any freeze. The trained weights' gradients equal those of the model with nothing frozen."""
    from paddleformers_glm.modeling import attention_forms

    if form == "dense-chunked":  # the query-chunked dense form, for scores beyond one block
        monkeypatch.setattr(attention_forms, "CHUNK_BYTES", 1024)
    ids = tokens(2, 16, seed=3)
    grads = []
    for freeze in (False, True):
        model = tiny_model(seed=1)
        model.set_attn_implementation(form.split("-")[0])
        model.train()
        for n, p in model.named_parameters():
            p.stop_gradient = freeze and trained not in n
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters() if trained in n and p.grad is not None})
    assert grads[0] and grads[1].keys() == grads[0].keys()
    for n, g in grads[0].items():
        np.testing.assert_allclose(grads[1][n], g, rtol=1e-6, atol=1e-9, err_msg=n)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads VmRSS (Linux)")
def test_a_forward_whose_graph_no_backward_walks_frees_it():
    """The attention PyLayers marked their probabilities output non-differentiable; in Paddle 3.3.1
    that keeps a PyLayer's saved state, and the whole forward graph it holds, alive whenever backward
    does not pass through it: an eval forward without ``paddle.no_grad()`` (as torch users score)
    grew 9.3 MB a forward on the tiny model, and the model-API training loop 2.8 MB a step (the MTP
    layer, which ``out.loss`` leaves out).  The probabilities are detached by the caller now: the
    memory after 40 such forwards is that after the first few (was about +370 MB)."""
    model = tiny_model(seed=1)
    model.eval()
    ids = tokens(2, 64, seed=2)
    for _ in range(5):  # warm-up: caches, allocator pools
        model(ids)
    before = _rss_mb()
    for _ in range(40):
        model(ids)
    grown = _rss_mb() - before
    assert grown < 60, f"{grown:.1f} MB more after 40 forwards"
