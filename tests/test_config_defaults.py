"""GlmMoeDsaConfig's value for a key a file (or a Python caller) does not give is transformers'.

The expected values are transformers 5.23's own, measured by tools/make_hf_config_defaults.py into
tests/fixtures/hf_config_defaults.json; no transformers is needed here. A wrong default would not
show on the official config.json (it states every key), only on a third-party file or a config
built in Python that leaves a key out: a different model, silently (``routed_scaling_factor`` 1.0,
``rms_norm_eps`` 1e-6, ``norm_topk_prob`` False all run).

Keys transformers has no setting for (its model hard-codes GLM-5.2's behaviour: sigmoid router with
the correction bias, interleaved rope, ...) take the official config's value. Also here: the
transformers alias ``num_experts``, and two shapes the model cannot run, refused by name."""

from __future__ import annotations

import copy
import json
import re

import pytest

from paddleformers_glm import GlmMoeDsaConfig

from .conftest import FIXTURES, OFFICIAL_CONFIG

HF = json.loads((FIXTURES / "hf_config_defaults.json").read_text())
OFFICIAL = json.loads(OFFICIAL_CONFIG.read_text())
# transformers' default is None; this library writes GLM-5.2's own values (docs/config.md)
BY_DESIGN = {"architectures": ["GlmMoeDsaForCausalLM"], "dtype": "bfloat16"}
# transformers fields this config does not hold: what they say is how the model is built
MODEL_FACTS = {"mlp_bias": False, "layer_types": ["indexed_attention"] * 78}
# keys transformers does not hold (measured: absent once dropped) that are no setting of the model
NOT_SETTINGS = {"ep_size", "pretraining_tp", "transformers_version"}
# the indexer schedule's inputs: transformers reads them from its kwargs (tested by the schedule below)
SCHEDULE_KEYS = {"index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"}


def _plain(v):
    return json.loads(json.dumps(v))


def test_the_fixture_is_transformers_5_23():
    assert HF["transformers"] == "5.23.0"
    assert {"routed_scaling_factor", "rms_norm_eps", "norm_topk_prob"} <= set(HF["defaults"])


@pytest.mark.parametrize("key", sorted(HF["defaults"]))
def test_every_default_is_transformers(key):
    want = HF["defaults"][key]
    if key in MODEL_FACTS:
        assert want == MODEL_FACTS[key]
        return
    if key in BY_DESIGN:
        assert want is None
        want = BY_DESIGN[key]
    assert _plain(getattr(GlmMoeDsaConfig(), key)) == want, key


def _without(key: str) -> dict:
    d = copy.deepcopy(OFFICIAL)
    del d[key]
    return d


@pytest.mark.parametrize("key", sorted(HF["dropped_from_official"]))
def test_a_key_dropped_from_the_official_file_takes_transformers_value(key):
    want = HF["dropped_from_official"][key]
    cfg = GlmMoeDsaConfig.from_dict(_without(key))
    if key in BY_DESIGN:
        assert want is None
        want = BY_DESIGN[key]
    if key == "rope_parameters":  # the attribute keeps the file's null; the rope in use is transformers'
        assert cfg.rope_parameters is None
        assert _plain(cfg.rope) == want
        return
    assert _plain(getattr(cfg, key)) == want, key


GLM_ONLY = sorted(set(HF["not_held_when_dropped"]) - NOT_SETTINGS - SCHEDULE_KEYS)


@pytest.mark.parametrize("key", GLM_ONLY)
def test_a_key_transformers_has_no_setting_for_takes_the_official_value(key):
    """``num_nextn_predict_layers`` (the MTP layer the official checkpoint ships), the router's
    ``scoring_func`` / ``topk_method`` / ``moe_router_dtype``, the rope interleave flags, ..."""
    assert key in OFFICIAL
    assert getattr(GlmMoeDsaConfig.from_dict(_without(key)), key) == OFFICIAL[key]
    assert getattr(GlmMoeDsaConfig(), key) == OFFICIAL[key]


def test_the_indexer_schedule_without_an_offset_is_transformers():
    """transformers derives the schedule from ``index_topk_freq`` and ``index_skip_topk_offset``
    (default 2 there, read from its kwargs); a file giving the frequency alone must get its list."""
    kwargs, want = HF["derived"]["schedule_kwargs"], HF["derived"]["schedule_indexer_types"]
    assert list(GlmMoeDsaConfig(**kwargs).indexer_types) == want
    d = copy.deepcopy(OFFICIAL)
    for k in ("indexer_types", "mlp_layer_types", "index_skip_topk_offset", "index_topk_pattern"):
        del d[k]
    d.update(kwargs)
    assert list(GlmMoeDsaConfig.from_dict(d).indexer_types) == want


def test_the_default_configs_offset_is_the_one_transformers_assumes():
    """``GlmMoeDsaConfig()`` writes an ``index_skip_topk_offset`` (every layer is full at frequency 1,
    whatever the offset); a file made from it with a frequency set describes the schedule
    transformers derives from that frequency alone."""
    kwargs, want = HF["derived"]["schedule_kwargs"], HF["derived"]["schedule_indexer_types"]
    d = GlmMoeDsaConfig().to_dict()
    assert "index_skip_topk_offset" in d
    for k in ("indexer_types", "mlp_layer_types"):
        d.pop(k, None)
    d.update(kwargs)
    assert list(GlmMoeDsaConfig.from_dict(d).indexer_types) == want


def test_num_experts_is_transformers_name_for_n_routed_experts():
    want = HF["derived"]["num_experts_8_n_routed_experts"]
    d = _without("n_routed_experts")
    d["num_experts"] = 8
    assert GlmMoeDsaConfig.from_dict(d).n_routed_experts == want == 8


INVALID = [
    # the rotary embedding turns pairs of channels (qk_head_dim kept consistent: 192 + 63)
    ("odd rope dim", {"qk_rope_head_dim": 63, "qk_head_dim": 255}, {"qk_rope_head_dim": 62, "qk_head_dim": 254}),
    # the router picks among the experts of the chosen groups: 1 of 8 groups of 32 holds no 64 of them
    (
        "too few experts in chosen groups",
        {"n_group": 8, "topk_group": 1, "num_experts_per_tok": 64},
        {"n_group": 8, "topk_group": 1, "num_experts_per_tok": 32},
    ),
]
KEYS = {"odd rope dim": "qk_rope_head_dim", "too few experts in chosen groups": "num_experts_per_tok"}


@pytest.mark.parametrize("name,bad,good", INVALID, ids=[c[0] for c in INVALID])
def test_shapes_the_model_cannot_run_are_refused_naming_the_key(name, bad, good):
    """Each refused next to its nearest accepted neighbour (the control)."""
    GlmMoeDsaConfig.from_dict({**OFFICIAL, **good})
    with pytest.raises(ValueError) as e:
        GlmMoeDsaConfig.from_dict({**OFFICIAL, **bad})
    named = re.findall(r"`([^`]+)`", str(e.value))
    assert any(n == KEYS[name] or n.endswith("." + KEYS[name]) for n in named), (str(e.value), name)
