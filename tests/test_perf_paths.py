"""The fast attention and MoE forms compute the same model as the reference forms.

* the latent (MQA) sparse attention equals the per-head sparse attention and the dense masked
  reference (outputs, padding rows, probabilities, gradients), also through the whole model;
* `attn_implementation="auto"` picks the per-head form (the association the HF fixtures pin)
  for small problems and the latent form for large ones;
* the MoE batched (`grouped`) form equals the per-expert loop;
* the indexer's chunking and the top-k selection cache change nothing.
"""

import contextlib

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling import attention_forms as attn
from paddleformers_glm.modeling.attention_forms import choose_form, dense_masked_attention, sparse_latent_attention
from paddleformers_glm.modeling.moe import MoE
from paddleformers_glm.ops import kernels as cpu_kernels

from ._tiny import tiny_config, tiny_model, tokens
from .test_attention import _random_case


def _latent_case(B=2, S=40, H=3, D=12, K=7, seed=0, empty_rows=0):
    rng = np.random.default_rng(seed)
    q = paddle.to_tensor(rng.standard_normal((B, S, H, D)).astype("float32"))
    kv = paddle.to_tensor(rng.standard_normal((B, S, D)).astype("float32"))
    idx = np.full((B, S, K), -1, dtype="int64")
    for b in range(B):
        for i in range(empty_rows, S):
            n = min(K, i + 1)
            idx[b, i, :n] = rng.choice(i + 1, size=n, replace=False)
    return q, kv, paddle.to_tensor(idx)


@pytest.fixture(params=["gather", "dense", "mixed"])
def chunk_mode(request, monkeypatch):
    """Every query chunk gathered, every chunk dense (GEMM against all its keys), or the default mix."""
    ratio = {"gather": 0.0, "dense": 1e9, "mixed": attn._DENSE_KEYS_PER_SLOT}[request.param]
    monkeypatch.setattr(attn, "_DENSE_KEYS_PER_SLOT", ratio)
    return request.param


@pytest.mark.parametrize("chunk", [1024, 7, 1])
def test_latent_sparse_equals_dense_masked_with_empty_rows(chunk, chunk_mode):
    q, kv, idx = _latent_case(empty_rows=3)
    B, S, H, D = q.shape
    kh = kv.unsqueeze(2).expand([B, S, H, D])
    dense = dense_masked_attention(q, kh, kh, idx, 0.3).numpy()
    out, _ = sparse_latent_attention(q, kv, idx, 0.3, chunk_size=chunk)
    np.testing.assert_allclose(out.numpy(), dense, atol=2e-6)
    np.testing.assert_allclose(out.numpy()[:, 0], np.broadcast_to(kv.numpy().mean(1)[:, None], (B, H, D)), atol=1e-6)


@pytest.mark.parametrize("save", [True, False])
def test_latent_sparse_gradients_equal_dense_masked(save, chunk_mode, monkeypatch):
    """Both backward modes (saved gather / recomputed gather) give the dense reference's gradients.

    (Rows with no key at all are left out: their output is a constant, the mean of the values, so
    their true gradient w.r.t. q is 0, which is what we give; the additive-mask reference yields a
    formal non-zero one through `scores + finfo.min`.)
    """
    monkeypatch.setattr(attn, "SAVE_ELEMS", 1 << 30 if save else 0)
    q, kv, idx = _latent_case(empty_rows=0)
    B, S, H, D = q.shape
    g = paddle.to_tensor(np.random.default_rng(5).standard_normal((B, S, H, D)).astype("float32"))
    grads = []
    for fn in ("sparse", "dense"):
        qq, kk = q.detach(), kv.detach()
        qq.stop_gradient = kk.stop_gradient = False
        if fn == "sparse":
            out, _ = sparse_latent_attention(qq, kk, idx, 0.3, chunk_size=9)
        else:
            kh = kk.unsqueeze(2).expand([B, S, H, D])
            out = dense_masked_attention(qq, kh, kh, idx, 0.3)
        (out * g).sum().backward()
        grads.append((qq.grad.numpy(), kk.grad.numpy()))
    np.testing.assert_allclose(grads[0][0], grads[1][0], atol=2e-5)
    np.testing.assert_allclose(grads[0][1], grads[1][1], atol=2e-5)


def test_latent_probs_sum_to_one_over_valid_slots(chunk_mode):
    q, kv, idx = _latent_case()
    _, probs = sparse_latent_attention(q, kv, idx, 0.3, chunk_size=11, return_probs=True)
    p = probs.numpy()
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    assert np.all(p[idx.numpy() < 0] == 0)


def _forward_backward(model, ids, mask, form):
    model.set_attn_implementation(form)
    model.clear_gradients()
    out = model(ids, attention_mask=mask, labels=ids, compute_mtp=True)
    (out.loss + out.mtp_loss).backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.numpy(), out.mtp_logits[0].numpy(), grads


def test_whole_model_latent_equals_per_head_with_padding(chunk_mode):
    model = tiny_model(seed=1)
    ids = tokens(2, 32, seed=2)
    mask = np.ones((2, 32), dtype="int64")
    mask[0, -6:] = 0
    mask[1, :5] = 0
    mask = paddle.to_tensor(mask)
    lat = _forward_backward(model, ids, mask, "latent")
    ref = _forward_backward(model, ids, mask, "sparse")
    np.testing.assert_allclose(lat[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lat[1], ref[1], rtol=1e-5, atol=1e-5)
    assert lat[2].keys() == ref[2].keys()
    for name in ref[2]:
        scale = max(1.0, float(np.abs(ref[2][name]).max()))
        np.testing.assert_allclose(lat[2][name], ref[2][name], atol=2e-5 * scale, err_msg=name)


def test_indexer_kl_loss_works_on_the_latent_path():
    model = tiny_model(seed=3, indexer_loss_coeff=0.5, attn_implementation="latent")
    model.train()
    out = model(tokens(1, 24, seed=4), labels=tokens(1, 24, seed=4), add_mtp_loss=True)
    assert out.indexer_loss is not None and np.isfinite(float(out.indexer_loss))
    out.loss.backward()


# q_lora, kv_lora, nope, rope, v of bench/bench_train_step.py's model and of the official config
BENCH_WIDTHS = (128, 64, 32, 16, 32)
OFFICIAL_WIDTHS = (2048, 512, 192, 64, 256)


def test_auto_form_is_per_head_for_fixture_sizes_and_latent_for_long_sequences():
    assert tiny_config().attn_implementation == "auto"
    fixture = attn.AttentionShape(2, 32, 8, 4, 48, 32, 32, 16, 32)
    assert choose_form("auto", fixture) == "sparse"  # the parity fixtures run the per-head form
    assert choose_form("auto", attn.AttentionShape(1, 8192, 64, 16, *BENCH_WIDTHS)) == "latent"


def test_form_by_cost_dense_near_the_top_k_latent_when_it_is_a_small_share():
    """At the official widths the per-head dense form (query chunks, no gather) costs about half
    the latent form's work while the top-k (2048) is close to the sequence (the latent form's
    rows are 576 wide and read twice by each of 64 heads: 2.25x the per-head 512 per key), and
    the latent form wins once k / S is small enough; `auto` takes the cheaper."""
    for S, want in ((2304, "dense"), (4096, "dense"), (8192, "dense"), (32768, "latent")):
        shape = attn.AttentionShape(1, S, 2048, 64, *OFFICIAL_WIDTHS)
        costs = attn.form_costs(shape)
        assert choose_form("auto", shape) == want == min(costs, key=costs.get), (S, costs)
    near_k = attn.form_costs(attn.AttentionShape(1, 2304, 2048, 64, *OFFICIAL_WIDTHS))
    assert near_k["latent"] > 1.5 * near_k["dense"] and near_k["sparse"] > near_k["latent"]
    for form in ("reference", "dense", "sparse", "latent"):  # a set form wins over the sizes
        assert choose_form(form, attn.AttentionShape(1, 2304, 2048, 64, *OFFICIAL_WIDTHS)) == form


def test_chunks_stay_within_the_byte_budget_at_any_width_and_length():
    """Every chunked form sizes its chunks from `CHUNK_BYTES`, down to one query row: the latent
    form's gathered [rows, k, 576] rows and dense-chunk scores, the per-head dense form's
    [heads, rows, keys] scores stay within it at the official widths up to S = 131072 (a floor of
    16 rows would gather 75 MB per latent chunk), the indexer's [rows, Hi, keys] scores up to
    S = 65536 (one row of its 32 heads' scores over all keys is the floor)."""
    from paddleformers_glm.modeling.indexer import DSAIndexer

    budget = attn.CHUNK_BYTES
    indexer = DSAIndexer(tiny_config(index_n_heads=32, index_head_dim=128, q_lora_rank=64))
    for S in (2304, 8192, 131072):
        for ch in attn._plan(1, S, 64, 576, 2048, 1024):
            if ch.dense:
                assert (ch.r1 - ch.r0) * 64 * (ch.c1 + 1) * 4 <= 2 * budget
            else:
                assert (ch.r1 - ch.r0) * 2048 * 576 * 4 <= budget
        for _b, r0, r1, groups in attn._dense_plan(1, S, 64):
            assert (r1 - r0) * max(h1 - h0 for h0, h1 in groups) * r1 * 4 <= budget
        if S <= 65536:
            assert indexer.chunk_rows(S, S) * 32 * S * 4 <= budget


def recall_rows_of(shapes: list, heads: int, keys: int) -> list[int]:
    """The query rows of the recall's [B, rows, H, keys] score tensors among ``shapes``."""
    return [sh[1] for sh in shapes if len(sh) == 4 and list(sh[2:]) == [heads, keys]]


def test_sparse_stage_recall_scores_within_the_byte_budget(monkeypatch):
    """The sparse stage's recall scores each query's dense attention (it attends over the top-k
    only): [B, rows, heads, keys] fp32 per chunk of queries.  Its chunks were ``attention_chunk_size``
    rows (1024) at any length, B x 1024 x H x S x 4 bytes (measured exactly: 4 MiB at S 512 with 4
    heads; at the official 16 heads per TP4 rank, 0.25 GiB at 4K tokens and 8 GiB at 128K, several
    alive per chunk), past the budget every other chunked path keeps.  They are now within
    `CHUNK_BYTES` down to 16 rows, and the recall is the same whatever the chunks.  Its latent queries
    [B, rows, H, 576] are made per chunk too: they were made for the whole sequence and kept, one
    fp32 copy per indexer layer until the forward ended (4.5 GiB a layer at TP4 and 128K tokens)."""
    from paddleformers_glm.modeling import attention as attention_module

    S = 256
    ids = tokens(1, S, seed=2)
    spied, seen, recalls = paddle.nn.functional.softmax, [], []
    roped, queries, in_terms = attention_module.rope_concat, [], []

    def spy(x, *a, **k):
        seen.append(x.shape)
        return spied(x, *a, **k)

    def rope_spy(a, *rest, **k):
        if in_terms and a.ndim == 4:  # [B, rows, H, L]: the recall's latent queries
            queries.append(a.shape[1])
        return roped(a, *rest, **k)

    for budget in (attn.CHUNK_BYTES, 16 * 4 * S * 4):  # the default; 16 rows of 4 heads over 256 keys
        monkeypatch.setattr(attn, "CHUNK_BYTES", budget)
        model = tiny_model(seed=1)
        model.set_indexer_training("sparse", loss_coeff=0.01)
        model.train()
        H = model.config.num_attention_heads
        seen.clear()
        queries.clear()
        end = model.model.end_forward

        def terms(*a, _end=end, **k):  # the indexer's terms (KL, recall) of the forward's records
            in_terms.append(1)
            try:
                return _end(*a, **k)
            finally:
                in_terms.clear()

        with monkeypatch.context() as m:
            m.setattr(paddle.nn.functional, "softmax", spy)
            m.setattr(attention_module, "rope_concat", rope_spy)
            m.setattr(model.model, "end_forward", terms)
            out = model(ids, labels=ids)
        assert queries and max(queries) == max(recall_rows_of(seen, H, S)), queries
        recall_rows = recall_rows_of(seen, H, S)
        assert recall_rows and max(recall_rows) * H * S * 4 <= max(budget, 16 * H * S * 4), (budget, recall_rows)
        recalls.append(float(out.indexer_recall))
    assert max(recall_rows) == 16
    assert recalls[0] == pytest.approx(recalls[1], abs=1e-6)


def test_moe_grouped_equals_loop():
    cfg = tiny_config()
    rng = np.random.default_rng(2)
    sorted_moe, padded_moe = MoE(cfg, routed_form="sorted"), MoE(cfg, routed_form="padded")
    for p in sorted_moe.parameters():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.3).astype("float32")))
    padded_moe.set_state_dict(sorted_moe.state_dict())
    x = paddle.to_tensor(rng.standard_normal((3, 37, cfg.hidden_size)).astype("float32"))
    g = paddle.to_tensor(rng.standard_normal((3, 37, cfg.hidden_size)).astype("float32"))
    results = []
    for moe in (sorted_moe, padded_moe):
        xx = x.detach()
        xx.stop_gradient = False
        moe.clear_gradients()
        y = moe(xx)
        (y * g).sum().backward()
        results.append((y.numpy(), xx.grad.numpy(), moe.expert(3).up_gate_proj.weight.grad.numpy()))
    for a, b in zip(results[0], results[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def _moe_run(moe, x, g):
    xx = x.detach()
    xx.stop_gradient = False
    moe.clear_gradients()
    y = moe(xx)
    (y * g).sum().backward()
    grads = {
        n: (p.grad.numpy() if p.grad is not None else np.zeros(p.shape, "float32")) for n, p in moe.named_parameters()
    }
    return y.numpy(), xx.grad.numpy(), grads


def test_moe_grouped_kernel_equals_expert_loop():
    """The compiled grouped matmul (all experts in one op per direction) against the per-expert
    loop (kernels off): outputs, input gradient and every parameter's gradient, an expert that
    gets no token included (the loop leaves its gradient empty, the kernel writes zeros)."""
    from paddleformers_glm.ops import kernels as cpu_kernels

    ops = cpu_kernels.cpu_ops()
    if ops is None or not hasattr(ops, "glm_grouped_matmul"):
        pytest.fail(f"the grouped matmul kernel is not built: {cpu_kernels._state['error']}")
    cfg = tiny_config()
    moe = MoE(cfg)
    rng = np.random.default_rng(4)
    for p in moe.parameters():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.3).astype("float32")))
    bias = np.zeros(cfg.n_routed_experts, "float32")
    bias[1] = -100.0  # expert 1 is never chosen
    moe.gate.e_score_correction_bias.set_value(paddle.to_tensor(bias))
    x = paddle.to_tensor(rng.standard_normal((2, 45, cfg.hidden_size)).astype("float32"))
    g = paddle.to_tensor(rng.standard_normal((2, 45, cfg.hidden_size)).astype("float32"))
    with cpu_kernels.disabled():
        loop = _moe_run(moe, x, g)
    fused = _moe_run(moe, x, g)
    assert not np.any(loop[2]["experts.1.up_gate_proj.weight"]) and not np.any(fused[2]["experts.1.down_proj.weight"])
    # the kernel path applies the routing weight before the down projection: fp32 rounding apart
    np.testing.assert_allclose(fused[0], loop[0], rtol=1e-5, atol=1e-6 * float(np.abs(loop[0]).max()))
    np.testing.assert_allclose(fused[1], loop[1], rtol=1e-5, atol=1e-6 * float(np.abs(loop[1]).max()))
    assert fused[2].keys() == loop[2].keys()
    for name in loop[2]:
        ref = loop[2][name]
        np.testing.assert_allclose(
            fused[2][name], ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())), err_msg=name
        )


@pytest.mark.parametrize("chunk", [3, 1024])
def test_indexer_chunking_does_not_change_the_selection(chunk):
    model = tiny_model(seed=5)
    layer = model.model.decoder_layers[0].self_attn
    ids = tokens(2, 29, seed=6)
    x = model.model.embedding(ids)
    cos, sin = model.model.rope(ids, None)
    ql = layer.q_a_layernorm(layer.q_a_proj(x))
    indexer = layer.core_attention.indexer
    ref = indexer(x, ql, cos, sin, None).numpy()
    indexer.chunk_size = chunk
    got = indexer(x, ql, cos, sin, None).numpy()
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(ref, -1))


@pytest.mark.parametrize("kernels", [False, True], ids=["paddle-ops", "cpu-kernels"])
@pytest.mark.parametrize("shape", [(2, 9, 32), (5, 48)])
def test_fused_rms_norm_equals_the_op_by_op_form(shape, kernels):
    """RMSNorm.forward (one PyLayer, hand-written backward) against RMSNorm.reference (autograd
    through each op, HF's formula): with Paddle's ops the forward is bitwise the reference; the
    fused CPU kernel (mean of squares in fp64) is within 4 ulps of it; gradients of input and
    weight to rounding either way."""
    from paddleformers_glm.modeling.norms import RMSNorm
    from paddleformers_glm.ops import kernels as cpu_kernels

    if kernels and cpu_kernels.cpu_ops() is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels._state['error']}")

    rng = np.random.default_rng(8)
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.set_value(paddle.to_tensor((1 + 0.3 * rng.standard_normal(shape[-1])).astype("float32")))
    x0 = (3 * rng.standard_normal(shape)).astype("float32")
    g = paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
    res = []
    for fn in (norm.forward, norm.reference):
        x = paddle.to_tensor(x0)
        x.stop_gradient = False
        norm.weight.clear_gradient()
        with contextlib.nullcontext() if kernels else cpu_kernels.disabled():
            y = fn(x)
            (y * g).sum().backward()
        res.append((y.numpy(), x.grad.numpy(), norm.weight.grad.numpy()))
    if kernels:
        np.testing.assert_array_max_ulp(res[0][0], res[1][0], maxulp=4)
    else:
        np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res[0][2], res[1][2], rtol=1e-5, atol=1e-5)


def test_fused_rms_norm_keeps_bf16_dtypes():
    """bf16 activations and weight (the GPU training dtype): output and gradients stay bf16; the
    statistics run in fp32 (on a CPU build the bf16 kernels Paddle lacks come from ops/cpu_bf16)."""
    from paddleformers_glm.modeling.norms import RMSNorm
    from paddleformers_glm.ops import cpu_bf16

    cpu_bf16.install()
    norm = RMSNorm(16)
    norm.to(dtype="bfloat16")
    x = paddle.to_tensor(np.random.default_rng(3).standard_normal((4, 16)).astype("float32")).astype("bfloat16")
    x.stop_gradient = False
    y = norm(x)
    y.astype("float32").sum().backward()
    assert y.dtype == paddle.bfloat16 and x.grad.dtype == paddle.bfloat16 and norm.weight.grad.dtype == paddle.bfloat16
    ref = norm.reference(x.detach()).astype("float32").numpy()
    np.testing.assert_array_equal(y.astype("float32").numpy(), ref)


def test_rope_heads_equals_apply_rope_bitwise():
    from paddleformers_glm.modeling.rope import apply_rope, rope_heads

    rng = np.random.default_rng(9)
    x = paddle.to_tensor(rng.standard_normal((2, 7, 3, 16)).astype("float32"))
    cos = paddle.to_tensor(rng.standard_normal((2, 7, 8)).astype("float32"))
    sin = paddle.to_tensor(rng.standard_normal((2, 7, 8)).astype("float32"))
    for interleave in (True, False):
        np.testing.assert_array_equal(
            rope_heads(x, cos, sin, interleave).numpy(), apply_rope(x, cos, sin, interleave).numpy()
        )


def test_prepared_topk_is_cached_per_tensor_and_not_shared_across_tensors():
    _, _, idx = _latent_case(empty_rows=1)
    cache = attn.SelectionCache()
    a = attn.prepare_topk(idx, cache)
    assert attn.prepare_topk(idx, cache) is a
    assert attn.prepare_topk(idx) is not a  # no cache: built afresh
    other = paddle.to_tensor(idx.numpy())
    b = attn.prepare_topk(other, cache)
    assert b is not a
    np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    cache.release()
    assert attn.prepare_topk(other, cache) is not b


def test_model_releases_the_selection_cache_after_each_forward():
    """Layers share the model's cache while the forward runs; nothing of the top-k (nor its
    S x S dense mask) stays alive after it."""
    model = tiny_model(seed=1, attn_implementation="dense")
    shared = model.model.selections
    attns = [layer.self_attn for layer in model.model.decoder_layers]
    attns += [m.transformer_layer.self_attn for m in model.model.mtp_layers]
    assert all(a.selections is shared for a in attns)
    seen = []
    store = shared.store

    def spy(topk, name, value):
        seen.append(name)
        store(topk, name, value)

    shared.store = spy
    model(tokens(1, 16, seed=2), labels=tokens(1, 16, seed=2))
    assert "dense_mask" in seen  # the dense form cached its mask during the forward
    assert shared._key is None and shared._forms == {}


def test_attn_implementation_is_validated_and_saved_only_when_set(tmp_path):
    with pytest.raises(ValueError, match="attn_implementation"):
        tiny_config(attn_implementation="flash")
    with pytest.raises(ValueError, match="attn_implementation"):
        tiny_model().set_attn_implementation("flash_attention_2")  # eager, sdpa: test_model_api
    assert "attn_implementation" not in tiny_config().to_dict()
    assert tiny_config(attn_implementation="latent").to_dict()["attn_implementation"] == "latent"
    assert attn.FORMS == ("auto", "reference", "dense", "sparse", "latent")


# ------------------------------------------------------------------ per-head dense form
def _per_head_case(empty_rows=0):
    return _random_case(B=2, S=24, H=3, D=10, Dv=6, K=9, seed=11, empty_rows=empty_rows)


@pytest.fixture(params=["whole", "chunked", "chunked_ops"])
def dense_blocks(request, monkeypatch):
    """The per-head dense form as one block, or in query chunks of 10 rows and one head per tile
    (a budget of 1 KB), with the compiled tile kernels or their Paddle-op forms."""
    if request.param != "whole":
        monkeypatch.setattr(attn, "CHUNK_BYTES", 1024)
        assert len(attn._dense_plan(2, 24, 3)) == 6 and attn._dense_plan(2, 24, 3)[0][3] == [(0, 1), (1, 2), (2, 3)]
    with cpu_kernels.disabled() if request.param == "chunked_ops" else contextlib.nullcontext():
        yield request.param


def test_dense_head_equals_dense_masked_and_per_head_sparse_with_empty_rows(dense_blocks):
    """Outputs (queries without any key included: the mean of all values, as HF eager) and the
    head-averaged probabilities at the selected slots (0 on empty slots)."""
    from paddleformers_glm.modeling.attention import dense_head_attention, sparse_attention

    q, k, v, idx = _per_head_case(empty_rows=3)
    ref = dense_masked_attention(q, k, v, idx, 0.3).numpy()
    out, probs = dense_head_attention(q, k, v, idx, 0.3, return_probs=True)
    sparse, sparse_probs = sparse_attention(q, k, v, idx, 0.3, return_probs=True)
    np.testing.assert_allclose(out.numpy(), ref, atol=2e-6)
    np.testing.assert_allclose(out.numpy(), sparse.numpy(), atol=2e-6)
    np.testing.assert_allclose(out.numpy()[:, 0], v.numpy().mean(1), atol=1e-6)  # row 0 has no key
    np.testing.assert_allclose(probs.numpy(), sparse_probs.numpy(), atol=1e-6)
    assert np.all(probs.numpy()[idx.numpy() < 0] == 0)


def test_bf16_forms_give_the_kl_target_as_the_fp32_softmax():
    """The head-averaged probabilities the indexer's KL takes as its target are the fp32 softmax in
    every form (docs/indexer.md): rounded to bf16 a row sums to 1 +- 1e-3, more than the KL itself
    (2e-4 on the tiny model), which then went negative in bf16 training.  Measured before: the sparse
    form's rows were off 1 by up to 1.5e-3 here (1e-6 now), the dense form's by 9.5e-8."""
    from paddleformers_glm.modeling.attention import dense_head_attention, sparse_attention
    from paddleformers_glm.modeling.attention_forms import sparse_latent_attention
    from paddleformers_glm.ops import cpu_bf16

    cpu_bf16.install()
    rng = np.random.default_rng(0)
    B, S, H, D, K = 1, 64, 4, 32, 16
    q, k, v = (paddle.to_tensor(rng.standard_normal((B, S, H, D)).astype("float32")).astype("bfloat16") for _ in "qkv")
    idx = np.full((B, S, K), -1, np.int64)
    for i in range(S):  # each query's K most recent keys
        sel = list(range(max(0, i - K + 1), i + 1))
        idx[0, i, : len(sel)] = sel
    topk = paddle.to_tensor(idx)
    _, sparse = sparse_attention(q, k, v, topk, D**-0.5, return_probs=True)
    _, dense = dense_head_attention(q, k, v, topk, D**-0.5, return_probs=True)
    # the latent form (one key/value row for every head; chunk 1024: gathered chunks only, chunk 8: dense ones too)
    latent = [
        sparse_latent_attention(q, k[:, :, 0], topk, D**-0.5, chunk_size=c, return_probs=True)[1] for c in (1024, 8)
    ]
    for probs in (sparse, dense, *latent):
        assert probs.dtype == paddle.float32
        assert np.abs(probs.numpy().astype(np.float64).sum(-1) - 1).max() < 1e-6
    np.testing.assert_allclose(sparse.numpy(), dense.numpy(), atol=1e-6)


def test_dense_head_gradients_equal_per_head_sparse_with_empty_rows(dense_blocks):
    """Queries without keys output the mean of the values: no score gradient (q, k) from them, v
    still gets g / S (the sparse forms' true gradient; the additive-mask reference would give a
    formal non-zero q gradient through `scores + finfo.min`)."""
    from paddleformers_glm.modeling.attention import dense_head_attention, sparse_attention

    q, k, v, idx = _per_head_case(empty_rows=3)
    g = paddle.to_tensor(np.random.default_rng(5).standard_normal(v.shape).astype("float32"))
    grads = []
    for fn in (dense_head_attention, sparse_attention):
        qq, kk, vv = q.detach(), k.detach(), v.detach()
        qq.stop_gradient = kk.stop_gradient = vv.stop_gradient = False
        out, _ = fn(qq, kk, vv, idx, 0.3)
        (out * g).sum().backward()
        grads.append([t.grad.numpy() for t in (qq, kk, vv)])
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_dense_form_is_picked_for_short_sequences_within_budget():
    def auto(B, S, K, H, widths=BENCH_WIDTHS):
        return choose_form("auto", attn.AttentionShape(B, S, K, H, *widths))

    assert auto(1, 64, 64, 16) == auto(1, 256, 128, 16) == "dense"  # S <= 2 x top-k
    assert auto(1, 2048, 64, 16) == "latent"  # the selection is a small share: gather it
    assert auto(2, 32, 8, 4, (48, 32, 32, 16, 32)) == "sparse"  # the parity fixtures keep the per-head sparse form
    for form in ("reference", "dense", "sparse", "latent"):  # a set form wins over the sizes
        assert choose_form(form, attn.AttentionShape(1, 64, 64, 16, *BENCH_WIDTHS)) == form
        assert choose_form(form, attn.AttentionShape(2, 32, 8, 4, 48, 32, 32, 16, 32)) == form


def test_whole_model_dense_head_equals_per_head_sparse_with_padding():
    """The dense form against the per-head sparse form the HF fixtures pin, through the model with
    left and right padding, MTP, the indexer's KL loss and backward."""
    model = tiny_model(seed=1, indexer_loss_coeff=0.5)
    ids = tokens(2, 32, seed=2)
    mask = np.ones((2, 32), dtype="int64")
    mask[0, -6:] = 0
    mask[1, :5] = 0
    mask = paddle.to_tensor(mask)
    results = []
    for form in ("dense", "sparse"):
        model.set_attn_implementation(form)
        model.clear_gradients()
        model.train()
        out = model(ids, attention_mask=mask, labels=ids, compute_mtp=True)
        assert out.indexer_loss is not None
        (out.loss + out.mtp_loss + out.indexer_loss).backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.numpy(), out.mtp_logits[0].numpy(), float(out.indexer_loss), grads))
    dense, ref = results
    np.testing.assert_allclose(dense[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense[1], ref[1], rtol=1e-5, atol=1e-5)
    assert abs(dense[2] - ref[2]) <= 1e-5
    assert dense[3].keys() == ref[3].keys()
    for name in ref[3]:
        scale = max(1.0, float(np.abs(ref[3][name]).max()))
        np.testing.assert_allclose(dense[3][name], ref[3][name], atol=2e-5 * scale, err_msg=name)
