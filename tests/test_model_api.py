"""The model API users of PaddleFormers / transformers reach for: output access, forward options,
embedding accessors, parameter counts, paddle.jit.to_static, and that registration is explicit."""

import importlib.util
import sys

import numpy as np
import paddle
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.cache import DSACache
from paddleformers_glm.ops import kernels as cpu_kernels

from ._tiny import TWO_LAYERS, tiny_model, tokens
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
    # by position and as a tuple: transformers' fields only, so its unpacking works here. Measured,
    # transformers 5.23 with labels: (loss, logits, DynamicCache) in eval and in training mode (ours
    # builds no cache in training: docs/model.md, so (loss, logits) there); ids alone, use_cache=False:
    # (logits,). Before, ours added mtp_loss, mtp_logits and last_hidden_state to every tuple
    assert out.to_tuple() == (out.loss, out.logits) and "last_hidden_state" in out.keys()
    loss, logits = model(ids, labels=ids, return_dict=False)
    np.testing.assert_array_equal(loss.numpy(), out.loss.numpy())
    np.testing.assert_array_equal(logits.numpy(), out.logits.numpy())
    model.eval()  # use_cache from the config: (loss, logits, past_key_values), as transformers
    loss, logits, cache = model(ids, labels=ids, return_dict=False)
    assert isinstance(cache, DSACache) and len(model(ids, use_cache=False, return_dict=False)) == 1


def test_positional_arguments_in_transformers_order():
    """transformers 5.23's ``GlmMoeDsaForCausalLM.forward(input_ids, attention_mask, position_ids,
    past_key_values, inputs_embeds, labels, use_cache, logits_to_keep, **kwargs)`` (its signature,
    read with inspect): code ported from it passes them by position. Before, the 4th was labels (a
    cache given there was taken for labels) and the 5th and 6th this package's MTP switches."""
    model = tiny_model()
    model.eval()
    ids = tokens(2, 12)
    want = model(ids, labels=ids)
    got = model(ids, None, None, None, None, ids)
    assert float(got.loss) == float(want.loss)
    np.testing.assert_array_equal(
        model(ids, None, None, None, None, None, None, 1).logits.numpy(), want.logits.numpy()[:, -1:]
    )
    cache = model(ids[:, :-1], use_cache=True).past_key_values
    step = model(ids[:, -1:], None, None, cache, None, None, True)
    np.testing.assert_allclose(step.logits.numpy()[:, -1], want.logits.numpy()[:, -1], atol=2e-5)
    embeds = model.get_input_embeddings()(ids)
    np.testing.assert_array_equal(model(None, None, None, None, embeds).logits.numpy(), want.logits.numpy())
    with pytest.raises(TypeError):
        model(ids, None, None, None, None, ids, None, 0, True)  # add_mtp_loss is a keyword


def test_inputs_embeds_of_another_dtype_are_refused_by_name():
    """bf16 inputs_embeds to a float32 model (and the reverse) failed deep inside with Paddle's
    "kernel 'add' (bfloat16) is not registered", which points at the CPU bf16 kernels. transformers
    5.23 refuses the bf16 model's case ("expected m1 and m2 to have the same dtype", measured) and
    runs the other by promotion, rounding layer 0's normed input to bf16 (0.011 from the float32
    result); here both say which dtype the model computes in."""
    model = tiny_model()
    emb = model.get_input_embeddings()(tokens(1, 6))
    with pytest.raises(ValueError, match=r"inputs_embeds is bfloat16, the model computes in float32"):
        model(inputs_embeds=emb.astype("bfloat16"))
    b16 = tiny_model().to(dtype="bfloat16")
    with pytest.raises(ValueError, match=r"inputs_embeds is float32, the model computes in bfloat16"):
        b16(inputs_embeds=emb)
    assert b16(inputs_embeds=emb.astype("bfloat16")).logits.dtype == paddle.bfloat16


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
    # transformers 5.23 on the tiny fixture: num_parameters() 700864, exclude_embeddings=True 684480
    # (16384 = vocab 256 x hidden 64 less: the token embedding only, the untied lm_head counts);
    # it was total - 2 * V * H here
    assert model.num_parameters(exclude_embeddings=True) == total - cfg.vocab_size * cfg.hidden_size
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
    model = tiny_model(seed=2, n_routed_experts=4, **TWO_LAYERS)  # the graph is built op by op
    model.eval()
    ids = tokens(2, 16, seed=3)
    with cpu_kernels.disabled(), paddle.no_grad():
        ref = model(ids, labels=ids)
        static = paddle.jit.to_static(model.forward, full_graph=full_graph)
        out = static(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    # with labels: (loss, logits, ...); the loss under full_graph=True raised NameError (a module
    # constant as shift_labels' default value) and then AttributeError (a graph value's place)
    assert abs(float(out[0]) - float(ref.loss)) <= 1e-5
    assert np.abs(out[1].numpy() - ref.logits.numpy()).max() <= 1e-5


def test_paddleformers_registration_is_explicit_and_optional(monkeypatch):
    """Importing the model registers nothing anywhere (no PaddleFormers import); asking for the
    PaddleFormers integration without PaddleFormers names the extra to install."""
    import subprocess

    code = (
        "import sys; import paddleformers_glm.modeling; "
        "print(any(m.startswith(('paddleformers.', 'paddleformers_glm.integrations')) or m == 'paddleformers' "
        "for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
    from paddleformers_glm.integrations import paddleformers as pf_glm

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[paddleformers\]'"):
        pf_glm.register()


def test_the_bytecode_tracer_is_loaded_only_by_to_static_and_still_seen_while_it_traces():
    """The model and the training loop do not import paddle.jit.sot (0.1 s of every worker's start);
    a function traced by ``paddle.jit.to_static`` (its bytecode mode, which imports the tracer on first
    use) still sees ``building_graph()`` true while traced and false when run eagerly."""
    import subprocess

    code = (
        "import sys, paddle; import paddleformers_glm.modeling, paddleformers_glm.train.loop; "
        "from paddleformers_glm.ops.norm import building_graph; "
        "loaded = 'paddle.jit.sot' in sys.modules\n"
        "def f(x):\n"
        "    y = x * 2.0 if building_graph() else x * 3.0\n"
        "    for _ in range(12):\n"  # enough ops that the tracer keeps the graph (it runs tiny ones eagerly)
        "        y = y + 0.0\n"
        "    return y\n"
        "x = paddle.ones([1]); print(loaded, paddle.jit.to_static(f)(x).item(), f(x).item())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["False", "2.0", "3.0"], out.stdout[-2000:]


@pytest.mark.reference
def test_num_parameters_exclude_embeddings_equals_transformers():
    """transformers' exclude_embeddings drops the nn.Embedding weights only (measured on the tiny
    fixture: 700864 - 684480 = 16384, the embedding); our count holds the MTP layer transformers
    drops on load, so the differences are compared."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    want = hf.num_parameters() - hf.num_parameters(exclude_embeddings=True)
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == want == 16384


def test_output_hidden_states_as_transformers():
    """transformers 5.23 on the tiny fixture (8 layers): output_hidden_states=True gives 9 [B, S, H]
    tensors; [0] equals embed_tokens(ids) exactly, [8] equals last_hidden_state (max diff 0.0: the
    final-normed one), [1..7] the decoder layers' outputs. (forward raised TypeError.)"""
    model = tiny_model()
    model.eval()
    n = model.config.num_hidden_layers
    ids = tokens(2, 12)
    for kw in ({}, {"use_cache": True}):
        out = model(ids, output_hidden_states=True, **kw)
        hs = out.hidden_states
        assert isinstance(hs, tuple) and len(hs) == n + 1 and all(h.shape == [2, 12, 64] for h in hs)
        np.testing.assert_array_equal(hs[0].numpy(), model.get_input_embeddings()(ids).numpy())
        assert hs[-1] is out.last_hidden_state
        assert np.abs(hs[-2].numpy() - hs[-1].numpy()).max() > 1e-3  # the layer's output is not normed
    assert model(ids).hidden_states is None and "hidden_states" not in model(ids)
    tup = model(ids, labels=ids, output_hidden_states=True, return_dict=False)
    # loss, logits, past_key_values (eval: use_cache defaults to config.use_cache), hidden_states: as transformers
    assert isinstance(tup[2], DSACache) and isinstance(tup[3], tuple) and len(tup[3]) == n + 1
    tup = model(ids, labels=ids, output_hidden_states=True, return_dict=False, use_cache=False)
    assert isinstance(tup[2], tuple) and len(tup[2]) == n + 1  # loss, logits, hidden_states


# transformers 5.23, tiny fixture loaded with attn_implementation="eager", ids = tokens(2, 10), mask 1 but
# row 1's first 3: out.attentions of hf(ids, attention_mask=mask, use_cache=True, output_attentions=True),
# then of the step hf(5s [2, 1], past_key_values=..., attention_mask=[mask, 1s]) (tests/fixtures: none;
# read off the live twin below). Every layer's 8 tensors [2, 4, 10, 10] hold 360 exact zeros.
_ATTN_L0_ROW8 = [0.125082, 0.0, 0.116532, 0.248237, 0.020557, 0.020049, 0.059153, 0.297781, 0.112608, 0.0]
_ATTN_L7_PADDED_ROW9 = [0.0, 0.0, 0.0, 0.189151, 0.123938, 0.193216, 0.217001, 0.03167, 0.203576, 0.041447]
_ATTN_STEP_L3 = [0.0, 0.0, 0.0, 0.024716, 0.017177, 0.180069, 0.030042, 0.072793, 0.309618, 0.215982, 0.149602]


def _tiny_eval(**kw):
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32", **kw)
    model.eval()
    return model


def test_output_attentions_as_transformers_eager():
    """transformers 5.23 with attn_implementation="eager" (its default sdpa warns and returns an empty
    tuple): ``out.attentions``, one [B, heads, S, T] per decoder layer (not the MTP layer), the softmax
    over the keys the layer's top-k kept (0 elsewhere), uniform 1 / T on a padded query, and per decode
    step [B, heads, n, past + n]; keyed after hidden_states (``return_dict=False``). Ours refused
    output_attentions=True (NotImplementedError). Every attention form gives the same weights."""
    ids, mask = tokens(2, 10), np.ones([2, 10], "int64")
    mask[1, :3] = 0
    for form in ("reference", "dense", "sparse", "latent", "auto"):
        model = _tiny_eval()
        model.set_attn_implementation(form)
        out = model(ids, attention_mask=paddle.to_tensor(mask), use_cache=True, output_attentions=True)
        att = out.attentions
        assert isinstance(att, tuple) and len(att) == 8 and all(a.shape == [2, 4, 10, 10] for a in att)
        assert [int((a.numpy() == 0).sum()) for a in att] == [360] * 8, form
        np.testing.assert_allclose(att[0].numpy()[0, 0, 8], _ATTN_L0_ROW8, atol=2e-6)
        np.testing.assert_allclose(att[7].numpy()[1, 3, 9], _ATTN_L7_PADDED_ROW9, atol=2e-6)
        np.testing.assert_array_equal(att[4].numpy()[1, 2, :3], np.full([3, 10], 0.1, "float32"))
        np.testing.assert_allclose(np.stack([a.numpy() for a in att]).sum(-1), 1.0, atol=1e-6)
        step_mask = paddle.to_tensor(np.concatenate([mask, np.ones([2, 1], "int64")], axis=1))
        step = model(paddle.full([2, 1], 5, "int64"), attention_mask=step_mask, past_key_values=out.past_key_values,
                     output_attentions=True)  # fmt: skip
        assert all(a.shape == [2, 4, 1, 11] for a in step.attentions) and len(step.attentions) == 8
        np.testing.assert_allclose(step.attentions[3].numpy()[1, 1, 0], _ATTN_STEP_L3, atol=2e-6)
    assert model(ids).attentions is None and "attentions" not in model(ids, output_attentions=False)
    tup = model(ids, labels=ids, output_attentions=True, return_dict=False, use_cache=False)
    assert isinstance(tup[2], tuple) and len(tup[2]) == 8  # loss, logits, attentions
    model.config.output_attentions = True  # None: the config's, as transformers
    assert len(model(ids).attentions) == 8
    assert all(layer.self_attn.keep_attention is None for layer in model.model.decoder_layers)


def test_attention_weights_are_the_ones_the_layer_attends_with():
    """The weights returned are the layer's: multiplied by the values they give the attention's output
    (before o_proj) of the reference form, whose output is transformers' eager one."""
    model = _tiny_eval()
    attn = model.model.layers[0].self_attn
    x = paddle.randn([2, 7, model.config.hidden_size])
    cos, sin = model.model.rope(x, None)
    kept = []
    attn.keep_attention = kept.append
    q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
    c, k_rot = paddle.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora, attn.rope_dim], axis=-1)
    c = attn.kv_a_layernorm(c)
    model.set_attn_implementation("reference")
    out, topk, _ = attn(x, cos, sin, None, None)
    attn.keep_attention = None
    _, _, v = attn._heads(q_latent, c, k_rot, (cos, sin))
    o = paddle.matmul(kept[0], v.transpose([0, 2, 1, 3])).transpose([0, 2, 1, 3]).reshape([2, 7, -1])
    np.testing.assert_allclose(paddle.matmul(o, attn.o_proj.weight).numpy(), out.numpy(), atol=1e-5)
    sel = np.zeros([2, 7, 7], bool)
    for b, i, j in zip(*np.nonzero(topk.numpy() >= 0)):
        sel[b, i, topk.numpy()[b, i, j]] = True
    assert ((kept[0].numpy() > 0) == sel[:, None]).all()  # nonzero exactly on the selected keys


def test_attn_implementation_takes_transformers_names():
    """transformers 5.23 loads this model with attn_implementation "eager" or "sdpa" (its default);
    ours refused both (ValueError: must be one of ('auto', ...)). "eager" is the reference form (its
    arithmetic: the masked S x S softmax), "sdpa" the form chosen by size; others are still refused."""
    assert _tiny_eval(attn_implementation="eager").config.attn_implementation == "reference"
    model = _tiny_eval(attn_implementation="sdpa")
    assert model.config.attn_implementation == "auto"
    model.set_attn_implementation("eager")
    assert model.config.attn_implementation == "reference"
    with pytest.raises(ValueError, match=r"or transformers' \('eager', 'sdpa'\)\), got 'flash_attention_2'"):
        model.set_attn_implementation("flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation.*got 'flex_attention'"):
        GlmMoeDsaConfig.from_pretrained(FIXTURES / "tiny" / "checkpoint", attn_implementation="flex_attention")


@pytest.mark.reference
def test_output_attentions_equal_transformers_eager():
    """The live twin: every layer's weights of a padded prefill and two decode steps (one token, then
    two), every attention form, within 2e-6 of transformers' eager ones (measured: 1.1e-6 at most)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    ids, mask = tokens(2, 10).numpy(), np.ones([2, 10], "int64")
    mask[1, :3] = 0
    steps = [np.full([2, 1], 5, "int64"), np.full([2, 2], 7, "int64")]
    with torch.no_grad():
        want = [hf(torch.tensor(ids), attention_mask=torch.tensor(mask), use_cache=True, output_attentions=True)]
        for i, new in enumerate(steps):
            m = np.concatenate([mask, np.ones([2, 1 + 2 * i], "int64")], axis=1)
            kw = {"past_key_values": want[-1].past_key_values, "attention_mask": torch.tensor(m)}
            want.append(hf(torch.tensor(new), use_cache=True, output_attentions=True, **kw))
    np.testing.assert_allclose(want[0].attentions[0].numpy()[0, 0, 8], _ATTN_L0_ROW8, atol=1e-6)
    np.testing.assert_allclose(want[1].attentions[3].numpy()[1, 1, 0], _ATTN_STEP_L3, atol=1e-6)
    for form in ("reference", "dense", "sparse", "latent"):
        model = _tiny_eval(attn_implementation=form)
        got = [model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), output_attentions=True)]
        for i, new in enumerate(steps):
            m = paddle.to_tensor(np.concatenate([mask, np.ones([2, 1 + 2 * i], "int64")], axis=1))
            got.append(model(paddle.to_tensor(new), attention_mask=m, past_key_values=got[-1].past_key_values,
                             output_attentions=True))  # fmt: skip
        for g, w in zip(got, want):
            assert len(g.attentions) == len(w.attentions) == 8
            for a, b in zip(g.attentions, w.attentions):
                assert a.shape == list(b.shape) and np.abs(a.numpy() - b.numpy()).max() <= 2e-6, form


def test_a_loss_on_the_attention_weights_trains_the_projections():
    """transformers 5.23's eager weights are in the autograd graph (requires_grad; measured, a loss
    sum(attentions[0] ** 2) in training gives layer 0's q_a_proj a gradient, max 2.58e-3 on the
    hunt's fixture). Ours were computed under no_grad: the same loss gave no parameter a gradient."""
    model = tiny_model()
    model.train()
    out = model(tokens(2, 12), output_attentions=True, use_cache=False)
    assert not out.attentions[0].stop_gradient
    (out.attentions[0] ** 2).sum().backward()
    g = model.model.layers[0].self_attn.q_a_proj.weight.grad
    assert g is not None and float(g.abs().max()) > 0
    assert model.model.layers[1].self_attn.q_a_proj.weight.grad is None  # the loss reads layer 0 only


def test_output_attentions_under_full_recompute_keeps_the_gradients():
    """Inside a recomputed layer the weights stay out of the graph (Fleet's recompute rebuilds it
    without them): with them in it, the backward of the plain LM loss failed ("The size of Holder is
    not enough"), and a loss reading them left a later model with missing gradients. The LM loss's
    gradients under --recompute full equal those without recompute."""
    ids = tokens(2, 8, seed=3)

    def grads(mode):
        model = tiny_model(seed=2)
        model.train()
        model.recompute = mode
        model(ids, labels=ids, output_attentions=True).loss.backward()
        return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}

    ref, full = grads("none"), grads("full")
    assert ref.keys() == full.keys() and all(np.array_equal(ref[k], full[k]) for k in ref)


@pytest.mark.reference
def test_a_loss_on_the_attention_weights_has_transformers_gradients():
    """The live twin: the gradient of sum(attentions[l] ** 2) on layer l's query and key projections."""
    torch, hf, model = _tiny_in_both()
    hf.set_attn_implementation("eager")
    hf.train()
    model.train()
    ids = tokens(2, 12)
    for layer in (0, 4):
        hf.zero_grad()
        model.clear_gradients()
        (hf(torch.tensor(ids.numpy()), output_attentions=True, use_cache=False).attentions[layer] ** 2).sum().backward()
        (model(ids, output_attentions=True, use_cache=False).attentions[layer] ** 2).sum().backward()
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            want = getattr(hf.model.layers[layer].self_attn, name).weight.grad.numpy()
            got = getattr(model.model.layers[layer].self_attn, name).weight.grad.numpy()
            if got.shape != want.shape:
                got = got.T  # Paddle's Linear holds [in, out]
            scale = np.abs(want).max()
            assert scale > 0 and np.abs(got - want).max() <= 1e-4 * scale, (layer, name)


@pytest.mark.reference
def test_output_hidden_states_equal_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    model.eval()
    ids = tokens(2, 10, vocab=hf.config.vocab_size, seed=1)
    mask = np.ones([2, 10], "int64")
    mask[0, :3] = 0
    with torch.no_grad():
        want = hf(torch.tensor(ids.numpy()), attention_mask=torch.tensor(mask), output_hidden_states=True)
    got = model(ids, attention_mask=paddle.to_tensor(mask), output_hidden_states=True).hidden_states
    assert len(got) == len(want.hidden_states) == hf.config.num_hidden_layers + 1
    real = mask.astype(bool)
    for g, w in zip(got, want.hidden_states):
        assert np.abs(g.numpy() - w.numpy())[real].max() <= 1e-4


def test_loss_normalisation_and_num_items_in_batch():
    """transformers 5.23 on the tiny fixture, ids [2, 10] (tokens(2, 10)), labels with the first 4
    of row 0 at -100 (15 targets after the shift): loss 5.968607 (ours 5.968608),
    num_items_in_batch=7 (int or tensor) -> 12.789873 = the sum over 7, 100 -> 0.895291; labels all
    -100 with num_items_in_batch=5 -> 0.0. (num_items_in_batch raised TypeError here.) Labels all
    -100 without it: transformers' mean is NaN, ours 0.0 on purpose (a fully ignored micro-batch
    must not poison a training step; docs/model.md)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    model.eval()
    ids = tokens(2, 10)
    lab = ids.clone()
    lab[0, :4] = -100
    mean = float(model(ids, labels=lab).loss)
    assert abs(mean - 5.968607) <= 2e-5
    for n in (7, paddle.to_tensor(7)):
        assert abs(float(model(ids, labels=lab, num_items_in_batch=n).loss) - 5.968607 * 15 / 7) <= 5e-5
    assert abs(float(model(ids, labels=lab, num_items_in_batch=100).loss) - 0.8952911) <= 1e-5
    none = paddle.full_like(ids, -100)
    assert float(model(ids, labels=none, num_items_in_batch=5).loss) == 0.0
    assert float(model(ids, labels=none).loss) == 0.0


def _tiny_in_both():
    """torch, and the tiny fixture in transformers 5.23 and in ours, both float32 in evaluation mode
    (our from_pretrained returns it so, as transformers'); skips without the reference extra."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return torch, hf, GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")


@pytest.mark.reference
def test_loss_with_ignored_labels_equals_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10, vocab=hf.config.vocab_size)
    lab = ids.numpy().copy()
    lab[0, :4] = -100
    for n in (None, 7, 100):
        with torch.no_grad():
            want = float(hf(torch.tensor(ids.numpy()), labels=torch.tensor(lab), num_items_in_batch=n).loss)
        got = float(model(ids, labels=paddle.to_tensor(lab), num_items_in_batch=n).loss)
        assert abs(want - got) <= 2e-5, (n, want, got)


def test_loss_function_as_transformers():
    """transformers 5.23: ``model.loss_function`` is ForCausalLMLoss(logits, labels, vocab_size,
    num_items_in_batch=None, ignore_index=-100, shift_labels=None) and the forward's loss is it; a
    function assigned to it computes the forward's loss instead, called (measured on the tiny
    fixture) with labels [B, S] and nothing else, + num_items_in_batch when given, + shift_labels
    when given; no labels, no loss (with shift_labels alone: None). Ours had no loss_function
    (AttributeError). Our forward also passes ``labels_shifted=True`` labels as shift_labels."""
    model = _tiny_eval()
    ids = tokens(2, 10)
    lab = ids.clone()
    lab[0, :4] = -100
    out = model(ids, labels=lab)
    V = model.config.vocab_size
    assert float(model.loss_function(out.logits, lab, V)) == float(out.loss)  # bit for bit
    assert abs(float(out.loss) - 5.968607) <= 2e-5  # transformers' (test_loss_normalisation_...)
    want = float(model(ids, labels=lab, num_items_in_batch=7).loss)
    assert float(model.loss_function(logits=out.logits, labels=lab, vocab_size=V, num_items_in_batch=7)) == want
    shifted = paddle.concat([lab[:, 1:], paddle.full([2, 1], -100, lab.dtype)], axis=1)
    assert float(model.loss_function(out.logits, None, V, shift_labels=shifted)) == float(out.loss)
    other = paddle.where(lab < 0, paddle.full_like(lab, -1), lab)  # another ignore_index, the same loss
    assert abs(float(model.loss_function(out.logits, other, V, ignore_index=-1)) - float(out.loss)) <= 1e-6
    calls = []

    def custom(logits, labels, vocab_size, **kw):
        calls.append((sorted(kw), list(labels.shape), vocab_size))
        return logits.astype("float32").mean() * 0 + 3.0

    model.loss_function = custom
    assert model.loss_function is custom
    assert float(model(ids, labels=lab).loss) == 3.0 and float(model(ids, labels=lab, num_items_in_batch=3).loss) == 3.0
    assert (
        float(model(ids, labels=lab, shift_labels=shifted).loss) == 3.0
        and model(ids, shift_labels=shifted).loss is None
    )
    assert [c[0] for c in calls] == [[], ["num_items_in_batch"], ["shift_labels"]] and calls[0][1:] == ([2, 10], V)
    # ignore_index reaches it as transformers passes it (measured: {'ignore_index': 8}); before, it got neither
    # the keyword nor the labels mapped
    model(ids, labels=lab, ignore_index=8)
    assert calls[-1][0] == ["ignore_index"]
    both = model(ids, labels=lab, add_mtp_loss=True)  # the MTP loss is still added to the assigned one's
    assert abs(float(both.loss) - (3.0 + model.config.mtp_loss_scaling_factor * float(both.mtp_loss))) <= 1e-5
    model.loss_function = None
    assert float(model(ids, labels=lab).loss) == float(out.loss)


@pytest.mark.reference
def test_loss_function_equals_transformers():
    """The live twin: transformers' ``model.loss_function`` and ours on the same logits (fp32 and
    bf16), labels with ignored positions, num_items_in_batch (int and tensor), shift_labels and
    another ignore_index: within 2e-6."""
    torch, hf, model = _tiny_in_both()
    rng = np.random.default_rng(3)
    V = hf.config.vocab_size
    logits = rng.standard_normal([2, 9, V]).astype("float32") * 3
    lab = rng.integers(0, V, [2, 9])
    lab[0, :3] = -100
    seven = np.where(lab < 0, 7, lab)  # the ignored positions as ignore_index=7
    cases = [(lab, {}), (lab, {"num_items_in_batch": 5}), (lab, {"shift_labels": np.roll(lab, -1, axis=1)})]
    cases.append((seven, {"ignore_index": 7}))
    for dtype in ("float32", "bfloat16"):
        for labels, kw in cases:
            t = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
            p = {k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
            x = torch.tensor(logits).to(getattr(torch, dtype))
            want = float(hf.loss_function(x, torch.tensor(labels), V, **t))
            got = float(model.loss_function(paddle.to_tensor(logits).astype(dtype), paddle.to_tensor(labels), V, **p))
            assert abs(got - want) <= 2e-6 * max(1.0, abs(want)), (dtype, kw, got, want)
    n = torch.tensor(5)
    want = float(hf.loss_function(torch.tensor(logits), torch.tensor(lab), V, num_items_in_batch=n))
    got = float(
        model.loss_function(paddle.to_tensor(logits), paddle.to_tensor(lab), V, num_items_in_batch=paddle.to_tensor(5))
    )
    assert abs(got - want) <= 2e-6 * abs(want)


def test_inputs_embeds_with_labels_and_logits_to_keep_positions():
    """transformers 5.23 on the tiny fixture, ids = tokens(2, 10): inputs_embeds=embed(ids) with
    labels=ids -> loss 6.107835, the loss of input_ids=ids (ours raised ValueError "the MTP heads
    need input_ids"); logits_to_keep=tensor([0, 5, 9]) -> logits [2, 3, 256], those positions
    (ours raised AssertionError)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    model.eval()
    ids = tokens(2, 10)
    out = model(inputs_embeds=model.get_input_embeddings()(ids), labels=ids)
    assert abs(float(out.loss) - 6.107835) <= 2e-5 and out.mtp_loss is None
    assert abs(float(out.loss) - float(model(ids, labels=ids).loss)) <= 1e-6
    with pytest.raises(ValueError, match="MTP heads need input_ids"):
        model(inputs_embeds=model.get_input_embeddings()(ids), labels=ids, compute_mtp=True)
    full = model(ids).logits.numpy()
    for keep in ([0, 5, 9], [-1, 2]):
        got = model(ids, logits_to_keep=paddle.to_tensor(keep)).logits.numpy()
        np.testing.assert_array_equal(got, full[:, keep])


@pytest.mark.reference
def test_inputs_embeds_labels_and_logits_to_keep_positions_equal_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10)
    t = torch.tensor(ids.numpy())
    with torch.no_grad():
        want = float(hf(inputs_embeds=hf.model.embed_tokens(t), labels=t).loss)
        want_logits = hf(t, logits_to_keep=torch.tensor([0, 5, 9])).logits.numpy()
    assert abs(float(model(inputs_embeds=model.get_input_embeddings()(ids), labels=ids).loss) - want) <= 2e-5
    got = model(ids, logits_to_keep=paddle.to_tensor([0, 5, 9])).logits.numpy()
    assert got.shape == want_logits.shape and np.abs(got - want_logits).max() <= 1e-4


def test_two_dimensional_logits_to_keep_as_transformers():
    """transformers 5.23's ``slice_logits_to_keep``: an int [B, n] tensor keeps those positions per
    row ([B, n, V]), a bool [B, S] mask its True positions flattened ([N, V]); measured on the tiny
    model: [[0, 1], [2, 3]] -> [2, 2, 256] equal to full[b, keep[b]] within 2.4e-7, a 3-True mask ->
    [3, 256] equal to full[mask]. Before: the tensor was flattened and read as positions for every
    row ([2, 4, 256]; a mask read as positions 0 / 1, [2, 20, 256]), without an error."""
    model = tiny_model()
    model.eval()
    ids = tokens(2, 10)
    full = model(ids, use_cache=False).logits.numpy()
    rows = [[0, 1], [2, 3]]
    got = model(ids, use_cache=False, logits_to_keep=paddle.to_tensor(rows)).logits.numpy()
    np.testing.assert_array_equal(got, np.stack([full[b, r] for b, r in enumerate(rows)]))
    mask = np.zeros((2, 10), bool)
    mask[0, [0, 9]] = mask[1, 2] = True
    got = model(ids, use_cache=False, logits_to_keep=paddle.to_tensor(mask)).logits.numpy()
    np.testing.assert_array_equal(got, full[mask])
    with pytest.raises(ValueError, match=r"logits_to_keep of shape \[2, 2\] with labels"):
        model(ids, labels=ids, logits_to_keep=paddle.to_tensor(rows))
    with pytest.raises(ValueError, match="logits_to_keep must be"):
        model(ids, logits_to_keep=paddle.zeros([1, 2, 2], "int64"))


def test_token_ids_outside_the_vocabulary_and_a_mask_of_another_shape_are_refused():
    """transformers 5.23: input id -1 (or 256 of 256) -> IndexError "index out of range in self"; a
    [B, S + 1] or [1, S] mask for B = 2 without a cache -> RuntimeError / IndexError. Ours ran -1
    (Paddle's CPU embedding read memory past the table: loss 5.572) and cut or broadcast the mask
    without a word (use_cache=False)."""
    model = tiny_model()
    model.eval()
    ids = tokens(2, 10)
    for bad in (-1, 256):
        wrong = paddle.to_tensor(np.where(np.arange(10) == 3, bad, ids.numpy()))
        with pytest.raises(IndexError, match=f"input_ids holds {bad}, outside the vocabulary"):
            model(wrong, use_cache=False)
    for shape in ([2, 11], [1, 10]):
        with pytest.raises(ValueError, match=r"attention_mask shape .* != the input's \[batch, seq\] \[2, 10\]"):
            model(ids, paddle.ones(shape, "int64"), use_cache=False)
    with pytest.raises(ValueError, match="attention_mask"):  # with a cache: the cache's own check
        model(ids, paddle.ones([2, 11], "int64"), use_cache=True)


def test_ids_of_a_larger_input_embedding_set_by_the_caller_are_taken():
    """transformers 5.23 embeds any id its input embedding has a row for: after
    ``set_input_embeddings(Embedding(300, H))`` id 270 runs (logits [1, 2, 256], measured). The range
    check refused it, reading config.vocab_size (256)."""
    model = tiny_model()
    model.eval()
    H = model.config.hidden_size
    model.set_input_embeddings(paddle.nn.Embedding(300, H))
    assert model(paddle.to_tensor([[5, 270]]), use_cache=False).logits.shape == [1, 2, model.config.vocab_size]
    with pytest.raises(IndexError, match="input_ids holds 300"):
        model(paddle.to_tensor([[5, 300]]), use_cache=False)


def test_ignore_index_and_float_labels_as_transformers():
    """transformers 5.23 passes ``forward(..., ignore_index=i)`` to its loss (labels equal to i count
    in none; measured 5.586433 on the hunt's fixture, where ours raised TypeError) and refuses float
    labels (RuntimeError), which Paddle's cross entropy truncated to ints without a word."""
    model = tiny_model()
    model.eval()
    ids = tokens(2, 10)
    marked, hf_marked = ids.numpy().copy(), ids.numpy().copy()
    marked[:, :3], hf_marked[:, :3] = -1, -100
    got = model(ids, labels=paddle.to_tensor(marked), ignore_index=-1, use_cache=False).loss
    want = model(ids, labels=paddle.to_tensor(hf_marked), use_cache=False).loss
    assert float(got) == float(want)
    with pytest.raises(ValueError, match="labels must be integer token ids, got float32"):
        model(ids, labels=ids.astype("float32") + 0.7)


@pytest.mark.reference
def test_ignore_index_equals_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10).numpy()
    marked = ids.copy()
    marked[:, [0, 4, 9]] = -1
    with torch.no_grad():
        want = float(hf(torch.tensor(ids), labels=torch.tensor(marked), ignore_index=-1).loss)
    got = float(model(paddle.to_tensor(ids), labels=paddle.to_tensor(marked), ignore_index=-1).loss)
    assert abs(got - want) <= 2e-5, (got, want)


def test_a_4d_attention_mask_is_refused_by_name():
    """transformers 5.23 takes a 4-D [B, 1, S, S] bool mask (the causal one: its plain logits); ours
    crashed inside paddle (expand_v2: "The number of elements (3) of 'shape' ... rank (5)"). The
    layers take a key padding mask only, so any other rank is refused naming the form wanted."""
    model = tiny_model()
    ids = tokens(2, 10)
    causal = paddle.to_tensor(np.tril(np.ones((10, 10), bool))[None, None].repeat(2, 0))
    with pytest.raises(ValueError, match=r"attention_mask must be a \[batch, seq\] padding mask.*\[2, 1, 10, 10\]"):
        model(ids, attention_mask=causal)
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=paddle.ones([10], "int64"))


def _hf_style_loop(model, ids, mask, steps):
    """transformers' hand-written decode loop: ``out = model(ids)``, then each greedy token alone
    with ``past_key_values=out.past_key_values`` (and the mask grown by one column when given).
    -> (tokens [steps + 1][B], each step's last logits)."""
    out = model(ids, attention_mask=mask)
    toks, logits = [], [out.logits[:, -1].numpy()]
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt[:, 0].numpy().tolist())
        if mask is not None:
            mask = paddle.concat([mask, paddle.ones_like(nxt)], 1)
        out = model(nxt, attention_mask=mask, past_key_values=out.past_key_values)
        logits.append(out.logits[:, -1].numpy())
    toks.append(out.logits[:, -1].argmax(-1).numpy().tolist())
    return toks, logits


def test_default_cache_and_the_transformers_decode_loop():
    """transformers 5.23 on the tiny fixture (eval, as its from_pretrained returns it): ``hf(ids)``
    returns a DynamicCache (use_cache defaults to config.use_cache), and the loop above gives, from
    ids = tokens(1, 6, seed=1), the greedy tokens 111, 82, 243, 12, 29, 168; from tokens(2, 7, seed=4)
    with row 0's first 2 left-padded (mask grown each step) [120, 65], [31, 91], [120, 145],
    [176, 141]. Ours returned no cache, so the loop's steps ran without context: 111, 175, 71, 135,
    232, 127 (step logits off by up to 5.3). The plain forward's logits and losses are unchanged bit
    for bit by the cache it now builds; a training-mode forward builds none."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    assert not model.training  # as transformers' from_pretrained
    out = model(tokens(1, 6, seed=1))
    assert isinstance(out.past_key_values, DSACache) and out.past_key_values.get_seq_length() == 6
    toks, _ = _hf_style_loop(model, tokens(1, 6, seed=1), None, 5)
    assert [t[0] for t in toks] == [111, 82, 243, 12, 29, 168]
    mask = paddle.ones([2, 7], "int64")
    mask[0, :2] = 0
    toks, _ = _hf_style_loop(model, tokens(2, 7, seed=4), mask, 3)
    assert toks == [[120, 65], [31, 91], [120, 145], [176, 141]]

    ids = tokens(2, 10)
    lab = ids.clone()
    lab[0, :3] = -100
    for kw in ({}, {"labels": lab}, {"labels": lab, "add_mtp_loss": True}, {"logits_to_keep": 1}):
        plain, cached = model(ids, use_cache=False, **kw), model(ids, **kw)
        assert plain.past_key_values is None and cached.past_key_values is not None
        for name in ("loss", "logits", "mtp_loss", "last_hidden_state"):
            a, b = getattr(plain, name), getattr(cached, name)
            assert (a is None) == (b is None), name
            if a is not None:
                np.testing.assert_array_equal(a.numpy(), b.numpy())
    model.train()
    assert model(ids).past_key_values is None and model(ids, labels=lab).past_key_values is None
    model.config.use_cache = False
    model.eval()
    assert model(ids).past_key_values is None


def _masked_steps(model, ids, prefill_mask, step_masks):
    """A left-padded continuation by hand: ``ids[:, :6]`` with ``prefill_mask``, then one token per
    step with ``past_key_values`` and the step's mask over past + new. -> each step's logits."""
    out = model(ids[:, :6], attention_mask=prefill_mask)
    logits = []
    for t, m in zip(range(6, ids.shape[1]), step_masks):
        out = model(ids[:, t : t + 1], attention_mask=m, past_key_values=out.past_key_values)
        logits.append(out.logits.numpy())
    return logits


def test_a_grown_masks_past_columns_apply_to_the_cached_slots():
    """transformers 5.23 applies the whole [B, past + new] mask at every step of a hand-written loop,
    so slots that a later mask marks 0 stop being attended (measured against it, tiny fixture: a
    prefill without a mask then steps whose masks mark row 0's first 3 slots 0, and a slot masked
    from a later step on: 2.3e-7 / 1.9e-7; ours kept the validity stored at prefill: 0.19 / 0.11).
    Here: the step with such a mask equals the step over a cache whose slots were marked invalid by
    hand, and differs from the step that attends them."""
    model = _tiny_eval()
    ids = tokens(2, 9, seed=7)
    mask = paddle.ones([2, 7], "int64")
    mask[0, :3] = 0
    mask[1, 4] = 0

    def step(m, clear=False):
        cache = model(ids[:, :6]).past_key_values
        if clear:
            cache.key_valid[:, :6] = mask[:, :6].astype("bool")
        return model(ids[:, 6:7], attention_mask=m, past_key_values=cache).logits.numpy()

    np.testing.assert_array_equal(step(mask), step(mask[:, 6:], clear=True))
    assert np.abs(step(mask) - step(mask[:, 6:])).max() > 1e-3


@pytest.mark.reference
def test_grown_masks_equal_transformers_when_they_change_the_past():
    torch, hf, model = _tiny_in_both()
    hf.config._attn_implementation = "eager"
    ids = tokens(2, 9, seed=7)
    left = np.ones([2, 9], "int64")
    left[0, :3] = 0
    later = np.ones([2, 9], "int64")
    later[1, 2] = 0  # a slot already cached, masked from the first step on
    for mask in (left, later):
        steps = [mask[:, :t] for t in (7, 8, 9)]
        got = _masked_steps(model, ids, None, [paddle.to_tensor(m) for m in steps])
        t = torch.tensor(ids.numpy())
        with torch.no_grad():
            out = hf(t[:, :6])
            for i, m in enumerate(steps):
                out = hf(t[:, 6 + i : 7 + i], attention_mask=torch.tensor(m), past_key_values=out.past_key_values)
                np.testing.assert_allclose(got[i], out.logits.numpy(), atol=1e-5)


@pytest.mark.reference
def test_default_cache_decode_loop_equals_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    for ids, mask in ((tokens(1, 6, seed=1), None), (tokens(2, 7, seed=4), np.array([[0, 0] + [1] * 5, [1] * 7]))):
        t = torch.tensor(ids.numpy())
        m = None if mask is None else torch.tensor(mask)
        with torch.no_grad():
            out = hf(t, attention_mask=m)
            want, want_logits = [], [out.logits[:, -1].numpy()]
            for _ in range(4):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                want.append(nxt[:, 0].tolist())
                m = None if m is None else torch.cat([m, torch.ones_like(nxt)], 1)
                out = hf(nxt, attention_mask=m, past_key_values=out.past_key_values)
                want_logits.append(out.logits[:, -1].numpy())
            want.append(out.logits[:, -1].argmax(-1).tolist())
        got, got_logits = _hf_style_loop(model, ids, None if mask is None else paddle.to_tensor(mask), 4)
        assert got == want
        for g, w in zip(got_logits, want_logits):
            assert np.abs(g - w).max() <= 1e-4


def test_num_logits_to_keep_is_accepted_and_ignored():
    """transformers 5.23 on the tiny fixture, ids = tokens(2, 10): ``hf(ids, num_logits_to_keep=1)``
    (and 3) gives logits [2, 10, 256], max diff 0.0 from ``hf(ids)``; with labels the loss is
    unchanged (6.107834); with ``logits_to_keep=2`` too, [2, 2, 256]. Ours raised TypeError
    (unexpected keyword argument)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10)
    full = model(ids)
    for n in (1, 3):
        with pytest.warns(UserWarning, match="num_logits_to_keep is ignored"):
            out = model(ids, num_logits_to_keep=n)
        np.testing.assert_array_equal(out.logits.numpy(), full.logits.numpy())
    with pytest.warns(UserWarning):
        out = model(ids, labels=ids, num_logits_to_keep=1)
    assert out.logits.shape == [2, 10, 256] and abs(float(out.loss) - 6.107834) <= 2e-5
    with pytest.warns(UserWarning):
        assert model(ids, num_logits_to_keep=1, logits_to_keep=2).logits.shape == [2, 2, 256]


@pytest.mark.reference
def test_num_logits_to_keep_equals_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10)
    t = torch.tensor(ids.numpy())
    with torch.no_grad():
        want = hf(t, labels=t, num_logits_to_keep=1)
    with pytest.warns(UserWarning):
        got = model(ids, labels=ids, num_logits_to_keep=1)
    assert list(got.logits.shape) == list(want.logits.shape)
    assert np.abs(got.logits.numpy() - want.logits.numpy()).max() <= 1e-4
    assert abs(float(got.loss) - float(want.loss)) <= 2e-5


def _added_row_stats(new_rows: np.ndarray, old: np.ndarray) -> tuple[float, float]:
    """(max |row - old mean|, std of (row - mean) / (sqrt(1e-9) * the old rows' per-column std)):
    transformers' mean_resizing draws from N(mean, 1e-9 * covariance), so the second is ~1."""
    old = old.astype(np.float64)
    mean, sd = old.mean(0), old.std(0)
    dev = new_rows.astype(np.float64) - mean
    return float(np.abs(dev).max()), float((dev / (np.sqrt(1e-9) * sd)).std())


def test_resize_token_embeddings_as_transformers(tmp_path):
    """transformers 5.23 on the tiny fixture (vocab 256, hidden 64): ``resize_token_embeddings(300)``
    returns the [300, 64] embedding, config.vocab_size 300, lm_head [300, 64], the old rows kept, and
    draws the 44 added rows of each from N(mean, 1e-9 cov) of the old rows (default mean_resizing):
    max |row - mean| 1.28e-4 (embedding) / 1.32e-5 (head), normalised spread 0.985 / 0.999;
    ``mean_resizing=False``: N(0, initializer_range 0.02) (std measured 0.01999 / 0.01984);
    (301, pad_to_multiple_of=64) -> 320; then (None, pad_to_multiple_of=7) -> 322; 200 -> both 200.
    Ours had no resize_token_embeddings (AttributeError)."""
    paddle.seed(0)
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    emb, head = model.get_input_embeddings().weight.numpy().copy(), model.lm_head.weight.numpy().T.copy()
    ids = tokens(2, 8)
    before = model(ids).logits.numpy()
    got = model.resize_token_embeddings(300)
    assert got is model.get_input_embeddings() and list(got.weight.shape) == [300, 64]
    assert model.config.vocab_size == 300 and list(model.lm_head.weight.shape) == [64, 300]
    new_emb, new_head = got.weight.numpy(), model.lm_head.weight.numpy().T
    np.testing.assert_array_equal(new_emb[:256], emb)
    np.testing.assert_array_equal(new_head[:256], head)
    for rows, old, far in ((new_emb[256:], emb, 1.28e-4), (new_head[256:], head, 1.32e-5)):
        dev, spread = _added_row_stats(rows, old)
        assert 0 < dev <= 3 * far and 0.8 <= spread <= 1.2, (dev, spread)
    after = model(ids).logits.numpy()
    np.testing.assert_array_equal(after[..., :256], before)
    assert after.shape[-1] == 300

    assert list(model.resize_token_embeddings(301, pad_to_multiple_of=64).weight.shape) == [320, 64]
    assert list(model.resize_token_embeddings(None, pad_to_multiple_of=7).weight.shape) == [322, 64]
    assert model.resize_token_embeddings() is model.get_input_embeddings() and model.config.vocab_size == 322
    model.resize_token_embeddings(200)
    assert list(model.get_input_embeddings().weight.shape) == [200, 64] and list(model.lm_head.weight.shape) == [
        64,
        200,
    ]
    assert model.config.vocab_size == 200 and model(tokens(1, 4, vocab=200)).logits.shape == [1, 4, 200]
    with pytest.raises(ValueError, match="not an integer"):
        model.resize_token_embeddings(256, pad_to_multiple_of=8.0)

    model.resize_token_embeddings(1200, mean_resizing=False)  # 1000 rows: N(0, 0.02)
    for w in (model.get_input_embeddings().weight.numpy()[200:], model.lm_head.weight.numpy().T[200:]):
        assert abs(float(w.std()) - 0.02) <= 0.001 and abs(float(w.mean())) <= 0.001

    model.resize_token_embeddings(300)
    out = tmp_path / "resized"
    model.save_pretrained(out)
    back = GlmMoeDsaForCausalLM.from_pretrained(out)
    assert back.config.vocab_size == 300 and list(back.get_input_embeddings().weight.shape) == [300, 64]
    assert list(back.lm_head.weight.shape) == [64, 300]


def test_resize_keeps_the_padding_row_while_it_is_in_the_table_as_transformers():
    """transformers 5.23 (modeling_utils.py, ``_get_resized_embeddings``) drops the embedding's
    ``padding_idx`` only when the new table no longer holds that row: ``(new_num_tokens - 1) <
    padding_idx``.  With pad_token_id 100: a resize to 101 rows keeps row 100 the padding row; a resize
    to 100 drops it, and after growing again row 100 is an ordinary row that trains.  Keeping the
    padding index past the end would leave that row without a gradient forever once regrown."""
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_pretrained(FIXTURES / "tiny" / "checkpoint", pad_token_id=100))
    emb = model.get_input_embeddings()
    assert emb.padding_idx == 100
    model.resize_token_embeddings(101)
    assert model.get_input_embeddings().padding_idx == 100
    model.resize_token_embeddings(100)
    assert model.get_input_embeddings().padding_idx is None
    model.resize_token_embeddings(108)
    emb = model.get_input_embeddings()
    assert emb.padding_idx is None
    ids = paddle.to_tensor([[1, 2, 100, 3]])
    model(ids, labels=ids).loss.backward()
    assert np.abs(emb.weight.grad.numpy()[100]).sum() > 0


@pytest.mark.reference
def test_resize_token_embeddings_equals_transformers(tmp_path):
    """transformers' own resize on the same fixture gives the same shapes and row statistics, and
    it loads our checkpoint saved after a resize, with our reload's logits (the file is the
    config's bfloat16: new rows are rounded once, the same for both)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    old_hf = hf.model.embed_tokens.weight.detach().numpy().copy()
    old = model.get_input_embeddings().weight.numpy().copy()
    np.testing.assert_array_equal(old, old_hf)
    hf.resize_token_embeddings(300)
    model.resize_token_embeddings(300)
    want = _added_row_stats(hf.model.embed_tokens.weight.detach().numpy()[256:], old_hf)
    got = _added_row_stats(model.get_input_embeddings().weight.numpy()[256:], old)
    assert got[0] <= 3 * want[0] and abs(got[1] - want[1]) <= 0.2, (got, want)
    assert hf.config.vocab_size == model.config.vocab_size == 300
    out = tmp_path / "resized"
    model.save_pretrained(out)
    loaded = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    back = GlmMoeDsaForCausalLM.from_pretrained(out, dtype="float32")
    ids = np.array([[5, 280, 299, 7, 256]])
    with torch.no_grad():
        want_logits = loaded(torch.tensor(ids)).logits.numpy()
    got_logits = back(paddle.to_tensor(ids)).logits.numpy()
    assert want_logits.shape == got_logits.shape == (1, 5, 300)
    assert np.abs(want_logits - got_logits).max() <= 1e-4


def _padded(side: str) -> paddle.Tensor:
    mask = np.ones([2, 10], "int64")
    mask[0, 7:] = 0
    return paddle.to_tensor(mask if side == "right" else mask[:, ::-1].copy())


def test_loss_on_unmasked_pads_with_a_cache():
    """transformers 5.23 on the tiny fixture, ids = tokens(2, 10, seed=1), row 0 right-padded after 7
    tokens, labels = ids (the pads' labels not -100): loss 5.834991 with use_cache False, True and an
    explicit empty DynamicCache alike (its pads sit at arange positions and attend to the real
    keys). Ours: 5.834992 without a cache, but 5.825914 with use_cache=True or an empty DSACache
    (the pad queries' rope position was 0: their logits off by 2.57). Left padding (row 0's first 3
    are pads): eager attention 5.657485, ours 5.657487; sdpa 5.575806 (its fully masked pad rows:
    transformers' own implementations disagree there)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10, seed=1)
    mask = _padded("right")
    plain = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    assert abs(float(plain.loss) - 5.834991) <= 2e-5
    for kw in ({"use_cache": True}, {"past_key_values": DSACache.for_config(model.config, 2)}):
        out = model(ids, attention_mask=mask, labels=ids, **kw)
        assert abs(float(out.loss) - 5.834991) <= 2e-5, kw
        assert np.abs(out.logits.numpy() - plain.logits.numpy()).max() <= 1e-5
    left = model(ids, attention_mask=_padded("left"), labels=ids)
    assert abs(float(left.loss) - 5.657485) <= 2e-5


@pytest.mark.reference
def test_loss_on_unmasked_pads_with_a_cache_equals_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    ids = tokens(2, 10, seed=1)
    t = torch.tensor(ids.numpy())
    for side in ("right", "left"):
        mask = _padded(side)
        for cached in (False, True):
            with torch.no_grad():
                cache = transformers.DynamicCache(config=hf.config) if cached else None
                want = hf(t, attention_mask=torch.tensor(mask.numpy()), labels=t, past_key_values=cache)
            cache = DSACache.for_config(model.config, 2) if cached else None
            got = model(ids, attention_mask=mask, labels=ids, past_key_values=cache, use_cache=cached)
            assert abs(float(got.loss) - float(want.loss)) <= 2e-5, (side, cached)
            # (left + our explicit cache: generate's positions, the real tokens' shifted by the pads:
            # rope attention sees the same relative positions)
            assert np.abs(got.logits.numpy() - want.logits.numpy()).max() <= 1e-4, (side, cached)


# transformers 5.23, GlmMoeDsaForCausalLM.from_pretrained(tiny, num_hidden_layers=n, dtype=float32):
# logits[0, -1, :3] of the ids 5..12 (measured; its load report lists the other layers as unexpected)
_FIRST_LAYERS_LOGITS = {1: [-1.7102097, 0.08146489, -1.2040416], 4: [-3.285771, 0.18278907, 0.78561157]}


def test_from_pretrained_num_hidden_layers_override_builds_the_first_layers(tmp_path):
    """transformers builds a model of the checkpoint's first n layers from
    ``from_pretrained(path, num_hidden_layers=n)`` (n=1: 144 unexpected keys in its load report;
    n=9 > 8 layers: IndexError); ours refused it (`indexer_types`: has 8 entries, num_hidden_layers
    is 1). The per-layer lists are cut to n entries (transformers keeps 8 and then refuses to save);
    our MTP layer is read from where the file holds it (model.layers.8)."""
    path = FIXTURES / "tiny" / "checkpoint"
    full = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    ids = paddle.to_tensor([list(range(5, 13))])
    for n, want in _FIRST_LAYERS_LOGITS.items():
        with pytest.warns(UserWarning, match=rf"decoder layers {n}\.\.7 of the checkpoint's 8 are not read"):
            model, report = GlmMoeDsaForCausalLM.from_pretrained(
                path, num_hidden_layers=n, dtype="float32", output_loading_info=True
            )
        assert model.config.num_hidden_layers == n and len(model.model.decoder_layers) == n
        assert model.config.indexer_types == full.config.indexer_types[:n]
        assert model.config.mlp_layer_types == full.config.mlp_layer_types[:n]
        assert not report.missing and not report.initialized
        np.testing.assert_allclose(model(ids).logits.numpy()[0, -1, :3], want, atol=1e-5)
        mtp, mtp_full = model.model.mtp_layers[0], full.model.mtp_layers[0]
        np.testing.assert_array_equal(mtp.eh_proj.weight.numpy(), mtp_full.eh_proj.weight.numpy())
        assert len(model(ids, labels=ids).mtp_logits) == 1
    model.save_pretrained(tmp_path / "cut")  # a consistent config: it loads back
    again = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "cut", dtype="float32")
    np.testing.assert_array_equal(again(ids).logits.numpy(), model(ids).logits.numpy())
    for n in (0, 9, 2.0):
        with pytest.raises(ValueError, match=r"num_hidden_layers=.*the checkpoint has 8 decoder layers"):
            GlmMoeDsaForCausalLM.from_pretrained(path, num_hidden_layers=n)
    # other overrides by keyword: as before (transformers: the same); with config= they are refused
    # (transformers: TypeError, __init__() got an unexpected keyword argument 'num_hidden_layers')
    assert GlmMoeDsaForCausalLM.from_pretrained(path, rms_norm_eps=1e-3).config.rms_norm_eps == 1e-3
    with pytest.raises(TypeError, match="given with an explicit config"):
        GlmMoeDsaForCausalLM.from_pretrained(path, config=full.config, num_hidden_layers=1)
    # transformers: from_pretrained(path, config=AutoConfig.from_pretrained(path, num_hidden_layers=1))
    # builds the same first layer (the same logits); ours raised CheckpointError (missing / unexpected keys)
    config = GlmMoeDsaConfig.from_pretrained(
        path, num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"]
    )
    with pytest.warns(UserWarning, match=r"decoder layers 1\.\.7 of the checkpoint's 8 are not read"):
        model = GlmMoeDsaForCausalLM.from_pretrained(path, config=config, dtype="float32")
    np.testing.assert_allclose(model(ids).logits.numpy()[0, -1, :3], _FIRST_LAYERS_LOGITS[1], atol=1e-5)


@pytest.mark.reference
def test_from_pretrained_num_hidden_layers_override_equals_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    ids = list(range(5, 13))
    for n in (1, 4):
        hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), num_hidden_layers=n, dtype=torch.float32)
        with torch.no_grad():
            want = hf.eval()(torch.tensor([ids])).logits.numpy()
        np.testing.assert_allclose(want[0, -1, :3], _FIRST_LAYERS_LOGITS[n], atol=1e-5)
        with pytest.warns(UserWarning, match="not read"):
            model = GlmMoeDsaForCausalLM.from_pretrained(path, num_hidden_layers=n, dtype="float32")
        assert np.abs(model(paddle.to_tensor([ids])).logits.numpy() - want).max() <= 1e-5


def test_logits_to_keep_with_labels_is_refused_by_name():
    """transformers 5.23 on the tiny fixture, ids [2, 10] with labels=ids: logits_to_keep=1 raises
    ValueError "Expected input batch_size (2) to match target batch_size (20)" (3: (6) vs (20);
    tensor([1, 2]): (4) vs (20)); logits_to_keep=10 or 0 gives the plain loss 6.107835 and
    [2, 10, 256] logits. Ours returned the whole sequence's loss beside the kept logits."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10)
    for keep in (1, 3, paddle.to_tensor([1, 2]), paddle.to_tensor([0, 9])):
        with pytest.raises(ValueError, match=r"logits_to_keep=.* of the 10 positions' logits, but labels need"):
            model(ids, labels=ids, logits_to_keep=keep)
    for keep in (0, 10, 12, paddle.to_tensor(list(range(10))), paddle.to_tensor(list(range(-10, 0)))):
        out = model(ids, labels=ids, logits_to_keep=keep)
        assert abs(float(out.loss) - 6.107835) <= 2e-5 and out.logits.shape == [2, 10, 256]
    assert model(ids, logits_to_keep=1).logits.shape == [2, 1, 256]  # without labels: as before


@pytest.mark.reference
def test_logits_to_keep_with_labels_as_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10)
    t = torch.tensor(ids.numpy())
    with torch.no_grad(), pytest.raises(ValueError, match="match target batch_size"):
        hf(t, labels=t, logits_to_keep=1)
    with torch.no_grad():
        want = float(hf(t, labels=t, logits_to_keep=10).loss)
    assert abs(float(model(ids, labels=ids, logits_to_keep=10).loss) - want) <= 2e-5


def test_save_pretrained_returns_the_report_its_annotation_names(tmp_path):
    """save_pretrained was annotated ``-> str`` and returned a SaveReport (transformers 5.23's
    returns None); the annotation and the docstring name the report it returns."""
    import inspect

    from paddleformers_glm.checkpoint import SaveReport

    # SaveReport, or None where is_main_process=False writes nothing (as transformers)
    assert inspect.signature(GlmMoeDsaForCausalLM.save_pretrained).return_annotation == "SaveReport | None"
    assert "SaveReport" in GlmMoeDsaForCausalLM.save_pretrained.__doc__
    report = tiny_model(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"]).save_pretrained(
        tmp_path / "out"
    )
    assert isinstance(report, SaveReport) and report.out_dir == str(tmp_path / "out") and report.tensors > 0


def _packed_pair():
    """Two sequences (5 and 7 tokens) packed in one row as transformers' DataCollatorWithFlattening
    packs them: ids, labels (-100 at each sequence's first token), position_ids restarting."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 256, 5).tolist(), rng.integers(3, 256, 7).tolist()
    ids = paddle.to_tensor([a + b])
    labels = paddle.to_tensor([[-100] + a[1:] + [-100] + b[1:]])
    return ids, labels, paddle.to_tensor([list(range(5)) + list(range(7))])


def test_packed_sequences_as_transformers():
    """transformers 5.23 on the tiny fixture, _packed_pair(): without an attention_mask and a cache
    (use_cache=False, or config.use_cache false) it reads restarting (or jumping) position_ids as
    packed sequences and attends and selects its top-k within each (loss 6.434098, logits equal to
    the two sequences' own); with a cache (use_cache True / None: config.use_cache true) or an
    all-ones attention_mask they are rope positions only (loss 6.118906). Its eager and sdpa
    attention ignore cu_seq_lens_q / _k, max_length_q / _k and seq_idx (the same losses). Ours
    refused the packed case (ValueError) and the collator's keys."""
    model = _tiny_eval()
    ids, labels, pos = _packed_pair()
    for kw in ({"use_cache": True}, {}, {"use_cache": False, "attention_mask": paddle.ones_like(ids)}):
        assert abs(float(model(ids, labels=labels, position_ids=pos, **kw).loss) - 6.118906) <= 2e-5, kw
    out = model(ids, labels=labels, position_ids=pos, use_cache=False)
    assert abs(float(out.loss) - 6.434098) <= 2e-5
    alone = [model(ids[:, a:b], use_cache=False).logits for a, b in ((0, 5), (5, 12))]
    np.testing.assert_allclose(out.logits.numpy(), paddle.concat(alone, axis=1).numpy(), atol=2e-5)
    gap = paddle.to_tensor([list(range(5)) + list(range(10, 17))])  # transformers: a new sequence too
    jumped = model(ids, position_ids=gap, use_cache=False).logits
    second = model(ids[:, 5:], position_ids=gap[:, 5:], use_cache=False).logits
    np.testing.assert_allclose(jumped.numpy()[:, 5:], second.numpy(), atol=2e-5)
    model(ids, position_ids=paddle.arange(12).unsqueeze(0), use_cache=False)  # one sequence: as before
    model.config.use_cache = False
    assert abs(float(model(ids, labels=labels, position_ids=pos).loss) - 6.434098) <= 2e-5
    bounds = paddle.to_tensor([0, 5, 12], dtype="int32")
    keys = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 7, "max_length_k": 7, "seq_idx": pos}
    assert float(model(ids, labels=labels, position_ids=pos, **keys).loss) == float(out.loss)
    with pytest.raises(
        ValueError, match=r"cu_seq_lens_q \[0, 4, 12\] disagrees with position_ids' sequences \[0, 5, 12\]"
    ):
        model(ids, position_ids=pos, cu_seq_lens_q=[0, 4, 12])
    model.config.use_cache = True
    for key, value in keys.items():  # without packed position_ids (here a cache): refused by name
        with pytest.raises(ValueError, match=rf"forward: {key} \(packed sequences"):
            model(ids, position_ids=pos, **{key: value})
    weights = model(ids, position_ids=pos, use_cache=False, output_attentions=True).attentions
    own = [model(ids[:, a:b], use_cache=False, output_attentions=True).attentions for a, b in ((0, 5), (5, 12))]
    assert len(weights) == 8 and all(w.shape == [1, 4, 12, 12] for w in weights)
    for w, first, second in zip(weights, *own):  # block-diagonal: each sequence over its own keys
        np.testing.assert_allclose(w.numpy()[:, :, :5, :5], first.numpy(), atol=2e-6)
        np.testing.assert_allclose(w.numpy()[:, :, 5:, 5:], second.numpy(), atol=2e-6)
        assert not w.numpy()[:, :, 5:, :5].any() and not w.numpy()[:, :, :5, 5:].any()
    assert float(model(ids, labels=labels, position_ids=pos, cu_seq_lens_q=None, seq_idx=None).loss) == float(
        model(ids, labels=labels, position_ids=pos).loss
    )  # the keys at None: not given
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_option'"):
        model(ids, not_an_option=1)


def test_one_row_of_packed_position_ids_serves_the_batch():
    """transformers 5.23 expands position_ids of one row over a batch of several
    (masking_utils._preprocess_mask_arguments) and reads them as packed sequences: measured, the tiny
    fixture, two rows, [1, 12] positions of two sequences: our logits within 4.2e-7 of it. Ours
    refused (ValueError: packed position_ids of 1 rows for 2 rows of input)."""
    model = _tiny_eval()
    ids = tokens(2, 12)
    pos = paddle.to_tensor([list(range(5)) + list(range(7))])
    one = model(ids, position_ids=pos, use_cache=False).logits
    expanded = model(ids, position_ids=pos.expand([2, 12]), use_cache=False).logits
    np.testing.assert_array_equal(one.numpy(), expanded.numpy())
    with pytest.raises(ValueError, match="packed position_ids of 2 rows for 3 rows of input"):
        model(tokens(3, 12), position_ids=pos.expand([2, 12]), use_cache=False)


def _two_packed_rows():
    """Two rows of 12 tokens packing sequences of 9, 2, 1 and 6, 3, 3 tokens (-100 at each sequence's
    first label, as the collator), which run as two groups (9 and 6; 3, 3, 2 and 1); and the same
    six sequences as rows of their own (right padding, labels -100 there)."""
    ids = tokens(2, 12)
    spans = [(0, 0, 9), (0, 9, 11), (0, 11, 12), (1, 0, 6), (1, 6, 9), (1, 9, 12)]
    pos = np.zeros([2, 12], "int64")
    labels = ids.numpy().copy()
    rows, row_labels, mask = np.zeros([6, 9], "int64"), np.full([6, 9], -100), np.zeros([6, 9], "int64")
    for r, (b, s0, s1) in enumerate(spans):
        pos[b, s0:s1] = np.arange(s1 - s0)
        labels[b, s0] = -100
        rows[r, : s1 - s0], row_labels[r, : s1 - s0], mask[r, : s1 - s0] = ids.numpy()[b, s0:s1], labels[b, s0:s1], 1
    packed = (ids, paddle.to_tensor(labels), paddle.to_tensor(pos))
    return packed, tuple(paddle.to_tensor(t) for t in (rows, row_labels, mask)), spans


def test_packed_sequences_run_in_groups_by_length():
    """A group's sequences are at least half its longest (so a group costs at most twice its tokens);
    the shortest groups then join the one before while that pads at most a quarter of the batch's
    tokens in all. Rows 9 + 2 + 1 and 6 + 3 + 3: groups {9, 6}, {3, 3, 2}, {1}; the last joins the
    one before (2 padding slots of the 6 allowed), {3, 3, 2, 1} would pad 24 more: two groups. One row
    40 + 12 + 6 + 3 + 3: {40}, {12, 6}, {3, 3}, the last would pad 18 of 16: three groups. Packing
    back what was unpacked gives the batch again, and cu_seq_lens are the sequences' bounds."""
    from paddleformers_glm.modeling.packing import packed_sequences

    (ids, _, pos), _, _ = _two_packed_rows()
    packing = packed_sequences(pos)
    assert [list(g.mask.shape) for g in packing.groups] == [[2, 9], [4, 3]]
    assert [g.spans for g in packing.groups] == [
        [(0, 0, 9), (1, 0, 6)],
        [(1, 6, 9), (1, 9, 12), (0, 9, 11), (0, 11, 12)],
    ]
    np.testing.assert_array_equal(packing.pack(packing.unpack(ids)).numpy(), ids.numpy())
    assert packing.bounds() == [0, 9, 11, 12, 18, 21, 24]
    one = paddle.to_tensor([[*range(40), *range(12), *range(6), *range(3), *range(3)]])
    assert [list(g.mask.shape) for g in packed_sequences(one).groups] == [[1, 40], [2, 12], [2, 3]]
    assert packed_sequences(paddle.arange(8).unsqueeze(0)) is None


def test_packed_sequences_train_as_their_own_rows():
    """Training on packed rows is training on the sequences as rows of their own: the same LM loss
    (transformers' mean over the counted labels: the cross-sequence label is -100 in both), the MTP
    loss over the targets within each sequence only (the last tokens' MTP targets would be the
    next sequence's), hidden states and router logits packed back, and every parameter's gradient
    equal (within 1e-5 relative of the largest). The sequences run in two groups by length
    (test_packed_sequences_run_in_groups_by_length), or in one with the indexer's training on."""
    from paddleformers_glm.modeling.packing import packed_sequences

    (ids, labels, pos), (rows, row_labels, mask), spans = _two_packed_rows()
    assert [list(g.mask.shape) for g in packed_sequences(pos).groups] == [[2, 9], [4, 3]]
    assert [list(g.mask.shape) for g in packed_sequences(pos, grouped=False).groups] == [[6, 9]]
    model = _tiny_eval()
    model.train()
    out = model(ids, labels=labels, position_ids=pos, use_cache=False, add_mtp_loss=True, output_hidden_states=True,
                output_router_logits=True)  # fmt: skip
    out.loss.backward()
    packed_grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    ref = model(rows, attention_mask=mask, labels=row_labels, add_mtp_loss=True, output_hidden_states=True,
                output_router_logits=True)  # fmt: skip
    ref.loss.backward()
    assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 and abs(float(out.mtp_loss) - float(ref.mtp_loss)) <= 1e-5
    assert len(out.hidden_states) == 9 and all(h.shape == [2, 12, 64] for h in out.hidden_states)
    for r, (b, s0, s1) in enumerate(spans):
        for h, hr in zip(out.hidden_states, ref.hidden_states):
            np.testing.assert_allclose(h.numpy()[b, s0:s1], hr.numpy()[r, : s1 - s0], rtol=1e-5, atol=5e-5)
        got = out.router_logits[0].numpy().reshape([2, 12, -1])[b, s0:s1]
        np.testing.assert_allclose(got, ref.router_logits[0].numpy().reshape([6, 9, -1])[r, : s1 - s0], atol=2e-5)
    assert len(packed_grads) > 100
    # labels already shifted (labels_shifted=True: PaddleFormers' convention): position i's target is
    # the next token of its own sequence; the MTP targets stay within the sequence as well
    nxt = np.full([2, 12], -100)
    for b, s0, s1 in spans:  # the last position's target: a token after the sequence (PaddleFormers' data)
        nxt[b, s0 : s1 - 1], nxt[b, s1 - 1] = ids.numpy()[b, s0 + 1 : s1], 7 + s1
    own = np.full([6, 9], -100)
    for r, (b, s0, s1) in enumerate(spans):
        own[r, : s1 - s0] = nxt[b, s0:s1]
    kw = {"labels_shifted": True, "add_mtp_loss": True}
    a = model(ids, labels=paddle.to_tensor(nxt), position_ids=pos, use_cache=False, **kw)
    b = model(rows, attention_mask=mask, labels=paddle.to_tensor(own), **kw)
    assert abs(float(a.loss) - float(b.loss)) <= 1e-5 and abs(float(a.mtp_loss) - float(b.mtp_loss)) <= 1e-5
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.numpy()
            assert np.abs(packed_grads[name] - g).max() <= 1e-5 * max(1.0, np.abs(g).max()), name


@pytest.mark.reference
def test_packed_sequences_equal_transformers():
    """The live twin: transformers' packed forward (use_cache=False) and ours on _packed_pair() and on
    two rows packing six sequences (run in two groups): loss, logits, hidden states and router logits (evaluation), and
    the training-mode loss; with a cache, the rope-positions-only loss."""
    torch, hf, model = _tiny_in_both()
    ids, labels, pos = (torch.tensor(t.numpy()) for t in _packed_pair())
    with torch.no_grad():
        per_sequence = float(hf(ids, labels=labels, position_ids=pos, use_cache=False).loss)
        rope_only = float(hf(ids, labels=labels, position_ids=pos, use_cache=True).loss)
    assert abs(per_sequence - 6.434098) <= 2e-5 and abs(rope_only - 6.118906) <= 2e-5
    ids, labels, pos = _packed_pair()
    assert abs(float(model(ids, labels=labels, position_ids=pos, use_cache=True).loss) - rope_only) <= 2e-5
    two = tokens(2, 12)  # one row of position_ids for two rows: transformers expands it
    with torch.no_grad():
        want = hf(torch.tensor(two.numpy()), position_ids=torch.tensor(pos.numpy()), use_cache=False).logits
    got = model(two, position_ids=pos, use_cache=False).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-5)
    hf.config._attn_implementation = "eager"  # for its attention weights
    (ids, labels, pos), _, _ = _two_packed_rows()
    kw = {"use_cache": False, "output_hidden_states": True, "output_router_logits": True, "output_attentions": True}
    t = {
        "input_ids": torch.tensor(ids.numpy()),
        "labels": torch.tensor(labels.numpy()),
        "position_ids": torch.tensor(pos.numpy()),
    }
    for mode in ("eval", "train"):
        getattr(hf, mode)(), getattr(model, mode)()
        with torch.no_grad():
            want = hf(**t, **kw)
        got = model(ids, labels=labels, position_ids=pos, **kw)
        assert abs(float(got.loss) - float(want.loss)) <= 2e-5, mode
        np.testing.assert_allclose(got.logits.numpy(), want.logits.numpy(), atol=2e-5)
        for g, w in zip(got.hidden_states + got.router_logits, want.hidden_states + want.router_logits):
            np.testing.assert_allclose(g.numpy(), w.numpy(), atol=5e-5)
        assert len(got.attentions) == len(want.attentions) == 8
        for g, w in zip(got.attentions, want.attentions):  # [2, 4, 12, 12], block-diagonal in both
            np.testing.assert_allclose(g.numpy(), w.numpy(), atol=2e-6)


def test_dtype_device_and_tie_weights_as_transformers():
    """transformers 5.23 on the tiny fixture: ``model.dtype`` torch.float32 (loaded with
    dtype=float32; torch.bfloat16 by default: the config's), ``model.device`` cpu, ``tie_weights()``
    None with the untied head unchanged. Ours had none of the three (AttributeError)."""
    path = FIXTURES / "tiny" / "checkpoint"
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    assert model.dtype == paddle.float32
    assert GlmMoeDsaForCausalLM.from_pretrained(path, dtype="bfloat16").dtype == paddle.bfloat16
    assert str(model.device) == str(model.lm_head.weight.place)
    assert paddle.to_tensor([1, 2]).to(model.device).place == model.lm_head.weight.place
    head = model.lm_head.weight.numpy()
    assert model.tie_weights() is None
    np.testing.assert_array_equal(model.lm_head.weight.numpy(), head)


def test_from_pretrained_loading_keywords_are_not_config_keys(tmp_path):
    """transformers 5.23: from_pretrained(tiny, trust_remote_code=True, low_cpu_mem_usage=True,
    revision="main", local_files_only=True, cache_dir=..., force_download=False, token=None,
    use_safetensors=True, weights_only=True, proxies=None) loads, and its save's config.json holds
    none of them; torch_dtype=float32 gives a float32 model (dtype's older name; dtype wins when
    both are given), config.json without torch_dtype; device_map needs accelerate, variant="x" /
    subfolder="nope" raise OSError (no such files). Ours wrote every one of them into the saved
    config.json, and torch_dtype too (the model in the default dtype)."""
    import json

    path = FIXTURES / "tiny" / "checkpoint"
    noop = {
        "trust_remote_code": True,
        "low_cpu_mem_usage": True,
        "revision": "main",
        "local_files_only": True,
        "cache_dir": str(tmp_path / "cache"),
        "force_download": False,
        "token": None,
        "use_safetensors": True,
        "weights_only": True,
        "proxies": None,
    }
    model = GlmMoeDsaForCausalLM.from_pretrained(path, torch_dtype="bfloat16", **noop)
    assert model.dtype == paddle.bfloat16
    assert GlmMoeDsaForCausalLM.from_pretrained(path, torch_dtype="bfloat16", dtype="float32").dtype == paddle.float32
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not set(saved) & (set(noop) | {"torch_dtype", "subfolder"})
    assert GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny", subfolder="checkpoint").config.vocab_size == 256
    for key, value in (("device_map", "auto"), ("variant", "x")):
        with pytest.raises(ValueError, match=rf"from_pretrained: {key}='.*' is not supported"):
            GlmMoeDsaForCausalLM.from_pretrained(path, **{key: value})


def test_output_hidden_states_defaults_to_the_config():
    """transformers 5.23 on the tiny fixture: from_pretrained(tiny, output_hidden_states=True) (or
    ``model.config.output_hidden_states = True``) makes ``model(ids).hidden_states`` 9 tensors,
    ``output_hidden_states=False`` still None; its save's config.json holds
    ``output_hidden_states: true``. Ours ignored the config's (hidden_states None)."""
    path = FIXTURES / "tiny" / "checkpoint"
    ids = paddle.to_tensor([[5, 6, 7, 8]])
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32", output_hidden_states=True)
    assert len(model(ids).hidden_states) == 9 and model(ids, output_hidden_states=False).hidden_states is None
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    assert model(ids).hidden_states is None
    model.config.output_hidden_states = True
    assert len(model(ids).hidden_states) == 9
    model.config.output_attentions = True  # the config's output_attentions, as the keyword's
    assert len(model(ids).attentions) == 8


def test_an_unknown_loading_keyword_is_refused_by_name():
    """transformers 5.23 on the tiny fixture: ``from_pretrained(tiny, foo=1)`` raises TypeError
    "GlmMoeDsaForCausalLM.__init__() got an unexpected keyword argument 'foo'" (its config returns
    foo as unused). Ours dropped it: a misspelt keyword (``output_hiden_states=True``) passed unseen."""
    path = FIXTURES / "tiny" / "checkpoint"
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['foo'\]"):
        GlmMoeDsaForCausalLM.from_pretrained(path, foo=1)
    with pytest.raises(TypeError, match="output_hiden_states"):
        GlmMoeDsaForCausalLM.from_pretrained(path, num_hidden_layers=2, output_hiden_states=True)


def test_labels_of_another_shape_are_refused_by_name():
    """transformers 5.23 on the tiny fixture, ids [2, 10]: labels [2, 8] raise ValueError "Expected
    input batch_size (20) to match target batch_size (16)", labels [1, 10] "(20) ... (10)". Ours read
    past the labels' end in the compiled cross entropy ("target -4769257344425033293 at row 16 is
    outside the vocabulary": whatever memory followed; a value inside the vocabulary would have been a
    silently wrong loss)."""
    from paddleformers_glm import ops

    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10)
    for labels in (ids[:, :8], ids[:1], ids.reshape([20])):
        with pytest.raises(ValueError, match=r"forward: labels of shape \[.*\]: expected \[2, 10\]"):
            model(ids, labels=labels)
    with pytest.raises(ValueError, match=r"cross_entropy_sum: target of shape \[16\] for 20 rows"):
        ops.cross_entropy_sum(paddle.zeros([20, 256]), paddle.zeros([16], dtype="int64"), -100)


def test_set_output_embeddings_get_decoder_and_can_generate():
    """transformers 5.23: ``set_output_embeddings(layer)`` replaces lm_head (the logits are the new
    layer's), ``get_decoder()`` is the GlmMoeDsaModel (``model.model``), ``can_generate()`` True.
    Ours had none of them (AttributeError)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(1, 6)
    head = paddle.nn.Linear(64, 256, bias_attr=False)
    head.weight.set_value(model.get_output_embeddings().weight * 2.0)
    before = model(ids).logits.numpy()
    model.set_output_embeddings(head)
    assert model.get_output_embeddings() is head
    np.testing.assert_allclose(model(ids).logits.numpy(), 2.0 * before, rtol=1e-5, atol=1e-5)
    assert model.get_decoder() is model.model and model.can_generate() is True


def test_shift_labels_as_transformers():
    """transformers 5.23 on the tiny fixture, ids = tokens(2, 10): ``labels=ids,
    shift_labels=ids shifted left by one (-100 last)`` -> 6.107834 (the plain loss); the first 3 of
    each row of shift_labels -100 -> 5.921163 (labels are not read then); shift_labels without
    labels -> no loss. Ours raised TypeError (unexpected keyword argument)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10)
    shifted = paddle.concat([ids[:, 1:], paddle.full([2, 1], -100, dtype="int64")], axis=1)
    assert abs(float(model(ids, labels=ids, shift_labels=shifted).loss) - 6.107834) <= 2e-5
    partly = shifted.clone()
    partly[:, :3] = -100
    assert abs(float(model(ids, labels=ids, shift_labels=partly).loss) - 5.921163) <= 2e-5
    assert model(ids, shift_labels=shifted).loss is None


def test_to_bfloat16_computes_as_a_bfloat16_load():
    """``model.to(dtype="bfloat16")`` (torch users' ``model.to(torch.bfloat16)``; transformers 5.23
    runs the tiny fixture so) cast the routers too and a CPU forward stopped in Paddle ("The kernel
    with key (CPU, ..., bfloat16) of kernel `where` is not registered"). It now keeps the routers'
    weights, correction biases and the rope frequencies float32 (their values unchanged) and gives
    the logits of ``from_pretrained(..., dtype="bfloat16")`` bit for bit (max diff measured 0.0,
    loss 6.112355 both); back to float32 gives the float32 loss again."""
    path = FIXTURES / "tiny" / "checkpoint"
    ids = tokens(2, 10)
    want = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="bfloat16")(ids, labels=ids)
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    plain = float(model(ids, labels=ids).loss)
    routers = {n: p.numpy() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert model.to(dtype="bfloat16") is model and model.dtype == paddle.bfloat16
    for n, p in model.named_parameters():
        if n in routers:
            assert p.dtype == paddle.float32 and (p.numpy() == routers[n]).all()
    assert {b.dtype for b in model.buffers()} == {paddle.float32}
    got = model(ids, labels=ids)
    assert float(got.loss) == float(want.loss)
    np.testing.assert_array_equal(got.logits.astype("float32").numpy(), want.logits.astype("float32").numpy())
    model.to(dtype="float32")
    assert model.dtype == paddle.float32 and abs(float(model(ids, labels=ids).loss) - plain) <= 1e-6


def test_every_paddle_cast_is_to_dtype():
    """Paddle's own casts of a Layer did other things on this model: ``bfloat16()``, ``float16()``,
    ``float()`` and ``astype("bfloat16")`` left every parameter float32 without a word (measured: 233
    float32 parameters after ``model.bfloat16()``), ``type(paddle.bfloat16)`` and ``half()`` cast the
    routers too (a CPU forward then stopped: "kernel `matmul` / `where` is not registered"), and
    torch's ``model.to(torch.bfloat16)`` form, ``model.to(paddle.bfloat16)``, raised ValueError
    ("device should be type of str ..."). Each is ``to(dtype=...)`` now: the same parameters' dtypes
    and, in bfloat16, the same logits bit for bit."""
    ids = tokens(1, 8)
    ref = tiny_model(seed=1).to(dtype="bfloat16")
    want = ref(ids).logits.astype("float32").numpy()
    dtypes = {n: p.dtype for n, p in ref.named_parameters()}
    assert sum(d == paddle.float32 for d in dtypes.values()) == 6  # the routers' weights and biases
    casts = {
        "bfloat16": lambda m: m.bfloat16(),
        "astype": lambda m: m.astype("bfloat16"),
        "type": lambda m: m.type(paddle.bfloat16),
        "to(dtype first)": lambda m: m.to(paddle.bfloat16),
        "to(name first)": lambda m: m.to("bf16"),
    }
    for what, cast in casts.items():
        model = tiny_model(seed=1)
        assert cast(model) is model, what
        assert {n: p.dtype for n, p in model.named_parameters()} == dtypes, what
        np.testing.assert_array_equal(model(ids).logits.astype("float32").numpy(), want, err_msg=what)
    for cast, dtype in ((lambda m: m.half(), paddle.float16), (lambda m: m.float16(), paddle.float16)):
        if not paddle.is_compiled_with_cuda():  # Paddle's CPU kernels compute no float16: refused up front
            with pytest.raises(ValueError, match="dtype float16: this Paddle build has no GPU"):
                cast(tiny_model(seed=1))
            continue
        model = cast(tiny_model(seed=1))
        got = {n: p.dtype for n, p in model.named_parameters()}
        assert got == {n: dtype if d == paddle.bfloat16 else d for n, d in dtypes.items()}
    model = tiny_model(seed=1).double()
    assert model.dtype == paddle.float64 and model.compute_dtype == "float64"
    plain = tiny_model(seed=1)(ids).logits.numpy()
    model = tiny_model(seed=1).bfloat16().float()  # back: the weights as bfloat16 rounded them
    assert model.dtype == paddle.float32 and all(p.dtype == paddle.float32 for p in model.parameters())
    assert 0 < np.abs(model(ids).logits.numpy() - plain).max() < 0.5
    with pytest.raises(NotImplementedError, match="excluded_layers"):
        tiny_model(seed=1).bfloat16(excluded_layers=[paddle.nn.Linear])
    assert tiny_model(seed=1).to("cpu").dtype == paddle.float32  # a device stays a device


def test_float64_loads_and_float16_is_refused_on_a_cpu_build(tmp_path):
    """transformers 5.23 on CPU computes float64 and float16 (measured: float16 loss 5.54297 on the
    hunt's fixture). Ours: ``dtype="float64"`` stopped in the checkpoint engine ("Unsupported cast
    dtype: float64"); it now reads float32 and widens, giving the float32 logits widened within
    float32 rounding. float16 built, then its forward stopped inside Paddle (no CPU float16 ``where``
    kernel): refused by name before anything is built on a build without CUDA."""
    path = FIXTURES / "tiny" / "checkpoint"
    ids = tokens(1, 8)
    wide = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float64")
    assert wide.dtype == paddle.float64 and wide.get_input_embeddings().weight.dtype == paddle.float64
    plain = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    np.testing.assert_allclose(wide(ids).logits.numpy(), plain(ids).logits.numpy(), atol=1e-5)
    if not paddle.is_compiled_with_cuda():
        with pytest.raises(ValueError, match="dtype float16: this Paddle build has no GPU"):
            GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float16")


def test_loading_info_reads_by_transformers_keys():
    """transformers 5.23: ``model, info = from_pretrained(tiny, output_loading_info=True)`` gives a
    dict {missing_keys: set() (0), unexpected_keys: set of 25 (its dropped MTP layer),
    mismatched_keys: set(), error_msgs: []}; ours returned a LoadReport that ``info["missing_keys"]``
    raised TypeError on (not subscriptable). It reads by those keys now (its own key names)."""
    _, info = GlmMoeDsaForCausalLM.from_pretrained(
        FIXTURES / "tiny" / "checkpoint", dtype="float32", output_loading_info=True
    )
    assert list(info.keys()) == ["missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"]
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()  # ours reads the MTP layer
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert {k: len(info[k]) for k in info.keys()} == dict.fromkeys(info.keys(), 0)
    with pytest.raises(KeyError, match="the loading info's keys are"):
        info["missing"]


# transformers 5.23, tiny fixture, hf(tokens(2, 10), output_router_logits=True).router_logits: 5 tensors
# (the MoE layers 3..7) of [20, 8]; [0][0, :3] and [4][19, :3] (measured)
_ROUTER_LOGITS = ([-1.1112930, -2.9713650, -0.3363898], [-3.0280313, 2.1225572, 0.5441422])


def test_output_router_logits_as_transformers():
    """transformers 5.23: output_router_logits=True (or config.output_router_logits) gives
    ``out.router_logits``, each decoder MoE layer's router logits [B * S, E] (no MTP layer), keyed
    after past_key_values (``return_dict=False``: loss, logits, past_key_values, router_logits);
    aux_loss None. Ours raised TypeError (unexpected keyword argument)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(FIXTURES / "tiny" / "checkpoint", dtype="float32")
    ids = tokens(2, 10)
    for kw in ({}, {"use_cache": False}, {"labels": ids}):
        out = model(ids, output_router_logits=True, **kw)
        got = out.router_logits
        assert isinstance(got, tuple) and len(got) == 5 and all(g.shape == [20, 8] for g in got)
        np.testing.assert_allclose(got[0].numpy()[0, :3], _ROUTER_LOGITS[0], atol=1e-5)
        np.testing.assert_allclose(got[4].numpy()[19, :3], _ROUTER_LOGITS[1], atol=1e-5)
    assert "router_logits" not in model(ids) and model(ids, output_router_logits=False).router_logits is None
    tup = model(ids, labels=ids, output_router_logits=True, return_dict=False, use_cache=False)
    assert isinstance(tup[2], tuple) and len(tup[2]) == 5  # loss, logits, router_logits, ...
    model.config.output_router_logits = True
    assert len(model(ids).router_logits) == 5


@pytest.mark.reference
def test_output_router_logits_equal_transformers():
    torch, hf, model = _tiny_in_both()
    ids = tokens(2, 10)
    with torch.no_grad():
        want = hf(torch.tensor(ids.numpy()), output_router_logits=True).router_logits
    got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert np.abs(g.numpy() - w.numpy()).max() <= 1e-4
    np.testing.assert_allclose(want[0].numpy()[0, :3], _ROUTER_LOGITS[0], atol=1e-5)


def test_save_pretrained_takes_transformers_keywords(tmp_path):
    """transformers 5.23 on the tiny fixture: save_pretrained(d, safe_serialization=True / False,
    push_to_hub=False, is_main_process=True, token=None, variant=None, save_original_format=True)
    each writes config.json, generation_config.json, model.safetensors (safetensors even with
    safe_serialization=False); is_main_process=False writes nothing. Ours raised TypeError
    (save_pretrained_state() got an unexpected keyword argument 'safe_serialization')."""
    model = tiny_model(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["dense"])
    for i, kw in enumerate(
        (
            {"safe_serialization": True},
            {"safe_serialization": False},
            {"push_to_hub": False, "is_main_process": True, "token": None, "variant": None},
            {"save_original_format": True},
        )
    ):
        assert model.save_pretrained(tmp_path / str(i), **kw) is not None
        assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / str(i)).iterdir()}
    assert model.save_pretrained(tmp_path / "none", is_main_process=False) is None
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    for key, value in (("push_to_hub", True), ("variant", "x")):
        with pytest.raises(ValueError, match=rf"save_pretrained: {key}=.* is not supported"):
            model.save_pretrained(tmp_path / "refused", **{key: value})


def test_the_causal_lm_is_built_on_the_pretrained_model_class():
    """As transformers' ``GlmMoeDsaForCausalLM(GlmMoeDsaPreTrainedModel)``: the loading, saving, embedding
    and generation API is the base class's (modeling/pretrained.py), the forward the model's own."""
    import paddleformers_glm
    from paddleformers_glm.modeling import GlmMoeDsaPreTrainedModel

    assert paddleformers_glm.GlmMoeDsaPreTrainedModel is GlmMoeDsaPreTrainedModel  # as transformers exports it
    assert issubclass(GlmMoeDsaForCausalLM, GlmMoeDsaPreTrainedModel)
    shared = ("from_pretrained", "save_pretrained", "resize_token_embeddings", "generate", "num_parameters")
    assert all(name in vars(GlmMoeDsaPreTrainedModel) for name in shared)
    assert "forward" in vars(GlmMoeDsaForCausalLM) and "forward" not in vars(GlmMoeDsaPreTrainedModel)
    model = tiny_model(seed=1, **TWO_LAYERS)
    assert isinstance(model, GlmMoeDsaPreTrainedModel) and model.can_generate()


def _layer_runs(model, ids):
    """How often each decoder layer's forward ran in one training forward + backward."""
    runs = [0] * model.config.num_hidden_layers
    hooks = [
        layer.register_forward_post_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, layer in enumerate(model.model.decoder_layers)
    ]
    model.clear_gradients()
    model(ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    return runs, {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


def test_base_model_decoder_and_memory_footprint_as_transformers():
    """transformers 5.23 on the tiny fixture (measured): ``base_model`` is ``model.model``;
    ``get_memory_footprint()`` is 2,803,680 bytes in float32, 2,803,456 of them parameters, and 1,401,952
    in bfloat16; its 7 buffers are 5 routers' correction biases and 2 rope vectors (float32, 8 each).
    Ours holds the MTP layer transformers drops (its parameters, and its router's bias where transformers
    has a second rope vector) and keeps the routers' weights float32 in a bfloat16 model: with those
    taken out the bytes are transformers'. ``get_parameter_or_buffer`` by dotted name, transformers'
    AttributeError for neither. Before: AttributeError for all four."""

    def size(tensors):
        return sum(int(np.prod(t.shape)) * t.element_size() for t in tensors)

    path = FIXTURES / "tiny" / "checkpoint"
    for dtype, want in (("float32", 2803680), ("bfloat16", 1401952)):
        model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=dtype)
        mtp = size(p for n, p in model.named_parameters() if n.startswith("model.layers.8."))
        routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight") and ".8." not in n]
        wider = size(routers) // 2 if dtype == "bfloat16" else 0  # float32 where transformers has bfloat16
        assert model.get_memory_footprint() - mtp - wider == want, dtype
        assert model.get_memory_footprint() - model.get_memory_footprint(return_buffers=False) == 7 * 8 * 4
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    assert model.base_model is model.model is model.get_decoder()
    name = "model.layers.3.mlp.gate.e_score_correction_bias"  # a buffer, as in transformers
    assert model.get_parameter_or_buffer(name) is dict(model.named_buffers())[name]
    norm = "model.norm.weight"
    assert model.get_parameter_or_buffer(norm) is dict(model.named_parameters())[norm]
    with pytest.raises(AttributeError, match="is neither a parameter, buffer, nor extra state"):
        model.get_parameter_or_buffer("model.nothing")
    other = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32").model
    model.set_decoder(other)
    assert model.get_decoder() is other and model.base_model is other


def test_activation_checkpointing_recomputes_every_nth_layer_with_the_same_gradients():
    """transformers 5.23's ``activation_checkpointing_enable(every_n_layers=n)`` checkpoints decoder layers
    0, n, 2n, ... (measured on the tiny fixture: n = 2 flags layers 0, 2, 4, 6; n = 3 layers 0, 3, 6;
    the reference twin below compares live): those run twice in a training step (forward, then again
    in backward), the others once, and every gradient is bitwise the one without checkpointing.
    ``gradient_checkpointing_enable`` / ``_disable`` / ``is_gradient_checkpointing`` are its deprecated
    names (a FutureWarning each, as there). Before: AttributeError."""
    model = tiny_model(seed=3)
    model.train()
    ids = tokens(2, 12, seed=4)
    assert GlmMoeDsaForCausalLM.supports_gradient_checkpointing and not model.is_activation_checkpointing
    plain_runs, plain = _layer_runs(model, ids)
    assert plain_runs == [1] * 8 and plain
    for n, twice in ((1, range(8)), (2, (0, 2, 4, 6)), (3, (0, 3, 6))):
        model.activation_checkpointing_enable(every_n_layers=n)
        assert model.is_activation_checkpointing
        runs, grads = _layer_runs(model, ids)
        assert runs == [2 if i in twice else 1 for i in range(8)], (n, runs)
        assert grads.keys() == plain.keys()
        for k in plain:
            np.testing.assert_array_equal(grads[k], plain[k], err_msg=k)
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing and _layer_runs(model, ids)[0] == [1] * 8
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        assert model.is_gradient_checkpointing
    assert _layer_runs(model, ids)[0] == [2] * 8
    with pytest.warns(FutureWarning, match="gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()
    assert not model.is_activation_checkpointing
    for bad, err, match in (
        ({"activation_checkpointing_kwargs": {"foo": 1}}, ValueError, r"unknown keywords \['foo'\]"),
        ({"activation_checkpointing_kwargs": {"preserve_rng_state": False}}, ValueError, "preserve_rng_state=False"),
        ({"every_n_layers": 0}, ValueError, "every_n_layers must be an int >= 1, got 0"),
        ({"offload": True}, NotImplementedError, "offload=True"),
    ):
        with pytest.raises(err, match=match):
            model.activation_checkpointing_enable(**bad)
        assert not model.is_activation_checkpointing  # a refused call changes nothing


def test_activation_checkpointing_with_a_frozen_embedding_recomputes_the_first_layer_too():
    """Adapter training freezes the embedding, so layer 0's input takes no gradient: transformers'
    ``activation_checkpointing_enable`` calls ``enable_input_require_grads`` (the embedding's output
    then takes one) so that layer 0 is checkpointed too; without it layer 0 keeps its activations
    (Fleet's recompute is skipped for inputs without a gradient). The gradients are unchanged."""
    model = tiny_model(seed=3)
    model.train()
    model.get_input_embeddings().weight.stop_gradient = True
    ids = tokens(2, 12, seed=4)
    _, plain = _layer_runs(model, ids)
    model.activation_checkpointing_enable()
    runs, grads = _layer_runs(model, ids)
    assert runs == [2] * 8 and grads.keys() == plain.keys() and "model.embedding.embed_tokens.weight" not in grads
    for k in plain:
        np.testing.assert_array_equal(grads[k], plain[k], err_msg=k)
    model.disable_input_require_grads()
    assert _layer_runs(model, ids)[0] == [1] + [2] * 7


@pytest.mark.reference
def test_activation_checkpointing_layers_equal_transformers():
    """The layers transformers 5.23 flags for checkpointing (``gradient_checkpointing`` per decoder layer)
    after ``activation_checkpointing_enable(every_n_layers=n)`` are the ones ours runs twice."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = FIXTURES / "tiny" / "checkpoint"
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    model.train()
    ids = tokens(1, 8, seed=5)
    for n in (1, 2, 3, 5):
        hf.activation_checkpointing_enable(every_n_layers=n)
        model.activation_checkpointing_enable(every_n_layers=n)
        want = [2 if layer.gradient_checkpointing else 1 for layer in hf.model.layers]
        assert _layer_runs(model, ids)[0] == want, n


def test_from_pretrained_on_a_pipeline_rank_builds_and_reads_only_its_stage(tmp_path):
    """A pipeline-parallel topology without a stage given: each rank's model is its stage of the
    even split (the trainer's default), built and read alone, each tensor the one-process model's.
    Before: every pipeline rank built and read the whole model."""
    from paddleformers_glm.parallel.topology import ParallelConfig, Topology, topology_override
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    one = {k: v.numpy() for k, v in GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32").state_dict().items()}
    L = 8  # the tiny checkpoint's decoder layers; its MTP layer is layer 8
    held = {}
    for stage, layers in ((0, range(0, 4)), (1, range(4, 9))):
        topo = Topology(ParallelConfig(pp=2), ranks={"tp": 0, "pp": stage, "dp": 0, "edp": 0, "ep": 0, "etp": 0})
        with topology_override(topo):
            model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32", topology=topo)
        assert model.pipelined and model.model.layer_ids == list(layers)
        assert model.stage.has_embedding == (stage == 0) and hasattr(model, "lm_head") == (stage == 1)
        assert model.model.mtp_layers if stage else not model.model.mtp_layers
        state = model.state_dict()
        for k, v in state.items():
            np.testing.assert_array_equal(v.numpy(), one[k], err_msg=k)
        held[stage] = set(state)
    assert held[0] | held[1] == set(one) and held[0] & held[1] == {"model.embedding.embed_tokens.weight"}
    assert not any(f"layers.{i}." in k for k in held[0] for i in range(4, L + 1))
