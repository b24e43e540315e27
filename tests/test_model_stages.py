"""The stage-aware model: a pipeline stage is ``GlmMoeDsaForCausalLM`` itself, built for the stage's
layers (no second forward), and a two-stage split of the tiny GLM run stage after stage computes
what the whole model computes, bit for bit: the carry (the hidden states and the top-k that the
shared indexer layer opening stage 2 reuses), the LM and MTP loss sums and token counts, and every
layer's indexer KL loss."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.parallel.pipeline import split_stages

from ._tiny import tiny_model, tokens


def _same(a: paddle.Tensor, b: paddle.Tensor, what: str) -> None:
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=what)


@pytest.mark.parametrize("mtp_shares_topk", [True, False], ids=["mtp-reuses-topk", "mtp-own-indexer"])
def test_two_stage_split_chains_to_the_full_forward_bit_for_bit(mtp_shares_topk):
    # the indexer KL loss on: every layer that runs its indexer has one (the MTP layer too when it
    # does not reuse the main model's top-k)
    full = tiny_model(seed=3, indexer_loss_coeff=0.1, index_share_for_mtp_iteration=mtp_shares_topk)
    cfg = full.config
    full.train()
    s0, s1 = split_stages(cfg.num_hidden_layers, 2, layout="E,t*4|t*4,m,L", has_mtp=True)
    assert cfg.indexer_types[4] == "shared"  # stage 2 opens on a shared layer: the top-k travels in the carry
    stages = [GlmMoeDsaForCausalLM(cfg, stage=s) for s in (s0, s1)]
    weights = full.state_dict()
    for st in stages:
        assert type(st) is GlmMoeDsaForCausalLM and set(st.state_dict()) <= set(weights)
        st.set_state_dict({k: weights[k] for k in st.state_dict()})
        st.train()
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(weights)

    # the whole model's hidden states and top-k leaving layer 3, where stage 1 ends
    boundary = {}
    full.model.layers[3].register_forward_post_hook(lambda _l, _i, out: boundary.update(hidden=out[0], topk=out[1]))
    ids = tokens(2, 32, seed=5)
    batch = {"input_ids": ids, "labels": ids}
    ref = full.forward_stage(None, batch)
    first = stages[0].forward_stage(None, batch)
    last = stages[1].forward_stage(first.carry, batch)

    hidden, topk = first.carry
    _same(hidden, boundary["hidden"], "carried hidden states")
    _same(topk, boundary["topk"], "carried top-k")
    # every layer that runs its own indexer reports its KL and top-k recall on the stage holding it
    own = [i for i, k in enumerate(cfg.indexer_types) if k == "full"] + ([] if mtp_shares_topk else [8])
    per_layer = {i: (f"indexer_kl@{i}", f"indexer_recall@{i}") for i in own}
    on = {id(st): [i for i in own if i in st.layers or (i == 8 and st.has_mtp)] for st in (s0, s1)}
    for out, spec in ((first, s0), (last, s1)):
        names = {"indexer_kl", *(n for i in on[id(spec)] for n in per_layer[i])}
        assert set(out.losses) == names | ({"lm", "mtp_1"} if spec.has_head else set()), spec
    for name in ("lm", "mtp_1"):
        _same(last.losses[name].sum, ref.losses[name].sum, f"{name} loss sum")
        assert int(last.losses[name].count) == int(ref.losses[name].count) > 0
    split = {**first.losses, **last.losses}
    for i in own:
        for name in per_layer[i]:
            _same(split[name].sum, ref.losses[name].sum, f"{name} of layer {i}")
    # each stage's objective term is the sum of its own layers' KLs
    for out, spec in ((first, s0), (last, s1)):
        mine = [ref.losses[f"indexer_kl@{i}"].sum for i in on[id(spec)]]
        _same(out.losses["indexer_kl"].sum, paddle.add_n(mine), f"stage {spec.stage} indexer KL")
    _same(ref.losses["indexer_kl"].sum, paddle.add_n([ref.losses[f"indexer_kl@{i}"].sum for i in own]), "whole KL")


def test_generate_on_a_pipeline_stage_is_refused_by_name():
    """generate needs every layer, the embedding and the head; a stage has some (before: an
    AttributeError on the missing lm_head, or on a None hidden state in the second stage)."""
    cfg = tiny_model(seed=3).config
    for s in split_stages(cfg.num_hidden_layers, 2, layout="E,t*4|t*4,m,L", has_mtp=True):
        stage = GlmMoeDsaForCausalLM(cfg, stage=s)
        stage.eval()
        with pytest.raises(NotImplementedError, match=r"generate: this model is a pipeline stage \(decoder layers"):
            stage.generate(paddle.to_tensor([[1, 2, 3]]), max_new_tokens=2)


def test_interleaved_chunks_of_the_glm_with_the_embedding_alone_chain_to_the_full_forward():
    """--pp 2 --vpp 5 splits the tiny GLM's 8 layers E|t|t|t|t|t|t|t|t,m|L-like: chunk 0 holds the
    embedding alone, so its carry's top-k goes as [B, S, k] -1 placeholders (the interleaved
    schedule sends every carry at the model's ``carry_topk_width``) and the next chunk's layer must
    select afresh.  Chained through Fleet's chunk wrapper, the chunks' loss terms equal the whole
    model's bit for bit."""
    from paddleformers_glm.parallel.fleet_pipeline import PipelineChunk, selection_gaps
    from paddleformers_glm.parallel.pipeline import LossLedger

    full = tiny_model(seed=3, indexer_loss_coeff=0.1)
    full.train()
    cfg = full.config
    chunks = split_stages(cfg.num_hidden_layers, 10, has_mtp=True)
    assert chunks[0].has_embedding and not chunks[0].layers  # the embedding alone
    ids = tokens(2, 32, seed=5)
    batch = {"input_ids": ids, "labels": ids}
    assert full.carry_topk_width(batch) == min(cfg.index_topk, 32)
    ref = full.forward_stage(None, batch).losses

    ledger = LossLedger()
    ledger.batch_keys = ["input_ids", "labels"]
    ledger.reset(dict.fromkeys(ref, 1.0))
    gaps = selection_gaps(chunks)
    assert gaps[0] == (False, True, True)
    x, sent = (ids, ids), []
    for c, g in zip(chunks, gaps):
        x = PipelineChunk(full, c, ledger, False, *g)(x)
        if not c.is_last:
            sent.append(x[3])  # (input_ids, labels, hidden, top-k)
    assert all(list(t.shape) == [2, 32, full.carry_topk_width(batch)] for t in sent)
    assert (sent[0].numpy() == -1).all()  # the placeholder; the first layer's selection is real:
    assert (sent[1].numpy()[:, -1] >= 0).all()  # the last query sees every key (-1 pads early queries)
    got = ledger.totals()
    assert set(got) == set(ref)
    for name, term in ref.items():  # each term once, on the chunk holding its layer or head
        if name != "indexer_kl":
            assert got[name] == (float(term.sum.astype("float64").numpy()), int(term.count)), name
    # the layers' KL summed per chunk (one term per chunk, weighted per micro-batch, not per count)
    # then over chunks: the whole model's float32 sum up to its rounding
    np.testing.assert_allclose(got["indexer_kl"][0], float(ref["indexer_kl"].sum.numpy()), rtol=1e-7, atol=0)
