"""Structure of the Paddle model: layer count, parameter names and count, shared layers without indexer."""

import numpy as np
import paddle

from paddleformers_glm import GlmMoeDsaForCausalLM, GlmMoeDsaModel
from paddleformers_glm.checkpoint import fleet_param_specs

from ._tiny import tiny_config, tiny_model, tokens


def _expected_param_count(c) -> int:
    """Counted by hand from the architecture (independent of the model code and of checkpoint.layout)."""
    H, V = c.hidden_size, c.vocab_size
    nH, qk, nope, v = c.num_attention_heads, c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
    attn = H * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * nH * qk
    attn += H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * nH * (nope + v)
    attn += nH * v * H
    indexer = c.q_lora_rank * c.index_n_heads * c.index_head_dim + H * c.index_head_dim + 2 * c.index_head_dim
    indexer += H * c.index_n_heads
    dense = 3 * H * c.intermediate_size
    moe = H * c.n_routed_experts + c.n_routed_experts  # router weight + correction bias
    moe += c.n_routed_experts * 3 * H * c.moe_intermediate_size
    moe += 3 * H * c.moe_intermediate_size * c.n_shared_experts
    total = 2 * V * H + H  # embedding, lm_head, final norm
    for i in range(c.num_hidden_layers):
        total += 2 * H + attn + (indexer if c.indexer_types[i] == "full" else 0)
        total += dense if c.mlp_layer_types[i] == "dense" else moe
    for _ in range(c.num_mtp_layers):
        total += 3 * H + 2 * H * H + 2 * H + attn + indexer + moe  # e/h/shared-head norms, eh_proj, layer
    return total


def test_layer_count_and_kinds():
    cfg = tiny_config()
    model = GlmMoeDsaForCausalLM(cfg)
    assert isinstance(model.model, GlmMoeDsaModel)
    # len() counts the decoder layers, as transformers' ModuleList; the MTP layer keeps its id (model.layers.8)
    assert len(model.model.layers) == cfg.num_hidden_layers == 8 and len(model.model.layers.keys()) == 9
    assert len(model.model.decoder_layers) == 8 and len(model.model.mtp_layers) == 1
    has_idx = [layer.self_attn.has_indexer for layer in model.model.decoder_layers]
    assert has_idx == [True, True, True, False, False, False, True, False]
    assert [layer.mlp_type for layer in model.model.decoder_layers] == ["dense"] * 3 + ["sparse"] * 5
    assert model.model.mtp_layers[0].transformer_layer.self_attn.has_indexer


def test_parameter_count_and_names():
    cfg = tiny_config()
    model = GlmMoeDsaForCausalLM(cfg)
    sd = model.state_dict()
    assert sum(int(np.prod(t.shape)) for t in sd.values()) == _expected_param_count(cfg)
    names = set(sd)
    for i in range(8):
        has = any(n.startswith(f"model.layers.{i}.self_attn.core_attention.indexer.") for n in names)
        assert has == (cfg.indexer_types[i] == "full"), i
    for expected in [
        "model.embedding.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.up_gate_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.6.self_attn.core_attention.indexer.k_norm.bias",
        "model.layers.7.mlp.experts.7.up_gate_proj.weight",
        "model.layers.7.mlp.shared_experts.down_proj.weight",
        "model.layers.7.mlp.gate.e_score_correction_bias",
        "model.layers.8.enorm.weight",
        "model.layers.8.hnorm.weight",
        "model.layers.8.eh_proj.weight",
        "model.layers.8.norm.weight",
        "model.layers.8.transformer_layer.self_attn.core_attention.indexer.wq_b.weight",
        "model.layers.8.transformer_layer.mlp.experts.0.down_proj.weight",
    ]:
        assert expected in names, expected
    assert not any(".self_attn.indexer." in n or "gate_proj.weight" in n.replace("up_gate_proj", "") for n in names)
    assert model.model.layers[0].mlp.up_gate_proj.weight.shape == [64, 256]  # [in, out], gate then up


def test_state_dict_matches_the_checkpoint_contract():
    cfg = tiny_config()
    sd = GlmMoeDsaForCausalLM(cfg).state_dict()
    specs = fleet_param_specs(cfg)
    assert set(sd) == set(specs)
    for name, spec in specs.items():
        assert tuple(sd[name].shape) == tuple(spec[0]), name


def test_official_744b_structure_without_allocating():
    """The official config builds 21 indexers over 78 layers; counted on the schedule, not on weights."""
    from paddleformers_glm import GlmMoeDsaConfig

    from .conftest import OFFICIAL_CONFIG

    cfg = GlmMoeDsaConfig.from_pretrained(OFFICIAL_CONFIG)
    specs = fleet_param_specs(cfg)
    indexer_layers = {int(n.split(".")[2]) for n in specs if ".core_attention.indexer." in n}
    assert indexer_layers == set(cfg.full_layer_ids) | {78}
    assert _expected_param_count(cfg) == sum(int(np.prod(s[0])) for s in specs.values())


def test_bf16_model_keeps_router_in_fp32():
    cfg = tiny_config()
    model = GlmMoeDsaForCausalLM(cfg, dtype="bfloat16")
    for name, t in model.state_dict().items():
        want = paddle.float32 if ".mlp.gate." in name else paddle.bfloat16
        assert t.dtype == want, (name, t.dtype)
    assert paddle.get_default_dtype() == "float32"  # construction does not leak the default dtype


def test_loss_follows_hf_convention():
    model = tiny_model(seed=3)
    model.eval()
    ids = tokens(2, 12, seed=4)
    labels = ids.numpy().copy()
    labels[0, 5:8] = -100
    out = model(ids, labels=paddle.to_tensor(labels), compute_mtp=False)
    logits = out.logits.numpy().astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    tgt = labels[:, 1:]
    mask = tgt != -100
    nll = -np.take_along_axis(lp[:, :-1], np.where(mask, tgt, 0)[..., None], -1)[..., 0]
    assert abs(float(out.loss) - nll[mask].mean()) < 1e-5


def test_pad_token_row_gets_no_gradient_but_keeps_its_vector():
    model = tiny_model(seed=5)
    ids = paddle.to_tensor([[5, 0, 7, 0, 9]], dtype="int64")  # pad_token_id 0
    out = model(ids, labels=ids, compute_mtp=False)
    emb = model.model.embedding.embed_tokens.weight
    assert np.allclose(model.model.embedding(ids).numpy()[0, 1], emb.numpy()[0])
    out.loss.backward()
    g = emb.grad.numpy()
    assert np.all(g[0] == 0) and np.abs(g[5]).sum() > 0
