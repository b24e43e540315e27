"""The load path's rules at its edges: what a partly present checkpoint loads under ``strict=False``,
which absences strict refuses and which it initialises (the MTP layer, its indexer), the shape
check of the model's own parameters, what a tensor-parallel rank reads from PaddleFleet and
old-spelling files, and ``n_shared_experts`` 0."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import paddleformers_glm
from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import CheckpointError, load_pretrained_state
from paddleformers_glm.checkpoint.convert import convert_checkpoint
from paddleformers_glm.testing import SpecModel

ROOT = pathlib.Path(paddleformers_glm.__file__).resolve().parents[1]
SRC = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"


def _read(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _write(folder, tensors: dict, config_src=SRC, metadata=None) -> pathlib.Path:
    from safetensors.paddle import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata=metadata)
    (folder / "config.json").write_bytes((pathlib.Path(config_src) / "config.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def cfg():
    return GlmMoeDsaConfig.from_pretrained(SRC)


@pytest.fixture(scope="module")
def fleet_tensors(tmp_path_factory):
    out = tmp_path_factory.mktemp("fleet") / "per-expert"
    convert_checkpoint(SRC, out, layout="fleet", expert_layout="per-expert")
    return _read(out)


def test_paddlefleet_file_without_any_mtp_tensor_initialises_the_mtp_layer(cfg, fleet_tensors, tmp_path):
    """A PaddleFleet-layout file with no model.layers.8.* at all loads (strict) and initialises the
    whole MTP layer, as the official layout does (not a 'missing keys' refusal)."""
    kept = {k: v for k, v in fleet_tensors.items() if not k.startswith("model.layers.8.")}
    folder = _write(tmp_path / "nomtp", kept)
    report = load_pretrained_state(SpecModel(cfg, "float32"), folder)
    assert report.layout == "fleet"
    assert report.initialized and all(k.startswith("model.layers.8.") for k in report.initialized)
    assert not report.missing


def test_paddlefleet_file_lacking_only_the_mtp_router_is_refused(cfg, fleet_tensors, tmp_path):
    """One MTP tensor (the MTP layer's router) absent while the rest of the MTP layer is there is
    damage: strict loading refuses it and names the key, it is not silently initialised."""
    key = "model.layers.8.transformer_layer.mlp.gate.weight"
    assert key in fleet_tensors
    kept = {k: v for k, v in fleet_tensors.items() if k != key}
    folder = _write(tmp_path / "norouter", kept)
    with pytest.raises(CheckpointError, match="missing"):
        load_pretrained_state(SpecModel(cfg, "float32"), folder)


def _interleave(a: np.ndarray, n: int) -> np.ndarray:
    """[gate | up] -> [gate_0 | up_0 | gate_1 | up_1 | ...] (an n-way column-parallel writer's bytes)."""
    gate, up = np.split(a, 2, axis=1)
    return np.concatenate([p for r in range(n) for p in (np.split(gate, n, 1)[r], np.split(up, n, 1)[r])], axis=1)


def _state(model) -> dict:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


def test_convert_of_a_tensor_parallel_paddlefleet_file_to_paddlefleet_writes_plain_gate_up(
    cfg, fleet_tensors, tmp_path
):
    """`convert` of a PaddleFleet file whose fused_ffn weights are TP-interleaved (metadata
    fused_ffn_tp_degree=2) into the PaddleFleet layout: the output holds plain [gate | up] and loads
    equal to the official source (the load's and the save's unit lists are not confused)."""
    import paddle

    fused = [k for k in fleet_tensors if k.endswith(("mlp.up_gate_proj.weight", "shared_experts.up_gate_proj.weight"))]
    mixed = dict(fleet_tensors)
    for k in fused:
        mixed[k] = paddle.to_tensor(_interleave(fleet_tensors[k].astype("float32").numpy(), 2)).astype(
            fleet_tensors[k].dtype
        )
    tp = _write(tmp_path / "tp2", mixed, metadata={"format": "pt", "fused_ffn_tp_degree": "2"})
    out = tmp_path / "plain"
    convert_checkpoint(tp, out, layout="fleet", expert_layout="per-expert")
    written = _read(out)
    for k in fused:
        np.testing.assert_array_equal(
            written[k].astype("float32").numpy(), fleet_tensors[k].astype("float32").numpy(), err_msg=k
        )
    a, b = SpecModel(cfg, "float32"), SpecModel(cfg, "float32")
    load_pretrained_state(a, SRC)
    load_pretrained_state(b, out)
    assert _state(a) == _state(b)


@pytest.mark.parametrize("layout", ["hf", "fleet"])
def test_no_shared_experts_config_saves_exactly_the_contract_keys(tmp_path, layout):
    """n_shared_experts=0: the mapping has no shared-expert unit, so save writes exactly the
    contract's tensors (no shared_experts key) and the file loads back strict."""
    from paddleformers_glm.checkpoint.aoa import expand_units
    from paddleformers_glm.checkpoint.layout import hf_param_specs, param_specs
    from paddleformers_glm.checkpoint.saver import save_pretrained_state

    cfg0 = GlmMoeDsaConfig.from_pretrained(SRC)
    cfg0.n_shared_experts = 0
    units = expand_units(cfg0)
    assert not [k for u in units for k in u.hf if ".shared_experts." in k]
    assert {k for u in units for k in u.hf} == set(hf_param_specs(cfg0))
    model = SpecModel(cfg0, "float32")
    save_pretrained_state(model, cfg0, tmp_path / "out", layout=layout)
    assert set(_read(tmp_path / "out")) == set(param_specs(cfg0, layout))
    load_pretrained_state(SpecModel(cfg0, "float32"), tmp_path / "out", config=cfg0)


def test_checkpoint_with_real_shared_experts_is_refused_by_a_config_without_them():
    """A config with n_shared_experts=0 loading a checkpoint whose shared experts have weights
    (non-empty tensors): strict refuses the unexpected keys; only transformers' zero-size
    placeholders are passed over."""
    cfg0 = GlmMoeDsaConfig.from_pretrained(SRC)
    cfg0.n_shared_experts = 0
    with pytest.raises(CheckpointError, match="unexpected"):
        load_pretrained_state(SpecModel(cfg0, "float32"), SRC, config=cfg0)
    report = load_pretrained_state(SpecModel(cfg0, "float32"), SRC, config=cfg0, strict=False)
    assert any(".mlp.shared_experts." in k for k in report.unexpected)


def test_unexpected_key_inside_the_built_mtp_layer_is_refused(tmp_path):
    """A stray tensor under model.layers.8 (the MTP layer the config builds) is an unexpected key,
    refused under strict; only layers past the config's MTP layers are skipped with a warning."""
    import paddle

    tensors = _read(SRC)
    tensors["model.layers.8.self_attn.stray.weight"] = paddle.ones([4], dtype="float32")
    folder = _write(tmp_path / "stray", tensors)
    cfg = GlmMoeDsaConfig.from_pretrained(SRC)
    with pytest.raises(CheckpointError, match="stray"):
        load_pretrained_state(SpecModel(cfg, "float32"), folder)


def test_paddlefleet_file_without_mtp_indexer_initialises_it_the_same_on_every_load(cfg, fleet_tensors, tmp_path):
    """The MTP indexer a PaddleFleet writer skipped is initialised from seeds named by key: two loads
    of the same file give bit-identical models."""
    kept = {k: v for k, v in fleet_tensors.items() if not (k.startswith("model.layers.8.") and ".indexer." in k)}
    folder = _write(tmp_path / "noidx", kept)
    a, b = SpecModel(cfg, "float32"), SpecModel(cfg, "float32")
    import paddle

    paddle.seed(1)
    load_pretrained_state(a, folder)
    paddle.seed(2)
    load_pretrained_state(b, folder)
    key = "model.layers.8.transformer_layer.self_attn.core_attention.indexer.wq_b.weight"
    assert _state(a)[key] == _state(b)[key]
    assert _state(a) == _state(b)


@pytest.mark.parametrize("degree", ["0", "-2", "two"])
def test_non_positive_fused_ffn_tp_degree_is_refused(fleet_tensors, tmp_path, degree):
    """fused_ffn_tp_degree metadata that is not a positive integer is refused, not read as 'plain'."""
    cfg = GlmMoeDsaConfig.from_pretrained(SRC)
    folder = _write(tmp_path / f"tp{degree}", fleet_tensors, metadata={"format": "pt", "fused_ffn_tp_degree": degree})
    with pytest.raises(CheckpointError, match="fused_ffn_tp_degree"):
        load_pretrained_state(SpecModel(cfg, "float32"), folder)


def test_tensor_parallel_ranks_get_gate_up_pieces_from_an_old_spelling_fleet_file(cfg, tmp_path):
    """A file in the old 'fleet' spelling (the model's own state-dict names, [gate | up] fused): a
    rank holding half the columns of a fused weight (``shard_info`` lists both ranks' pieces) gets
    Fleet's per-rank ``[gate_r | up_r]``, as from the official file, not a plain column slice."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    full = SpecModel(cfg, "float32")
    load_pretrained_state(full, SRC)
    folder = _write(tmp_path / "legacy", {k: v.clone() for k, v in full.state_dict().items()})
    for key, I in (
        ("model.layers.1.mlp.up_gate_proj.weight", 128),
        ("model.layers.6.mlp.shared_experts.up_gate_proj.weight", 32),
        ("model.layers.3.mlp.experts.2.up_gate_proj.weight", 32),
    ):
        whole = full.state_dict()[key].numpy()
        g, u = whole[:, :I], whole[:, I:]
        h = I // 2
        info = {key: [((64, I), (0, 0)), ((64, I), (0, I))]}
        for r in range(2):
            state = {key: ShardedWeight(key, paddle.zeros([64, I]), (64, I), (64, 2 * I), (0, I * r))}
            with pytest.warns(FutureWarning):
                load_pretrained_state(state, folder, config=cfg, keys=[key], shard_info=info)
            want = np.concatenate([g[:, h * r : h * (r + 1)], u[:, h * r : h * (r + 1)]], 1)
            np.testing.assert_array_equal(state[key].local_tensor.numpy(), want, err_msg=f"{key} rank {r}")


def test_tensor_parallel_rank_initialises_its_gate_up_piece_of_the_single_process_mtp_matrix(cfg, tmp_path):
    """An official folder without MTP weights: the MTP layer is initialised from key-seeded draws, and a
    tensor-parallel rank holding [gate_r | up_r] of a fused weight gets exactly that piece of the matrix
    one process draws (so a TP run starts from the same MTP weights as a single process)."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from paddleformers_glm.parallel.layers import ShardSpec, set_shard_spec

    kept = {k: v for k, v in _read(SRC).items() if not k.startswith("model.layers.8.")}
    folder = _write(tmp_path / "nomtp", kept)
    full = SpecModel(cfg, "float32")
    report = load_pretrained_state(full, folder)
    assert report.initialized
    for key, I in (
        ("model.layers.8.transformer_layer.mlp.shared_experts.up_gate_proj.weight", 32),
        ("model.layers.8.transformer_layer.mlp.experts.5.up_gate_proj.weight", 32),
    ):
        whole = full.state_dict()[key].numpy()
        g, u = whole[:, :I], whole[:, I:]
        h = I // 2
        info = {key: [((64, I), (0, 0)), ((64, I), (0, I))]}
        for r in range(2):
            t = paddle.zeros([64, I])
            set_shard_spec(t, ShardSpec(axis=1, chunks=2), split=2)
            state = {key: ShardedWeight(key, t, (64, I), (64, 2 * I), (0, I * r))}
            load_pretrained_state(state, folder, config=cfg, keys=[key], shard_info=info)
            want = np.concatenate([g[:, h * r : h * (r + 1)], u[:, h * r : h * (r + 1)]], 1)
            np.testing.assert_array_equal(state[key].local_tensor.numpy(), want, err_msg=f"{key} rank {r}")


def test_official_file_missing_one_mtp_tensor_is_refused(cfg, tmp_path):
    """Only one MTP tensor absent (eh_proj) is damage, not a save_pretrained folder: strict refuses it
    naming the key (the MTP layer is not re-initialised over the file's other MTP tensors)."""
    kept = {k: v for k, v in _read(SRC).items() if k != "model.layers.8.eh_proj.weight"}
    folder = _write(tmp_path / "damaged", kept)
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_pretrained_state(SpecModel(cfg, "float32"), folder)
    report = load_pretrained_state(SpecModel(cfg, "float32"), folder, strict=False)
    assert not report.initialized and "model.layers.8.eh_proj.weight" in report.missing


@pytest.mark.parametrize(
    "absent", ["model.layers.8.eh_proj.weight", "model.layers.3.mlp.gate.weight"], ids=["mtp-eh-proj", "router"]
)
def test_non_strict_load_loads_every_present_tensor_and_reports_only_the_absent_one(cfg, tmp_path, absent):
    """strict=False with one tensor of a mapping group absent: the group's tensors that map by their
    own name still load (the MTP layer's enorm and hnorm beside a missing eh_proj; a router's
    e_score_correction_bias beside its missing weight), and only the absent one is reported
    missing, as transformers 5.23 does (measured: its from_pretrained of the file without layer 3's
    router weight lists only that weight missing and holds the file's bias). Measured before: those
    tensors kept their initial values (enorm / hnorm 0.0, about 1.0 in the file; the bias 0.0, the
    file's -0.0379, 0.0810, ...) and were listed missing."""
    folder = _write(tmp_path / "damaged", {k: v for k, v in _read(SRC).items() if k != absent})
    ref = SpecModel(cfg, "float32")
    load_pretrained_state(ref, SRC)
    model = SpecModel(cfg, "float32")
    report = load_pretrained_state(model, folder, strict=False)
    a, b = _state(model), _state(ref)
    assert sorted(k for k in a if a[k] != b[k]) == [absent]
    assert report.missing == [absent]


def test_model_holding_parameters_the_checkpoint_contract_lacks_is_refused(cfg):
    """A model whose state has parameters outside the config's contract (here the attention biases of
    an attention_bias=True build, loading with an attention_bias=False config): strict refuses it
    naming them, instead of leaving those parameters at their initial values."""
    import paddle

    state = dict(SpecModel(cfg, "float32").state_dict())
    state["model.layers.0.self_attn.q_a_proj.bias"] = paddle.zeros([48])
    with pytest.raises(CheckpointError, match="outside the contract"):
        load_pretrained_state(state, SRC, config=cfg)


def test_mtp_layer_initialised_as_transformers_does_norms_one_biases_zero(cfg, tmp_path):
    """An official folder with no MTP weights: the initialised MTP layer has norms 1, biases 0
    (indexer k_norm.bias, router correction bias) and matrices ~ normal(0, initializer_range)."""
    kept = {k: v for k, v in _read(SRC).items() if not k.startswith("model.layers.8.")}
    folder = _write(tmp_path / "nomtp", kept)
    model = SpecModel(cfg, "float32")
    report = load_pretrained_state(model, folder)
    st = {k: v.numpy() for k, v in model.state_dict().items()}
    p = "model.layers.8.transformer_layer."
    assert (st[p + "self_attn.core_attention.indexer.k_norm.bias"] == 0).all()
    assert (st[p + "mlp.gate.e_score_correction_bias"] == 0).all()
    assert (st[p + "self_attn.core_attention.indexer.k_norm.weight"] == 1).all()
    assert (st["model.layers.8.enorm.weight"] == 1).all() and (st[p + "input_layernorm.weight"] == 1).all()
    w = st[p + "self_attn.q_a_proj.weight"]
    assert abs(float(w.std()) - cfg.initializer_range) < 0.2 * cfg.initializer_range and abs(float(w.mean())) < 0.005
    assert set(report.initialized) == {k for k in st if k.startswith("model.layers.8.")}


@pytest.mark.parametrize("shape", [[64, 40], [48, 64], [32, 48]])
def test_model_parameter_of_another_shape_is_refused_naming_key_and_shapes(cfg, shape):
    """A model parameter whose shape differs from the contract's (same rank; also a transposed
    one) is refused before anything is read, naming the key and both shapes."""
    import paddle

    state = dict(SpecModel(cfg, "float32").state_dict())
    key = "model.layers.0.self_attn.q_a_proj.weight"  # contract (64, 48)
    state[key] = paddle.zeros(shape)
    with pytest.raises(CheckpointError, match="shape") as e:
        load_pretrained_state(state, SRC, config=cfg)
    assert key in str(e.value)


@pytest.mark.parametrize("which", ["fleet", "legacy"])
def test_tensor_parallel_rank_gets_a_plain_column_slice_of_an_unfused_weight_from_fleet_files(
    cfg, fleet_tensors, tmp_path, which
):
    """A rank holding half the columns of an unfused weight (q_b_proj, column-parallel; the head) with
    ``shard_info`` given reads a plain column slice from a PaddleFleet or old-spelling file; only the
    gate|up fused weights are re-laid per rank."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    full = SpecModel(cfg, "float32")
    load_pretrained_state(full, SRC)
    if which == "fleet":
        folder = _write(tmp_path / "fleet", fleet_tensors)
    else:
        folder = _write(tmp_path / "legacy", {k: v.clone() for k, v in full.state_dict().items()})
    for key in (
        "model.layers.0.self_attn.q_b_proj.weight",
        "lm_head.weight",
        "model.layers.8.transformer_layer.self_attn.q_b_proj.weight",
    ):
        whole = full.state_dict()[key].numpy()
        rows, cols = whole.shape
        c = cols // 2
        info = {key: [((rows, c), (0, 0)), ((rows, c), (0, c))]}
        for r in range(2):
            state = {key: ShardedWeight(key, paddle.zeros([rows, c]), (rows, c), (rows, cols), (0, c * r))}
            load_pretrained_state(state, folder, config=cfg, keys=[key], shard_info=info)
            np.testing.assert_array_equal(
                state[key].local_tensor.numpy(), whole[:, c * r : c * (r + 1)], err_msg=f"{key} rank {r}"
            )


def test_non_strict_load_missing_half_of_a_fused_pair_reports_the_fused_weight_missing(cfg, tmp_path):
    """strict=False, a dense layer's gate_proj absent (its up_proj present): the fused up_gate_proj it
    would make is reported missing and keeps its values, the layer's down_proj still loads."""
    kept = {k: v for k, v in _read(SRC).items() if k != "model.layers.1.mlp.gate_proj.weight"}
    folder = _write(tmp_path / "nogate", kept)
    ref = SpecModel(cfg, "float32")
    load_pretrained_state(ref, SRC)
    model = SpecModel(cfg, "float32")
    report = load_pretrained_state(model, folder, strict=False)
    assert report.missing == ["model.layers.1.mlp.up_gate_proj.weight"]
    a, b = _state(model), _state(ref)
    assert sorted(k for k in a if a[k] != b[k]) == ["model.layers.1.mlp.up_gate_proj.weight"]


@pytest.mark.parametrize("drop", ["decoder_indexer", "part_of_mtp_indexer"])
def test_paddlefleet_file_missing_a_decoder_indexer_or_part_of_the_mtp_indexer_is_refused(
    cfg, fleet_tensors, tmp_path, drop
):
    """Only the MTP layer's whole indexer may be absent from a PaddleFleet file (its writer skips it);
    a decoder layer's indexer absent, or two of the MTP indexer's five tensors absent, is damage:
    strict refuses it naming the keys."""
    if drop == "decoder_indexer":
        gone = [k for k in fleet_tensors if k.startswith("model.layers.0.") and ".indexer." in k]
    else:
        gone = [
            k
            for k in fleet_tensors
            if k.startswith("model.layers.8.") and k.endswith(("indexer.wk.weight", "indexer.k_norm.bias"))
        ]
    assert gone
    folder = _write(tmp_path / drop, {k: v for k, v in fleet_tensors.items() if k not in gone})
    with pytest.raises(CheckpointError, match="missing"):
        load_pretrained_state(SpecModel(cfg, "float32"), folder)
