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


def _kl_taps(model: GlmMoeDsaForCausalLM, taps: dict[int, list]) -> dict[int, list]:
    """Fill ``taps``: layer id -> the indexer KL losses its forwards return (decoder and MTP layers)."""
    L = model.config.num_hidden_layers
    for i in model.model.layer_ids:
        layer = model.model.layers[i]
        block = layer.transformer_layer if i >= L else layer

        def hook(_layer, _inputs, out, i=i):
            if out[2] is not None:
                taps.setdefault(i, []).append(out[2])

        block.register_forward_post_hook(hook)
    return taps


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
    kl_full, kl_split = _kl_taps(full, {}), _kl_taps(stages[1], _kl_taps(stages[0], {}))
    ids = tokens(2, 32, seed=5)
    batch = {"input_ids": ids, "labels": ids}
    ref = full.forward_stage(None, batch)
    first = stages[0].forward_stage(None, batch)
    last = stages[1].forward_stage(first.carry, batch)

    hidden, topk = first.carry
    _same(hidden, boundary["hidden"], "carried hidden states")
    _same(topk, boundary["topk"], "carried top-k")
    assert sorted(last.losses) == ["indexer_kl", "lm", "mtp_1"] and sorted(first.losses) == ["indexer_kl"]
    for name in ("lm", "mtp_1"):
        _same(last.losses[name].sum, ref.losses[name].sum, f"{name} loss sum")
        assert int(last.losses[name].count) == int(ref.losses[name].count) > 0
    # every layer's KL loss, and each stage's term is the sum over its own layers
    own = [i for i, k in enumerate(cfg.indexer_types) if k == "full"] + ([] if mtp_shares_topk else [8])
    assert sorted(kl_split) == sorted(kl_full) == own
    for i in kl_full:
        _same(kl_split[i][0], kl_full[i][0], f"indexer KL of layer {i}")
    for out, spec in ((first, s0), (last, s1)):
        mine = [kl_full[i][0] for i in (*spec.layers, 8) if i in kl_full and (i < 8 or spec.has_mtp)]
        _same(out.losses["indexer_kl"].sum, paddle.add_n(mine), f"stage {spec.stage} indexer KL")
    _same(ref.losses["indexer_kl"].sum, paddle.add_n([kl_full[i][0] for i in sorted(kl_full)]), "whole KL")
