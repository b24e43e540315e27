"""load_pretrained_state / save_pretrained_state on the HF-written tiny checkpoint (two bf16 shards,
MTP layer): lossless both ways, Fleet export, strictness, read-only source, partial loads, atomicity.

Expected values come from the source files read with the ``safetensors`` library, never from our
reader or writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import (
    CheckpointError,
    fleet_param_specs,
    load_pretrained_state,
    paddlefleet_param_specs,
    save_pretrained_state,
)
from paddleformers_glm.checkpoint.safetensors_io import SafetensorsWriter
from paddleformers_glm.testing import SpecModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


def _cfg(folder):
    return GlmMoeDsaConfig.from_pretrained(folder)


def _read_all(folder) -> dict[str, tuple[str, tuple, bytes]]:
    """Every tensor of a checkpoint folder via the safetensors library: (dtype, shape, raw bytes)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                assert k not in out, k
                out[k] = (str(t.dtype), tuple(t.shape), t.numpy().tobytes())
    return out


def _snapshot(folder) -> dict[str, tuple]:
    out = {}
    for f in sorted(os.listdir(folder)):
        p = os.path.join(folder, f)
        st = os.stat(p)
        out[f] = (st.st_size, st.st_mtime_ns, st.st_ino, hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest())
    return out


def _state_np(model) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _rewrite(folder, drop=(), add=None, replace=None):
    """Rewrite the shards with the safetensors library: drop keys, add or replace tensors."""
    from safetensors import safe_open
    from safetensors.paddle import save_file

    folder = pathlib.Path(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    by_file: dict[str, dict] = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / f), framework="paddle") as h:
            by_file[f] = {k: h.get_tensor(k) for k in h.keys() if k not in drop}
    last = sorted(by_file)[-1]
    for k, t in (add or {}).items():
        by_file[last][k] = t
    for k, t in (replace or {}).items():
        f = index["weight_map"][k]
        by_file[f][k] = t
    wm = {}
    for f, tensors in by_file.items():
        save_file(tensors, str(folder / f), metadata={"format": "pt"})
        wm.update(dict.fromkeys(tensors, f))
    total = sum(
        int(np.prod(t.shape)) * (4 if "float32" in str(t.dtype) or "int32" in str(t.dtype) else 2)
        for ts in by_file.values()
        for t in ts.values()
    )
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm})
    )


def test_load_then_save_is_lossless(src, tmp_path):
    cfg = _cfg(src)
    before = _snapshot(src)
    model = SpecModel(cfg, "float32")
    rep = load_pretrained_state(model, src, dtype="float32")
    assert rep.layout == "hf" and len(rep.loaded) == len(fleet_param_specs(cfg)) == 239
    assert not rep.missing and not rep.unexpected
    source = _read_all(src)
    # spot-check the Paddle layout against the source (full check: test_aoa_mapping)
    sd = model.state_dict()
    from safetensors import safe_open

    with safe_open(str(src / "model-00001-of-00002.safetensors"), framework="paddle") as h:
        g = h.get_tensor("model.layers.0.mlp.gate_proj.weight").astype("float32").numpy()
        u = h.get_tensor("model.layers.0.mlp.up_proj.weight").astype("float32").numpy()
        q = h.get_tensor("model.layers.0.self_attn.q_b_proj.weight").astype("float32").numpy()
    np.testing.assert_array_equal(sd["model.layers.0.mlp.up_gate_proj.weight"].numpy(), np.concatenate([g.T, u.T], 1))
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.q_b_proj.weight"].numpy(), q.T)

    out = tmp_path / "out"
    srep = save_pretrained_state(model, cfg, out, max_shard_size="600KB")
    saved = _read_all(out)
    assert len(saved) == len(source) == srep.tensors == 296
    assert set(saved) == set(source)
    for k in source:
        assert saved[k] == source[k], k  # dtype, shape and bytes
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source)
    assert index["metadata"]["total_size"] == sum(len(b) for _, _, b in source.values())
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert _snapshot(src) == before  # nothing written into (or touched in) the source folder


def test_save_is_deterministic(src, tmp_path):
    cfg = _cfg(src)
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, src)
    a, b = tmp_path / "a", tmp_path / "b"
    save_pretrained_state(model, cfg, a, max_shard_size="300KB")
    save_pretrained_state(model.state_dict(), cfg, b, max_shard_size="300KB")
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for f in os.listdir(a):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_fleet_export_and_load_back(src, tmp_path):
    cfg = _cfg(src)
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, src)
    out = tmp_path / "fleet"
    save_pretrained_state(model, cfg, out, layout="fleet")
    saved = _read_all(out)
    specs = paddlefleet_param_specs(cfg)
    assert set(saved) == set(specs)  # PaddleFleet's names, exactly
    assert saved["model.lm_head.weight"][1] == (256, 64) and saved["model.layers.3.mlp.gate.weight"][1] == (8, 64)
    for k, (shape, kind) in specs.items():
        assert saved[k][1] == shape, k
        assert saved[k][0] == ("paddle.float32" if kind == "float32" else "paddle.bfloat16"), k
    assert "model.layers.8.transformer_layer.self_attn.core_attention.indexer.wq_b.weight" in saved
    back = SpecModel(cfg, "float32")
    rep = load_pretrained_state(back, out)
    assert rep.layout == "fleet" and len(rep.loaded) == 239
    want, got = _state_np(model), _state_np(back)
    for k in want:
        assert want[k].tobytes() == got[k].tobytes(), k


def test_bf16_model_gets_source_bits(src):
    cfg = _cfg(src)
    model = SpecModel(cfg, "bfloat16")
    load_pretrained_state(model, src, dtype="bfloat16")
    source = _read_all(src)
    sd = model.state_dict()
    emb = sd["model.embedding.embed_tokens.weight"]
    assert str(emb.dtype) == "paddle.bfloat16"
    assert emb.numpy().tobytes() == source["model.embed_tokens.weight"][2]
    assert str(sd["model.layers.3.mlp.gate.weight"].dtype) == "paddle.float32"  # router stays fp32
    down = sd["model.layers.4.mlp.experts.5.down_proj.weight"].numpy()
    raw = np.frombuffer(source["model.layers.4.mlp.experts.5.down_proj.weight"][2], np.uint16).reshape(64, 32)
    np.testing.assert_array_equal(down, raw.T)


def test_fp32_checkpoint_into_bf16_model_uses_paddle_rounding(src, tmp_path):
    """An fp32 source into a bf16 model needs a rounding cast: Paddle's cast kernel does it."""
    import paddle

    cfg = _cfg(src)
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, src)
    sd = model.state_dict()
    key = "model.layers.1.self_attn.o_proj.weight"
    nudged = sd[key].numpy() * np.float32(1 + 2**-8 + 2**-10)  # no longer bf16-representable
    sd[key].set_value(nudged)
    save_pretrained_state(model, cfg, tmp_path / "fp32", layout="fleet", dtype="float32")
    bf = SpecModel(cfg, "bfloat16")
    load_pretrained_state(bf, tmp_path / "fp32", dtype="bfloat16")
    want = paddle.to_tensor(nudged).astype("bfloat16").numpy()
    assert bf.state_dict()[key].numpy().tobytes() == want.tobytes()
    assert not np.array_equal(want, (nudged.view(np.uint32) >> 16).astype(np.uint16))  # rounding, not truncation


def test_paddle_load_state_dict_backend_agrees_and_leaves_source_alone(src):
    cfg = _cfg(src)
    before = _snapshot(src)
    a, b = SpecModel(cfg, "float32"), SpecModel(cfg, "float32")
    load_pretrained_state(a, src, backend="engine")
    rep = load_pretrained_state(b, src, backend="paddle")
    assert len(rep.loaded) == 239
    sa, sb = _state_np(a), _state_np(b)
    for k in sa:
        assert sa[k].tobytes() == sb[k].tobytes(), k
    assert _snapshot(src) == before
    assert not [f for f in os.listdir(src) if "metadata" in f]


def test_strict_missing_and_unexpected(src):
    cfg = _cfg(src)
    mtp_indexer = [
        f"model.layers.8.self_attn.indexer.{n}"
        for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    ]
    _rewrite(src, drop=mtp_indexer)
    model = SpecModel(cfg)
    with pytest.raises(CheckpointError) as ei:
        load_pretrained_state(model, src)
    msg = str(ei.value)
    assert "missing 5 keys: " + ", ".join(sorted(mtp_indexer)) in msg
    assert all(not v.numpy().any() for v in model.state_dict().values())  # nothing half-loaded
    rep = load_pretrained_state(model, src, strict=False)
    fleet_idx = sorted(
        f"model.layers.8.transformer_layer.self_attn.core_attention.indexer.{n}"
        for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    )
    assert rep.missing == fleet_idx and len(rep.loaded) == 234
    assert not model.state_dict()[fleet_idx[0]].numpy().any()
    import paddle

    _rewrite(src, add={"model.layers.8.extra.weight": paddle.ones([2], dtype="bfloat16")})
    with pytest.raises(CheckpointError, match=r"unexpected 1 key: model\.layers\.8\.extra\.weight"):
        load_pretrained_state(SpecModel(cfg), src)
    assert load_pretrained_state(SpecModel(cfg), src, strict=False).unexpected == ["model.layers.8.extra.weight"]


def test_many_missing_lists_first_few_and_the_count(src):
    cfg = _cfg(src)
    drop = sorted(k for k in _read_all(src) if k.startswith("model.layers.4.mlp.experts."))
    assert len(drop) == 24
    _rewrite(src, drop=drop)
    with pytest.raises(CheckpointError) as ei:
        load_pretrained_state(SpecModel(cfg), src)
    assert f"missing 24 keys: {', '.join(drop[:5])}, ... (+19 more)" in str(ei.value)


def test_shape_mismatch_names_key_file_and_shapes(src):
    import paddle

    cfg = _cfg(src)
    key = "model.layers.2.self_attn.o_proj.weight"
    _rewrite(src, replace={key: paddle.zeros([64, 127], dtype="bfloat16")})
    with pytest.raises(CheckpointError) as ei:
        load_pretrained_state(SpecModel(cfg), src)
    e = ei.value
    assert e.key == key and e.file.endswith("model-00001-of-00002.safetensors")
    assert (e.expected, e.actual) == ((64, 128), (64, 127))
    assert "(64, 128)" in str(e) and "(64, 127)" in str(e)


def test_model_dtype_must_match_request(src):
    with pytest.raises(CheckpointError, match="dtype differs from the requested dtype") as ei:
        load_pretrained_state(SpecModel(_cfg(src), "bfloat16"), src, dtype="float32")
    assert (ei.value.expected, ei.value.actual) == ("float32", "bfloat16")
    rep = load_pretrained_state(SpecModel(_cfg(src), "bfloat16"), src, dtype="float32", strict=False)
    assert len(rep.loaded) == 239 and len(rep.warnings) == 239 - 12  # all but the 6 routers x 2 fp32 tensors
    assert "loaded as bfloat16" in rep.warnings[0]


def test_pipeline_stage_reads_only_its_layers(src):
    from safetensors import safe_open

    cfg = _cfg(src)
    stage = ("model.layers.0.", "model.layers.1.", "model.layers.2.", "model.layers.3.")
    model = SpecModel(cfg)
    rep = load_pretrained_state(model, src, key_filter=lambda k: k.startswith(stage))
    assert set(rep.loaded) == {k for k in fleet_param_specs(cfg) if k.startswith(stage)}
    assert "model.embedding.embed_tokens.weight" in rep.skipped
    want_bytes = 0
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="paddle") as h:
            for k in h.keys():
                if k.startswith(stage):
                    want_bytes += int(np.prod(h.get_slice(k).get_shape())) * (
                        4 if h.get_slice(k).get_dtype() == "F32" else 2
                    )
    assert rep.bytes_read == want_bytes
    sd = model.state_dict()
    assert not sd["model.layers.4.self_attn.o_proj.weight"].numpy().any()
    assert sd["model.layers.3.self_attn.o_proj.weight"].numpy().any()


def test_tensor_parallel_rank_reads_only_its_slice(src):
    """A TP rank's target is a ShardedWeight (local piece of the global tensor): only that is read."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from safetensors import safe_open

    cfg = _cfg(src)
    with safe_open(str(src / "model-00001-of-00002.safetensors"), framework="paddle") as h:
        q = h.get_tensor("model.layers.0.self_attn.q_b_proj.weight").astype("float32").numpy()  # [192, 48]
        g = h.get_tensor("model.layers.0.mlp.gate_proj.weight").astype("float32").numpy()  # [128, 64]
        u = h.get_tensor("model.layers.0.mlp.up_proj.weight").astype("float32").numpy()
    state = {k: paddle.zeros(list(s), dtype="float32") for k, (s, _) in fleet_param_specs(cfg).items()}
    qk, ugk = "model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.mlp.up_gate_proj.weight"
    # rank 1 of 2, column parallel: q_b_proj [48, 192] -> columns 96:192; up_gate [64, 256] -> 128:256
    state[qk] = ShardedWeight(qk, paddle.zeros([48, 96]), (48, 96), (48, 192), (0, 96))
    state[ugk] = ShardedWeight(ugk, paddle.zeros([64, 128]), (64, 128), (64, 256), (0, 128))
    shard_info = {ugk: [((64, 128), (0, 0)), ((64, 128), (0, 128))]}  # both ranks' pieces
    rep = load_pretrained_state(state, src, config=cfg, keys=[qk], dtype="float32")
    np.testing.assert_array_equal(state[qk].local_tensor.numpy(), q.T[:, 96:])
    assert rep.bytes_read == 96 * 48 * 2  # half of the bf16 source tensor, not all of it
    rep = load_pretrained_state(state, src, config=cfg, keys=[ugk], dtype="float32", shard_info=shard_info)
    # Paddle's fused_ffn lays a TP-sharded fused weight out per rank: [gate_r | up_r]
    np.testing.assert_array_equal(state[ugk].local_tensor.numpy(), np.concatenate([g.T[:, 64:], u.T[:, 64:]], 1))
    assert rep.bytes_read == 2 * 64 * 64 * 2


def test_stage_state_with_tp_pieces_loads_alike_from_both_layouts(src, tmp_path):
    """A pipeline stage's partial state dict (strict, ``keys=`` its own names) with a TP rank's
    fused piece: the Fleet-layout checkpoint (global ``[gate | up]``) gives the same per-rank
    ``[gate_r | up_r]`` as the HF one, reading only that rank's columns."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from safetensors import safe_open

    from paddleformers_glm.checkpoint.convert import convert_checkpoint

    cfg = _cfg(src)
    convert_checkpoint(src, tmp_path / "fleet", layout="fleet")
    with safe_open(str(src / "model-00001-of-00002.safetensors"), framework="paddle") as h:
        g = h.get_tensor("model.layers.0.mlp.gate_proj.weight").astype("float32").numpy()  # [128, 64]
        u = h.get_tensor("model.layers.0.mlp.up_proj.weight").astype("float32").numpy()
    ugk, nk = "model.layers.0.mlp.up_gate_proj.weight", "model.layers.0.input_layernorm.weight"
    info = {ugk: [((64, 128), (0, 0)), ((64, 128), (0, 128))]}
    for folder in (src, tmp_path / "fleet"):
        for r in range(2):
            state = {
                ugk: ShardedWeight(ugk, paddle.zeros([64, 128]), (64, 128), (64, 256), (0, 128 * r)),
                nk: paddle.zeros([64]),
            }
            rep = load_pretrained_state(state, folder, config=cfg, keys=list(state), shard_info=info)
            assert sorted(rep.loaded) == sorted(state)
            want = np.concatenate([g.T[:, 64 * r : 64 * (r + 1)], u.T[:, 64 * r : 64 * (r + 1)]], 1)
            np.testing.assert_array_equal(state[ugk].local_tensor.numpy(), want, err_msg=f"{folder} rank {r}")
            assert rep.bytes_read == 2 * 64 * 64 * 2 + 64 * 2  # two half tensors (bf16) + the norm
    with pytest.raises(CheckpointError, match="model lacks 1 key"):  # a selected key the state lacks
        load_pretrained_state({nk: paddle.zeros([64])}, src, config=cfg, keys=[nk, ugk])


def test_failed_save_leaves_nothing(src, tmp_path, monkeypatch):
    cfg = _cfg(src)
    model = SpecModel(cfg)
    load_pretrained_state(model, src)
    real = SafetensorsWriter.write
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 100:
            raise OSError("disk full (injected)")
        return real(self, *a, **kw)

    monkeypatch.setattr(SafetensorsWriter, "write", flaky)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="injected"):
        save_pretrained_state(model, cfg, out, max_shard_size="300KB")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temp folder left behind
    # an existing checkpoint at the target survives a failed overwrite untouched
    monkeypatch.setattr(SafetensorsWriter, "write", real)
    save_pretrained_state(model, cfg, out)
    before = _snapshot(out)
    calls["n"] = 0
    monkeypatch.setattr(SafetensorsWriter, "write", flaky)
    with pytest.raises(OSError, match="injected"):
        save_pretrained_state(model, cfg, out, max_shard_size="300KB")
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_save_over_existing_checkpoint_replaces_stale_shards(src, tmp_path):
    cfg = _cfg(src)
    model = SpecModel(cfg)
    load_pretrained_state(model, src)
    out = tmp_path / "out"
    save_pretrained_state(model, cfg, out, max_shard_size="200KB")
    (out / "tokenizer.json").write_text("{}")
    save_pretrained_state(model, cfg, out)  # one shard now
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    back = SpecModel(cfg)
    load_pretrained_state(back, out)
    assert all(np.array_equal(a, b) for a, b in zip(_state_np(model).values(), _state_np(back).values()))


def test_convert_cli_both_ways(src, tmp_path, capsys):
    from paddleformers_glm.cli import main

    assert main(["convert", str(src), str(tmp_path / "fleet"), "--to", "fleet"]) == 0
    assert (
        main(["convert", str(tmp_path / "fleet"), str(tmp_path / "hf"), "--to", "hf", "--max-shard-size", "1MB"]) == 0
    )
    assert _read_all(tmp_path / "hf") == _read_all(src)
    assert "wrote 296 tensors" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_hf_layout_export_of_a_paddlefleet_spelled_config_reads_as_the_same_model_in_transformers(tmp_path):
    """A checkpoint whose config.json spells settings as PaddleFleet does (``rotary_base`` + ``rope_type:
    "rope"`` instead of ``rope_parameters``, ``dsa_index_topk``, ``dsa_index_n_heads``, ...): its
    official-layout export must carry the transformers keys too. Before, the export kept only
    PaddleFleet's spelling and transformers 5.23 read it with its defaults (measured: rope_theta
    10000.0 instead of 8000000, index_topk 2048 instead of 8, index_n_heads 32 instead of 8, so
    ``from_pretrained`` refused the indexer weights with a size mismatch)."""
    fleet = tmp_path / "fleet"
    shutil.copytree(FIXTURE, fleet)
    cfg = json.loads((fleet / "config.json").read_text())
    official = dict(cfg)
    del cfg["rope_parameters"]
    cfg |= {"rotary_base": 8000000, "rope_type": "rope"}
    for alias, key in (("dsa_index_topk", "index_topk"), ("dsa_index_n_heads", "index_n_heads")):
        cfg[alias] = cfg.pop(key)
    cfg["rotary_interleaved"] = cfg.pop("rope_interleave")
    (fleet / "config.json").write_text(json.dumps(cfg, indent=2))
    model = SpecModel(GlmMoeDsaConfig.from_pretrained(fleet))
    load_pretrained_state(model, fleet)
    save_pretrained_state(model, model.config, tmp_path / "hf")
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("rope_parameters", "index_topk", "index_n_heads", "rope_interleave"):
        assert out[key] == official[key], key
    assert {k: out[k] for k in cfg} == cfg  # PaddleFleet's own keys are kept as they were
    GlmMoeDsaConfig.from_pretrained(tmp_path / "hf")  # both spellings agree
    # the Fleet layout keeps the file as it was
    save_pretrained_state(model, model.config, tmp_path / "fl", layout="fleet")
    assert json.loads((tmp_path / "fl" / "config.json").read_text()) == cfg

    from tests._reference import missing_reference_extra

    if missing_reference_extra() is None:
        from transformers import GlmMoeDsaConfig as HfConfig

        got, want = HfConfig.from_pretrained(tmp_path / "hf").to_dict(), HfConfig.from_pretrained(FIXTURE).to_dict()
        for key in (
            "rope_parameters",
            "index_topk",
            "index_n_heads",
            "index_head_dim",
            "indexer_types",
            "rope_interleave",
        ):
            assert got.get(key) == want.get(key), key


def test_hf_layout_export_after_set_attn_implementation_loads_in_transformers(tmp_path):
    """``set_attn_implementation("dense")`` records the form in the config (``attn_implementation``);
    transformers never writes that key (measured: its ``save_pretrained`` with sdpa writes none) and
    5.23's ``from_pretrained`` refuses any value it does not implement (measured: ValueError
    'Specified `attn_implementation="dense"` is not supported'), so an official-layout export that
    carried it could not be loaded there at all. The Fleet layout keeps the key."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="float32")
    model.set_attn_implementation("dense")
    model.save_pretrained(tmp_path / "hf", dtype="auto")  # the source's dtype: its config.json bytes
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "attn_implementation" not in out
    assert (tmp_path / "hf" / "config.json").read_bytes() == (FIXTURE / "config.json").read_bytes()
    model.save_pretrained(tmp_path / "fl", layout="fleet")
    assert json.loads((tmp_path / "fl" / "config.json").read_text())["attn_implementation"] == "dense"

    from tests._reference import missing_reference_extra

    if missing_reference_extra() is None:
        from transformers import GlmMoeDsaForCausalLM as HfModel

        HfModel.from_pretrained(tmp_path / "hf")  # raised ValueError before


def test_hf_layout_export_names_the_architecture(tmp_path):
    """transformers' ``save_pretrained`` writes ``architectures: ["GlmMoeDsaForCausalLM"]`` for a model
    whose config has none (measured, 5.23); vLLM-style loaders pick the model class from that key.
    Ours wrote none (measured) when the source config lacked it."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["architectures"]
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    model = SpecModel(GlmMoeDsaConfig.from_pretrained(src))
    load_pretrained_state(model, src)
    save_pretrained_state(model, model.config, tmp_path / "hf")
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert out == {**cfg, "architectures": ["GlmMoeDsaForCausalLM"]}
