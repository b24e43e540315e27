"""Folders as transformers' ``save_pretrained`` writes them (no MTP tensors, num_nextn_predict_layers
kept) load by default; ``strict`` is about weights only; the load report is returned on request.

Expected weights come from the committed HF-written fixture loaded whole, never from the folder
under test.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import numpy as np
import pytest

from paddleformers_glm.checkpoint import CheckpointError
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

from .test_checkpoint_roundtrip import _read_all, _rewrite

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
MTP = "model.layers.8."


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


@pytest.fixture(scope="module")
def full():
    return {k: v.numpy() for k, v in GlmMoeDsaForCausalLM.from_pretrained(FIXTURE).state_dict().items()}


def _records(caplog, level=logging.WARNING):
    return [r.getMessage() for r in caplog.records if r.levelno >= level and r.name.startswith("paddleformers_glm")]


def test_transformers_saved_folder_loads_and_initialises_mtp(src, full, caplog):
    import paddle

    mtp_keys = sorted(k for k in _read_all(src) if k.startswith(MTP))
    assert len(mtp_keys) == 47
    _rewrite(src, drop=mtp_keys)
    caplog.set_level(logging.INFO)
    paddle.seed(0)
    model, rep = GlmMoeDsaForCausalLM.from_pretrained(src, output_loading_info=True)
    warnings = _records(caplog)
    assert len(warnings) == 1 and "MTP" in warnings[0] and "mtp_loss" in warnings[0]
    assert rep.warnings == warnings and not rep.missing
    assert rep.initialized and all(k.startswith(MTP) for k in rep.initialized)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(rep.initialized) == sorted(k for k in sd if k.startswith(MTP))
    for k, v in sd.items():
        if k.startswith(MTP):
            if v.ndim >= 2:  # normal(0, initializer_range = 0.02)
                assert abs(float(v.std()) - 0.02) < 0.02 * 0.15 and abs(float(v.mean())) < 0.005, k
            elif k.endswith("bias"):
                assert not v.any(), k
            else:
                assert (v == 1).all(), k
        else:
            assert np.array_equal(v, full[k]), k
    assert any(r.levelno == logging.INFO and "loaded" in r.getMessage() for r in caplog.records)
    out = model(paddle.to_tensor([[5, 6, 7, 8]]), labels=paddle.to_tensor([[5, 6, 7, 8]]))
    assert np.isfinite(float(out.mtp_loss))


def test_partial_mtp_or_other_missing_keys_still_refused_naming_the_option(src):
    _rewrite(src, drop=[MTP + "eh_proj.weight"])
    with pytest.raises(CheckpointError, match=r"missing 1 key: model\.layers\.8\.eh_proj\.weight.*strict=False"):
        GlmMoeDsaForCausalLM.from_pretrained(src)
    shutil.rmtree(src)
    shutil.copytree(FIXTURE, src)
    _rewrite(src, drop=["model.layers.2.mlp.down_proj.weight"])
    with pytest.raises(CheckpointError, match="strict=False"):
        GlmMoeDsaForCausalLM.from_pretrained(src)


def test_bookkeeping_problems_are_warnings_not_refusals(src, full, caplog):
    idx_p = src / "model.safetensors.index.json"
    idx = json.loads(idx_p.read_text())
    idx["metadata"]["total_size"] += 7
    idx_p.write_text(json.dumps(idx))
    shutil.copy(src / "model-00001-of-00002.safetensors", src / "adapter_model.safetensors")
    with open(src / "model-00002-of-00002.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    caplog.set_level(logging.WARNING)
    model, rep = GlmMoeDsaForCausalLM.from_pretrained(src, output_loading_info=True)
    assert len(rep.warnings) == 3
    text = " | ".join(rep.warnings)
    assert "total_size" in text and "adapter_model.safetensors" in text and "trailing garbage: 16 bytes" in text
    assert _records(caplog) == rep.warnings
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), full[k]), k


def test_strict_false_initialises_what_is_missing_like_hf_and_init_is_restored(src, full):
    import paddle

    k = "model.layers.2.mlp.down_proj.weight"
    _rewrite(src, drop=[k, "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.input_layernorm.weight"])
    model, rep = GlmMoeDsaForCausalLM.from_pretrained(src, strict=False, output_loading_info=True)
    # only what is absent: measured before, the whole mapping unit of each (the layer's gate/up, its
    # other four MLA projections, its other three norms) was left unloaded and reported missing
    assert rep.missing == sorted(
        [k, "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.input_layernorm.weight"]
    )
    for kept in ("mlp.up_gate_proj", "self_attn.q_b_proj", "self_attn.o_proj", "post_attention_layernorm"):
        name = f"model.layers.{2 if 'mlp' in kept else 0}.{kept}.weight"
        assert np.array_equal(model.state_dict()[name].numpy(), full[name]), name
    v = model.state_dict()[k].numpy()
    assert abs(float(v.std()) - 0.02) < 0.02 * 0.15  # normal(0, initializer_range), not zeros
    assert np.array_equal(
        model.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy(), full["model.layers.1.mlp.down_proj.weight"]
    )
    # from_pretrained skips the random draw only while it builds its own model
    assert float(paddle.nn.Linear(64, 64).weight.abs().sum()) > 0


def test_a_missing_embedding_is_initialised_with_a_zero_pad_row_as_transformers_does(src):
    """transformers 5.23 initialises a missing ``embed_tokens`` through nn.Embedding's padding_idx:
    measured on this fixture without the key, row ``pad_token_id`` (0) is all zeros and the rest
    normal(0, 0.02) (std 0.0199); the pad row held normal values here (|row| sum 1.05) before."""
    import paddle

    from paddleformers_glm.parallel.topology import ParallelConfig, Topology, topology_override

    k = "model.embed_tokens.weight"
    _rewrite(src, drop=[k])
    model, rep = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32", strict=False, output_loading_info=True)
    pad = model.config.pad_token_id
    w = model.model.embedding.embed_tokens.weight.numpy()
    assert rep.missing and pad is not None
    assert not w[pad].any() and abs(float(np.delete(w, pad, 0).std()) - 0.02) < 0.02 * 0.15
    for tp_rank in range(2):  # split over TP2: the rank holding row pad zeroes it, the other keeps its rows
        topo = Topology(ParallelConfig(tp=2), ranks={"tp": tp_rank, "pp": 0, "dp": 0, "edp": 0, "ep": 0, "etp": 0})
        paddle.seed(7 + tp_rank)
        with topology_override(topo):
            split = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32", strict=False, topology=topo)
        rows = split.model.embedding.embed_tokens.weight.numpy()
        np.testing.assert_array_equal(rows, w[tp_rank * rows.shape[0] : (tp_rank + 1) * rows.shape[0]])


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 4, "ep": 2, "etp": 2}], ids=["tp2", "tp4-ep2-etp2"])
def test_weights_initialised_on_load_are_one_model_over_the_ranks(src, layout):
    """What a load initialises (the MTP layer of a transformers-written folder; with strict=False any
    missing weight) is, on every rank of a split model, that rank's piece of the one model a single
    process initialises: transformers initialises one tensor per missing key. Ranks are simulated in
    one process, each with its own Paddle seed as separate processes have. Before the fix each rank
    drew its pieces from its own generator: in a real two-process TP2 launch 23 of the 33 replicated
    MTP parameters (eh_proj, q_a_proj, the indexer...) held different values on the two ranks, and
    here every initialised matrix differed from the single-process one."""
    import paddle

    from paddleformers_glm.parallel.layers import get_shard_spec, local_slice
    from paddleformers_glm.parallel.topology import ParallelConfig, Topology, expert_layout, topology_override

    dropped = "model.layers.2.mlp.down_proj.weight"  # a row-parallel weight, initialised with strict=False
    _rewrite(src, drop=[k for k in _read_all(src) if k.startswith(MTP)] + [dropped])
    paddle.seed(0)
    one, rep = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32", strict=False, output_loading_info=True)
    assert rep.initialized and dropped in rep.missing
    want = {k: v.numpy() for k, v in one.state_dict().items()}
    pc = ParallelConfig(**layout)
    for tp_rank in range(pc.tp):
        edp, ep, etp = expert_layout(pc, 0, tp_rank)
        topo = Topology(pc, ranks={"tp": tp_rank, "pp": 0, "dp": 0, "edp": edp, "ep": ep, "etp": etp})
        paddle.seed(100 + tp_rank)
        with topology_override(topo):
            model = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32", strict=False, topology=topo)
        differ = []
        for k, t in model.state_dict().items():
            spec = get_shard_spec(t)
            size = topo.size(spec.group) if spec.axis is not None else 1
            if not np.array_equal(t.numpy(), local_slice(want[k], spec, topo.rank_in(spec.group), size)):
                differ.append(k)
        assert not differ, (tp_rank, len(differ), differ[:4])


@pytest.mark.parametrize("layout", ["hf", "fleet"])
def test_fewer_mtp_layers_than_the_checkpoint_loads_the_rest_with_a_warning(src, full, tmp_path, caplog, layout):
    """num_nextn_predict_layers=0 (what the no-MTP warning suggests) on a checkpoint that has the MTP
    layer: transformers ignores its tensors (`_keys_to_ignore_on_load_unexpected`); before the fix
    the load was refused ("unexpected 47 keys: model.layers.8.eh_proj.weight, ...")."""
    from paddleformers_glm.checkpoint.convert import convert_checkpoint

    path = src
    if layout == "fleet":
        path = tmp_path / "fleet"
        convert_checkpoint(src, path, layout="fleet")
    caplog.set_level(logging.WARNING)
    model, rep = GlmMoeDsaForCausalLM.from_pretrained(path, num_nextn_predict_layers=0, output_loading_info=True)
    assert not rep.unexpected and not rep.missing and not rep.initialized
    n = {"hf": 47, "fleet": 38}[layout]  # the MTP layer's tensors in each layout (Fleet fuses gate/up)
    assert len(rep.warnings) == 1 and f"{n} keys" in rep.warnings[0] and "num_nextn_predict_layers=0" in rep.warnings[0]
    assert _records(caplog) == rep.warnings
    sd = model.state_dict()
    assert set(sd) == {k for k in full if not k.startswith(MTP)}
    for k, v in sd.items():
        assert np.array_equal(v.numpy(), full[k]), k
    if layout == "hf":  # another unexpected key is still refused
        import paddle

        _rewrite(src, add={"model.layers.3.mlp.extra.weight": paddle.to_tensor(full["model.norm.weight"])})
        with pytest.raises(CheckpointError, match=r"unexpected 1 key: model\.layers\.3\.mlp\.extra\.weight"):
            GlmMoeDsaForCausalLM.from_pretrained(src, num_nextn_predict_layers=0)


def test_no_shared_experts_saves_and_loads(tmp_path):
    """n_shared_experts 0 (a valid config: the model then builds no shared expert) could be neither
    saved nor loaded: the contracts still listed zero-width shared experts ("model lacks 12 keys:
    model.layers.3.mlp.shared_experts.down_proj.weight, ..."). transformers builds zero-size ones and
    its save_pretrained writes them ([0, 64] / [64, 0], 15 tensors on the tiny config, measured with
    5.23): they are read as nothing."""
    import paddle

    from ._reference import missing_reference_extra
    from ._tiny import tiny_model

    model = tiny_model(seed=3, n_shared_experts=0)
    model.save_pretrained(tmp_path / "ours")
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "ours", dtype="float32")
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    assert not any("shared_experts" in k for k in want)
    for k, v in back.state_dict().items():  # a float32 model saves float32, as transformers: exact
        assert np.array_equal(v.numpy(), want[k]), k
    if missing_reference_extra() is not None:
        return
    import torch
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig as HfConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaForCausalLM as HfModel

    d = json.loads((FIXTURE / "config.json").read_text())
    d["n_shared_experts"] = 0
    torch.manual_seed(0)
    hf = HfModel(HfConfig(**d)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(3, 256, size=(1, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "hf", dtype="float32").eval()
    assert np.abs(ours(paddle.to_tensor(ids)).logits.numpy() - ref).max() < 1e-5  # measured 2.3e-7
