"""MTP: token alignment, the shared lm_head, index sharing, and the loss wiring."""

import numpy as np
import paddle

from paddleformers_glm.modeling import causal_lm_loss

from ._tiny import tiny_model, tokens


def test_mtp_depth_one_predicts_token_i_plus_two():
    model = tiny_model(seed=7)
    model.eval()
    ids = tokens(2, 16, seed=1)
    out = model(ids, labels=ids)
    logits = out.mtp_logits[0].numpy().astype(np.float64)
    lp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    tgt = ids.numpy()[:, 2:]
    nll = -np.take_along_axis(lp[:, :-2], tgt[..., None], -1)[..., 0]
    assert abs(float(out.mtp_loss) - nll.mean()) < 1e-5
    assert float(causal_lm_loss(out.mtp_logits[0], ids, shift=2)) == float(out.mtp_loss)


def test_mtp_is_causal_in_the_future_token():
    """Position i of depth 1 sees tokens <= i+1 only: changing token j changes nothing before j-1."""
    model = tiny_model(seed=7)
    model.eval()
    ids = tokens(1, 16, seed=2)
    a = model(ids, compute_mtp=True).mtp_logits[0].numpy()
    ids2 = ids.numpy().copy()
    ids2[0, 10] = (ids2[0, 10] + 1) % 256
    b = model(paddle.to_tensor(ids2), compute_mtp=True).mtp_logits[0].numpy()
    assert np.allclose(a[0, :9], b[0, :9], atol=1e-5)
    assert not np.allclose(a[0, 9], b[0, 9], atol=1e-4)


def _perturb_mtp_indexer(model):
    idx = model.model.mtp_layers[0].transformer_layer.self_attn.core_attention.indexer
    w = idx.wq_b.weight
    w.set_value(paddle.to_tensor(np.random.default_rng(0).standard_normal(w.shape).astype("float32")))


def test_index_share_for_mtp_iteration_uses_main_topk():
    model = tiny_model(seed=8, index_share_for_mtp_iteration=True)
    model.eval()
    ids = tokens(1, 32, seed=3)
    a = model(ids, compute_mtp=True).mtp_logits[0].numpy()
    _perturb_mtp_indexer(model)  # unused when sharing
    b = model(ids, compute_mtp=True).mtp_logits[0].numpy()
    assert np.array_equal(a, b)


def test_without_index_sharing_mtp_runs_its_own_indexer():
    model = tiny_model(seed=8, index_share_for_mtp_iteration=False)
    model.eval()
    ids = tokens(1, 32, seed=3)
    a = model(ids, compute_mtp=True).mtp_logits[0].numpy()
    _perturb_mtp_indexer(model)
    b = model(ids, compute_mtp=True).mtp_logits[0].numpy()
    assert not np.allclose(a, b, atol=1e-5)


def test_mtp_loss_is_reported_apart_unless_asked():
    model = tiny_model(seed=9)
    ids = tokens(2, 16, seed=4)
    plain = model(ids, labels=ids)
    added = model(ids, labels=ids, add_mtp_loss=True)
    assert plain.mtp_loss is not None
    expect = float(plain.loss) + 0.1 * float(plain.mtp_loss)
    assert abs(float(added.loss) - expect) < 1e-5 and abs(float(plain.loss) - expect) > 1e-3


def test_two_mtp_depths_chain():
    model = tiny_model(seed=10, num_nextn_predict_layers=2)
    model.eval()
    ids = tokens(1, 16, seed=5)
    out = model(ids, labels=ids)
    assert len(out.mtp_logits) == 2 and len(model.model.layers.keys()) == 10  # 8 decoder + 2 MTP layers
    d2 = float(causal_lm_loss(out.mtp_logits[1], ids, shift=3))
    d1 = float(causal_lm_loss(out.mtp_logits[0], ids, shift=2))
    assert abs(float(out.mtp_loss) - (d1 + d2) / 2) < 1e-5
