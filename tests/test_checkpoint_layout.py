"""The parameter-name contract, checked against sources that do not come from the code under test:
the HF-written tiny fixture checkpoint, the official index's shapes of the 744B model, and hand counts."""

from __future__ import annotations

import json

import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint.layout import fleet_param_specs, hf_param_specs, layer_plan, resolve_dtype

from ._tiny import config_from as _cfg
from .conftest import FIXTURES
from .conftest import OFFICIAL_CONFIG as OFFICIAL

FIXTURE = FIXTURES / "tiny" / "checkpoint"


def test_tiny_counts_by_hand():
    # tiny: 8 layers (3 dense, 5 MoE), full layers {0,1,2,6}, 1 MTP layer (MoE + indexer), 8 experts.
    # HF:    3 global + 9 layers x 9 (2 norms + 7 MLA) + 5 indexers x 5 + 3 dense x 3
    #        + 6 MoE x (2 router + 3 shared + 8 x 3) + 4 MTP wrapper = 296
    # Fleet: same but dense 3 x 2 and MoE 6 x (2 + 2 + 8 x 2) = 239
    cfg = _cfg()
    assert len(hf_param_specs(cfg)) == 3 + 81 + 25 + 9 + 174 + 4 == 296
    assert len(fleet_param_specs(cfg)) == 3 + 81 + 25 + 6 + 120 + 4 == 239


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_hf_specs_equal_hf_written_checkpoint():
    from safetensors import safe_open

    cfg = GlmMoeDsaConfig.from_pretrained(FIXTURE)
    found = {}
    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(FIXTURE / shard), framework="paddle") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                found[k] = (tuple(sl.get_shape()), sl.get_dtype())
    specs = {
        k: (s, {"bfloat16": "BF16", "float32": "F32"}[resolve_dtype(kind, cfg.model_dtype)])
        for k, (s, kind) in hf_param_specs(cfg).items()
    }
    assert set(found) == set(specs), (sorted(set(found) - set(specs))[:5], sorted(set(specs) - set(found))[:5])
    assert found == specs


def test_fleet_shapes_by_hand():
    f = fleet_param_specs(_cfg())
    # H=64 V=256 nH=4 qk=32+16 v=32 q_lora=48 kv_lora=32 I=128 Im=32 E=8 idxH=8 idxD=32
    expect = {
        "model.embedding.embed_tokens.weight": ((256, 64), "model"),
        "lm_head.weight": ((64, 256), "model"),
        "model.layers.0.self_attn.q_a_proj.weight": ((64, 48), "model"),
        "model.layers.0.self_attn.q_b_proj.weight": ((48, 192), "model"),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ((64, 48), "model"),
        "model.layers.0.self_attn.kv_b_proj.weight": ((32, 256), "model"),
        "model.layers.0.self_attn.o_proj.weight": ((128, 64), "model"),
        "model.layers.0.self_attn.core_attention.indexer.wq_b.weight": ((48, 256), "model"),
        "model.layers.0.self_attn.core_attention.indexer.wk.weight": ((64, 32), "model"),
        "model.layers.0.self_attn.core_attention.indexer.k_norm.bias": ((32,), "model"),
        "model.layers.0.self_attn.core_attention.indexer.weights_proj.weight": ((64, 8), "model"),
        "model.layers.0.mlp.up_gate_proj.weight": ((64, 256), "model"),
        "model.layers.0.mlp.down_proj.weight": ((128, 64), "model"),
        "model.layers.3.mlp.gate.weight": ((64, 8), "float32"),
        "model.layers.3.mlp.gate.e_score_correction_bias": ((8,), "float32"),
        "model.layers.3.mlp.shared_experts.up_gate_proj.weight": ((64, 64), "model"),
        "model.layers.3.mlp.shared_experts.down_proj.weight": ((32, 64), "model"),
        "model.layers.3.mlp.experts.7.up_gate_proj.weight": ((64, 64), "model"),
        "model.layers.3.mlp.experts.7.down_proj.weight": ((32, 64), "model"),
        "model.layers.8.enorm.weight": ((64,), "model"),
        "model.layers.8.eh_proj.weight": ((128, 64), "model"),
        "model.layers.8.norm.weight": ((64,), "model"),
        "model.layers.8.transformer_layer.self_attn.core_attention.indexer.wk.weight": ((64, 32), "model"),
        "model.layers.8.transformer_layer.mlp.experts.0.up_gate_proj.weight": ((64, 64), "model"),
    }
    for k, v in expect.items():
        assert f[k] == v, k
    for shared in (3, 4, 5, 7):  # no indexer weights on shared layers
        assert not [k for k in f if k.startswith(f"model.layers.{shared}.") and "indexer" in k]
    assert not [k for k in f if k.startswith("model.layers.8.") and "transformer_layer" not in k and "self_attn" in k]
    assert "model.layers.8.shared_head.norm.weight" not in f


def test_official_744b_shapes_from_reference():
    cfg = _cfg(OFFICIAL)
    hf = hf_param_specs(cfg)
    assert hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][0] == (576, 6144)
    assert hf["model.layers.0.self_attn.kv_b_proj.weight"][0] == (28672, 512)
    assert hf["model.layers.0.self_attn.indexer.wq_b.weight"][0] == (4096, 2048)
    assert hf["model.layers.0.self_attn.indexer.wk.weight"][0] == (128, 6144)
    assert hf["model.layers.0.self_attn.indexer.weights_proj.weight"][0] == (32, 6144)
    assert hf["model.layers.78.eh_proj.weight"][0] == (6144, 12288)
    assert hf["model.layers.78.mlp.gate.e_score_correction_bias"][1] == "float32"
    # 21 full layers + the MTP layer carry 5 indexer tensors each
    assert sum(".self_attn.indexer." in k for k in hf) == (21 + 1) * 5
    assert "model.layers.78.self_attn.indexer.wk.weight" in hf and "model.layers.79.enorm.weight" not in hf
    fl = fleet_param_specs(cfg)
    assert fl["model.layers.78.transformer_layer.self_attn.kv_a_proj_with_mqa.weight"][0] == (6144, 576)
    assert fl["model.layers.78.transformer_layer.mlp.experts.255.up_gate_proj.weight"][0] == (6144, 4096)


def test_attention_bias_adds_biases_both_sides():
    cfg = _cfg(attention_bias=True)
    hf, fl = hf_param_specs(cfg), fleet_param_specs(cfg)
    for name, n in (("q_a_proj", 48), ("kv_a_proj_with_mqa", 48), ("o_proj", 64)):
        assert hf[f"model.layers.2.self_attn.{name}.bias"] == ((n,), "model")
        assert fl[f"model.layers.2.self_attn.{name}.bias"] == ((n,), "model")
        assert f"model.layers.8.transformer_layer.self_attn.{name}.bias" in fl


def test_layer_plan_follows_schedule():
    plans = layer_plan(_cfg())
    assert [p.indexer for p in plans] == [True, True, True, False, False, False, True, False, True]
    assert [p.moe for p in plans] == [False] * 3 + [True] * 6
    assert plans[-1].mtp and plans[-1].fleet_prefix == "model.layers.8.transformer_layer"


def test_resolve_dtype():
    assert resolve_dtype("model", "bfloat16") == "bfloat16"
    assert resolve_dtype("float32", "bfloat16") == "float32"
