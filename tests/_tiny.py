"""Small helpers shared by the model tests: configs and randomly initialised models."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import paddle

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

from .conftest import TINY_CONFIG


def config_from(path=TINY_CONFIG, **changes) -> GlmMoeDsaConfig:
    """A config file with some keys changed (no schedule fix-ups; see tiny_config)."""
    d = json.loads(pathlib.Path(path).read_text())
    d.update(changes)
    return GlmMoeDsaConfig.from_dict(d)


def tiny_config(**changes) -> GlmMoeDsaConfig:
    d = json.loads(TINY_CONFIG.read_text())
    d.update(changes)
    if "index_topk_pattern" in changes:
        d.pop("indexer_types", None)
        d.pop("index_topk_freq", None)
        d.pop("index_skip_topk_offset", None)
    return GlmMoeDsaConfig.from_dict(d)


def randomize(model: GlmMoeDsaForCausalLM, seed: int = 0) -> GlmMoeDsaForCausalLM:
    """O(1) activations: matrices ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N, biases ~ 0.1 N."""
    rng = np.random.default_rng(seed)
    for name, p in model.state_dict().items():
        shape = list(p.shape)
        if len(shape) == 2:
            std = 1.0 if "embed_tokens" in name else shape[0] ** -0.5
            v = rng.standard_normal(shape) * std
        elif name.endswith("e_score_correction_bias"):
            v = rng.standard_normal(shape) * 0.05
        elif name.endswith("bias"):
            v = rng.standard_normal(shape) * 0.1
        else:
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        p.set_value(paddle.to_tensor(v.astype(str(p.dtype).replace("paddle.", ""))))
    return model


# Two layers of the tiny config, one of each kind (a full and a shared indexer, dense and MoE), no
# MTP: for the tests whose cost grows with every layer (paddle.jit.to_static's graph builds).
TWO_LAYERS = dict(
    num_hidden_layers=2, indexer_types=["full", "shared"], index_topk_freq=2, index_skip_topk_offset=1,
    mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, num_nextn_predict_layers=0,
)  # fmt: skip


def tiny_model(seed: int = 0, **changes) -> GlmMoeDsaForCausalLM:
    return randomize(GlmMoeDsaForCausalLM(tiny_config(**changes)), seed)


def tokens(B: int, S: int, vocab: int = 256, seed: int = 0) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).integers(3, vocab, size=(B, S)).astype("int64"))


def tied_index_scores(qp: paddle.Tensor, kp: paddle.Tensor) -> paddle.Tensor:
    """Index scores of query position ``qp`` against key position ``kp``: a relu of a pattern, full of
    exact zeros and equal values (the ties a top-k must break as HF's does)."""
    return paddle.nn.functional.relu(paddle.remainder(qp * 7 + kp * 3, paddle.to_tensor(5.0)) - 2.0)


def score_indexer_by_position(ix, B: int, S: int, setattr_=setattr) -> paddle.Tensor:
    """Make indexer ``ix`` score [B, S] positions by :func:`tied_index_scores` (positions ride in the
    first element of its q and k); -> the positions [S] float32."""
    pos = paddle.arange(S, dtype="float32")

    def project(x, q_latent, cos, sin):
        q = paddle.zeros([B, S, ix.n_heads, ix.head_dim])
        q[:, :, 0, 0] = pos
        kk = paddle.zeros([B, S, ix.head_dim])
        kk[:, :, 0] = pos
        return q, kk, paddle.ones([B, S, ix.n_heads])

    setattr_(ix, "project", project)
    setattr_(
        ix, "chunk_scores", lambda q, kk, w: tied_index_scores(q[:, :, 0, 0].unsqueeze(-1), kk[:, :, 0].unsqueeze(1))
    )
    return pos
