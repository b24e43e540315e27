"""The AOA rules (aoa_mappings/glm_moe_dsa.json) expanded per config and run by Paddle's own engine
(``full_param``): complete, schedule-aware, value-correct, and an exact round trip of every tensor."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint.aoa import build_statements, expand_units, load_rules, rules_path
from paddleformers_glm.checkpoint.layout import fleet_param_specs, hf_param_specs, resolve_dtype

from ._tiny import config_from as _cfg
from .conftest import FIXTURES, ROOT
from .conftest import OFFICIAL_CONFIG as OFFICIAL

FIXTURE = FIXTURES / "tiny" / "checkpoint"


def test_rules_are_data_in_the_repo():
    assert pathlib.Path(rules_path()).resolve() == (ROOT / "aoa_mappings" / "glm_moe_dsa.json").resolve()
    rules = load_rules()
    assert {u["scope"] for u in rules["units"]} == {"global", "decoder", "expert", "mtp"}


@pytest.mark.parametrize("changes", [{}, {"attention_bias": True}, {"num_nextn_predict_layers": 0}])
def test_units_cover_both_contracts_exactly_once(changes):
    cfg = _cfg(**changes)
    units = expand_units(cfg)
    hf = [k for u in units for k in u.hf]
    fl = [k for u in units for k in u.fleet]
    assert len(hf) == len(set(hf)) and len(fl) == len(set(fl))
    assert set(hf) == set(hf_param_specs(cfg))
    assert set(fl) == set(fleet_param_specs(cfg))


def test_units_cover_official_744b():
    cfg = _cfg(OFFICIAL)
    units = expand_units(cfg)
    assert {k for u in units for k in u.hf} == set(hf_param_specs(cfg))
    assert {k for u in units for k in u.fleet} == set(fleet_param_specs(cfg))


def _stmts(cfg, direction, dtype="float32"):
    units = expand_units(cfg)
    hf, fl = hf_param_specs(cfg), fleet_param_specs(cfg)
    hf_dt = {k: resolve_dtype(kind, "bfloat16") for k, (_, kind) in hf.items()}
    fl_dt = {k: resolve_dtype(kind, dtype) for k, (_, kind) in fl.items()}
    if direction == "hf_to_fleet":
        return build_statements(units, direction, hf_dt, fl_dt)
    return build_statements(units, direction, fl_dt, hf_dt)


def test_statements_follow_schedule_and_expand_macros():
    cfg = _cfg()
    for direction in ("hf_to_fleet", "fleet_to_hf"):
        st = _stmts(cfg, direction)
        assert not [s for s in st if "$" in s]  # macros expanded in Python, never by the engine
        for shared in (3, 4, 5, 7):
            assert not [s for s in st if f"layers.{shared}." in s and "indexer" in s]
        mtp_idx = [s for s in st if "layers.8." in s and "indexer" in s and "^T" in s]
        assert len(mtp_idx) == 3  # wq_b, wk, weights_proj transposed; k_norm weight/bias renamed
        assert any("layers.8.transformer_layer.mlp.experts.7.up_gate_proj.weight" in s for s in st)
    casts = [s for s in _stmts(cfg, "hf_to_fleet") if "dst_dtype" in s]
    # bf16 -> fp32 for every fleet tensor except the correction biases, which are fp32 already
    assert len(casts) == len(fleet_param_specs(cfg)) - 6
    assert all("src_dtype='bfloat16', dst_dtype='float32'" in s for s in casts)


def _fixture_tensors():
    from safetensors import safe_open

    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(FIXTURE / shard), framework="paddle") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _f32(t):
    return t.astype("float32").numpy()


def _expected_fleet(hf, key):
    """Independent statement of the mapping, for checking values (not the rules file)."""
    src = key.replace(".transformer_layer.", ".").replace(".core_attention.indexer.", ".indexer.")
    src = src.replace("model.embedding.embed_tokens", "model.embed_tokens").replace(
        "layers.8.norm.", "layers.8.shared_head.norm."
    )
    if "up_gate_proj" in src:
        g, u = src.replace("up_gate_proj", "gate_proj"), src.replace("up_gate_proj", "up_proj")
        return np.concatenate([_f32(hf[g]).T, _f32(hf[u]).T], axis=1)
    a = _f32(hf[src])
    return a if a.ndim == 1 or "embed_tokens" in src else a.T


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_full_param_round_trip_every_tensor_bit_exact():
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import build_sharded_state_dict

    cfg = GlmMoeDsaConfig.from_pretrained(FIXTURE)
    hf = _fixture_tensors()
    fleet = dict(full_param(build_sharded_state_dict(hf), {"aoa_statements": _stmts(cfg, "hf_to_fleet")}))
    specs = fleet_param_specs(cfg)
    assert set(fleet) == set(specs)
    for k, (shape, _) in specs.items():
        assert tuple(fleet[k].shape) == shape, k
        assert str(fleet[k].dtype) == "paddle.float32", k  # bf16 cast up; router/bias fp32
        np.testing.assert_array_equal(fleet[k].numpy(), _expected_fleet(hf, k), err_msg=k)
    back = dict(full_param(build_sharded_state_dict(fleet), {"aoa_statements": _stmts(cfg, "fleet_to_hf")}))
    assert set(back) == set(hf) and len(back) == len(hf) == 296
    for k, t in hf.items():
        assert back[k].dtype == t.dtype and tuple(back[k].shape) == tuple(t.shape), k
        assert back[k].numpy().tobytes() == t.numpy().tobytes(), k


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_engine_derived_inverse_matches_explicit_inverse():
    """``aoa_config_reverse=True`` over the hf->fleet program (casts in src/dst form) inverts it too."""
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import build_sharded_state_dict

    cfg = GlmMoeDsaConfig.from_pretrained(FIXTURE)
    hf = {
        k: v for k, v in _fixture_tensors().items() if k.startswith(("model.layers.0.", "model.layers.3.", "lm_head"))
    }
    units = [u for u in expand_units(cfg) if set(u.hf) <= set(hf)]
    hf_dt = {k: str(v.dtype).replace("paddle.", "") for k, v in hf.items()}
    fl_dt = {k: resolve_dtype(kind, "float32") for k, (_, kind) in fleet_param_specs(cfg).items()}
    fwd = build_statements(units, "hf_to_fleet", hf_dt, fl_dt)
    fleet = dict(full_param(build_sharded_state_dict(hf), {"aoa_statements": fwd}))
    back = dict(full_param(build_sharded_state_dict(fleet), {"aoa_statements": fwd, "aoa_config_reverse": True}))
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].numpy().tobytes() == hf[k].numpy().tobytes(), k


@pytest.mark.parametrize("expert_layout", ["per-expert", "grouped", "stacked"])
@pytest.mark.parametrize("path", [None, OFFICIAL])
def test_paddlefleet_units_cover_both_contracts_exactly_once(path, expert_layout):
    """HF <-> PaddleFleet (``layout="fleet"``) and PaddleFleet file <-> model: every tensor of each
    side belongs to exactly one unit, for the tiny and the 744B schedule."""
    from paddleformers_glm.checkpoint.aoa import fleet_units
    from paddleformers_glm.checkpoint.layout import model_param_specs, paddlefleet_param_specs

    cfg = _cfg(path) if path else _cfg()
    pf = paddlefleet_param_specs(cfg, expert_layout)
    for units, left, right in (
        (expand_units(cfg, layout="fleet", expert_layout=expert_layout), hf_param_specs(cfg), pf),
        (fleet_units(cfg, expert_layout), pf, model_param_specs(cfg)),
    ):
        a = [k for u in units for k in u.hf]
        b = [k for u in units for k in u.fleet]
        assert len(a) == len(set(a)) == len(left) and set(a) == set(left)
        assert len(b) == len(set(b)) == len(right) and set(b) == set(right)


def test_reverse_rules_are_generated_from_the_forward_ones():
    """The rules file writes one direction; the reverse of each statement form is made in code."""
    from paddleformers_glm.checkpoint.aoa import invert_statements

    assert invert_statements(["a.w -> b.w", "lm_head.weight^T -> lm_head.weight"]) == [
        "b.w -> a.w",
        "lm_head.weight^T -> lm_head.weight",
    ]
    # a fusion of transposed pieces: split first, then transpose each piece back
    assert invert_statements(["g^T, u^T -> m.up_gate_proj.weight, fused_ffn", "d^T -> m.down_proj.weight"]) == [
        "m.up_gate_proj.weight -> g, u, fused_ffn",
        "g^T -> g",
        "u^T -> u",
        "m.down_proj.weight^T -> d",
    ]
    assert invert_statements(["<L.experts.#.w> -> L.stacked, axis=0"]) == ["L.stacked -> <L.experts.#.w>, axis=0"]
    for bad in ("a -> b -> c", "a -> b^T", "a -> b, c"):
        with pytest.raises(ValueError, match="AOA statement"):
            invert_statements([bad])


def test_loaded_rules_carry_the_generated_reverse_and_keep_expert_ids_for_python():
    """Every unit (and PaddleFleet override, and adapter) has its reverse after loading; the
    `$EXPERT_ID` placeholder survives into the reverse so Python expands it, never the engine."""
    rules = load_rules()
    routed = next(u for u in rules["units"] if u["name"] == "moe_routed_expert")
    assert routed["fleet_to_hf"][0] == (
        "$FLEET.mlp.experts.$EXPERT_ID.up_gate_proj.weight -> "
        "$HF.mlp.experts.$EXPERT_ID.gate_proj.weight, $HF.mlp.experts.$EXPERT_ID.up_proj.weight, fused_ffn"
    )
    router = next(u for u in rules["units"] if u["name"] == "moe_router")
    assert router["paddlefleet"]["fleet_to_hf"] == [
        "$FLEET.mlp.gate.weight -> $HF.mlp.gate.weight",
        "$FLEET.mlp.gate.e_score_correction_bias -> $HF.mlp.gate.e_score_correction_bias",
    ]
    assert all("fleet_to_hf" in u for u in rules["units"])
    assert all("fleet_to_model" in a for a in rules["fleet_adapters"])


def test_rules_named_by_the_environment_are_used_or_the_command_says_they_are_missing(tmp_path, monkeypatch):
    """GLM52_AOA_MAPPINGS names the mapping rules (the file, or a folder holding glm_moe_dsa.json); a
    name that holds none fell back to the packaged rules without a word, so a typo converted with
    other rules than the user's, exit 0. Now it is refused naming the variable."""
    own = tmp_path / "rules"
    own.mkdir()
    shutil.copy(ROOT / "aoa_mappings" / "glm_moe_dsa.json", own / "glm_moe_dsa.json")
    monkeypatch.setenv("GLM52_AOA_MAPPINGS", str(own))
    assert rules_path() == str(own / "glm_moe_dsa.json")
    monkeypatch.setenv("GLM52_AOA_MAPPINGS", str(own / "glm_moe_dsa.json"))
    assert rules_path() == str(own / "glm_moe_dsa.json")
    for missing in (tmp_path / "typo", tmp_path):  # no such path; a folder without the rules
        monkeypatch.setenv("GLM52_AOA_MAPPINGS", str(missing))
        with pytest.raises(FileNotFoundError, match=f"GLM52_AOA_MAPPINGS={missing}: no mapping rules there"):
            rules_path()


def test_reading_a_share_drops_paddles_unexpected_keys_warning_only():
    """A rank resuming into another layout (one process's state into ``--ep 2``) reads only its
    share: Paddle's load_state_dict then warned "Unexpected keys: {...}" listing the other ranks'
    312 tensors in one 23 KB line, which reads like an error.  Within the read it is dropped; its
    "Missing keys" warning stays, and after the read both print again."""
    import logging

    from paddle.distributed.fleet.utils.log_util import logger

    from paddleformers_glm.checkpoint.aoa import reading_a_share

    class Kept(logging.Handler):  # what the logger passes on to its handlers (stderr in a run)
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    kept = Kept()
    logger.addHandler(kept)
    try:
        with reading_a_share():
            logger.warning("Unexpected keys:{'layers.1.mlp.experts.3'}, these keys exist in checkpoint")
            logger.warning("Missing keys:{'layers.0.weight'}, check whether the checkpoint is complete.")
        logger.warning("Unexpected keys:{'after'}, these keys exist in checkpoint")
    finally:
        logger.removeHandler(kept)
    assert [line.split(",")[0] for line in kept.lines] == [
        "Missing keys:{'layers.0.weight'}",
        "Unexpected keys:{'after'}",
    ]
