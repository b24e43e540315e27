"""Config files written by transformers, PaddleFormers and a PaddleFleet run all load, mean the same
model, and are written back byte for byte; PaddleFleet's names come from one mapping."""

import copy
import json

import numpy as np
import paddle
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.modeling.rope import RotaryEmbedding

from .conftest import FIXTURES, OFFICIAL_CONFIG

PRODUCERS = ("hf", "paddleformers", "paddlefleet")
CONFIGS = FIXTURES / "configs"
LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
    "context_parallel_size",
)


def official() -> dict:
    return json.loads(OFFICIAL_CONFIG.read_text())


def fixture(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def semantics(cfg: GlmMoeDsaConfig) -> dict:
    """What the model is built from: derived schedules, rope, dims, and the Fleet view minus layout."""
    fleet = {k: v for k, v in cfg.to_fleet_config().items() if k not in LAYOUT_KEYS}
    return {
        "fleet": fleet,
        "rope": cfg.rope,
        "softmax_scale": cfg.softmax_scale,
        "indexer_types": cfg.indexer_types,
        "mlp_layer_types": cfg.mlp_layer_types,
        "full_layer_ids": cfg.full_layer_ids,
        "qk_head_dim": cfg.qk_head_dim,
        "model_dtype": cfg.model_dtype,
        "interleave": (cfg.rope_interleave, cfg.indexer_rope_interleave),
        "num_mtp_layers": cfg.num_mtp_layers,
        "use_qk_norm": cfg.use_qk_norm,
        "fp32_residual_connection": cfg.fp32_residual_connection,
    }


@pytest.mark.parametrize("name", PRODUCERS)
def test_fixture_round_trips_byte_for_byte(name, tmp_path):
    path = CONFIGS / name / "config.json"
    cfg = GlmMoeDsaConfig.from_pretrained(path)
    src = json.loads(path.read_text())
    out = cfg.to_dict()
    assert out == src and list(out) == list(src)
    cfg.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").read_bytes() == path.read_bytes()
    again = GlmMoeDsaConfig.from_pretrained(tmp_path)
    assert again.to_json_string() == path.read_text()


def test_hf_fixture_is_the_official_config():
    assert fixture("hf") == official()


@pytest.mark.parametrize("name", ("paddleformers", "paddlefleet"))
def test_every_producer_gives_the_same_model(name):
    hf = GlmMoeDsaConfig.from_pretrained(CONFIGS / "hf")
    other = GlmMoeDsaConfig.from_pretrained(CONFIGS / name)
    assert fixture(name) != fixture("hf")  # really a different file
    assert semantics(other) == semantics(hf)
    # and that model is GLM-5.2 as the official file states it
    assert hf.full_layer_ids == [i for i, t in enumerate(official()["indexer_types"]) if t == "full"]
    assert hf.rope == official()["rope_parameters"]


def test_producer_layouts_are_read_under_their_names():
    pf = GlmMoeDsaConfig.from_pretrained(CONFIGS / "paddleformers")
    assert pf.expert_tensor_model_parallel_size == 2 and pf.to_fleet_config()["expert_tensor_parallel_size"] == 2
    fl = GlmMoeDsaConfig.from_pretrained(CONFIGS / "paddlefleet")
    assert fl.expert_tensor_model_parallel_size == 2 and fl.expert_tensor_parallel_size == 2
    f = fl.to_fleet_config()
    assert {k: f[k] for k in LAYOUT_KEYS} == {
        "tensor_model_parallel_size": 4,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 8,
        "expert_tensor_parallel_size": 2,
        "sequence_parallel": True,
        "context_parallel_size": 1,
    }


def test_paddleformers_fields_are_kept_and_readable():
    src = fixture("paddleformers")
    cfg = GlmMoeDsaConfig.from_dict(src)
    for key in ("seq_aux", "using_flex_token", "use_fp8", "pp_seg_method", "disable_ffn_model_parallel", "fd_fallback"):
        assert getattr(cfg, key) == src[key]
    assert cfg.partial_rotary_factor == 0.5 and cfg.to_dict()["partial_rotary_factor"] == 0.5
    assert cfg.to_dict()["rope_scaling"] is None and cfg.to_dict()["rope_theta"] == 8000000
    d = dict(src, tensor_parallel_degree=1, tensor_parallel_output=True)
    assert GlmMoeDsaConfig.from_dict(d).to_dict() == d


def test_expert_tensor_parallel_key_in_the_file_survives_at_its_place(tmp_path):
    d = {}
    for k, v in official().items():  # put it in the middle, after ep_size
        d[k] = v
        if k == "ep_size":
            d["expert_tensor_model_parallel_size"] = 2
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    cfg = GlmMoeDsaConfig.from_pretrained(tmp_path / "in")
    assert cfg.expert_tensor_model_parallel_size == 2
    assert cfg.to_fleet_config()["expert_tensor_parallel_size"] == 2
    cfg.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved == d and list(saved) == list(d)


def test_a_changed_setting_is_written_under_the_files_spelling(tmp_path):
    path = CONFIGS / "paddlefleet"
    cfg = GlmMoeDsaConfig.from_pretrained(path, expert_tensor_model_parallel_size=1)
    out = cfg.to_dict()
    assert out["expert_tensor_parallel_size"] == 1 and "expert_tensor_model_parallel_size" not in out
    changed = GlmMoeDsaConfig.from_pretrained(path).copy(rope_interleave=False)
    out = changed.to_dict()
    assert out["rotary_interleaved"] is False and out["rope_interleave"] is False
    assert out["dsa_indexer_rotary_interleaved"] is True and out["indexer_rope_interleave"] is True
    assert list(out) == list(fixture("paddlefleet"))
    assert (
        GlmMoeDsaConfig.from_pretrained(path).copy(expert_tensor_parallel_size=1).expert_tensor_model_parallel_size == 1
    )
    with pytest.raises(ValueError, match="`rotary_base`"):
        GlmMoeDsaConfig.from_pretrained(path, rotary_base=1000000)


def test_library_keys_in_the_file_keep_their_place():
    d = official()
    keys = list(d)
    d = {k: d[k] for k in keys[:5]} | {"use_qk_norm": True, "attention_chunk_size": 1024} | {k: d[k] for k in keys[5:]}
    out = GlmMoeDsaConfig.from_dict(d).to_dict()
    assert list(out) == list(d) and out == d


def test_use_qk_norm_false_is_refused_with_the_reason():
    d = fixture("paddleformers")
    d["use_qk_norm"] = False
    with pytest.raises(ValueError, match=r"`use_qk_norm`.*latent norms"):
        GlmMoeDsaConfig.from_dict(d)


DISAGREE = [
    ("rotary_interleaved", {"rotary_interleaved": False}, "paddlefleet"),
    ("dsa_indexer_rotary_interleaved", {"dsa_indexer_rotary_interleaved": False}, "paddlefleet"),
    ("expert_tensor_parallel_size", {"expert_tensor_model_parallel_size": 4}, "paddlefleet"),
    ("rotary_base", {"rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}}, "paddlefleet"),
    ("rope_type", {"rope_type": "yarn"}, "paddlefleet"),
    ("rope_theta", {"rope_theta": 1000000}, "paddleformers"),
    ("rope_scaling.rope_type", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "paddleformers"),
    ("torch_dtype", {"torch_dtype": "float32"}, "hf"),
]


@pytest.mark.parametrize("key,change,name", DISAGREE, ids=[c[0] for c in DISAGREE])
def test_two_spellings_that_disagree_are_refused(key, change, name):
    d = fixture(name)
    d.update(copy.deepcopy(change))
    with pytest.raises(ValueError, match=f"`{key}`"):
        GlmMoeDsaConfig.from_dict(d)


def test_fleet_config_of_the_official_model_is_pinned():
    pinned = json.loads((CONFIGS / "fleet_official.json").read_text())
    declared = {name for names in pinned["fleet_fields"].values() for name in names}
    f = GlmMoeDsaConfig.from_pretrained(OFFICIAL_CONFIG).to_fleet_config()
    assert set(f) <= declared, sorted(set(f) - declared)
    lists = {"dsa_indexer_types", "moe_layer_freq"}
    assert {k: v for k, v in f.items() if k not in lists} == pinned["official"]
    assert f["dsa_indexer_types"] == official()["indexer_types"]
    assert f["moe_layer_freq"] == [0 if t == "dense" else 1 for t in official()["mlp_layer_types"]]


def test_fleet_config_of_a_yarn_rope_carries_the_yarn_fields():
    d = official()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 8000000, "factor": 4.0, "mscale_all_dim": 1.0}
    f = GlmMoeDsaConfig.from_dict(d).to_fleet_config()
    assert f["rope_type"] == "yarn" and f["rotary_scaling_factor"] == 4.0 and f["mscale_all_dim"] == 1.0
    assert f["original_max_position_embeddings"] == d["max_position_embeddings"]


def _tables(cfg: GlmMoeDsaConfig) -> tuple[np.ndarray, np.ndarray]:
    pos = paddle.to_tensor([[0, 1, 7, 4095, 131071]], dtype="int64")
    cos, sin = RotaryEmbedding(cfg)(pos)
    return cos.numpy(), sin.numpy()


def test_rope_spellings_give_the_same_cos_sin_tables():
    base = official()
    del base["rope_parameters"]
    spellings = {
        "hf rope_parameters": {"rope_parameters": {"rope_theta": 8000000, "rope_type": "default"}},
        "paddleformers": {
            "rope_theta": 8000000,
            "rope_scaling": None,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
        },
        "older top-level rope_theta": {"rope_theta": 8000000.0},
        "paddlefleet rotary_base": {"rotary_base": 8000000, "rope_type": "rope"},
    }
    tables = {name: _tables(GlmMoeDsaConfig.from_dict({**base, **extra})) for name, extra in spellings.items()}
    ref_cos, ref_sin = tables["hf rope_parameters"]
    for name, (cos, sin) in tables.items():
        assert np.array_equal(cos, ref_cos) and np.array_equal(sin, ref_sin), name
    # the shared table is the 64-channel one (qk_rope_head_dim), not halved by partial_rotary_factor
    d = base["qk_rope_head_dim"]
    assert ref_cos.shape == (1, 5, d // 2)
    inv = 1.0 / 8000000.0 ** (np.arange(0, d, 2) / d)
    np.testing.assert_allclose(ref_cos[0, 2], np.cos(7 * inv), rtol=0, atol=1e-6)


def test_yarn_rope_spellings_give_the_same_cos_sin_tables():
    base = official()
    del base["rope_parameters"]
    yarn = {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 131072}
    hf = GlmMoeDsaConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 8000000, **yarn}})
    pf = GlmMoeDsaConfig.from_dict({**base, "rope_theta": 8000000, "rope_scaling": {"type": "yarn", **yarn}})
    (c1, s1), (c2, s2) = _tables(hf), _tables(pf)
    assert np.array_equal(c1, c2) and np.array_equal(s1, s2)
    assert hf.softmax_scale == pf.softmax_scale
    assert not np.array_equal(c1, _tables(GlmMoeDsaConfig.from_dict(official()))[0])  # yarn really differs
