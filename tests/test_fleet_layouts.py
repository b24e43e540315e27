"""PaddleFleet-layout files end to end: each expert layout written by ``glm52 convert`` loads and
equals the HF source and converts back to the same bytes; the old spelling loads with a warning; a
file without the MTP indexer loads with a warning; a tensor-parallel interleaved file loads when its
metadata says so; ``check-ckpt`` finds no difference against an independently made PaddleFleet file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import (
    CheckpointError,
    load_pretrained_state,
    paddlefleet_param_specs,
)
from paddleformers_glm.checkpoint.convert import convert_checkpoint
from paddleformers_glm.testing import SpecModel

from .conftest import FIXTURES

SRC = FIXTURES / "tiny" / "checkpoint"
CONTRACT = json.loads((FIXTURES / "paddlefleet_contract.json").read_text())
pytestmark = pytest.mark.skipif(not SRC.exists(), reason="HF fixture checkpoint not present")


def _read(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _write(folder, tensors: dict, metadata: dict | None = None) -> None:
    """An independent writer (the safetensors library), one file, config beside it."""
    from safetensors.paddle import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata=metadata)
    (folder / "config.json").write_bytes((SRC / "config.json").read_bytes())


def _state(model) -> dict:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def cfg():
    return GlmMoeDsaConfig.from_pretrained(SRC)


@pytest.fixture(scope="module")
def from_hf(cfg):
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, SRC)
    return _state(model)


@pytest.fixture(scope="module")
def exports(cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    for el in ("per-expert", "grouped", "stacked"):
        convert_checkpoint(SRC, root / el, layout="fleet", expert_layout=el, max_shard_size="400KB")
    return root


@pytest.mark.parametrize("expert_layout", ["per-expert", "grouped", "stacked"])
def test_each_expert_layout_loads_equal_to_hf_and_converts_back_byte_identical(
    cfg, from_hf, exports, tmp_path, expert_layout
):
    folder = exports / expert_layout
    saved = _read(folder)
    specs = paddlefleet_param_specs(cfg, expert_layout)
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: s for k, (s, _) in specs.items()}
    names = {e["fleet"].split("{P}.")[-1] for e in CONTRACT["experts"][expert_layout]}
    assert all(any(k.endswith(n.replace("{e}", "0")) for k in saved) for n in names)  # contract spelling
    assert str(saved["model.layers.3.mlp.gate.weight"].dtype) == "paddle.float32"
    model = SpecModel(cfg, "float32")
    rep = load_pretrained_state(model, folder)
    assert rep.layout == "fleet" and not rep.missing and not rep.warnings
    assert _state(model) == from_hf
    convert_checkpoint(folder, tmp_path / "hf", layout="hf", max_shard_size="700KB")
    src, back = _read(SRC), _read(tmp_path / "hf")
    assert set(src) == set(back)
    for k in src:
        assert src[k].numpy().tobytes() == back[k].numpy().tobytes() and src[k].dtype == back[k].dtype, k


def test_old_fleet_spelling_loads_with_a_warning(cfg, from_hf, tmp_path):
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, SRC)
    _write(tmp_path / "old", dict(model.state_dict()))  # the model's own names: lm_head [H, V], router [H, E]
    back = SpecModel(cfg, "float32")
    with pytest.warns(FutureWarning, match="model.lm_head.weight"):
        rep = load_pretrained_state(back, tmp_path / "old")
    assert rep.layout == "fleet-legacy" and any("--to fleet" in w for w in rep.warnings)
    assert _state(back) == from_hf


def test_mtp_indexer_absent_from_a_paddlefleet_file_is_initialised_with_a_warning(cfg, from_hf, exports, tmp_path):
    tensors = _read(exports / "per-expert")
    gone = [k for k in tensors if k.startswith("model.layers.8.transformer_layer.self_attn.core_attention.indexer.")]
    assert len(gone) == 5
    _write(tmp_path / "skip", {k: v for k, v in tensors.items() if k not in gone})
    model = SpecModel(cfg, "float32")
    with pytest.warns(UserWarning, match="MTP layer's indexer"):
        rep = load_pretrained_state(model, tmp_path / "skip")  # strict, and still loads
    assert any("initialised" in w for w in rep.warnings)
    got = _state(model)
    assert {k for k in got if got[k] != from_hf[k]} <= set(gone)
    sd = model.state_dict()
    p = "model.layers.8.transformer_layer.self_attn.core_attention.indexer."
    assert np.all(sd[p + "k_norm.weight"].numpy() == 1) and np.all(sd[p + "k_norm.bias"].numpy() == 0)
    w = sd[p + "wq_b.weight"].numpy()
    assert 0.01 < w.std() < 0.03 and abs(w.mean()) < 0.01  # N(0, initializer_range = 0.02)
    # only some of them gone is damage, not a writer's choice
    _write(tmp_path / "partial", {k: v for k, v in tensors.items() if k != gone[0]})
    with pytest.raises(CheckpointError, match="missing 1 key"):
        load_pretrained_state(SpecModel(cfg, "float32"), tmp_path / "partial")


def _interleave(a: np.ndarray, n: int) -> np.ndarray:
    """[gate | up] -> [gate_0 | up_0 | gate_1 | up_1 | ...] (what an n-way column-parallel writer stores)."""
    gate, up = np.split(a, 2, axis=1)
    return np.concatenate([p for r in range(n) for p in (np.split(gate, n, 1)[r], np.split(up, n, 1)[r])], axis=1)


def test_tensor_parallel_interleaved_fused_ffn_loads_when_the_metadata_says_so(cfg, from_hf, exports, tmp_path):
    import paddle

    tensors = _read(exports / "per-expert")
    fused = [k for k in tensors if k.endswith(("mlp.up_gate_proj.weight", "shared_experts.up_gate_proj.weight"))]
    assert len(fused) == 3 + 6
    mixed = dict(tensors)
    for k in fused:
        mixed[k] = paddle.to_tensor(_interleave(tensors[k].astype("float32").numpy(), 2)).astype(tensors[k].dtype)
    _write(tmp_path / "tp2", mixed, {"format": "pt", "fused_ffn_tp_degree": "2"})
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, tmp_path / "tp2")
    assert _state(model) == from_hf
    with pytest.raises(ValueError, match="interleaved"):  # Paddle's file driver cannot: refused, not misread
        load_pretrained_state(SpecModel(cfg, "float32"), tmp_path / "tp2", backend="paddle")
    _write(tmp_path / "unmarked", mixed)  # same bytes without the marker: read as plain [gate | up]
    plain = SpecModel(cfg, "float32")
    load_pretrained_state(plain, tmp_path / "unmarked")
    differ = {k for k, v in _state(plain).items() if v != from_hf[k]}
    assert differ == set(fused)


def _independent_paddlefleet_file(cfg, folder) -> None:
    """A PaddleFleet-layout file made from the contract alone: its ops in numpy on the HF tensors."""
    import paddle

    hf = _read(SRC)
    L = int(cfg.num_hidden_layers)
    out = {}

    def put(e, Lp, P, x=None):
        def sub(s):
            s = s.replace("{L}", Lp).replace("{P}", P)
            return s if x is None else s.replace("{e}", str(x))

        src = [hf[sub(h)].astype("float32").numpy() for h in e["hf"]]
        op = e["op"]
        a = {"copy": lambda: src[0], "transpose": lambda: src[0].T}.get(op, lambda: None)()
        if op == "gate_up":
            a = np.concatenate([src[0].T, src[1].T], axis=1)
        dtype = "float32" if e["dtype"] == "float32" else str(hf[sub(e["hf"][0])].dtype).replace("paddle.", "")
        out[sub(e["fleet"])] = paddle.to_tensor(np.ascontiguousarray(a)).astype(dtype)

    for e in CONTRACT["global"]:
        put(e, "", "")
    for i in range(L + int(cfg.num_mtp_layers)):
        mtp = i >= L
        full = mtp or cfg.indexer_types[i] == "full"
        moe = mtp or cfg.mlp_layer_types[i] == "sparse"
        kind = (
            "mtp"
            if mtp
            else {(True, False): "dense_full", (False, True): "moe_shared", (True, True): "moe_full"}[(full, moe)]
        )
        spec = CONTRACT["layer_kinds"][kind]
        Lp = f"model.layers.{i}"
        P = spec["prefix"].replace("{L}", Lp)
        for block in spec["blocks"]:
            for e in CONTRACT["experts"]["per-expert"] if block == "experts" else CONTRACT["blocks"][block]:
                for x in range(int(cfg.n_routed_experts)) if "{e}" in e["fleet"] else [None]:
                    put(e, Lp, P, x)
    _write(folder, out, {"format": "pt"})


def test_check_ckpt_finds_no_difference_against_an_independent_paddlefleet_file(cfg, exports, tmp_path):
    from paddleformers_glm.parity.ckpt_check import check_checkpoints

    _independent_paddlefleet_file(cfg, tmp_path / "pf")
    rep = check_checkpoints(str(tmp_path / "pf"), str(exports / "per-expert"), layout="fleet")
    assert rep["exit_code"] == 0, rep.get("errors")
    assert rep["counts"]["naming"] == 0 and rep["counts"]["structural"] == 0 and rep["counts"]["value"] == 0
    assert rep["counts"]["matched"] == 239
    # the HF source against our fleet file: every difference is a naming one
    rep = check_checkpoints(str(SRC), str(exports / "grouped"), layout="fleet")
    assert rep["exit_code"] == 0 and rep["counts"]["structural"] == 0 and rep["counts"]["value"] == 0


def test_hf_layout_refuses_an_expert_layout(tmp_path):
    with pytest.raises(ValueError, match="fleet layout only"):
        convert_checkpoint(SRC, tmp_path / "x", layout="hf", expert_layout="grouped")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("which", ["per-expert", "grouped", "stacked", "tp2"])
def test_expert_and_tensor_parallel_ranks_get_their_fused_pieces_from_every_fleet_layout(cfg, exports, tmp_path, which):
    """A rank holding half the columns of a fused weight (``shard_info`` lists both ranks' pieces)
    gets Fleet's per-rank ``[gate_r | up_r]`` from every PaddleFleet file, as from the HF one."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    hf = _read(SRC)
    if which == "tp2":
        tensors = _read(exports / "per-expert")
        fused = [k for k in tensors if k.endswith(("mlp.up_gate_proj.weight", "shared_experts.up_gate_proj.weight"))]
        for k in fused:
            tensors[k] = paddle.to_tensor(_interleave(tensors[k].astype("float32").numpy(), 2)).astype(tensors[k].dtype)
        folder = tmp_path / "tp2"
        _write(folder, tensors, {"format": "pt", "fused_ffn_tp_degree": "2"})
    else:
        folder = exports / which
    for key, hf_key, I in (
        ("model.layers.3.mlp.experts.2.up_gate_proj.weight", "model.layers.3.mlp.experts.2.{}_proj.weight", 32),
        (
            "model.layers.8.transformer_layer.mlp.experts.7.up_gate_proj.weight",
            "model.layers.8.mlp.experts.7.{}_proj.weight",
            32,
        ),
        ("model.layers.1.mlp.up_gate_proj.weight", "model.layers.1.mlp.{}_proj.weight", 128),
        (
            "model.layers.6.mlp.shared_experts.up_gate_proj.weight",
            "model.layers.6.mlp.shared_experts.{}_proj.weight",
            32,
        ),
    ):
        g = hf[hf_key.format("gate")].astype("float32").numpy().T
        u = hf[hf_key.format("up")].astype("float32").numpy().T
        h = I // 2
        info = {key: [((64, I), (0, 0)), ((64, I), (0, I))]}
        for r in range(2):
            state = {key: ShardedWeight(key, paddle.zeros([64, I]), (64, I), (64, 2 * I), (0, I * r))}
            load_pretrained_state(state, folder, config=cfg, keys=[key], shard_info=info)
            want = np.concatenate([g[:, h * r : h * (r + 1)], u[:, h * r : h * (r + 1)]], 1)
            np.testing.assert_array_equal(state[key].local_tensor.numpy(), want, err_msg=f"{which} {key} rank {r}")
