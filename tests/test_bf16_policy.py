"""The bf16 dtype policy (docs/model.md, "dtypes"), checked on a bf16 model: every parameter's dtype,
and the dtype of each listed intermediate, recorded by probes around the functions that compute
it, over every attention form, padding, MTP, the loss and a decoding step.

HF transformers 5.23 (modeling_glm_moe_dsa.py, read): RMSNorm statistics in fp32; indexer scores
``q.float() @ k.float()`` and its top-k on fp32; the router's logits ``F.linear`` on fp32 inputs,
``e_score_correction_bias`` fp32 (``_keep_in_fp32_modules_strict``); the attention softmax with
``dtype=torch.float32``; rotary cos/sin computed in fp32; the loss on ``logits.float()``.
``indexer.weights_proj`` is in ``_keep_in_fp32_modules``, which transformers applies to fp16 only:
in a bf16 model it is bf16 (measured: tests/fixtures/*/meta_bf16.json lists only the correction
biases as non-bf16), as the official checkpoint stores it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import numpy as np
import paddle
import pytest

import paddleformers_glm.modeling.model as glm_model
import paddleformers_glm.ops as glm_ops
from paddleformers_glm.checkpoint.safetensors_io import parse_header
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.indexer import DSAIndexer
from paddleformers_glm.modeling.moe import TopkRouter
from paddleformers_glm.modeling.rope import RotaryEmbedding

from .conftest import FIXTURES

CKPT = FIXTURES / "tiny_pattern_yarn" / "checkpoint"  # own MTP indexer, yarn rope, group-limited routing


@pytest.fixture(scope="module")
def model():
    m = GlmMoeDsaForCausalLM.from_pretrained(CKPT, dtype="bfloat16")
    m.eval()
    return m


def test_parameter_dtypes(model):
    for name, p in model.named_parameters():
        want = paddle.float32 if name.endswith(".mlp.gate.weight") else paddle.bfloat16
        assert p.dtype == want, name
    buffers = dict(model.named_buffers())
    biases = [k for k in buffers if k.endswith("e_score_correction_bias")]
    assert biases and all(buffers[k].dtype == paddle.float32 for k in biases)
    assert all(buffers[k].dtype == paddle.float32 for k in buffers if k.endswith("inv_freq"))
    wp = [p for n, p in model.named_parameters() if n.endswith("indexer.weights_proj.weight")]
    assert wp and all(p.dtype == paddle.bfloat16 for p in wp)  # as HF's bf16 model and the checkpoint


class _Probe:
    """Records the dtype of the first tensor argument of each wrapped function, per label."""

    def __init__(self) -> None:
        self.seen: dict[str, list] = defaultdict(list)

    @contextlib.contextmanager
    def wrap(self, owner: object, attr: str, label: str, arg: int = 0):
        orig = getattr(owner, attr)

        def probe(*args, **kwargs):
            self.seen[label].append(args[arg].dtype)
            return orig(*args, **kwargs)

        setattr(owner, attr, probe)
        try:
            yield
        finally:
            setattr(owner, attr, orig)


def _forward_hook(layer_type, label, probe, model):
    hooks = []
    for layer in model.sublayers():
        if isinstance(layer, layer_type):

            def hook(mod, inputs, out, label=label):
                outs = out if isinstance(out, tuple) else (out,)
                probe.seen[label].extend(
                    o.dtype for o in outs if isinstance(o, paddle.Tensor) and o.is_floating_point()
                )

            hooks.append(layer.register_forward_post_hook(hook))
    return hooks


@pytest.mark.parametrize("form", ["reference", "dense", "sparse", "latent"])
def test_intermediates_computed_in_fp32(model, form):
    probe = _Probe()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(3, model.config.vocab_size, (2, 32)))
    mask = paddle.ones([2, 32], dtype="int64")
    mask[1, :4] = 0  # left padding: queries without keys take the all-masked path
    hooks = _forward_hook(TopkRouter, "router", probe, model) + _forward_hook(RotaryEmbedding, "rotary", probe, model)
    norm_stats = glm_ops.norm  # RMSNorm's statistics: the mean of squares and its rsqrt
    with contextlib.ExitStack() as st:
        st.enter_context(probe.wrap(norm_stats, "mean_square", "rms statistics"))
        st.enter_context(probe.wrap(paddle, "rsqrt", "rms statistics"))
        st.enter_context(probe.wrap(paddle.nn.functional, "layer_norm", "indexer k_norm"))
        st.enter_context(probe.wrap(DSAIndexer, "chunk_scores", "indexer scores", arg=1))
        st.enter_context(probe.wrap(paddle, "topk", "top-k scores"))
        st.enter_context(probe.wrap(paddle.nn.functional, "sigmoid", "router scores"))
        st.enter_context(probe.wrap(paddle.nn.functional, "softmax", "softmax"))
        st.enter_context(probe.wrap(glm_ops, "masked_softmax_", "softmax"))
        st.enter_context(probe.wrap(glm_model, "cross_entropy_sum", "loss"))
        model.set_attn_implementation(form)
        try:
            out = model(ids, attention_mask=mask, labels=ids)
        finally:
            model.set_attn_implementation("auto")
            for h in hooks:
                h.remove()
    assert out.logits.dtype == paddle.bfloat16 and out.mtp_logits[0].dtype == paddle.bfloat16
    assert out.loss.dtype == paddle.float32 and out.mtp_loss.dtype == paddle.float32
    want = ["rms statistics", "indexer k_norm", "indexer scores", "top-k scores", "router scores", "softmax"]
    want += ["loss", "router", "rotary"]
    for label in want:
        assert probe.seen[label], f"{label}: the probe never fired ({form})"
        assert set(probe.seen[label]) == {paddle.float32}, (form, label, set(probe.seen[label]))


def test_decoding_step_computes_scores_and_softmax_in_fp32(model):
    probe = _Probe()
    ids = paddle.to_tensor(np.random.default_rng(1).integers(3, model.config.vocab_size, (1, 12)))
    with contextlib.ExitStack() as st:
        st.enter_context(probe.wrap(paddle.nn.functional, "softmax", "softmax"))
        st.enter_context(probe.wrap(glm_ops, "masked_softmax_", "softmax"))  # the decode step's latent form
        st.enter_context(probe.wrap(paddle, "topk", "top-k scores"))
        seq = model.generate(ids, max_new_tokens=3, pad_token_id=0, eos_token_id=[])
    assert seq.shape == [1, 15]
    assert set(probe.seen["softmax"]) == {paddle.float32} and set(probe.seen["top-k scores"]) == {paddle.float32}


def test_bf16_save_stores_the_official_dtypes(model, tmp_path):
    """A bf16 model saves what the official checkpoint stores: BF16 (the fp32 routers rounded back,
    ``weights_proj`` as it is), the correction bias F32: the source checkpoint's dtype per key."""
    model.save_pretrained(tmp_path)
    src, out = {}, {}
    for d, got in ((CKPT, src), (tmp_path, out)):
        for shard in sorted(d.glob("*.safetensors")):
            got.update({k: t.dtype for k, t in parse_header(str(shard))[0].items()})
    assert out == src
    assert {v for k, v in out.items() if k.endswith("e_score_correction_bias")} == {"F32"}
