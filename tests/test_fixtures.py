"""Well-formedness of the HF reference fixtures in tests/fixtures/<case>/ (made by tools/make_reference.py).

Runs with numpy + safetensors only (no torch / transformers / paddle): the checkpoint shards are bf16,
which numpy cannot hold, so their headers are parsed directly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CASES = ["tiny", "tiny_pattern_yarn"]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
MIN_GAP = 1e-4
B, S = 2, 32
RIGHT_PAD, LEFT_PAD = 5, 4
TRAIN_STEPS = 4
MTP_COEFF = 0.1
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "BOOL": 1}


# ---------------------------------------------------------------------------------------------- helpers


def read_header(path: Path) -> tuple[dict, dict]:
    """(tensors {name: {dtype, shape, data_offsets}}, __metadata__) of a safetensors file, checking layout."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    pos = 0
    for start, end in spans:
        assert start == pos, f"{path.name}: gap/overlap in the data section at {start}"
        pos = end
    assert 8 + n + pos == len(raw), f"{path.name}: file size does not match the header"
    for name, v in header.items():
        nbytes = int(np.prod(v["shape"], dtype=np.int64)) * DTYPE_BYTES[v["dtype"]]
        assert v["data_offsets"][1] - v["data_offsets"][0] == nbytes, f"{path.name}: {name} byte size"
    return header, meta


def schedule(cfg: dict) -> list[str]:
    """Indexer schedule from the pattern, else freq/offset: layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    n = cfg["num_hidden_layers"]
    if cfg.get("index_topk_pattern"):
        return ["full" if c == "F" else "shared" for c in cfg["index_topk_pattern"]]
    freq, offset = cfg["index_topk_freq"], cfg["index_skip_topk_offset"]
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def expected_keys(cfg: dict) -> dict[str, tuple]:
    """Official key -> shape for the whole checkpoint (the names of the official index), MTP layer included."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, E = cfg["num_attention_heads"], cfg["n_routed_experts"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    Im, I = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Ish = Im * cfg["n_shared_experts"]
    types = schedule(cfg)
    mlp_types = cfg.get("mlp_layer_types") or [
        "dense" if i < cfg["first_k_dense_replace"] else "sparse" for i in range(L)
    ]
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}

    def layer(i: int, full: bool, sparse: bool) -> None:
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = (qr, H)
        out[a + "q_a_layernorm.weight"] = (qr,)
        out[a + "q_b_proj.weight"] = (nh * qk, qr)
        out[a + "kv_a_proj_with_mqa.weight"] = (kvr + cfg["qk_rope_head_dim"], H)
        out[a + "kv_a_layernorm.weight"] = (kvr,)
        out[a + "kv_b_proj.weight"] = (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvr)
        out[a + "o_proj.weight"] = (H, nh * cfg["v_head_dim"])
        if full:
            x = a + "indexer."
            out[x + "wq_b.weight"] = (cfg["index_n_heads"] * cfg["index_head_dim"], qr)
            out[x + "wk.weight"] = (cfg["index_head_dim"], H)
            out[x + "k_norm.weight"] = (cfg["index_head_dim"],)
            out[x + "k_norm.bias"] = (cfg["index_head_dim"],)
            out[x + "weights_proj.weight"] = (cfg["index_n_heads"], H)
        m = p + "mlp."
        if sparse:
            out[m + "gate.weight"] = (E, H)
            out[m + "gate.e_score_correction_bias"] = (E,)
            out[m + "shared_experts.gate_proj.weight"] = (Ish, H)
            out[m + "shared_experts.up_proj.weight"] = (Ish, H)
            out[m + "shared_experts.down_proj.weight"] = (H, Ish)
            for e in range(E):
                out[m + f"experts.{e}.gate_proj.weight"] = (Im, H)
                out[m + f"experts.{e}.up_proj.weight"] = (Im, H)
                out[m + f"experts.{e}.down_proj.weight"] = (H, Im)
        else:
            out[m + "gate_proj.weight"] = (I, H)
            out[m + "up_proj.weight"] = (I, H)
            out[m + "down_proj.weight"] = (H, I)

    for i in range(L):
        layer(i, types[i] == "full", mlp_types[i] == "sparse")
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{L + j}."
        out[p + "enorm.weight"] = (H,)
        out[p + "hnorm.weight"] = (H,)
        out[p + "eh_proj.weight"] = (H, 2 * H)
        out[p + "shared_head.norm.weight"] = (H,)
        layer(L + j, True, True)
    return out


def ce(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean cross entropy over labels != -100 (float64)."""
    x = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    y = labels.reshape(-1)
    keep = y != -100
    x, y = x[keep], y[keep]
    m = x.max(-1, keepdims=True)
    logz = np.log(np.exp(x - m).sum(-1)) + m[:, 0]
    return float(np.mean(logz - x[np.arange(len(y)), y]))


@pytest.fixture(scope="module", params=CASES)
def case(request):
    d = FIXTURES / request.param
    assert d.is_dir(), f"missing fixture dir {d} (run tools/make_reference.py)"
    cfg = json.loads((d / "checkpoint" / "config.json").read_text())
    meta = json.loads((d / "meta.json").read_text())
    ref = load_file(str(d / "reference.safetensors"))
    return {"name": request.param, "dir": d, "cfg": cfg, "meta": meta, "ref": ref}


# ---------------------------------------------------------------------------------------------- files


def test_file_set(case):
    d = case["dir"]
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    want = sorted(
        ["meta.json", "reference.safetensors", "checkpoint/config.json", "checkpoint/model.safetensors.index.json"]
        + ["meta_bf16.json", "reference_bf16.safetensors"]
        + [f"checkpoint/{s}" for s in SHARDS]
    )
    assert files == want


def test_bf16_reference_layout(case):
    """HF's bf16 run: bf16 logits, fp32 losses, and the spread of HF's own bf16 results recorded."""
    header, _ = read_header(case["dir"] / "reference_bf16.safetensors")
    V = case["cfg"]["vocab_size"]
    want = {
        "logits": ("BF16", [B, S, V]),
        "pad_logits": ("BF16", [B, S, V]),
        "loss": ("F32", []),
        "pad_loss": ("F32", []),
        "train_losses": ("F32", [2]),
    }
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == want
    meta = json.loads((case["dir"] / "meta_bf16.json").read_text())
    assert meta["experts_implementation"] == "grouped_mm"
    # HF keeps only the router's correction bias in fp32 in a bf16 model (weights_proj is bf16)
    assert all(k.endswith("e_score_correction_bias") for k in meta["parameter_dtypes_not_bf16"])
    assert set(meta["other_experts_implementations"]) == {"eager", "batched_mm"}
    spread = meta["hf_bf16_spread"]
    assert all(spread[k] >= 0 for k in ("loss", "pad_loss", "train_loss_after_step", "logits_max_abs"))


def test_total_size_budget():
    """The committed fixtures stay small: three tiny checkpoints with their HF references (about 5.99 MB
    of the budget) and the pinned HF measurements beside them."""
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 6_100_000, f"fixtures grew to {total} bytes"


# ---------------------------------------------------------------------------------------------- config


def test_config_official_style(case):
    cfg, name = case["cfg"], case["name"]
    assert cfg["model_type"] == "glm_moe_dsa"
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert cfg["dtype"] == "bfloat16"
    assert "torch_dtype" not in cfg and "rope_scaling" not in cfg and "rope_theta" not in cfg
    assert cfg["indexer_types"] == schedule(cfg), "indexer_types disagrees with the pattern / freq+offset schedule"
    assert cfg["indexer_types"][0] == "full"
    assert cfg["num_hidden_layers"] == 8 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["index_n_heads"] == 8 and cfg["index_topk"] == 8
    assert cfg["indexer_types"] == case["meta"]["indexer_types"]
    if name == "tiny":
        assert cfg["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
        assert cfg["rope_parameters"] == {"rope_theta": 8000000, "rope_type": "default"}
        assert cfg["index_share_for_mtp_iteration"] is True and cfg["norm_topk_prob"] is True
        assert (cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]) == (2, 1, 2)
    else:
        assert cfg["index_topk_pattern"] == "FFSFSSFS"
        assert cfg["index_topk_freq"] is None and cfg["index_skip_topk_offset"] is None
        assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 4.0
        assert cfg["index_share_for_mtp_iteration"] is False and cfg["norm_topk_prob"] is False
        assert (cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]) == (4, 2, 3)


# ---------------------------------------------------------------------------------------------- checkpoint


def test_checkpoint_keys_shapes_dtypes(case):
    cfg, ckpt = case["cfg"], case["dir"] / "checkpoint"
    want = expected_keys(cfg)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    weight_map = index["weight_map"]
    assert set(weight_map.values()) == set(SHARDS)

    seen, total = {}, 0
    for shard in SHARDS:
        header, meta = read_header(ckpt / shard)
        assert meta.get("format") == "pt"
        for name, info in header.items():
            assert name not in seen, f"{name} in two shards"
            assert weight_map.get(name) == shard, f"{name} is in {shard} but the index says {weight_map.get(name)}"
            seen[name] = info
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert set(seen) == set(weight_map), "index.json and the shards list different keys"
    assert index["metadata"]["total_size"] == total

    missing, extra = sorted(set(want) - set(seen)), sorted(set(seen) - set(want))
    assert not missing and not extra, f"missing {missing[:5]} extra {extra[:5]}"
    for name, info in seen.items():
        assert tuple(info["shape"]) == want[name], name
        want_dtype = "F32" if name.endswith("mlp.gate.e_score_correction_bias") else "BF16"
        assert info["dtype"] == want_dtype, name


def test_indexer_and_mtp_layout(case):
    cfg = case["cfg"]
    L = cfg["num_hidden_layers"]
    index = json.loads((case["dir"] / "checkpoint" / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    full = [i for i, t in enumerate(cfg["indexer_types"]) if t == "full"]
    with_indexer = sorted({int(k.split(".")[2]) for k in keys if ".self_attn.indexer." in k})
    assert with_indexer == full + [L], "indexer tensors must be on exactly the full layers and the MTP layer"
    assert sum(1 for k in keys if k.startswith(f"model.layers.{L}.self_attn.indexer.")) == 5
    mtp = {k for k in keys if k.startswith(f"model.layers.{L}.")}
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert f"model.layers.{L}.{k}" in mtp
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in mtp)
    assert not any(k.startswith(f"model.layers.{L + 1}.") for k in keys)
    E = cfg["n_routed_experts"]
    experts = {int(k.split(".")[5]) for k in mtp if ".mlp.experts." in k}
    assert experts == set(range(E))
    assert case["meta"]["checkpoint"]["load_back"]["hf_layers_with_indexer"] == full
    assert case["meta"]["checkpoint"]["load_back"]["exact"] is True


# ---------------------------------------------------------------------------------------------- reference


def test_meta_gaps(case):
    gaps = case["meta"]["gaps"]
    assert gaps["min_gap_required"] >= MIN_GAP
    for cat in ("indexer", "router_expert", "router_group"):
        assert gaps["checked_rows"][cat] > 0, cat
        assert gaps["min"][cat] >= MIN_GAP, (cat, gaps["min"][cat])
        for phase, mins in gaps["by_phase"].items():
            if cat in mins:
                assert mins[cat] >= gaps["min"][cat], (phase, cat)
    # MTP-only passes run an indexer only when the MTP layer does not reuse the main model's top-k
    own = not case["cfg"]["index_share_for_mtp_iteration"]
    for phase in ("eval_mtp", "pad_mtp"):
        assert ("indexer" in gaps["by_phase"][phase]) == own, phase
        assert "router_expert" in gaps["by_phase"][phase], phase
    for phase in ("eval", "pad", "train_step0", "train_mtp_step0"):
        assert set(gaps["by_phase"][phase]) == {"indexer", "router_expert", "router_group"}, phase
    phases = set(gaps["by_phase"])
    want = {"eval", "eval_mtp", "pad", "pad_mtp"} | {f"train_step{i}" for i in range(TRAIN_STEPS)}
    want |= {f"train_mtp_step{i}" for i in range(TRAIN_STEPS)}
    assert phases == want


def test_reference_tensor_shapes(case):
    ref, cfg, meta = case["ref"], case["cfg"], case["meta"]
    V, E = cfg["vocab_size"], cfg["n_routed_experts"]
    shapes = {
        "input_ids": ((B, S), np.int64),
        "labels": ((B, S), np.int64),
        "pad_attention_mask": ((B, S), np.int64),
        "pad_input_ids": ((B, S), np.int64),
        "pad_labels": ((B, S), np.int64),
        "logits": ((B, S, V), np.float32),
        "pad_logits": ((B, S, V), np.float32),
        "mtp_logits": ((B, S, V), np.float32),
        "pad_mtp_logits": ((B, S, V), np.float32),
        "loss": ((), np.float32),
        "pad_loss": ((), np.float32),
        "mtp_loss": ((), np.float32),
        "pad_mtp_loss": ((), np.float32),
        "train_losses": ((TRAIN_STEPS,), np.float32),
        "train_losses_with_mtp": ((TRAIN_STEPS,), np.float32),
        "train_mtp_losses": ((TRAIN_STEPS,), np.float32),
    }
    ckpt_shapes = expected_keys(cfg)
    grad_keys = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.4.self_attn.kv_b_proj.weight",
        "model.layers.5.mlp.gate.weight",
        "model.layers.5.mlp.shared_experts.down_proj.weight",
        "model.layers.7.self_attn.o_proj.weight",
        "model.layers.6.input_layernorm.weight",
    ] + [f"model.layers.5.mlp.experts.{e}.up_proj.weight" for e in range(E)]
    for k in grad_keys:
        shapes["grad." + k] = (ckpt_shapes[k], np.float32)
    assert set(ref) == set(shapes), sorted(set(ref) ^ set(shapes))
    for k, (shape, dtype) in shapes.items():
        assert ref[k].shape == tuple(shape), (k, ref[k].shape)
        assert ref[k].dtype == dtype, (k, ref[k].dtype)
        if dtype == np.float32:
            assert np.isfinite(ref[k]).all(), k
    assert {k: (tuple(v["shape"]), v["dtype"]) for k, v in meta["tensors"].items()} == {
        k: (tuple(v.shape), str(v.dtype)) for k, v in ref.items()
    }


def test_inputs_and_padding(case):
    ref, cfg = case["ref"], case["cfg"]
    ids = ref["input_ids"]
    assert ids.min() >= 3 and ids.max() < cfg["vocab_size"]
    assert np.array_equal(ref["labels"], ids)
    mask = np.ones((B, S), np.int64)
    mask[0, S - RIGHT_PAD :] = 0
    mask[1, :LEFT_PAD] = 0
    assert np.array_equal(ref["pad_attention_mask"], mask)
    pad = cfg["pad_token_id"]
    assert np.array_equal(ref["pad_input_ids"], np.where(mask == 1, ids, pad))
    assert np.array_equal(ref["pad_labels"], np.where(mask == 1, ids, -100))
    assert case["meta"]["pad_queries_without_visible_key"] == [[1, i] for i in range(LEFT_PAD)]


def test_losses_match_logits(case):
    """The stored losses are the HF conventions applied to the stored logits."""
    ref = case["ref"]
    labels, plabels = ref["labels"], ref["pad_labels"]
    assert abs(ce(ref["logits"][:, :-1], labels[:, 1:]) - float(ref["loss"])) < 1e-4
    assert abs(ce(ref["pad_logits"][:, :-1], plabels[:, 1:]) - float(ref["pad_loss"])) < 1e-4
    # MTP depth 1: position i predicts labels[i + 2]
    assert abs(ce(ref["mtp_logits"][:, :-2], labels[:, 2:]) - float(ref["mtp_loss"])) < 1e-4
    assert abs(ce(ref["pad_mtp_logits"][:, :-2], plabels[:, 2:]) - float(ref["pad_mtp_loss"])) < 1e-4
    assert not np.allclose(ref["logits"], ref["mtp_logits"])
    assert 0.5 < ref["logits"].std() < 2.0, "logits scale drifted away from O(1) (std ~1 by design, see GAIN)"


def test_training_consistency(case):
    ref = case["ref"]
    tl, tm, tmt = ref["train_losses"], ref["train_mtp_losses"], ref["train_losses_with_mtp"]
    # step 0 starts from the checkpoint weights on the no-mask batch: same as the eval forward
    assert abs(float(tl[0]) - float(ref["loss"])) < 1e-5
    assert abs(float(tm[0]) - float(ref["mtp_loss"])) < 1e-5
    assert abs(float(tmt[0]) - (float(ref["loss"]) + MTP_COEFF * float(ref["mtp_loss"]))) < 1e-4
    assert float(tl[-1]) < float(tl[0]) and float(tmt[-1]) < float(tmt[0]), "SGD did not reduce the loss"
    assert not np.allclose(tl[1:], tmt[1:] - MTP_COEFF * tm[1:]), "MTP term did not change the trajectory"
    assert case["meta"]["training"]["lr"] == 0.1 and case["meta"]["training"]["steps"] == TRAIN_STEPS


def test_gradients_nontrivial(case):
    ref, cfg = case["ref"], case["cfg"]
    for k, v in ref.items():
        if k.startswith("grad.") and ".experts." not in k:
            assert np.abs(v).max() > 0, f"{k} is all zero"
    ups = [ref[f"grad.model.layers.5.mlp.experts.{e}.up_proj.weight"] for e in range(cfg["n_routed_experts"])]
    assert sum(float(np.abs(g).max() > 0) for g in ups) >= 2, "fewer than two experts got gradient"
    # embedding rows of tokens absent from the batch get no gradient
    absent = np.setdiff1d(np.arange(cfg["vocab_size"]), ref["input_ids"])
    assert np.abs(ref["grad.model.embed_tokens.weight"][absent]).max() == 0


def test_meta_identity(case):
    meta = case["meta"]
    assert meta["case"] == case["name"]
    assert {"torch", "transformers"} <= set(meta["versions"])
    assert meta["seeds"]["weight_seed"] == meta["seeds"]["base"] + meta["seeds"]["attempt"]
    assert meta["mtp"]["index_share_for_mtp_iteration"] == case["cfg"]["index_share_for_mtp_iteration"]
