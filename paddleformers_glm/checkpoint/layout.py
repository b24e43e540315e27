"""The parameter-name contract: every tensor of a GLM-5.2 model from the config, in the official
(``hf``) layout, the model's own ``state_dict()`` and PaddleFleet's checkpoint layout
(docs/checkpoints.md, "The parameter contract" and "The PaddleFleet layout").

Written out by hand, *not* derived from the AOA rules in ``aoa_mappings/``, so tests can check the
rules against them (two independent statements of the same contract). A spec is ``(shape,
dtype_kind)``, ``dtype_kind`` ``"model"`` (the config's / requested dtype) or ``"float32"``
(:func:`resolve_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ParamSpec",
    "LayerPlan",
    "layer_plan",
    "fleet_param_specs",
    "model_param_specs",
    "paddlefleet_param_specs",
    "hf_param_specs",
    "EXPERT_LAYOUTS",
    "LAYOUTS",
    "resolve_dtype",
    "param_specs",
]

ParamSpec = tuple[tuple[int, ...], str]
LAYOUTS = ("hf", "fleet", "fleet-legacy")
EXPERT_LAYOUTS = ("per-expert", "grouped", "stacked")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer as the checkpoint sees it."""

    index: int  # the number in ``model.layers.{index}``
    mtp: bool  # the MTP layer (index >= num_hidden_layers)
    indexer: bool  # has its own DSA indexer weights ("full")
    moe: bool  # sparse MLP (router + experts) instead of a dense MLP

    @property
    def hf_prefix(self) -> str:
        return f"model.layers.{self.index}"

    @property
    def fleet_prefix(self) -> str:
        """Where the decoder-layer tensors live on the Paddle side (MTP adds ``transformer_layer``)."""
        return f"model.layers.{self.index}.transformer_layer" if self.mtp else f"model.layers.{self.index}"


def layer_plan(config: Any) -> list[LayerPlan]:
    """Decoder layers then MTP layers, following ``indexer_types`` / ``mlp_layer_types``.

    MTP layers always have their own indexer and a MoE MLP (the official checkpoint ships both).
    """
    L = int(config.num_hidden_layers)
    plans = [
        LayerPlan(i, False, config.indexer_types[i] == "full", config.mlp_layer_types[i] == "sparse") for i in range(L)
    ]
    plans += [LayerPlan(L + j, True, True, True) for j in range(int(config.num_mtp_layers))]
    return plans


def resolve_dtype(kind: str, model_dtype: str) -> str:
    """Dtype name of a spec's dtype_kind: ``"float32"`` stays, ``"model"`` becomes ``model_dtype``."""
    return "float32" if kind == "float32" else str(model_dtype)


def _dims(c: Any) -> dict[str, int]:
    nH = int(c.num_attention_heads)
    return {
        "H": int(c.hidden_size),
        "V": int(c.vocab_size),
        "nH": nH,
        "qk": int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim),
        "nope": int(c.qk_nope_head_dim),
        "rope": int(c.qk_rope_head_dim),
        "v": int(c.v_head_dim),
        "qr": int(c.q_lora_rank),
        "kvr": int(c.kv_lora_rank),
        "I": int(c.intermediate_size),
        "Im": int(c.moe_intermediate_size),
        "E": int(c.n_routed_experts),
        "Ns": int(c.n_shared_experts),
        "iH": int(c.index_n_heads),
        "iD": int(c.index_head_dim),
    }


def _decoder(p: str, lp: LayerPlan, d: dict[str, int], bias: bool, model_layout: bool) -> dict[str, ParamSpec]:
    """One decoder layer's tensors: the model's names, ``[in, out]`` linears, fused ``up_gate_proj``
    and an fp32 router, or the official names, ``[out, in]`` linears and separate gate/up."""
    H, M = d["H"], "model"

    def linear(n_in: int, n_out: int) -> tuple[int, int]:
        return (n_in, n_out) if model_layout else (n_out, n_in)

    out: dict[str, ParamSpec] = {
        f"{p}.input_layernorm.weight": ((H,), M),
        f"{p}.post_attention_layernorm.weight": ((H,), M),
        f"{p}.self_attn.q_a_proj.weight": (linear(H, d["qr"]), M),
        f"{p}.self_attn.q_a_layernorm.weight": ((d["qr"],), M),
        f"{p}.self_attn.q_b_proj.weight": (linear(d["qr"], d["nH"] * d["qk"]), M),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": (linear(H, d["kvr"] + d["rope"]), M),
        f"{p}.self_attn.kv_a_layernorm.weight": ((d["kvr"],), M),
        f"{p}.self_attn.kv_b_proj.weight": (linear(d["kvr"], d["nH"] * (d["nope"] + d["v"])), M),
        f"{p}.self_attn.o_proj.weight": (linear(d["nH"] * d["v"], H), M),
    }
    if bias:
        out[f"{p}.self_attn.q_a_proj.bias"] = ((d["qr"],), M)
        out[f"{p}.self_attn.kv_a_proj_with_mqa.bias"] = ((d["kvr"] + d["rope"],), M)
        out[f"{p}.self_attn.o_proj.bias"] = ((H,), M)
    if lp.indexer:
        q = f"{p}.self_attn.core_attention.indexer" if model_layout else f"{p}.self_attn.indexer"
        out[f"{q}.wq_b.weight"] = (linear(d["qr"], d["iH"] * d["iD"]), M)
        out[f"{q}.wk.weight"] = (linear(H, d["iD"]), M)
        out[f"{q}.k_norm.weight"] = ((d["iD"],), M)
        out[f"{q}.k_norm.bias"] = ((d["iD"],), M)
        out[f"{q}.weights_proj.weight"] = (linear(H, d["iH"]), M)

    def gated_mlp(q: str, inter: int) -> None:
        if model_layout:
            out[f"{q}.up_gate_proj.weight"] = ((H, 2 * inter), M)
        else:
            out[f"{q}.gate_proj.weight"] = ((inter, H), M)
            out[f"{q}.up_proj.weight"] = ((inter, H), M)
        out[f"{q}.down_proj.weight"] = (linear(inter, H), M)

    if not lp.moe:
        gated_mlp(f"{p}.mlp", d["I"])
    else:
        out[f"{p}.mlp.gate.weight"] = (linear(H, d["E"]), "float32" if model_layout else M)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = ((d["E"],), "float32")
        if d["Ns"]:  # n_shared_experts 0: no shared expert (the model builds none)
            gated_mlp(f"{p}.mlp.shared_experts", d["Im"] * d["Ns"])
        for e in range(d["E"]):
            gated_mlp(f"{p}.mlp.experts.{e}", d["Im"])
    return out


def _whole_model_specs(config: Any, model_layout: bool) -> dict[str, ParamSpec]:
    """The same tensors in either spelling: the embedding, final norm and head, then every layer
    (MTP layers with their extra norms and ``eh_proj``); ``model_layout`` picks the model's names and
    ``[in, out]`` linears, else the official names and ``[out, in]``."""
    d = _dims(config)
    H, V, M = d["H"], d["V"], "model"
    out: dict[str, ParamSpec] = {
        "model.embedding.embed_tokens.weight" if model_layout else "model.embed_tokens.weight": ((V, H), M),
        "model.norm.weight": ((H,), M),
        "lm_head.weight": ((H, V) if model_layout else (V, H), M),
    }
    for lp in layer_plan(config):
        if lp.mtp:
            p = lp.hf_prefix
            out[f"{p}.enorm.weight"] = ((H,), M)
            out[f"{p}.hnorm.weight"] = ((H,), M)
            out[f"{p}.eh_proj.weight"] = ((2 * H, H) if model_layout else (H, 2 * H), M)
            out[f"{p}.norm.weight" if model_layout else f"{p}.shared_head.norm.weight"] = ((H,), M)
        prefix = lp.fleet_prefix if model_layout else lp.hf_prefix
        out.update(_decoder(prefix, lp, d, bool(config.attention_bias), model_layout))
    return out


def model_param_specs(config: Any) -> dict[str, ParamSpec]:
    """Every key of the Paddle model's ``state_dict()`` with its shape ([in, out] linears) and dtype kind."""
    return _whole_model_specs(config, model_layout=True)


def hf_param_specs(config: Any) -> dict[str, ParamSpec]:
    """Every key of the official checkpoint with its torch-layout shape and dtype kind."""
    return _whole_model_specs(config, model_layout=False)


fleet_param_specs = model_param_specs  # the model's state dict; the name predates the PaddleFleet layout


def paddlefleet_param_specs(config: Any, expert_layout: str = "per-expert") -> dict[str, ParamSpec]:
    """Every tensor of a PaddleFleet-layout checkpoint (what its AOA rules make from the official one):
    :func:`model_param_specs` but the router and head untransposed and, unless ``per-expert``, a layer's
    routed experts concatenated on axis 0 (docs/checkpoints.md, "The PaddleFleet layout").
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {expert_layout!r}; expected one of {EXPERT_LAYOUTS}")
    d = _dims(config)
    out: dict[str, ParamSpec] = {}
    for k, spec in model_param_specs(config).items():
        if k == "lm_head.weight":
            out["model.lm_head.weight"] = ((d["V"], d["H"]), spec[1])
        elif k.endswith(".mlp.gate.weight"):
            out[k] = ((d["E"], d["H"]), "float32")
        elif ".mlp.experts." in k and expert_layout != "per-expert":
            p = k.split(".mlp.experts.")[0] + ".mlp"
            if expert_layout == "grouped":
                w1, w2 = f"{p}.grouped_gemm_experts.weight1", f"{p}.grouped_gemm_experts.weight2"
            else:
                w1, w2 = f"{p}.experts.up_gate_proj", f"{p}.experts.down_proj"
            out[w1] = ((d["E"] * d["H"], 2 * d["Im"]), spec[1])
            out[w2] = ((d["E"] * d["Im"], d["H"]), spec[1])
        else:
            out[k] = spec
    return out


def param_specs(config: Any, layout: str, expert_layout: str = "per-expert") -> dict[str, ParamSpec]:
    """The tensors of a checkpoint in ``layout`` (``hf``, ``fleet`` = PaddleFleet, ``fleet-legacy``)."""
    if layout == "hf":
        return hf_param_specs(config)
    if layout == "fleet":
        return paddlefleet_param_specs(config, expert_layout)
    if layout in ("fleet-legacy", "model"):
        return model_param_specs(config)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
