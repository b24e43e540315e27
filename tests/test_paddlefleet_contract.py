"""Our "fleet" layout is PaddleFleet's, tensor for tensor: the contract in
tests/fixtures/paddlefleet_contract.json (written by hand from PaddleFleet's sources at the commits it
names) against our specs and our AOA rules, in both directions, for the tiny and the 744B config."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint.aoa import build_statements, expand_units
from paddleformers_glm.checkpoint.layout import EXPERT_LAYOUTS, hf_param_specs, paddlefleet_param_specs, resolve_dtype

from ._tiny import config_from
from .conftest import FIXTURES, ROOT

CONTRACT = json.loads((FIXTURES / "paddlefleet_contract.json").read_text())
TINY_CKPT = FIXTURES / "tiny" / "checkpoint"


def _entries(name: str, expert_layout: str) -> list[dict]:
    """The contract's tensors for one config: globals + every listed layer of each kind, expanded."""
    c = CONTRACT["configs"][name]
    dims = c["dims"]
    out = []

    def add(e: dict, L: str, P: str) -> None:
        shape = tuple(int(eval(s, {}, dict(dims))) for s in e["shape"])  # products of named dims
        experts = range(dims["E"]) if "{e}" in e["fleet"] or any("{e}" in h for h in e["hf"]) else [None]
        if e["op"].startswith("experts_"):
            hf = [h.replace("{L}", L).replace("{e}", str(x)) for x in range(dims["E"]) for h in e["hf"]]
            out.append({**e, "fleet": e["fleet"].replace("{P}", P), "hf": hf, "shape": shape})
            return
        for x in experts:

            def sub(s: str, x=x) -> str:
                s = s.replace("{L}", L).replace("{P}", P)
                return s if x is None else s.replace("{e}", str(x))

            out.append({**e, "fleet": sub(e["fleet"]), "hf": [sub(h) for h in e["hf"]], "shape": shape})

    for e in CONTRACT["global"]:
        add(e, "", "")
    for kind, layers in c["layers"].items():
        spec = CONTRACT["layer_kinds"][kind]
        for i in layers:
            L = f"model.layers.{i}"
            P = spec["prefix"].replace("{L}", L)
            for block in spec["blocks"]:
                for e in CONTRACT["experts"][expert_layout] if block == "experts" else CONTRACT["blocks"][block]:
                    add(e, L, P)
    return out


def _config(name: str) -> GlmMoeDsaConfig:
    return config_from(ROOT / CONTRACT["configs"][name]["config"])


def _in_listed_layers(key: str, name: str) -> bool:
    layers = {i for ls in CONTRACT["configs"][name]["layers"].values() for i in ls}
    if not key.startswith("model.layers."):
        return True
    return int(key.split(".")[2]) in layers


@pytest.mark.parametrize("expert_layout", EXPERT_LAYOUTS)
@pytest.mark.parametrize("name", ["tiny", "744b"])
def test_specs_equal_the_contract(name, expert_layout):
    cfg = _config(name)
    ours = paddlefleet_param_specs(cfg, expert_layout)
    assert len(ours) == CONTRACT["configs"][name]["counts"][expert_layout]
    want = {e["fleet"]: (e["shape"], e["dtype"]) for e in _entries(name, expert_layout)}
    got = {k: v for k, v in ours.items() if _in_listed_layers(k, name)}
    assert set(got) == set(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    for k, (shape, kind) in want.items():
        assert got[k] == (shape, "float32" if kind == "float32" else "model"), k


@pytest.mark.parametrize(
    "name, expert_layout",
    [("tiny", el) for el in EXPERT_LAYOUTS]
    + [("744b", "per-expert")]
    + [pytest.param("744b", el, marks=pytest.mark.slow) for el in ("grouped", "stacked")],  # ~15 s each
)
def test_rules_map_the_contract_both_ways_at_full_scale(name, expert_layout):
    """Paddle's engine plans our rules on metadata only (no tensor is made, so the 744B shapes are
    fine): every PaddleFleet tensor comes from exactly the contract's HF tensors, transposed exactly
    when the contract says so, and every HF tensor comes back from its PaddleFleet tensor."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    cfg = _config(name)
    entries = _entries(name, expert_layout)
    listed = {e["fleet"] for e in entries}
    units = [u for u in expand_units(cfg, layout="fleet", expert_layout=expert_layout) if set(u.fleet) & listed]
    hf_specs, pf_specs = hf_param_specs(cfg), paddlefleet_param_specs(cfg, expert_layout)
    hf_dt = {k: resolve_dtype(kind, "bfloat16") for k, (_, kind) in hf_specs.items()}
    pf_dt = {k: resolve_dtype(kind, "bfloat16") for k, (_, kind) in pf_specs.items()}

    def desc(k, specs, dt):
        s = tuple(specs[k][0])
        return ShardedWeightDesc(k, s, s, (0,) * len(s), dt[k])

    by_layer: dict = {}
    for u in units:
        by_layer.setdefault(u.layer, []).append(u)
    by_fleet = {e["fleet"]: e for e in entries}
    owners: dict = {}
    for e in entries:
        for h in e["hf"]:
            owners.setdefault(h, []).append(e)
    checked_fwd = checked_inv = 0
    for group in by_layer.values():
        hf_keys = [k for u in group for k in u.hf]
        pf_keys = [k for u in group for k in u.fleet]
        for direction, srcs, dsts, sspec, dspec, sdt, ddt in (
            ("hf_to_fleet", hf_keys, pf_keys, hf_specs, pf_specs, hf_dt, pf_dt),
            ("fleet_to_hf", pf_keys, hf_keys, pf_specs, hf_specs, pf_dt, hf_dt),
        ):
            stmts = build_statements(group, direction, sdt, ddt)
            # no macro and no expert list left for the engine, in either direction (Paddle expands
            # $EXPERT_ID only against source keys, which breaks the inverse on intermediates)
            assert not [s for s in stmts if "$" in s or "<" in s or "#" in s]
            engine = AOAEngine(
                {"aoa_statements": stmts},
                {k: [desc(k, sspec, sdt)] for k in srcs},
                {k: [desc(k, dspec, ddt)] for k in dsts},
            )
            for k in dsts:
                maps = engine.find_shard_sources(desc(k, dspec, ddt))
                sources = {m.source_slice.key for m in maps}
                transposed = {any(str(p).startswith("[") for p in (m.postprocess_list or [])) for m in maps}
                if direction == "hf_to_fleet":
                    e = by_fleet[k]
                    assert sources == set(e["hf"]), k
                    assert transposed == {e["op"] != "copy"}, (k, e["op"])
                    checked_fwd += 1
                else:
                    owner = owners[k]
                    assert len(owner) == 1 and sources == {owner[0]["fleet"]}, k
                    assert transposed == {owner[0]["op"] != "copy"}, k
                    checked_inv += 1
    assert checked_fwd == len(entries)
    assert checked_inv == sum(len(e["hf"]) for e in entries)


def _expected(e: dict, hf: dict) -> np.ndarray:
    """The contract's op, in numpy, on the HF tensors (independent of the rules)."""
    src = [hf[k] for k in e["hf"]]
    op = e["op"]
    if op == "copy":
        return src[0]
    if op == "transpose":
        return src[0].T
    if op == "gate_up":
        return np.concatenate([src[0].T, src[1].T], axis=1)
    if op == "experts_gate_up":
        return np.concatenate([np.concatenate([g.T, u.T], axis=1) for g, u in zip(src[0::2], src[1::2])], axis=0)
    if op == "experts_transpose":
        return np.concatenate([d.T for d in src], axis=0)
    raise AssertionError(op)


@pytest.mark.skipif(not TINY_CKPT.exists(), reason="HF fixture checkpoint not present")
@pytest.mark.parametrize("expert_layout", EXPERT_LAYOUTS)
def test_tiny_values_follow_the_contract_and_come_back_bit_exact(expert_layout):
    """Paddle's ``full_param`` runs our HF -> PaddleFleet program on the HF fixture: every listed
    tensor equals the contract's op on the HF tensors; the inverse program gives the HF bytes back."""
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import build_sharded_state_dict
    from safetensors import safe_open

    cfg = GlmMoeDsaConfig.from_pretrained(TINY_CKPT)
    hf_pd = {}
    for f in sorted(TINY_CKPT.glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as fh:
            hf_pd.update({k: fh.get_tensor(k) for k in fh.keys()})
    hf_np = {k: v.astype("float32").numpy() for k, v in hf_pd.items()}  # bf16 -> fp32 is exact
    units = expand_units(cfg, layout="fleet", expert_layout=expert_layout)
    specs = paddlefleet_param_specs(cfg, expert_layout)
    hf_dt = {k: str(v.dtype).replace("paddle.", "") for k, v in hf_pd.items()}
    pf_dt = {k: resolve_dtype(kind, "bfloat16") for k, (_, kind) in specs.items()}
    fleet = dict(
        full_param(
            build_sharded_state_dict(hf_pd), {"aoa_statements": build_statements(units, "hf_to_fleet", hf_dt, pf_dt)}
        )
    )
    assert set(fleet) == set(specs)
    for e in _entries("tiny", expert_layout):
        t = fleet[e["fleet"]]
        assert str(t.dtype) == ("paddle.float32" if e["dtype"] == "float32" else "paddle.bfloat16"), e["fleet"]
        np.testing.assert_array_equal(t.astype("float32").numpy(), _expected(e, hf_np), err_msg=e["fleet"])
    back = dict(
        full_param(
            build_sharded_state_dict(fleet), {"aoa_statements": build_statements(units, "fleet_to_hf", pf_dt, hf_dt)}
        )
    )
    assert set(back) == set(hf_pd)
    for k, t in hf_pd.items():
        assert back[k].numpy().tobytes() == t.numpy().tobytes(), k
