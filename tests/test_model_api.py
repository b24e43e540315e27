"""The model API users of PaddleFormers / transformers reach for: output access, forward options,
embedding accessors, parameter counts, paddle.jit.to_static, and Auto-class registration."""

import importlib.machinery
import json
import sys
import types

import numpy as np
import paddle
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.auto import register_auto_classes
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.cache import DSACache
from paddleformers_glm.ops import kernels as cpu_kernels

from ._tiny import tiny_model, tokens
from .conftest import FIXTURES


def test_outputs_by_name_position_and_tuple():
    model = tiny_model()
    ids = tokens(2, 12)
    out = model(ids)
    assert out["logits"] is out.logits and out[0] is out.logits
    assert "loss" not in out and out.keys() == ["logits", "last_hidden_state"]
    with pytest.raises(KeyError, match="'loss' is not set"):
        out["loss"]
    out = model(ids, labels=ids)
    assert out[0] is out.loss and out[1] is out.logits and out["mtp_logits"] is out.mtp_logits
    assert out.to_tuple() == tuple(out[k] for k in out.keys())
    tup = model(ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and len(tup) == len(out.to_tuple())
    for a, b in zip(tup, out.to_tuple()):
        if isinstance(a, list):
            a, b = a[0], b[0]
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_inputs_embeds_and_use_cache():
    model = tiny_model()
    ids = tokens(2, 12)
    ref = model(ids).logits.numpy()
    emb = model.get_input_embeddings()(ids)
    np.testing.assert_array_equal(model(inputs_embeds=emb).logits.numpy(), ref)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(ids, inputs_embeds=emb)
    with pytest.raises(ValueError, match="exactly one"):
        model()
    out = model(ids, use_cache=True)
    assert isinstance(out.past_key_values, DSACache) and out.past_key_values.get_seq_length() == 12
    np.testing.assert_allclose(out.logits.numpy(), ref, atol=1e-5)
    assert model(ids, use_cache=True, logits_to_keep=1).logits.shape == [2, 1, 256]


def test_embedding_accessors_parameter_counts_and_config_class():
    model = tiny_model()
    cfg = model.config
    assert GlmMoeDsaForCausalLM.config_class is GlmMoeDsaConfig
    emb = model.get_input_embeddings()
    assert list(emb.weight.shape) == [cfg.vocab_size, cfg.hidden_size]
    assert list(model.get_output_embeddings().weight.shape) == [cfg.hidden_size, cfg.vocab_size]
    total = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert model.num_parameters() == total
    assert model.num_parameters(exclude_embeddings=True) == total - 2 * cfg.vocab_size * cfg.hidden_size
    model.lm_head.weight.stop_gradient = True
    assert model.num_parameters(only_trainable=True) == total - cfg.vocab_size * cfg.hidden_size

    ids = tokens(1, 8)
    before = model(ids).logits.numpy()
    new = paddle.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    new.weight.set_value(emb.weight * 2.0)
    model.set_input_embeddings(new)
    assert model.get_input_embeddings() is new
    assert np.abs(model(ids).logits.numpy() - before).max() > 1e-3


@pytest.mark.slow  # graph building takes tens of seconds even for two layers
@pytest.mark.parametrize("full_graph", [False, True])
def test_to_static_forward_with_kernels_off(full_graph):
    """Both of paddle.jit.to_static's modes: the bytecode tracer (default) and the whole-graph
    translation (full_graph=True, where MoE runs its static-shape form). No eager forward runs
    first, so the eager-side caches start cold."""
    model = tiny_model(  # two layers (one full, one shared; dense + MoE): the graph is built op by op
        seed=2,
        num_hidden_layers=2,
        indexer_types=["full", "shared"],
        index_topk_freq=2,
        index_skip_topk_offset=1,
        mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        n_routed_experts=4,
    )
    model.eval()
    ids = tokens(2, 16, seed=3)
    with cpu_kernels.disabled(), paddle.no_grad():
        ref = model(ids).logits.numpy()
        static = paddle.jit.to_static(model.forward, full_graph=full_graph)
        out = static(ids, return_dict=False)
    assert isinstance(out, tuple)
    assert np.abs(out[0].numpy() - ref).max() <= 1e-5


def _stub_registry():
    """A stand-in for paddleformers.transformers' Auto classes with their (HF) register API."""

    class AutoConfig:
        mapping: dict = {}

        @classmethod
        def register(cls, model_type, config_class, exist_ok=False):
            if model_type in cls.mapping and not exist_ok:
                raise ValueError(f"{model_type} already registered")
            cls.mapping[model_type] = config_class

        @classmethod
        def from_pretrained(cls, path):
            d = json.loads((path / "config.json").read_text())
            return cls.mapping[d["model_type"]].from_dict(d)

    class AutoModelForCausalLM:
        mapping: dict = {}

        @classmethod
        def register(cls, config_class, model_class, exist_ok=False):
            if getattr(model_class, "config_class", config_class) is not config_class:
                raise ValueError("config_class mismatch")
            cls.mapping[config_class] = model_class

        @classmethod
        def from_pretrained(cls, path, **kwargs):
            config = AutoConfig.from_pretrained(path)
            return cls.mapping[type(config)].from_pretrained(path, config=config, **kwargs)

    return AutoConfig, AutoModelForCausalLM


def _install_stub_paddleformers(monkeypatch):
    """A ``paddleformers`` package in sys.modules whose Auto classes are :func:`_stub_registry`'s."""
    AutoConfig, AutoModelForCausalLM = _stub_registry()
    pkg = types.ModuleType("paddleformers")
    pkg.__spec__ = importlib.machinery.ModuleSpec("paddleformers", None)
    sub = types.ModuleType("paddleformers.transformers")
    sub.AutoConfig, sub.AutoModelForCausalLM = AutoConfig, AutoModelForCausalLM
    pkg.transformers = sub
    monkeypatch.setitem(sys.modules, "paddleformers", pkg)
    monkeypatch.setitem(sys.modules, "paddleformers.transformers", sub)
    return AutoConfig, AutoModelForCausalLM


def test_auto_classes_resolve_glm_moe_dsa(monkeypatch):
    AutoConfig, AutoModelForCausalLM = _install_stub_paddleformers(monkeypatch)
    assert register_auto_classes() is True
    ckpt = FIXTURES / "tiny" / "checkpoint"
    assert isinstance(AutoConfig.from_pretrained(ckpt), GlmMoeDsaConfig)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32")
    assert type(model) is GlmMoeDsaForCausalLM
    ids = tokens(1, 8)
    direct = GlmMoeDsaForCausalLM.from_pretrained(ckpt)
    np.testing.assert_array_equal(model(ids).logits.numpy(), direct(ids).logits.numpy())


def test_importing_the_model_registers_nothing(monkeypatch):
    """Registration is the explicit call only: re-importing modeling with a PaddleFormers registry
    installed leaves it empty."""
    AutoConfig, AutoModelForCausalLM = _install_stub_paddleformers(monkeypatch)
    import paddleformers_glm.modeling

    importlib.reload(paddleformers_glm.modeling)
    assert AutoConfig.mapping == {} and AutoModelForCausalLM.mapping == {}
    import paddleformers_glm

    assert paddleformers_glm.register_auto_classes() is True
    assert AutoModelForCausalLM.mapping[GlmMoeDsaConfig] is GlmMoeDsaForCausalLM


def test_auto_registration_is_optional(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert register_auto_classes() is False
