"""Config keys the reference (transformers 5.23 ``glm_moe_dsa``) reads differently from what their
name suggests: the model computes what transformers computes, or refuses the value naming the key.

* ``attention_dropout``: transformers drops attention probabilities in training mode; the attention
  forms here apply no dropout, so a training forward with a positive value is refused (an eval
  forward is what transformers computes: no dropout at eval).
* ``index_topk_freq`` 0 or below: transformers reads ``max(freq, 1)``, every layer full (it was
  refused here); the value is kept and written back.
* ``rope_interleave`` / ``indexer_rope_interleave``: transformers' MLA and indexer apply interleaved
  rope whatever the flags say; ``false`` (PaddleFleet reads it as half-split pairs) has no answer
  that agrees with both, so building a model with it is refused. The config keeps and round-trips
  the value (docs/config.md).

The tests that build the transformers model run only with the reference extra installed; each has
a torch-free twin pinning the same semantic.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

from ._tiny import randomize, tiny_config, tiny_model, tokens
from .conftest import TINY_CONFIG


def _hf_model(changes: dict, seed: int = 0):
    """transformers' tiny model from configs/glm52-tiny with ``changes``, fp32, O(1) activations."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig
    from transformers import GlmMoeDsaForCausalLM as HFModel

    d = json.loads(TINY_CONFIG.read_text()) | copy.deepcopy(changes)
    conf = HFConfig.from_dict(d)
    conf._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = HFModel(conf).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5))
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return torch, model


def _hf_loss(torch, model, ids: np.ndarray) -> float:
    t = torch.tensor(ids)
    with torch.no_grad():
        return float(model(t, labels=t).loss)


# ------------------------------------------------------------------ attention_dropout


def test_transformers_applies_attention_dropout_in_training_only():
    """Measured (transformers 5.23, tiny, attention_dropout 0.5): eval loss 6.0503669, train-mode
    losses 6.2280545 and 6.0256977 (two draws)."""
    torch, model = _hf_model({"attention_dropout": 0.5})
    ids = np.random.default_rng(0).integers(3, 256, size=(2, 32))
    ev = _hf_loss(torch, model, ids)
    model.train()
    torch.manual_seed(0)
    tr = [_hf_loss(torch, model, ids) for _ in range(2)]
    assert all(abs(t - ev) > 1e-3 for t in tr) and abs(tr[0] - tr[1]) > 1e-3, (ev, tr)


def test_attention_dropout_training_forward_is_refused_eval_is_unchanged():
    """Before the fix a training forward with attention_dropout 0.5 gave the no-dropout loss exactly
    (6.05036735 in train mode, twice, = the eval loss): the key was validated and then ignored."""
    ids = tokens(2, 16, seed=1)
    plain = tiny_model(seed=4)
    dropped = tiny_model(seed=4, attention_dropout=0.5)
    plain.eval(), dropped.eval()
    a, b = plain(ids, labels=ids), dropped(ids, labels=ids)
    assert float(a.loss) == float(b.loss) and np.array_equal(a.logits.numpy(), b.logits.numpy())
    dropped.train()
    with pytest.raises(ValueError, match=r"`attention_dropout`: 0\.5 .*training"):
        dropped(ids, labels=ids)
    plain.train()
    plain(ids, labels=ids)  # 0.0 trains as before


# ------------------------------------------------------------------ rope interleave flags


@pytest.mark.parametrize("key", ["rope_interleave", "indexer_rope_interleave"])
def test_transformers_ignores_the_interleave_flags(key):
    """transformers 5.23 applies interleaved rope in MLA and in the indexer unconditionally: the
    same weights give the same logits with the flag false (measured 0 apart; this library's half-split
    reading of false was 4.68 (MLA) / 4.23 (indexer) apart on these logits)."""
    torch, ref = _hf_model({})
    torch, flipped = _hf_model({key: False})
    ids = torch.tensor(np.random.default_rng(0).integers(3, 256, size=(2, 32)))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, flipped(ids).logits)


@pytest.mark.parametrize("key", ["rope_interleave", "indexer_rope_interleave"])
def test_interleave_flag_false_is_kept_by_the_config_and_refused_by_the_model(key):
    cfg = tiny_config(**{key: False})
    assert getattr(cfg, key) is False and cfg.to_dict()[key] is False  # the round trip keeps it
    assert GlmMoeDsaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=rf"`{key}`: false .*interleaved"):
        GlmMoeDsaForCausalLM(cfg)
    randomize(GlmMoeDsaForCausalLM(tiny_config(**{key: True})))  # true builds


# ------------------------------------------------------------------ transformers' other expert-count names


def _tiny_file(**changes) -> dict:
    d = json.loads(TINY_CONFIG.read_text()) | changes
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def test_transformers_reads_num_local_experts_as_the_expert_count():
    """transformers 5.23 maps `num_local_experts` onto `n_routed_experts` (its attribute_map):
    measured 16 from a file with only `num_local_experts: 16`, and 16 (not the file's 8) with both."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig

    assert HFConfig.from_dict(_tiny_file(n_routed_experts=_DROP, num_local_experts=16)).n_routed_experts == 16
    assert HFConfig.from_dict(_tiny_file(num_local_experts=16)).n_routed_experts == 16


def test_num_local_experts_is_the_expert_count_and_must_agree():
    """Before the fix `num_local_experts` was an unknown key: a file giving the count only under it built
    256 experts (the default) where transformers builds 16, and one with both names disagreeing was
    read as the other name says (8 vs transformers' 16)."""
    d = _tiny_file(n_routed_experts=_DROP, num_local_experts=16)
    cfg = GlmMoeDsaConfig.from_dict(copy.deepcopy(d))
    assert cfg.n_routed_experts == 16 and cfg.num_local_experts == 16
    assert cfg.to_dict() == d  # written back under the file's name only
    assert cfg.to_transformers_dict()["n_routed_experts"] == 16
    assert GlmMoeDsaConfig.from_dict(_tiny_file(num_local_experts=8)).n_routed_experts == 8  # agreeing: fine
    with pytest.raises(ValueError, match=r"`num_local_experts`: 16 disagrees with `n_routed_experts` 8"):
        GlmMoeDsaConfig.from_dict(_tiny_file(num_local_experts=16))


def test_dynamic_rope_is_kept_by_the_config_and_refused_by_the_model_naming_the_key():
    """Before: the model build raised NotImplementedError("dynamic NTK rope is an inference-time
    scheme; not supported for training") from rope.py, naming no key (and refusing inference too)."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000, "factor": 2.0}
    cfg = GlmMoeDsaConfig.from_dict(_tiny_file(rope_parameters=rope))
    assert cfg.to_dict()["rope_parameters"] == rope
    with pytest.raises(ValueError, match=r"`rope_parameters\.rope_type`: 'dynamic' is not supported by the model"):
        GlmMoeDsaForCausalLM(cfg)


# ------------------------------------------------------------------ rope_parameters beside rope_scaling

_YARN = {"rope_type": "yarn", "rope_theta": 10000, "factor": 4.0}
# (rope_parameters, rope_scaling, top-level rope_theta or _DROP, the field that disagrees or None)
ROPE_PAIRS = {
    "same dicts": (_YARN, {"type": "yarn", "factor": 4.0}, 10000, None),
    "mscale_all_dim only in rope_scaling": (_YARN, {"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}, 10000,
                                            "mscale_all_dim"),
    "mscale_all_dim only in rope_parameters": (_YARN | {"mscale_all_dim": 1.0}, {"type": "yarn", "factor": 4.0},
                                               10000, "mscale_all_dim"),
    "original length differs": (_YARN | {"original_max_position_embeddings": 1024},
                                {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 10000,
                                "original_max_position_embeddings"),
    "base only in rope_parameters": (_YARN | {"rope_theta": 8000000}, {"type": "yarn", "factor": 4.0}, _DROP,
                                     "rope_theta"),
    "base only at the top level": ({"rope_type": "yarn", "factor": 4.0}, {"type": "yarn", "factor": 4.0}, 10000,
                                   None),
}  # fmt: skip


def _rope_file(params, scaling, theta):
    return _tiny_file(rope_parameters=copy.deepcopy(params), rope_scaling=copy.deepcopy(scaling), rope_theta=theta)


@pytest.mark.parametrize("case", ROPE_PAIRS)
def test_transformers_reads_rope_scaling_in_place_of_rope_parameters(case):
    """transformers 5.23 (`convert_rope_params_to_dict`: `rope_parameters = rope_scaling or
    rope_parameters`) builds its rope from a non-null `rope_scaling` alone, its base from a top-level
    `rope_theta` (10000 when there is none): measured, the fields only rope_parameters has are gone."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig

    params, scaling, theta, field = ROPE_PAIRS[case]
    got = HFConfig.from_dict(_rope_file(params, scaling, theta)).rope_parameters
    assert got["rope_theta"] == (theta if theta is not _DROP else 10000)
    for key in set(params) | set(scaling):
        if key not in ("type", "rope_type", "rope_theta", "original_max_position_embeddings"):
            assert got.get(key) == scaling.get(key), key


@pytest.mark.parametrize("case", ROPE_PAIRS)
def test_rope_parameters_beside_rope_scaling_must_agree_on_every_field(case):
    """Before the fix only the type and factor were compared and rope_parameters was used: with
    `mscale_all_dim: 1.0` only in rope_scaling the model ran without it (softmax scale 0.1443 where
    transformers uses 0.1443 x 1.1386^2), with a base only in rope_parameters it used 8e6 where
    transformers uses 10000."""
    params, scaling, theta, field = ROPE_PAIRS[case]
    d = _rope_file(params, scaling, theta)
    if field is None:
        cfg = GlmMoeDsaConfig.from_dict(copy.deepcopy(d))
        assert cfg.rope == {**_YARN, "original_max_position_embeddings": 4096} and cfg.to_dict() == d
        return
    with pytest.raises(ValueError, match=rf"`rope_scaling\.{field}`: .* disagrees with `rope_parameters\.{field}`"):
        GlmMoeDsaConfig.from_dict(d)


# ------------------------------------------------------------------ pad_token_id at initialisation


def test_transformers_initialises_the_pad_row_to_zero():
    """transformers 5.23's `_init_weights` zeroes the embedding row `pad_token_id` (nn.Embedding
    padding_idx); the row then gets no gradient, so a model trained from it keeps it at zero."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig
    from transformers import GlmMoeDsaForCausalLM as HFModel

    torch.manual_seed(0)
    w = HFModel(HFConfig.from_dict(_tiny_file(pad_token_id=5))).model.embed_tokens.weight
    assert float(w[5].abs().max()) == 0.0 and float(w[4].abs().max()) > 0


@pytest.mark.parametrize("pad", [0, 5, None])
def test_init_weights_zeroes_the_pad_row_as_transformers_does(pad):
    """Before the fix the pad row was drawn like the others (abs max 0.049 for pad_token_id 0,
    tiny, seed 0) and, getting no gradient, never moved."""
    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.from_dict(_tiny_file(pad_token_id=pad)), seed=0)
    w = model.model.embedding.embed_tokens.weight.numpy()
    zero_rows = [i for i in range(w.shape[0]) if not w[i].any()]
    assert zero_rows == ([] if pad is None else [pad])
    assert abs(float(w.std()) - 0.02) < 0.002


# ------------------------------------------------------------------ index_topk_freq below 1
# measured with transformers 5.23: GlmMoeDsaConfig(num_hidden_layers=4, index_topk_freq=f).indexer_types is
# ["full"] * 4 for f = 0 and f = -2 (and for 1), ["full", "full", "shared", "full"] for 2; to_dict() keeps f
FREQS_BELOW_ONE = [0, -2]


def _schedule_only(freq: int) -> dict:
    d = json.loads(TINY_CONFIG.read_text())
    d.pop("indexer_types", None)
    return d | {"index_topk_freq": freq, "index_skip_topk_offset": 2}


@pytest.mark.parametrize("freq", FREQS_BELOW_ONE)
def test_transformers_reads_a_frequency_below_one_as_every_layer_full(freq):
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig

    hf = HFConfig.from_dict(_schedule_only(freq))
    assert hf.indexer_types == ["full"] * hf.num_hidden_layers
    assert hf.to_dict()["index_topk_freq"] == freq
    assert GlmMoeDsaConfig.from_dict(_schedule_only(freq)).indexer_types == hf.indexer_types


@pytest.mark.parametrize("freq", FREQS_BELOW_ONE)
def test_a_frequency_below_one_makes_every_layer_full_and_is_written_back(freq, tmp_path):
    cfg = GlmMoeDsaConfig.from_dict(_schedule_only(freq))
    assert cfg.indexer_types == ["full"] * cfg.num_hidden_layers
    assert cfg.to_fleet_config()["dsa_indexer_topk_freq"] == 1
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["index_topk_freq"] == freq
    shared = GlmMoeDsaConfig.from_dict(_schedule_only(2))  # the control: a real schedule shares layers
    assert "shared" in shared.indexer_types
