"""The routed experts of PaddleFleet's grouped and stacked layouts are stacked in expert order 0..E-1.

PaddleFleet's ``MoEAOAConfigGenerator`` (src/paddlefleet/transformers/aoa_config_base.py at
444bc3892a4a13583151b3376af347313fb8f0e3, the revision tests/fixtures/paddlefleet_contract.json
names) makes each expert's ``up_gate_proj.weight`` from ``gate_proj.weight^T, up_proj.weight^T``
(axis=1) and its ``down_proj.weight`` from ``down_proj.weight^T``; ``_get_grouped_gemm_statements``
then joins ``experts.{expert_id}.up_gate_proj.weight`` for ``expert_id in range(num_experts)`` into
``mlp.grouped_gemm_experts.weight1, axis=0`` (``down_proj`` into ``weight2``), and
``_get_fd_fallback_statements`` joins the same lists, in the same order, into ``mlp.experts.up_gate_proj``
/ ``mlp.experts.down_proj, axis=0``. The contract's ops ``experts_gate_up`` / ``experts_transpose``
say the same. So rows ``e*H:(e+1)*H`` of weight1 are expert e's ``[gate^T | up^T]`` and rows
``e*Im:(e+1)*Im`` of weight2 its ``down^T``.

Writing and reading through one mapping stay consistent with each other even with the order
reversed; these tests hold each direction against tensors stacked here with numpy from the HF
fixture: what ``convert`` writes, and what a PaddleFleet file stacked in that order loads as.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import load_pretrained_state
from paddleformers_glm.checkpoint.convert import convert_checkpoint
from paddleformers_glm.testing import SpecModel

from .conftest import FIXTURES
from .test_fleet_layouts import _read  # every tensor of a folder, through the safetensors library

SRC = FIXTURES / "tiny" / "checkpoint"
CONTRACT = json.loads((FIXTURES / "paddlefleet_contract.json").read_text())
pytestmark = pytest.mark.skipif(not SRC.exists(), reason="HF fixture checkpoint not present")
LAYOUTS = ["grouped", "stacked"]


@pytest.fixture(scope="module")
def cfg():
    return GlmMoeDsaConfig.from_pretrained(SRC)


@pytest.fixture(scope="module")
def hf():
    return {k: v.astype("float32").numpy() for k, v in _read(SRC).items()}  # bf16 -> fp32 is exact


def _moe_layers(cfg) -> list[tuple[str, str]]:
    """(HF prefix, PaddleFleet prefix) of every layer with routed experts, the MTP layer included."""
    L = int(cfg.num_hidden_layers)
    out = []
    for i in range(L + int(cfg.num_mtp_layers)):
        if i < L and cfg.mlp_layer_types[i] != "sparse":
            continue
        kind = "mtp" if i >= L else "moe_shared"
        out.append((f"model.layers.{i}", CONTRACT["layer_kinds"][kind]["prefix"].replace("{L}", f"model.layers.{i}")))
    return out


def _names(layout: str, P: str) -> tuple[str, str]:
    w1, w2 = (e["fleet"].replace("{P}", P) for e in CONTRACT["experts"][layout])
    return w1, w2


def _stacked(hf: dict, L: str, E: int) -> tuple[np.ndarray, np.ndarray]:
    """weight1 / weight2 stacked in expert order 0..E-1 from the HF per-expert tensors."""
    up_gate = [
        np.concatenate([hf[f"{L}.mlp.experts.{e}.gate_proj.weight"].T, hf[f"{L}.mlp.experts.{e}.up_proj.weight"].T], 1)
        for e in range(E)
    ]
    down = [hf[f"{L}.mlp.experts.{e}.down_proj.weight"].T for e in range(E)]
    return np.concatenate(up_gate, axis=0), np.concatenate(down, axis=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_writes_the_experts_in_expert_order(cfg, hf, tmp_path, layout):
    convert_checkpoint(SRC, tmp_path / layout, layout="fleet", expert_layout=layout)
    saved = _read(tmp_path / layout)
    E = int(cfg.n_routed_experts)
    layers = _moe_layers(cfg)
    assert len(layers) >= 2
    for L, P in layers:
        w1, w2 = _names(layout, P)
        want1, want2 = _stacked(hf, L, E)
        np.testing.assert_array_equal(saved[w1].astype("float32").numpy(), want1, err_msg=w1)
        np.testing.assert_array_equal(saved[w2].astype("float32").numpy(), want2, err_msg=w2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_paddlefleet_file_stacked_in_expert_order_loads_each_expert_into_its_slot(cfg, hf, tmp_path, layout):
    """The other tensors of the file are ``convert``'s; every expert tensor is replaced by the numpy
    stack above (one file, the safetensors library's writer). The model it loads equals the model
    loaded from the HF fixture, expert for expert."""
    import paddle
    from safetensors.paddle import save_file

    convert_checkpoint(SRC, tmp_path / "conv", layout="fleet", expert_layout=layout)
    tensors = _read(tmp_path / "conv")
    E = int(cfg.n_routed_experts)
    for L, P in _moe_layers(cfg):
        for name, a in zip(_names(layout, P), _stacked(hf, L, E)):
            assert tuple(tensors[name].shape) == a.shape, name
            tensors[name] = paddle.to_tensor(np.ascontiguousarray(a)).astype(tensors[name].dtype)
    folder = tmp_path / "pf"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_bytes((tmp_path / "conv" / "config.json").read_bytes())

    model = SpecModel(cfg, "float32")
    rep = load_pretrained_state(model, folder)
    assert rep.layout == "fleet" and not rep.missing
    ref = SpecModel(cfg, "float32")
    load_pretrained_state(ref, SRC)
    got, want = model.state_dict(), ref.state_dict()
    experts = [k for k in want if ".mlp.experts." in k]
    assert len(experts) >= 2 * E
    for k in experts:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
