#!/usr/bin/env python
"""Build the HF-transformers reference fixtures for GLM-5.2 (`glm_moe_dsa`) under tests/fixtures/<case>/.

Each case gets:

* ``checkpoint/``: a tiny checkpoint in the *official* HF layout (config.json, two bf16 safetensors
  shards + model.safetensors.index.json, per-expert keys, fp32 ``e_score_correction_bias``, the MTP
  layer ``model.layers.{num_hidden_layers}.`` with its own indexer);
* ``reference.safetensors``: inputs, logits, losses, first-step gradients, 4-step SGD losses and the
  MTP reference, all computed by HF transformers (eager attention, fp32, CPU, one thread);
* ``meta.json``: seeds, settings, shapes, versions and the measured top-k selection gaps.

Every top-k decision that HF takes in every forward pass (DSA indexer and MoE router, main model and
MTP) is checked for a clear margin (>= MIN_GAP) at the selection boundary; a seed that produces a
near-tie is rejected and the next seed is tried, so the fixtures never depend on how an
implementation orders equal scores.

The script is deterministic (same bytes on every run on the same machine/software). ``--check``
regenerates into a temporary directory and compares bytes with the committed fixtures.

Needs torch + transformers (``pip install -e .[reference]``). See tools/README.md.
"""

from __future__ import annotations

import argparse
import copy
import filecmp
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

from paddleformers_glm.parity.reference.topk_gaps import MIN_GAP, GapMonitor, TieError

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "glm52-tiny" / "config.json"

BATCH, SEQ = 2, 32
RIGHT_PAD, LEFT_PAD = 5, 4  # row 0: last 5 positions padded; row 1: first 4 positions padded
LR = 0.1
TRAIN_STEPS = 4
MTP_LOSS_COEFF = 0.1
MAX_ATTEMPTS = 200

GRAD_KEYS = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.q_b_proj.weight",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.4.self_attn.kv_b_proj.weight",
    "model.layers.5.mlp.gate.weight",
    "model.layers.5.mlp.shared_experts.down_proj.weight",
    "model.layers.5.mlp.experts.{e}.up_proj.weight",  # expanded for every expert
    "model.layers.7.self_attn.o_proj.weight",
    "model.layers.6.input_layernorm.weight",
]

# Per case: seed base, the pinned seed attempt (found by --search-seeds: the first attempt whose every
# top-k boundary gap is >= MIN_GAP) and the edits applied to configs/glm52-tiny/config.json.
CASES: dict[str, dict] = {
    "tiny": {"seed": 1000, "attempt": 25, "edits": {}},
    "tiny_pattern_yarn": {
        "seed": 2000,
        "attempt": 77,
        "edits": {
            "index_topk_pattern": "FFSFSSFS",
            "index_topk_freq": None,
            "index_skip_topk_offset": None,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 8000000,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "index_share_for_mtp_iteration": False,
        },
    },
}


# ----------------------------------------------------------------------------------------------
# config


def schedule_from_freq(num_layers: int, freq: int, offset: int) -> list[str]:
    """Layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def case_config(name: str) -> dict:
    cfg = json.loads(BASE_CONFIG.read_text())
    cfg.update(copy.deepcopy(CASES[name]["edits"]))
    n = cfg["num_hidden_layers"]
    if cfg.get("index_topk_pattern"):
        types = ["full" if c == "F" else "shared" for c in cfg["index_topk_pattern"]]
    else:
        types = schedule_from_freq(n, cfg["index_topk_freq"], cfg["index_skip_topk_offset"])
    cfg["indexer_types"] = types
    assert len(types) == n and types[0] == "full"
    return cfg


def hf_config(cfg: dict, **overrides):
    from transformers import GlmMoeDsaConfig

    d = copy.deepcopy(cfg)
    d.update(overrides)
    conf = GlmMoeDsaConfig.from_dict(d)
    conf._attn_implementation = "eager"
    return conf


def check_hf_reads_schedule(cfg: dict) -> dict:
    """HF 5.23 takes `indexer_types` when present, else `index_topk_pattern` (from kwargs), else
    freq/offset (from kwargs, defaults freq 1 / offset 2). Check every route gives our schedule."""
    want = cfg["indexer_types"]
    got_full = list(hf_config(cfg).indexer_types)
    stripped = {k: v for k, v in cfg.items() if k != "indexer_types"}
    got_derived = list(hf_config(stripped).indexer_types)
    assert got_full == want, (got_full, want)
    assert got_derived == want, ("HF derives a different schedule without indexer_types", got_derived, want)
    return {"indexer_types_from_file": got_full == want, "indexer_types_derived_without_list": got_derived == want}


# ----------------------------------------------------------------------------------------------
# weights (official layout)


def official_shapes(cfg: dict) -> OrderedDict:
    """Ordered official key -> (shape, kind). kind picks the init rule."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    E, I_moe, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    I_sh = I_moe * cfg["n_shared_experts"]
    L = cfg["num_hidden_layers"]
    s = OrderedDict()
    s["model.embed_tokens.weight"] = ((V, H), "embed")

    def layer(i: int, full: bool, sparse: bool):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = ((H,), "norm")
        s[p + "post_attention_layernorm.weight"] = ((H,), "norm")
        a = p + "self_attn."
        s[a + "q_a_proj.weight"] = ((cfg["q_lora_rank"], H), "linear")
        s[a + "q_a_layernorm.weight"] = ((cfg["q_lora_rank"],), "norm")
        s[a + "q_b_proj.weight"] = ((nh * qk, cfg["q_lora_rank"]), "linear")
        s[a + "kv_a_proj_with_mqa.weight"] = ((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H), "linear")
        s[a + "kv_a_layernorm.weight"] = ((cfg["kv_lora_rank"],), "norm")
        s[a + "kv_b_proj.weight"] = (
            (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
            "linear",
        )
        s[a + "o_proj.weight"] = ((H, nh * cfg["v_head_dim"]), "linear")
        if full:
            x = a + "indexer."
            s[x + "wq_b.weight"] = ((cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"]), "linear")
            s[x + "wk.weight"] = ((cfg["index_head_dim"], H), "linear")
            s[x + "k_norm.weight"] = ((cfg["index_head_dim"],), "norm")
            s[x + "k_norm.bias"] = ((cfg["index_head_dim"],), "ln_bias")
            s[x + "weights_proj.weight"] = ((cfg["index_n_heads"], H), "index_weights")
        m = p + "mlp."
        if sparse:
            s[m + "gate.weight"] = ((E, H), "router")
            s[m + "gate.e_score_correction_bias"] = ((E,), "score_bias")
            for n in ("gate_proj", "up_proj"):
                s[m + f"shared_experts.{n}.weight"] = ((I_sh, H), "linear")
            s[m + "shared_experts.down_proj.weight"] = ((H, I_sh), "linear")
            for e in range(E):
                s[m + f"experts.{e}.gate_proj.weight"] = ((I_moe, H), "linear")
                s[m + f"experts.{e}.up_proj.weight"] = ((I_moe, H), "linear")
                s[m + f"experts.{e}.down_proj.weight"] = ((H, I_moe), "linear")
        else:
            for n in ("gate_proj", "up_proj"):
                s[m + f"{n}.weight"] = ((I, H), "linear")
            s[m + "down_proj.weight"] = ((H, I), "linear")

    for i in range(L):
        layer(i, cfg["indexer_types"][i] == "full", cfg["mlp_layer_types"][i] == "sparse")
    for j in range(cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{L + j}."
        s[p + "enorm.weight"] = ((H,), "norm")
        s[p + "hnorm.weight"] = ((H,), "norm")
        s[p + "eh_proj.weight"] = ((H, 2 * H), "linear")
        s[p + "shared_head.norm.weight"] = ((H,), "norm")
        layer(L + j, True, True)  # a complete MoE decoder layer with its own indexer
    s["model.norm.weight"] = ((H,), "norm")
    s["lm_head.weight"] = ((V, H), "lm_head")
    return s


# std multipliers (times 1/sqrt(fan_in)) that make activations O(1) and the top-k decisions well
# separated (index scores O(1), sigmoid router scores spread over (0, 1)). The lm_head gain keeps
# logits at std ~1: two correct fp32 implementations of 8 layers differ by ~1e-6 relative (HF fp32
# itself is ~5e-6 from an fp64 evaluation at logit std 1, ~1e-5 at std 2), and the parity bound
# is 1e-5 absolute, so larger logits would measure fp32 rounding rather than correctness.
GAIN = {"linear": 1.0, "router": 1.5, "index_weights": 3.0, "lm_head": 1.0}


def init_weights(cfg: dict, seed: int) -> OrderedDict:
    """Seeded official-layout fp32 state dict. All values are bf16-representable except the fp32
    `e_score_correction_bias`, so a bf16 checkpoint cast back to fp32 gives exactly these weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = OrderedDict()
    for key, (shape, kind) in official_shapes(cfg).items():
        z = torch.randn(shape, generator=g, dtype=torch.float32)
        if kind == "embed":
            w = z
        elif kind == "norm":
            w = 1.0 + 0.1 * z
        elif kind == "ln_bias":
            w = 0.1 * z
        elif kind == "score_bias":
            w = 0.05 * z
        else:
            w = z * (GAIN[kind] / math.sqrt(shape[1]))
        if kind != "score_bias":
            w = w.to(torch.bfloat16).to(torch.float32)
        out[key] = w.contiguous()
    return out


def split_layer_keys(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def fuse_experts(sd: dict, num_experts: int) -> dict:
    """Official per-expert keys (relative to a decoder layer) -> HF 5.x fused gate_up_proj/down_proj."""
    import torch

    out = {}
    for k, v in sd.items():
        if ".experts." not in k:
            out[k] = v
    if any(".experts." in k for k in sd):
        gu = [
            torch.cat([sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"]], 0)
            for e in range(num_experts)
        ]
        out["mlp.experts.gate_up_proj"] = torch.stack(gu).contiguous()
        out["mlp.experts.down_proj"] = torch.stack(
            [sd[f"mlp.experts.{e}.down_proj.weight"] for e in range(num_experts)]
        ).contiguous()
    return out


def official_to_hf(cfg: dict, state: dict) -> dict:
    L, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    hf = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    for i in range(L):
        p = f"model.layers.{i}."
        for k, v in fuse_experts(split_layer_keys(state, p), E).items():
            hf[p + k] = v
    return hf


def mtp_layer_state(cfg: dict, state: dict, own_indexer: bool) -> tuple[dict, dict]:
    L, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    sd = split_layer_keys(state, f"model.layers.{L}.")
    heads = {k: sd.pop(k) for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")}
    if not own_indexer:
        sd = {k: v for k, v in sd.items() if ".indexer." not in k}
    return heads, fuse_experts(sd, E)


# ----------------------------------------------------------------------------------------------
# checkpoint writing


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_checkpoint(ckpt: Path, cfg: dict, state: OrderedDict) -> dict:
    import torch
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True, exist_ok=True)
    write_json(ckpt / "config.json", cfg)
    split_layer = cfg["num_hidden_layers"] // 2  # shard 1: embed + layers [0, split); shard 2: the rest
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for k, v in state.items():
        first = k.startswith("model.embed_tokens.") or (
            k.startswith("model.layers.") and int(k.split(".")[2]) < split_layer
        )
        t = v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
        shards["model-00001-of-00002.safetensors" if first else "model-00002-of-00002.safetensors"][k] = t.contiguous()
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        save_file(tensors, str(ckpt / fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    write_json(
        ckpt / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    return {"total_size": total, "num_tensors": len(weight_map)}


def verify_load_back(ckpt: Path, cfg: dict, state: dict) -> dict:
    """HF from_pretrained(dtype=float32) must give exactly the weights the reference used."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    model, info = GlmMoeDsaForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    want = official_to_hf(cfg, state)
    got = model.state_dict()
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:10]
    for k in want:
        assert got[k].dtype == torch.float32, (k, got[k].dtype)
        assert torch.equal(got[k], want[k]), k
    mtp_prefix = f"model.layers.{cfg['num_hidden_layers']}."
    unexpected = sorted(info.get("unexpected_keys", []))
    assert not info.get("missing_keys"), info.get("missing_keys")
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    assert all(k.startswith(mtp_prefix) for k in unexpected), unexpected
    indexer_layers = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    return {
        "exact": True,
        "num_tensors_compared": len(want),
        "missing_keys": 0,
        "unexpected_keys": len(unexpected),
        "unexpected_key_prefixes": sorted({mtp_prefix} if unexpected else set()),
        "hf_layers_with_indexer": indexer_layers,
    }


# ----------------------------------------------------------------------------------------------
# model pieces


class Capture:
    """Main-model taps: final-normed hidden state, the top-k in effect after every layer and the
    mask / rope inputs handed to the decoder layers."""

    def __init__(self, model, cfg: dict):
        self.cfg = cfg
        self.h0 = None
        self.layer_kwargs = None
        self.topk: list = []
        model.model.norm.register_forward_hook(self._norm)
        model.model.layers[0].register_forward_pre_hook(self._pre, with_kwargs=True)
        for layer in model.model.layers:
            layer.register_forward_hook(self._layer)

    def _pre(self, mod, args, kwargs):
        self.layer_kwargs = {k: kwargs[k] for k in ("attention_mask", "position_embeddings", "position_ids")}
        self.topk = []

    def _layer(self, mod, args, out):
        self.topk.append(out[1])

    def _norm(self, mod, args, out):
        self.h0 = out
        # the schedule really in effect: a shared layer returns the very tensor of the last full layer
        types = self.cfg["indexer_types"]
        assert len(self.topk) == len(types)
        last_full = None
        for i, t in enumerate(types):
            if t == "full":
                assert last_full is None or self.topk[i] is not last_full
                last_full = self.topk[i]
            else:
                assert self.topk[i] is last_full, f"layer {i} did not reuse the previous full layer's top-k"

    @property
    def last_topk(self):
        return self.topk[-1]


def build_mtp(cfg: dict, state: dict):
    import torch
    from torch import nn
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    share = bool(cfg["index_share_for_mtp_iteration"])
    conf = hf_config(
        cfg,
        num_hidden_layers=L + 1,
        indexer_types=list(cfg["indexer_types"]) + ["shared" if share else "full"],
        mlp_layer_types=list(cfg["mlp_layer_types"]) + ["sparse"],
    )
    mtp = nn.ModuleDict(
        {
            "enorm": GlmMoeDsaRMSNorm(H, cfg["rms_norm_eps"]),
            "hnorm": GlmMoeDsaRMSNorm(H, cfg["rms_norm_eps"]),
            "eh_proj": nn.Linear(2 * H, H, bias=False),
            "layer": GlmMoeDsaDecoderLayer(conf, L),
            "shared_head_norm": GlmMoeDsaRMSNorm(H, cfg["rms_norm_eps"]),
        }
    )
    assert (mtp["layer"].self_attn.indexer is None) == share
    heads, layer_sd = mtp_layer_state(cfg, state, own_indexer=not share)
    with torch.no_grad():
        mtp["enorm"].weight.copy_(heads["enorm.weight"])
        mtp["hnorm"].weight.copy_(heads["hnorm.weight"])
        mtp["eh_proj"].weight.copy_(heads["eh_proj.weight"])
        mtp["shared_head_norm"].weight.copy_(heads["shared_head.norm.weight"])
    mtp["layer"].load_state_dict(layer_sd, strict=True)
    return mtp


def mtp_forward(model, mtp, cap: Capture, cfg: dict, input_ids, labels, depth: int = 1):
    """One MTP depth on top of the main forward just run (see tools/README.md for the semantics)."""
    import torch
    import torch.nn.functional as F

    B, S = input_ids.shape
    tokens = torch.cat([input_ids[:, depth:], input_ids.new_zeros(B, depth)], dim=1)
    e = model.model.embed_tokens(tokens)
    x = mtp["eh_proj"](torch.cat([mtp["enorm"](e), mtp["hnorm"](cap.h0)], dim=-1))
    prev = cap.last_topk if cfg["index_share_for_mtp_iteration"] else None
    x, _ = mtp["layer"](
        x,
        attention_mask=cap.layer_kwargs["attention_mask"],
        position_embeddings=cap.layer_kwargs["position_embeddings"],
        position_ids=cap.layer_kwargs["position_ids"],
        past_key_values=None,
        use_cache=False,
        prev_topk_indices=prev,
    )
    logits = model.lm_head(mtp["shared_head_norm"](x))
    mtp_labels = torch.full_like(labels, -100)
    mtp_labels[:, : S - depth - 1] = labels[:, depth + 1 :]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mtp_labels.reshape(-1), ignore_index=-100)
    return logits, loss


def hf_grads_to_official(model, cfg: dict) -> dict:
    out = {}
    params = dict(model.named_parameters())
    for key in GRAD_KEYS:
        if "{e}" in key:
            prefix = key.split("experts.")[0]
            g = params[prefix + "experts.gate_up_proj"].grad
            inter = cfg["moe_intermediate_size"]
            for e in range(cfg["n_routed_experts"]):
                out["grad." + key.format(e=e)] = g[e, inter:].clone()
        else:
            out["grad." + key] = params[key].grad.clone()
    return out


# ----------------------------------------------------------------------------------------------
# one case


def make_inputs(cfg: dict, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg["vocab_size"], (BATCH, SEQ), generator=g, dtype=torch.int64)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[0, SEQ - RIGHT_PAD :] = 0
    mask[1, :LEFT_PAD] = 0
    pad_id = cfg["pad_token_id"]
    pad_ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
    pad_labels = torch.where(mask.bool(), pad_ids, torch.full_like(ids, -100))
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "pad_attention_mask": mask,
        "pad_input_ids": pad_ids,
        "pad_labels": pad_labels,
    }


def fresh_model(cfg: dict, ckpt_cfg_dir: Path, state: dict):
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    conf = GlmMoeDsaConfig.from_pretrained(str(ckpt_cfg_dir))
    conf._attn_implementation = "eager"
    assert list(conf.indexer_types) == cfg["indexer_types"]
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(conf).to(torch.float32)
    model.load_state_dict(official_to_hf(cfg, state), strict=True)
    assert model.config._attn_implementation == "eager"
    have = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    assert have == [i for i, t in enumerate(cfg["indexer_types"]) if t == "full"], have
    return model


def run_case(name: str, cfg: dict, state: dict, inputs: dict, ckpt: Path) -> tuple[dict, dict]:
    import torch

    mon = GapMonitor()
    ref: dict = dict(inputs)
    info: dict = {}
    ids, labels = inputs["input_ids"], inputs["labels"]
    pmask, pids, plabels = inputs["pad_attention_mask"], inputs["pad_input_ids"], inputs["pad_labels"]

    with mon.mode():
        # --- eval forwards (logits/loss, padding, MTP) ---
        model = fresh_model(cfg, ckpt, state)
        mtp = build_mtp(cfg, state)
        cap = Capture(model, cfg)
        mon.attach(model)
        mon.attach(mtp)
        model.eval()
        mtp.eval()
        with torch.no_grad():
            mon.phase = "eval"
            out = model(input_ids=ids, labels=labels)
            ref["logits"], ref["loss"] = out.logits.clone(), out.loss.clone()
            mon.phase = "eval_mtp"
            ref["mtp_logits"], ref["mtp_loss"] = mtp_forward(model, mtp, cap, cfg, ids, labels)
            mon.phase = "pad"
            out = model(input_ids=pids, attention_mask=pmask, labels=plabels)
            ref["pad_logits"], ref["pad_loss"] = out.logits.clone(), out.loss.clone()
            m4 = cap.layer_kwargs["attention_mask"]
            no_key = (m4[:, 0] == 0).sum(-1) == 0  # [B, S] queries that see no key at all
            info["pad_queries_without_visible_key"] = [[b, s] for b, s in no_key.nonzero().tolist()]
            mon.phase = "pad_mtp"
            ref["pad_mtp_logits"], ref["pad_mtp_loss"] = mtp_forward(model, mtp, cap, cfg, pids, plabels)
        del model, mtp, cap

        # --- training: 4 SGD steps on the main loss ---
        model = fresh_model(cfg, ckpt, state)
        mon.attach(model)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0, weight_decay=0.0)
        losses = []
        for step in range(TRAIN_STEPS):
            mon.phase = f"train_step{step}"
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            losses.append(float(loss.detach()))
            if step == 0:
                ref.update(hf_grads_to_official(model, cfg))
                no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
                assert no_grad and all(".indexer." in n for n in no_grad), no_grad
                info["params_without_grad"] = len(no_grad)
            opt.step()
        ref["train_losses"] = torch.tensor(losses, dtype=torch.float32)
        del model, opt

        # --- training with MTP: loss + 0.1 * mtp_loss ---
        model = fresh_model(cfg, ckpt, state)
        mtp = build_mtp(cfg, state)
        cap = Capture(model, cfg)
        mon.attach(model)
        mon.attach(mtp)
        model.train()
        mtp.train()
        params = list(model.parameters()) + list(mtp.parameters())
        opt = torch.optim.SGD(params, lr=LR, momentum=0.0, weight_decay=0.0)
        totals, mtps = [], []
        for step in range(TRAIN_STEPS):
            mon.phase = f"train_mtp_step{step}"
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            _, mtp_loss = mtp_forward(model, mtp, cap, cfg, ids, labels)
            total = loss + MTP_LOSS_COEFF * mtp_loss
            total.backward()
            totals.append(float(total.detach()))
            mtps.append(float(mtp_loss.detach()))
            if step == 0:
                g = mtp["eh_proj"].weight.grad
                assert g is not None and float(g.abs().sum()) > 0
            opt.step()
        ref["train_losses_with_mtp"] = torch.tensor(totals, dtype=torch.float32)
        ref["train_mtp_losses"] = torch.tensor(mtps, dtype=torch.float32)

    info["gaps"] = {
        "min_gap_required": MIN_GAP,
        "min": mon.mins,
        "checked_rows": mon.counts,
        "module_calls": mon.calls,
        "by_phase": mon.phase_mins,
    }
    for k in ("loss", "mtp_loss", "pad_loss", "pad_mtp_loss"):
        ref[k] = ref[k].reshape(())
    ref = {
        k: (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous() for k, v in ref.items()
    }
    return ref, info


def build_case(name: str, out_dir: Path, search: bool, max_attempts: int) -> dict:
    import numpy
    import safetensors
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = case_config(name)
    hf_schedule = check_hf_reads_schedule(cfg)
    base = CASES[name]["seed"]
    case_dir = out_dir / name
    first = 0 if search else CASES[name]["attempt"]
    last = max_attempts if search else first + 1
    for attempt in range(first, last):
        weight_seed, data_seed = base + attempt, base + 500_000 + attempt
        if case_dir.exists():
            shutil.rmtree(case_dir)
        ckpt = case_dir / "checkpoint"
        state = init_weights(cfg, weight_seed)
        ckpt_info = write_checkpoint(ckpt, cfg, state)
        inputs = make_inputs(cfg, data_seed)
        try:
            ref, info = run_case(name, cfg, state, inputs, ckpt)
        except TieError as err:
            print(f"[{name}] seed attempt {attempt} rejected: {err}", file=sys.stderr)
            continue
        break
    else:
        if not search:
            raise SystemExit(f"[{name}] the pinned seed attempt {first} now has a near-tie; rerun with --search-seeds")
        raise SystemExit(f"[{name}] no seed without near-ties in {max_attempts} attempts")
    if search:
        print(f"[{name}] first accepted seed attempt: {attempt} (pin it in CASES)", file=sys.stderr)

    load_back = verify_load_back(ckpt, cfg, state)
    save_file(dict(sorted(ref.items())), str(case_dir / "reference.safetensors"))
    conf = hf_config(cfg)
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding, yarn_apply_mscale

    meta = {
        "case": name,
        "description": "HF transformers GlmMoeDsaForCausalLM reference (eager attention, fp32 compute on CPU, 1 thread)",
        "seeds": {
            "base": base,
            "attempt": attempt,
            "weight_seed": weight_seed,
            "data_seed": data_seed,
            "rule": "weight_seed = base + attempt, data_seed = base + 500000 + attempt; attempt = the first one "
            "(from 0) whose every top-k boundary gap is >= min_gap_required, pinned in tools/make_reference.py",
        },
        "weight_init": {
            "rule": "linear: N(0,1)*gain/sqrt(fan_in); norms 1+0.1*N; k_norm.bias 0.1*N; embed N(0,1); "
            "e_score_correction_bias 0.05*N (fp32); everything except the bias rounded to bf16 first",
            "gain": GAIN,
        },
        "config_edits": CASES[name]["edits"],
        "indexer_types": cfg["indexer_types"],
        "mtp": {
            "layer_index": cfg["num_hidden_layers"],
            "depths": cfg["num_nextn_predict_layers"],
            "index_share_for_mtp_iteration": cfg["index_share_for_mtp_iteration"],
            "mtp_topk_source": (
                f"reuses the top-k in effect at main layer {cfg['num_hidden_layers'] - 1} (computed by layer "
                f"{max(i for i, t in enumerate(cfg['indexer_types']) if t == 'full')})"
                if cfg["index_share_for_mtp_iteration"]
                else f"own indexer (model.layers.{cfg['num_hidden_layers']}.self_attn.indexer)"
            ),
            "loss_coeff_in_training": MTP_LOSS_COEFF,
        },
        "hf": {
            "schedule_checks": hf_schedule,
            "attention_scaling": yarn_apply_mscale(conf.rope_parameters, conf.qk_head_dim**-0.5),
            "rope_attention_factor": float(GlmMoeDsaRotaryEmbedding(conf).attention_scaling),
            "rope_head_dim": conf.head_dim,
        },
        "inputs": {
            "batch": BATCH,
            "seq": SEQ,
            "token_range": [3, cfg["vocab_size"]],
            "pad_token_id": cfg["pad_token_id"],
            "pad_row0_right_padded_positions": RIGHT_PAD,
            "pad_row1_left_padded_positions": LEFT_PAD,
            "position_ids": "arange(S) for every row (HF default, no padding adjustment)",
        },
        "training": {
            "optimizer": "torch.optim.SGD",
            "lr": LR,
            "momentum": 0.0,
            "weight_decay": 0.0,
            "steps": TRAIN_STEPS,
            "batch": "input_ids/labels, no attention mask, same batch every step",
            "loss_reported": "before each update",
            "grads": "first step of train_losses (main loss only), official [out,in] orientation",
            **{k: v for k, v in info.items() if k == "params_without_grad"},
        },
        "pad_queries_without_visible_key": info["pad_queries_without_visible_key"],
        "gaps": info["gaps"],
        "checkpoint": {**ckpt_info, "load_back": load_back},
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sorted(ref.items())
        },
        "values": {
            "loss": float(ref["loss"]),
            "pad_loss": float(ref["pad_loss"]),
            "mtp_loss": float(ref["mtp_loss"]),
            "pad_mtp_loss": float(ref["pad_mtp_loss"]),
            "train_losses": [float(x) for x in ref["train_losses"]],
            "train_losses_with_mtp": [float(x) for x in ref["train_losses_with_mtp"]],
            "train_mtp_losses": [float(x) for x in ref["train_mtp_losses"]],
            "logits_std": float(ref["logits"].std()),
            "mtp_logits_std": float(ref["mtp_logits"].std()),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": numpy.__version__,
        },
    }
    write_json(case_dir / "meta.json", meta)
    return meta


# ----------------------------------------------------------------------------------------------
# the block-FP8 case: the official release format (F8_E4M3 weights + F32 `<name>_scale_inv` per block)

FP8_CASE = "tiny_fp8"
FP8_ATTEMPT = 26  # the tiny case's pinned attempt (25) has an indexer near-tie once quantized
FP8_BLOCK = (128, 128)
FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}
_FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def is_fp8_key(key: str) -> bool:
    """The tensors the official release stores in FP8 (MTP layer included)."""
    return key.startswith("model.layers.") and key.endswith(_FP8_SUFFIXES)


def fp8_quantize(w):
    """torch reference of the scheme: per block scale = amax / 448 (fp32), q = (w / scale) in e4m3."""
    import torch

    br, bc = FP8_BLOCK
    rows, cols = w.shape
    R, C = -(-rows // br), -(-cols // bc)
    pad = torch.zeros(R * br, C * bc, dtype=torch.float32)
    pad[:rows, :cols] = w.abs()
    amax = pad.reshape(R, br, C, bc).amax(dim=(1, 3))
    scale = amax / 448.0
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def fp8_dequantize(q, scale):
    """The reference dequantization: ``q.float() * scale_inv`` broadcast per block, in fp32."""
    br, bc = FP8_BLOCK
    rows, cols = q.shape
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * full


def build_fp8_case(out_dir: Path) -> dict:
    """tests/fixtures/tiny_fp8: the tiny model's weights quantized to block FP8 and written in the
    official FP8 layout (three shards, MTP layer included); HF's logits on the dequantized weights;
    sha256 of every dequantized fp32 tensor (official [out, in] orientation)."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    name = "tiny"
    cfg = case_config(name)
    cfg_out = dict(cfg, quantization_config=FP8_QUANT_CONFIG)
    base = CASES[name]["seed"]
    case_dir = out_dir / FP8_CASE
    for attempt in range(FP8_ATTEMPT, FP8_ATTEMPT + MAX_ATTEMPTS):
        if case_dir.exists():
            shutil.rmtree(case_dir)
        ckpt = case_dir / "checkpoint"
        ckpt.mkdir(parents=True)
        state = init_weights(cfg, base + attempt)
        stored, deq = OrderedDict(), OrderedDict()
        for k, w in state.items():
            if is_fp8_key(k):
                q, s = fp8_quantize(w)
                stored[k], stored[k + "_scale_inv"] = q, s
                deq[k] = fp8_dequantize(q, s)
            else:
                stored[k] = w if k.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
                deq[k] = stored[k].to(torch.float32)
        inputs = make_inputs(cfg, base + 500_000 + attempt)
        mon = GapMonitor()
        try:
            with mon.mode():
                write_json(ckpt / "config.json", cfg)  # fresh_model reads the plain config
                model = fresh_model(cfg, ckpt, deq)
                mtp = build_mtp(cfg, deq)
                cap = Capture(model, cfg)
                mon.attach(model)
                mon.attach(mtp)
                model.eval()
                mtp.eval()
                with torch.no_grad():
                    mon.phase = "eval"
                    out = model(input_ids=inputs["input_ids"], labels=inputs["labels"])
                    mon.phase = "eval_mtp"
                    mtp_logits, _ = mtp_forward(model, mtp, cap, cfg, inputs["input_ids"], inputs["labels"])
        except TieError as err:
            print(f"[{FP8_CASE}] seed attempt {attempt} rejected: {err}", file=sys.stderr)
            continue
        break
    else:
        raise SystemExit(f"[{FP8_CASE}] no seed without near-ties")
    # three shards: embeddings + layers [0, 3), layers [3, 6), the rest (layers 6-8 incl. MTP, norm, head)
    shards: dict[str, dict] = {f"model-0000{i}-of-00003.safetensors": {} for i in (1, 2, 3)}
    for k, t in stored.items():
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else (-1 if "embed" in k else 99)
        shards[f"model-0000{1 if layer < 3 else 2 if layer < 6 else 3}-of-00003.safetensors"][k] = t
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        save_file(dict(sorted(tensors.items())), str(ckpt / fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    write_json(
        ckpt / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    write_json(ckpt / "config.json", cfg_out)
    ref = {
        "input_ids": inputs["input_ids"],
        "labels": inputs["labels"],
        "logits": out.logits.detach().to(torch.float32).contiguous(),
        "loss": out.loss.detach().reshape(()).contiguous(),
        "mtp_logits": mtp_logits.detach().to(torch.float32).contiguous(),
    }
    save_file(dict(sorted(ref.items())), str(case_dir / "reference.safetensors"))
    meta = {
        "case": FP8_CASE,
        "description": "the tiny case's weights in block FP8 (official release layout); HF transformers logits "
        "(eager, fp32, CPU) on the dequantized weights",
        "seeds": {"weight_seed": base + attempt, "data_seed": base + 500_000 + attempt, "attempt": attempt},
        "quantization": {
            **FP8_QUANT_CONFIG,
            "scale": "per block: amax(|w|) / 448 in fp32; q = (w / scale).to(torch.float8_e4m3fn)",
            "dequantized": "q.float() * scale_inv broadcast per block (fp32)",
            "fp8_tensors": sum(1 for k in stored if k.endswith("_scale_inv")),
        },
        "gaps": {"min_gap_required": MIN_GAP, "min": mon.mins},
        "checkpoint": {"total_size": total, "num_tensors": len(weight_map)},
        "dequantized_sha256": {
            k: hashlib.sha256(deq[k].contiguous().numpy().tobytes()).hexdigest() for k in sorted(deq) if is_fp8_key(k)
        },
        "versions": {"torch": torch.__version__},
    }
    write_json(case_dir / "meta.json", meta)
    return meta


# generation fixtures: HF greedy `generate` on the committed checkpoints (tests/test_generate.py)

GEN_PROMPT_LENS = [24, 17, 9]  # one batch, left-padded to the longest row
GEN_NEW_TOKENS = 16
GEN_SEED = 7000
GEN_MIN_LOGIT_GAP = 1e-3  # top-1 vs top-2 logit at every greedy step, every row


def build_generate_fixture(
    name: str, out_dir: Path, max_attempts: int = MAX_ATTEMPTS, gen_out: Path | None = None
) -> dict:
    """``generate/<case>.safetensors`` (+ ``.json``): HF greedy generation (eager, fp32, KV + indexer-key cache)
    from the case's committed checkpoint, for a left-padded batch of prompts and for each prompt
    alone. Prompts are drawn again while any indexer/router top-k boundary or any greedy choice is
    a near-tie, so the tokens do not depend on how an implementation rounds."""
    import torch
    from safetensors.torch import save_file
    from transformers import GlmMoeDsaForCausalLM

    case_dir = out_dir / name
    ckpt = case_dir / "checkpoint"
    cfg = json.loads((ckpt / "config.json").read_text())
    model = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert model.config._attn_implementation == "eager"
    pad = int(cfg["pad_token_id"])
    B, S = len(GEN_PROMPT_LENS), max(GEN_PROMPT_LENS)
    kw = dict(max_new_tokens=GEN_NEW_TOKENS, do_sample=False, pad_token_id=pad, eos_token_id=None)
    kw.update(output_logits=True, return_dict_in_generate=True)

    def run(ids, mask):
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        logits = torch.stack(out.logits, 1)  # [B, n, V]
        top2 = logits.topk(2, dim=-1).values
        gap = float((top2[..., 0] - top2[..., 1]).min())
        if gap < GEN_MIN_LOGIT_GAP:
            raise TieError(f"greedy logit gap {gap:.3e} < {GEN_MIN_LOGIT_GAP}")
        return out.sequences, gap

    for attempt in range(max_attempts):
        g = torch.Generator().manual_seed(GEN_SEED + attempt)
        ids = torch.full((B, S), pad, dtype=torch.int64)
        mask = torch.zeros((B, S), dtype=torch.int64)
        rows = []
        for b, n in enumerate(GEN_PROMPT_LENS):
            row = torch.randint(3, cfg["vocab_size"], (n,), generator=g, dtype=torch.int64)
            rows.append(row)
            ids[b, S - n :], mask[b, S - n :] = row, 1
        mon = GapMonitor()
        mon.attach(model)
        try:
            with mon.mode(), torch.no_grad():
                mon.phase = "generate_batch"
                seqs, gap = run(ids, mask)
                alone, gaps = [], [gap]
                for b, row in enumerate(rows):
                    mon.phase = f"generate_row{b}"
                    one, gap = run(row.unsqueeze(0), torch.ones((1, len(row)), dtype=torch.int64))
                    alone.append(one[0])
                    gaps.append(gap)
        except TieError as err:
            print(f"[{name}] generation prompt attempt {attempt} rejected: {err}", file=sys.stderr)
            model._forward_hooks.clear()
            for m in model.modules():
                m._forward_hooks.clear()
                m._forward_pre_hooks.clear()
            continue
        break
    else:
        raise SystemExit(f"[{name}] no generation prompts without near-ties in {max_attempts} attempts")
    ref = {"gen_input_ids": ids, "gen_attention_mask": mask, "gen_sequences": seqs.contiguous()}
    for b, one in enumerate(alone):
        ref[f"gen_row{b}_sequence"] = one.contiguous()
    gen_dir = (gen_out or out_dir) / "generate"
    gen_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(ref.items())), str(gen_dir / f"{name}.safetensors"))
    info = {
        "prompt_lens": GEN_PROMPT_LENS,
        "new_tokens": GEN_NEW_TOKENS,
        "prompt_seed": GEN_SEED + attempt,
        "min_greedy_logit_gap": min(gaps),
        "topk_gaps": mon.mins,
        "batch_equals_rows_alone": all(bool((seqs[b, S - len(r) :] == alone[b]).all()) for b, r in enumerate(rows)),
    }
    write_json(gen_dir / f"{name}.json", info)
    return info


# option fixtures: HF `generate` with options whose handling tests/test_generate_pins.py pins without torch

GEN_OPTIONS_CASE = "tiny"  # the checkpoint the option fixture runs on
_GEN_P1 = [[5, 6, 7, 8, 5, 6, 5]]
_GEN_P2, _GEN_M2 = [[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], [[0, 0, 1, 1, 1, 1], [1] * 6]
# name: the prompt (attention_mask None: none passed) and generate's keywords. Recorded: the sequences
# (greedy and beam search cases), each step's count of finite processed scores per row, and what "record"
# names: "kept": each row's finite step-0 scores' token ids; "scores": the step-0 processed scores at
# "columns". Beam search cases record the sequence scores too, and no greedy gap (a greedy-only rule).
GEN_OPTION_CASES: dict[str, dict] = {
    # do_sample alone: HF's default top_k 50 (and top_p 1.0, temperature 1.0)
    "sample_default_top_k": {
        "input_ids": _GEN_P2,
        "attention_mask": _GEN_M2,
        "kwargs": {"do_sample": True, "max_new_tokens": 1},
        "record": ["kept"],
    },
    # the pad token is an EOS and no mask is given: HF infers no mask (the 211s are attended)
    "pad_is_eos_without_mask": {
        "input_ids": [[211, 211, 5, 6]],
        "attention_mask": None,
        "kwargs": {"eos_token_id": [211], "pad_token_id": 211, "max_new_tokens": 6},
    },
    # min_length counts the prompt: 6-token prompts, min_length 9, so EOS is masked for 3 new tokens
    "min_length_counts_the_prompt": {
        "input_ids": _GEN_P2,
        "attention_mask": _GEN_M2,
        "kwargs": {"min_length": 9, "eos_token_id": [240, 211, 172], "max_new_tokens": 6},
    },
    # min_new_tokens 3 with the EOS set to the greedy run's 4th new token: allowed, and taken, at step 3
    "min_new_tokens_boundary": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {"min_new_tokens": 3, "max_new_tokens": 6},
        "eos_from_greedy_step": 3,
    },
    # the repetition penalty skips the left padding (pad id 0, not among the rows' real tokens)
    "repetition_penalty_left_padding": {
        "input_ids": _GEN_P2,
        "attention_mask": _GEN_M2,
        "kwargs": {"repetition_penalty": 2.0, "eos_token_id": [], "pad_token_id": 0, "max_new_tokens": 4},
        "record": ["scores"],
        "columns": [0, *range(5, 15)],
    },
    # beam search whose last step forces two EOS ids: each beam's two continuations score exactly alike,
    # and HF's candidate top-k (4 x 3 of 3 x 256, k * 64 = n) breaks the tie in torch.topk's order
    "beam_forced_eos_tie": {
        "input_ids": [[23, 9]],
        "attention_mask": None,
        "kwargs": {
            "num_beams": 3,
            "max_new_tokens": 2,
            "eos_token_id": [82, 100, 153],
            "forced_eos_token_id": [153, 204],
            "pad_token_id": 3,
        },
        "exact_ties": True,
    },
    # sampling, top_k 0, a logits_processor ("tied": n) that leaves the first 4 tokens alone and equal:
    # top_p 0.75 drops one of them (a summed 0.25 <= 1 - top_p goes), min_p 1.0 none (none is below the top)
    "top_p_tied_boundary": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {
            "do_sample": True,
            "top_k": 0,
            "top_p": 0.75,
            "eos_token_id": [],
            "pad_token_id": 0,
            "max_new_tokens": 1,
        },
        "tied": 4,
    },
    "min_p_tied_top": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {
            "do_sample": True,
            "top_k": 0,
            "min_p": 1.0,
            "eos_token_id": [],
            "pad_token_id": 0,
            "max_new_tokens": 1,
        },
        "tied": 4,
    },
    # beam sampling keeps min_tokens_to_keep = 1 + #EOS tokens under top-p: 2 finite scores per beam
    "beam_sample_top_p_keeps_eos_count": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {
            "do_sample": True,
            "num_beams": 2,
            "top_k": 0,
            "top_p": 0.01,
            "eos_token_id": [211],
            "pad_token_id": 0,
            "max_new_tokens": 3,
        },
    },
    # EOS held back by min_new_tokens stays -inf under the EOS boost (sampling must still find a token)
    "decay_with_min_new_tokens": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {
            "do_sample": True,
            "min_new_tokens": 3,
            "exponential_decay_length_penalty": [0, 1.5],
            "eos_token_id": [211],
            "pad_token_id": 0,
            "max_new_tokens": 4,
        },
    },
    # three sequence biases end on token 99 at step 0 (after [6], after [5, 6], always): they add up (+6)
    "sequence_biases_add_up": {
        "input_ids": [[5, 6, 7, 8, 5, 6]],
        "attention_mask": None,
        "kwargs": {
            "sequence_bias": [[[6, 99], 2.0], [[5, 6, 99], 3.0], [[99], 1.0]],
            "eos_token_id": [],
            "pad_token_id": 0,
            "max_new_tokens": 1,
        },
        "record": ["scores"],
        "columns": [98, 99, 100],
    },
    # guidance_scale 1 is no guidance: the scores are the raw logits
    "guidance_scale_one_is_off": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {"guidance_scale": 1.0, "eos_token_id": [], "pad_token_id": 0, "max_new_tokens": 3},
        "record": ["scores"],
        "columns": [0, 1, 2, 3, 99, 226],
    },
    # a prefix_allowed_tokens_fn ("prefix_allowed": allowed ids for a row of that length ending with that
    # token, else every id) whose only token is a bad word in one beam: that beam alone stays all -inf
    "prefix_unmet_in_one_beam": {
        "input_ids": _GEN_P1,
        "attention_mask": None,
        "kwargs": {
            "num_beams": 2,
            "bad_words_ids": [[9]],
            "eos_token_id": [211],
            "pad_token_id": 0,
            "max_new_tokens": 3,
        },
        "prefix_allowed": {"length": 8, "last": 99, "allowed": [9]},
    },
    # early_stopping "never": K finished hypotheses do not end the search
    "beam_never_stops_early": {
        "input_ids": [[219, 143, 11]],
        "attention_mask": None,
        "kwargs": {
            "num_beams": 3,
            "early_stopping": "never",
            "eos_token_id": [211, 240, 156, 252, 226],
            "pad_token_id": 0,
            "max_new_tokens": 6,
            "num_return_sequences": 3,
        },
    },
    # "never" with length_penalty <= 0 judges the best running beam at the current length: 6 steps
    "beam_never_negative_length_penalty": {
        "input_ids": [[219, 143, 11]],
        "attention_mask": None,
        "kwargs": {
            "num_beams": 3,
            "early_stopping": "never",
            "length_penalty": -1.0,
            "eos_token_id": [211, 240, 156, 252, 226],
            "pad_token_id": 0,
            "max_new_tokens": 6,
            "num_return_sequences": 3,
        },
    },
    # early_stopping True in a batch: a prompt whose K hypotheses are done takes no more
    "beam_early_stopping_batch": {
        "input_ids": [[25, 221], [8, 139]],
        "attention_mask": None,
        "kwargs": {
            "num_beams": 2,
            "early_stopping": True,
            "eos_token_id": [211, 240, 156, 252, 226, 165, 99, 128],
            "pad_token_id": 0,
            "max_new_tokens": 6,
            "num_return_sequences": 2,
        },
    },
}
# config.json edits for the generation config HF derives (and saves) from a folder without generation_config.json
GEN_DERIVED_CONFIG_EDITS = {
    "output_scores": True,
    "bos_token_id": None,
    "max_new_tokens": None,
    "num_beam_groups": None,
    "watermarking_config": None,
    "cache_config": None,
}


def _greedy_gap(scores: list, sequences, prompt_len: int, eos: list[int]) -> float:
    """The smallest top-1 vs top-2 processed score gap over every step of every row not yet finished."""
    gap = math.inf
    done = [False] * sequences.shape[0]
    for t, sc in enumerate(scores):
        top2 = sc.topk(2, dim=-1).values
        for b in range(sc.shape[0]):
            if not done[b]:
                gap = min(gap, float(top2[b, 0] - top2[b, 1]))
                done[b] = int(sequences[b, prompt_len + t]) in eos
    return gap


def _tied_first(n: int):
    """A logits processor: the first ``n`` tokens score 0, every other -inf."""
    import torch

    def tie(input_ids, scores):
        tied = torch.arange(scores.shape[-1]) < n
        return torch.where(tied, torch.zeros_like(scores), torch.full_like(scores, -math.inf))

    return tie


def _prefix_allowed(rule: dict, vocab: int):
    """A prefix_allowed_tokens_fn: ``rule["allowed"]`` for a row of ``rule["length"]`` tokens ending with
    ``rule["last"]``, every token id otherwise."""
    every = list(range(vocab))
    return lambda batch_id, sent: (
        rule["allowed"] if len(sent) == rule["length"] and int(sent[-1]) == rule["last"] else every
    )


def build_generate_options_fixture(name: str, out_dir: Path, gen_out: Path | None = None) -> dict:
    """``generate/<case>_options.json``: HF's generate (eager, fp32) on the case's committed checkpoint for
    each of GEN_OPTION_CASES, and the generation_config.json HF saves for the checkpoint whose config.json
    carries GEN_DERIVED_CONFIG_EDITS (no generation_config.json). Greedy choices must lead the runner-up by
    GEN_MIN_LOGIT_GAP and the "kept" case's 50th logit the 51st by MIN_GAP, so the tokens and kept sets
    do not depend on rounding. Sampling cases record no tokens (torch's generator draws them); beam search
    cases record the sequences and their scores, without a gap check."""
    import torch
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    ckpt = out_dir / name / "checkpoint"
    model = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg_eos = json.loads((ckpt / "config.json").read_text())["eos_token_id"]
    cases = {}
    for case, spec in GEN_OPTION_CASES.items():
        ids = torch.tensor(spec["input_ids"])
        mask = None if spec["attention_mask"] is None else torch.tensor(spec["attention_mask"])
        kw = dict(spec["kwargs"])
        if "eos_from_greedy_step" in spec:
            k = spec["eos_from_greedy_step"]
            with torch.no_grad():
                free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k + 1, eos_token_id=[])
            new = free[0, ids.shape[1] :].tolist()
            if new[k] in new[:k]:
                raise SystemExit(f"[{case}] the greedy step-{k} token {new[k]} occurs earlier: pick another prompt")
            kw["eos_token_id"] = [new[k]]
        hooks = {}
        if "tied" in spec:  # a logits_processor: the first n tokens at 0, the rest -inf
            hooks["logits_processor"] = transformers.LogitsProcessorList([_tied_first(spec["tied"])])
        if "prefix_allowed" in spec:
            hooks["prefix_allowed_tokens_fn"] = _prefix_allowed(spec["prefix_allowed"], model.config.vocab_size)
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                **kw,
                **hooks,
                return_dict_in_generate=True,
                output_scores=True,
                output_logits=True,
            )
        rec = {"input_ids": spec["input_ids"], "attention_mask": spec["attention_mask"], "kwargs": kw}
        for key in ("tied", "prefix_allowed"):
            if key in spec:
                rec[key] = spec[key]
        rec["finite_per_step"] = [torch.isfinite(s).sum(-1).tolist() for s in out.scores]
        if kw.get("do_sample"):  # the sampled tokens (torch's generator) are not pinned
            if "kept" in spec.get("record", ()):
                top = out.logits[0].topk(51, dim=-1).values
                rec["top_k_boundary_gap"] = float((top[:, 49] - top[:, 50]).min())
                if rec["top_k_boundary_gap"] < MIN_GAP:
                    raise SystemExit(f"[{case}] 50th vs 51st logit gap {rec['top_k_boundary_gap']:.3e} < {MIN_GAP}")
        else:
            eos = kw.get("eos_token_id", cfg_eos)
            rec["sequences"] = out.sequences.tolist()
            if kw.get("num_beams", 1) > 1 and not spec.get("exact_ties"):
                rec["sequences_scores"] = out.sequences_scores.tolist()
            elif not spec.get("exact_ties"):  # else the tie is the case (forced tokens score exactly alike)
                rec["min_greedy_gap"] = _greedy_gap(
                    out.scores, out.sequences, ids.shape[1], eos if isinstance(eos, list) else [eos]
                )
                if rec["min_greedy_gap"] < GEN_MIN_LOGIT_GAP:
                    raise SystemExit(f"[{case}] greedy gap {rec['min_greedy_gap']:.3e} < {GEN_MIN_LOGIT_GAP}")
        if "kept" in spec.get("record", ()):
            rec["kept"] = [torch.isfinite(row).nonzero()[:, 0].tolist() for row in out.scores[0]]
        if "scores" in spec.get("record", ()):
            rec["columns"] = spec["columns"]
            rec["scores"] = out.scores[0][:, spec["columns"]].tolist()
        cases[case] = rec
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        shutil.copytree(ckpt, folder)
        cfg = json.loads((folder / "config.json").read_text()) | GEN_DERIVED_CONFIG_EDITS
        write_json(folder / "config.json", cfg)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        hf.save_pretrained(str(Path(tmp) / "saved"))
        derived = json.loads((Path(tmp) / "saved" / "generation_config.json").read_text())
    info = {
        "cases": cases,
        "derived_generation_config": {"config_edits": GEN_DERIVED_CONFIG_EDITS, "saved": derived},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    gen_dir = (gen_out or out_dir) / "generate"
    gen_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(info, indent=2, sort_keys=True)  # each innermost list of numbers on one line
    text = re.sub(
        r"\[[^\[\]{}\"]*\]", lambda m: " ".join(m.group(0).split()).replace("[ ", "[").replace(" ]", "]"), text
    )
    (gen_dir / f"{name}_options.json").write_text(text + "\n")
    return info


# ----------------------------------------------------------------------------------------------
# bf16 fixtures: HF in bfloat16 on the committed checkpoints and the fp32 fixture's inputs

BF16_FILE = "reference_bf16.safetensors"
BF16_META = "meta_bf16.json"


def _hf_bf16_run(ckpt: Path, fp32: dict, experts_implementation: str | None, mon: GapMonitor | None) -> dict:
    """One HF bf16 run on the fixture inputs: eval and padded logits / losses, the loss before and
    after one ``torch.optim.SGD`` step (lr LR)."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    ids, labels = torch.from_numpy(fp32["input_ids"]), torch.from_numpy(fp32["labels"])
    pmask, pids = torch.from_numpy(fp32["pad_attention_mask"]), torch.from_numpy(fp32["pad_input_ids"])
    plabels = torch.from_numpy(fp32["pad_labels"])
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}

    def load():
        m = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, attn_implementation="eager", **kw)
        assert m.config._attn_implementation == "eager"
        if mon is not None:
            mon.attach(m)
        return m

    model = load()
    run = {"experts_implementation": str(model.config._experts_implementation)}
    run["dtypes"] = {k: str(p.dtype).replace("torch.", "") for k, p in model.state_dict().items()}
    mode = mon.mode() if mon is not None else torch.no_grad()
    with mode, torch.no_grad():
        model.eval()
        if mon is not None:
            mon.phase = "eval"
        out = model(input_ids=ids, labels=labels)
        run["logits"], run["loss"] = out.logits, out.loss.float().reshape(())
        if mon is not None:
            mon.phase = "pad"
        out = model(input_ids=pids, attention_mask=pmask, labels=plabels)
        run["pad_logits"], run["pad_loss"] = out.logits, out.loss.float().reshape(())
    model = load()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0, weight_decay=0.0)
    losses = []
    mode = mon.mode() if mon is not None else torch.enable_grad()
    with mode:
        for step in range(2):  # the loss before the update and after it
            if mon is not None:
                mon.phase = f"train_step{step}"
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            losses.append(float(loss.detach()))
            if step == 0:
                loss.backward()
                opt.step()
    run["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    return run


def build_bf16_fixture(name: str, out_dir: Path) -> dict:
    """``<case>/reference_bf16.safetensors`` (+ ``meta_bf16.json``): HF transformers with bf16
    weights and activations (``from_pretrained(dtype=bfloat16)``: HF's own dtype policy, eager
    attention, its default experts form) on the case's committed checkpoint and the fp32 fixture's
    inputs: eval logits / loss, the padded batch, and the loss before and after one SGD step
    (lr 0.1, ``torch.optim.SGD`` on the bf16 parameters). The fp32 counterparts are the fp32
    fixture's own tensors.

    The same runs with HF's two other experts forms (``eager``, ``batched_mm``: the same maths,
    other rounding) give the spread of HF's own bf16 results, recorded in ``meta_bf16.json``:
    the scale on which another bf16 implementation can be compared. Top-k margins are recorded,
    not enforced: bf16 rounding moves them by more than any threshold the fp32 fixtures use."""
    import torch
    from safetensors.numpy import load_file as load_numpy
    from safetensors.torch import save_file

    case_dir = out_dir / name
    ckpt = case_dir / "checkpoint"
    fp32 = load_numpy(str(case_dir / "reference.safetensors"))
    mon = GapMonitor(min_gap=None)
    main = _hf_bf16_run(ckpt, fp32, None, mon)
    keys = ("logits", "loss", "pad_logits", "pad_loss", "train_losses")
    ref = {k: main[k].detach().contiguous() for k in keys}
    save_file(dict(sorted(ref.items())), str(case_dir / BF16_FILE))

    def maxdiff(a, b) -> float:
        a = a.to(torch.float64).numpy()
        b = b.to(torch.float64).numpy() if isinstance(b, torch.Tensor) else b.astype("float64")
        return float(abs(a - b).max())

    def scalars(run: dict) -> dict:
        return {
            "loss": float(run["loss"]),
            "pad_loss": float(run["pad_loss"]),
            "train_losses": [float(x) for x in run["train_losses"]],
        }

    others = {}
    for impl in ("eager", "batched_mm"):
        if impl == main["experts_implementation"]:
            continue
        run = _hf_bf16_run(ckpt, fp32, impl, None)
        others[impl] = {
            **scalars(run),
            "logits_max_abs_vs_default": maxdiff(run["logits"], ref["logits"]),
            "pad_logits_max_abs_vs_default": maxdiff(run["pad_logits"], ref["pad_logits"]),
        }
    runs = [scalars(main), *others.values()]

    def spread(f) -> float:
        vals = [f(r) for r in runs]
        return max(vals) - min(vals)

    info = {
        "description": "HF transformers GlmMoeDsaForCausalLM in bfloat16 (from_pretrained dtype=bfloat16, eager "
        "attention) on CPU, one thread, on the committed checkpoint and the fp32 fixture's inputs",
        "experts_implementation": main["experts_implementation"],
        "parameter_dtypes_not_bf16": {k: v for k, v in sorted(main["dtypes"].items()) if v != "bfloat16"},
        "training": {
            "optimizer": "torch.optim.SGD (its bf16 update uses the learning rate rounded to bf16)",
            "lr": LR,
            "steps": 1,
            "train_losses": "before, after the step",
        },
        "hf_bf16_vs_fp32": {
            "logits_max_abs": maxdiff(ref["logits"], fp32["logits"]),
            "loss_abs": abs(float(ref["loss"]) - float(fp32["loss"])),
            "pad_logits_max_abs": maxdiff(ref["pad_logits"], fp32["pad_logits"]),
            "pad_loss_abs": abs(float(ref["pad_loss"]) - float(fp32["pad_loss"])),
            "train_losses_abs": [
                abs(float(a) - float(b)) for a, b in zip(ref["train_losses"], fp32["train_losses"][:2])
            ],
        },
        "other_experts_implementations": others,
        "hf_bf16_spread": {
            "loss": spread(lambda r: r["loss"]),
            "pad_loss": spread(lambda r: r["pad_loss"]),
            "train_loss_after_step": spread(lambda r: r["train_losses"][1]),
            "logits_max_abs": max([0.0] + [o["logits_max_abs_vs_default"] for o in others.values()]),
            "pad_logits_max_abs": max([0.0] + [o["pad_logits_max_abs_vs_default"] for o in others.values()]),
        },
        "topk_min_gaps": {"min": mon.mins, "by_phase": mon.phase_mins},
        "tensors": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in sorted(ref.items())
        },
        "values": scalars(main),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    write_json(case_dir / BF16_META, info)
    return info


# ----------------------------------------------------------------------------------------------


def setup_torch() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def generate(out: Path, cases: list[str], search: bool = False, max_attempts: int = MAX_ATTEMPTS) -> dict:
    setup_torch()
    out.mkdir(parents=True, exist_ok=True)
    metas = {}
    for name in cases:
        metas[name] = build_fp8_case(out) if name == FP8_CASE else build_case(name, out, search, max_attempts)
    for name in cases:
        if name != FP8_CASE:
            build_generate_fixture(name, out)
            if name == GEN_OPTIONS_CASE:
                build_generate_options_fixture(name, out)
            build_bf16_fixture(name, out)
    return metas


def compare_dirs(a: Path, b: Path) -> list[str]:
    problems = []
    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    if fa != fb:
        problems.append(
            f"file sets differ: only committed {sorted(set(fa) - set(fb))}, only regenerated {sorted(set(fb) - set(fa))}"
        )
    for rel in sorted(set(fa) & set(fb)):
        if not filecmp.cmp(a / rel, b / rel, shallow=False):
            problems.append(f"bytes differ: {rel}{describe_diff(a / rel, b / rel)}")
    return problems


def compare_generated(committed: Path, regenerated: Path) -> list[str]:
    """The regenerated generate/ files against the committed ones of the same names."""
    problems = []
    for p in sorted((regenerated / "generate").glob("*")):
        mine = committed / "generate" / p.name
        if not mine.is_file():
            problems.append(f"generate: only regenerated {p.name}")
        elif not filecmp.cmp(mine, p, shallow=False):
            problems.append(f"generate: bytes differ: {p.name}{describe_diff(mine, p)}")
    return problems


def describe_diff(pa: Path, pb: Path) -> str:
    """For safetensors files: which tensors differ and by how much (numeric noise vs real change)."""
    if pa.suffix != ".safetensors":
        return ""
    from safetensors.torch import load_file

    ta, tb = load_file(str(pa)), load_file(str(pb))
    if set(ta) != set(tb):
        return f" (keys differ: {sorted(set(ta) ^ set(tb))[:5]})"
    parts = []
    for k in sorted(ta):
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            parts.append(f"{k}: shape/dtype {tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)}/{y.dtype}")
        elif not x.equal(y):
            parts.append(f"{k}: max abs diff {float((x.double() - y.double()).abs().max()):.3e}")
    return " (" + "; ".join(parts[:8]) + (" ..." if len(parts) > 8 else "") + ")"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=ROOT / "tests" / "fixtures", help="fixtures root (default tests/fixtures)"
    )
    ap.add_argument("--cases", nargs="*", default=[*CASES, FP8_CASE], choices=[*CASES, FP8_CASE])
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare bytes with --out")
    ap.add_argument("--search-seeds", action="store_true", help="ignore the pinned seed attempts and search from 0")
    ap.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS, help="seed attempts tried by --search-seeds")
    ap.add_argument(
        "--generate-only",
        action="store_true",
        help="only (re)write generate/ (<case>.safetensors, <case>.json, tiny_options.json) from the committed "
        "checkpoints; with --check, regenerate them into a temp dir and compare",
    )
    ap.add_argument(
        "--bf16-only",
        action="store_true",
        help="only (re)write <case>/reference_bf16.safetensors from the committed checkpoints",
    )
    args = ap.parse_args(argv)

    if args.bf16_only:
        setup_torch()
        for name in args.cases:
            if name != FP8_CASE:
                info = build_bf16_fixture(name, args.out)
                print(name, json.dumps({k: info[k] for k in ("hf_bf16_vs_fp32", "hf_bf16_spread")}))
        return 0

    if args.generate_only:  # from the committed checkpoints; with --check, into a temp dir and compared
        setup_torch()
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) if args.check else args.out
            for name in args.cases:
                if name == FP8_CASE:
                    continue
                print(name, json.dumps(build_generate_fixture(name, args.out, gen_out=dest)))
                if name == GEN_OPTIONS_CASE:
                    build_generate_options_fixture(name, args.out, gen_out=dest)
            problems = compare_generated(args.out, dest) if args.check else []
        for p in problems:
            print("MISMATCH", p)
        if args.check:
            print("check:", "OK (identical bytes)" if not problems else f"{len(problems)} mismatches")
        return 1 if problems else 0

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp), args.cases, args.search_seeds, args.max_attempts)
            problems = []
            for name in args.cases:
                problems += [f"{name}: {p}" for p in compare_dirs(args.out / name, Path(tmp) / name)]
            problems += compare_generated(args.out, Path(tmp))
        for p in problems:
            print("MISMATCH", p)
        print("check:", "OK (identical bytes)" if not problems else f"{len(problems)} mismatches")
        return 1 if problems else 0

    metas = generate(args.out, args.cases, args.search_seeds, args.max_attempts)
    for name, meta in metas.items():
        size = sum(p.stat().st_size for p in (args.out / name).rglob("*") if p.is_file())
        if name == FP8_CASE:
            print(f"{name}: seed attempt {meta['seeds']['attempt']} size {size} bytes gaps {meta['gaps']['min']}")
            continue
        print(
            f"{name}: seed attempt {meta['seeds']['attempt']} size {size} bytes loss {meta['values']['loss']:.6f} gaps {meta['gaps']['min']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
