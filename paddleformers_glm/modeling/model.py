"""GlmMoeDsaModel and GlmMoeDsaForCausalLM: embedding -> decoder layers (top-k flows layer to layer)
-> final norm -> lm_head, plus the MTP layers and the losses.

Parameter names follow the Paddle/Fleet layout of REFERENCE §5 (`model.embedding.embed_tokens`,
`self_attn.core_attention.indexer`, fused `up_gate_proj`, MTP `transformer_layer`); the checkpoint
package maps them to and from the official HF names with Paddle's AOA engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig
from ..ops import cross_entropy_sum
from ..parallel import comm
from ..parallel.layers import ParallelLMHead, VocabParallelEmbedding, mark_sequence_parallel
from ..parallel.topology import get_topology
from .decoder import DecoderLayer
from .mtp import MTPLayer
from .norms import RMSNorm
from .rope import RotaryEmbedding

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    logits: paddle.Tensor | None = None  # [B, S, V]
    loss: paddle.Tensor | None = None  # main LM loss (+ extras only when asked)
    mtp_loss: paddle.Tensor | None = None  # mean CE over MTP depths, unscaled
    mtp_logits: list[paddle.Tensor] = field(default_factory=list)  # per depth [B, S, V]
    indexer_loss: paddle.Tensor | None = None  # sum of per-layer indexer KL losses, unscaled
    last_hidden_state: paddle.Tensor | None = None  # after the final norm


def causal_lm_loss(logits: paddle.Tensor, labels: paddle.Tensor, shift: int = 1) -> paddle.Tensor:
    """HF convention: position i predicts labels[i + shift]; mean over labels that are not -100."""
    B, S, V = logits.shape
    target = paddle.concat([labels[:, shift:], paddle.full([B, min(shift, S)], IGNORE_INDEX, dtype=labels.dtype)], 1)
    target = target[:, :S].reshape([-1]).astype("int64")
    flat = logits.reshape([-1, V]).astype("float32")
    loss_sum = cross_entropy_sum(flat, target, IGNORE_INDEX)
    n = (target != IGNORE_INDEX).astype("float32").sum()
    return loss_sum / paddle.clip(n, min=1.0)


class Embedding(nn.Layer):
    """Token embedding under the Fleet name `embedding.embed_tokens` (vocabulary split over TP;
    under sequence parallel its output is this rank's sequence shard).

    Like torch's `padding_idx`, the pad row gets no gradient but still returns its stored vector
    (Paddle's own `padding_idx` would return zeros and break parity with the reference).
    """

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        pad = config.pad_token_id if isinstance(config.pad_token_id, int) else None
        sp = get_topology().sequence_parallel
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, sp, padding_idx=pad)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        return self.embed_tokens(input_ids)


def build_layer(config: GlmMoeDsaConfig, index: int) -> DecoderLayer | MTPLayer:
    """Layer ``index`` of the stack (a decoder layer below ``num_hidden_layers``, else an MTP layer),
    built on its own so a pipeline stage can make just its layers."""
    L = config.num_hidden_layers
    if 0 <= index < L:
        return DecoderLayer(
            config, has_indexer=config.indexer_types[index] == "full", mlp_type=config.mlp_layer_types[index]
        )
    if L <= index < L + config.num_mtp_layers:
        return MTPLayer(config)
    raise IndexError(
        f"layer {index} does not exist: {L} decoder layers (0..{L - 1}) and {config.num_mtp_layers} MTP layers"
    )


def _final_norm(config: GlmMoeDsaConfig) -> RMSNorm:
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    mark_sequence_parallel(norm, enabled=get_topology().sequence_parallel)
    return norm


class GlmMoeDsaModel(nn.Layer):
    """The decoder stack. `layers` holds the L decoder layers followed by the MTP layers (index L+j)."""

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.config = config
        L = config.num_hidden_layers
        self.embedding = Embedding(config)
        self.layers = nn.LayerList([build_layer(config, i) for i in range(L + config.num_mtp_layers)])
        self.norm = _final_norm(config)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)[: self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers)[self.config.num_hidden_layers :]

    def rope(self, input_ids: paddle.Tensor, position_ids: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
        if position_ids is None:
            position_ids = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        return self.rotary_emb(position_ids)

    def run_layers(
        self,
        hidden: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        topk: paddle.Tensor | None,
        start: int = 0,
        end: int | None = None,
        dense_reference: bool = False,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[paddle.Tensor]]:
        """Decoder layers [start, end): hidden [B,S,H] and the top-k in effect flow from layer to layer.

        A pipeline stage that starts on a shared layer passes in the top-k carried from the stage before.
        """
        end = self.config.num_hidden_layers if end is None else end
        kls = []
        for layer in list(self.layers)[start:end]:
            hidden, topk, kl = layer(hidden, cos, sin, key_padding, topk, dense_reference=dense_reference)
            if kl is not None:
                kls.append(kl)
        return hidden, topk, kls

    def forward(
        self,
        input_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
        dense_reference: bool = False,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[paddle.Tensor]]:
        """-> (final-normed hidden [B, S, H], top-k of the last decoder layer, indexer KL losses)."""
        cos, sin = self.rope(input_ids, position_ids)
        hidden = self.embedding(input_ids)
        hidden, topk, kls = self.run_layers(hidden, cos, sin, attention_mask, None, dense_reference=dense_reference)
        return self.norm(hidden), topk, kls


class GlmMoeDsaStageModel(nn.Layer):
    """The part of :class:`GlmMoeDsaModel` one pipeline stage holds, under the same parameter names
    (``layers.<global index>``, ``embedding.*``, ``norm.*``) so checkpoints map onto it unchanged.

    Only ``layer_ids`` are constructed (decoder and/or MTP layers): a stage of a 744B model never
    allocates the other stages' layers, not even transiently.
    """

    def __init__(self, config: GlmMoeDsaConfig, layer_ids: Sequence[int], *, embedding: bool, norm: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_ids = [int(i) for i in layer_ids]
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"GlmMoeDsaStageModel: layer ids repeat: {self.layer_ids}")
        if embedding:
            self.embedding = Embedding(config)
        self.layers = nn.LayerDict({str(i): build_layer(config, i) for i in self.layer_ids})
        if norm:
            self.norm = _final_norm(config)
        self.rotary_emb = RotaryEmbedding(config)


def build_lm_head(config: GlmMoeDsaConfig) -> ParallelLMHead:
    """The output projection [H, V], vocabulary split over TP (vocab-parallel logits)."""
    return ParallelLMHead(config.hidden_size, config.vocab_size, get_topology().sequence_parallel)


@contextmanager
def default_dtype(dtype: str) -> Iterator[None]:
    """Create parameters in ``dtype`` (Paddle takes it from the global default) and restore it after."""
    prev = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(prev)


_LOG = logging.getLogger("paddleformers_glm.checkpoint")


@contextmanager
def _skip_random_init() -> Iterator[None]:
    """Parameters created inside are allocated but not initialised (no random draw, no memset).

    For ``from_pretrained`` only: every parameter is overwritten by the load right after (and what
    a ``strict=False`` load does not fill is initialised as HF does), and drawing normals for a
    large model costs several times the load itself. Distributed parameters get zeros. The switch is
    process-wide while the block runs (another thread building layers then gets no init either).
    """
    from paddle.base.framework import _current_expected_place
    from paddle.nn.initializer import Constant
    from paddle.nn.initializer.initializer import Initializer

    zero = Constant(0.0)
    real = Initializer.__call__

    def allocate(self: Any, param: Any, block: Any = None) -> Any:
        if getattr(param, "is_dist", lambda: False)() or not paddle.in_dynamic_mode():
            return zero.forward(param, block)
        out = paddle._C_ops.empty(param.shape, param.dtype, _current_expected_place())
        out._share_underline_tensor_to(param)
        return None

    Initializer.__call__ = allocate  # type: ignore[method-assign]
    try:
        yield
    finally:
        Initializer.__call__ = real  # type: ignore[method-assign]


class GlmMoeDsaForCausalLM(nn.Layer):
    """GLM-5.2 with its LM head, MTP heads and losses.

    `out = model(input_ids, attention_mask=None, position_ids=None, labels=None)` gives `out.logits`
    [B, S, V]; with labels, `out.loss` (HF convention) and `out.mtp_loss` when MTP layers exist.
    `add_mtp_loss=True` adds `mtp_loss_scaling_factor * mtp_loss` (and the indexer KL loss when
    `indexer_loss_coeff` > 0) into `out.loss`.
    """

    def __init__(self, config: GlmMoeDsaConfig, dtype: str = "float32") -> None:
        with default_dtype(dtype):
            super().__init__()
            self.config = config
            self.model = GlmMoeDsaModel(config)
            # vocabulary split over TP: vocab-parallel logits, gathered below for `out.logits`
            self.lm_head = build_lm_head(config)
        self.compute_dtype = dtype

    # ------------------------------------------------------------------ construction / IO
    def init_weights(self, seed: int | None = None) -> None:
        """HF-style init: N(0, initializer_range) for matrices, ones for norms, zeros for biases."""
        if seed is not None:
            paddle.seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if len(p.shape) >= 2:
                p.set_value(paddle.normal(0.0, std, p.shape).astype(p.dtype))
            elif name.endswith(".bias"):
                p.set_value(paddle.zeros_like(p))
            else:  # RMSNorm / LayerNorm weights
                p.set_value(paddle.ones_like(p))

    @classmethod
    def from_config(cls, config: GlmMoeDsaConfig, dtype: str = "float32", seed: int | None = None):
        model = cls(config, dtype=dtype)
        model.init_weights(seed)
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: object = "auto",
        strict: bool = True,
        output_loading_info: bool = False,
        **config_overrides,
    ):
        """Load an official HF-layout (or Fleet-layout, or block-FP8) checkpoint folder.

        ``dtype``: a name (``"bfloat16"``, ``"bf16"``, ``"float32"``...) or a Paddle dtype; ``"auto"``
        (default) is the config's dtype where the device computes it (an accelerator), else float32
        with an info line. See checkpoint.load_pretrained_state. The load report is logged (one
        info line, warnings as warnings); ``output_loading_info=True`` returns ``(model, report)``
        as transformers does.
        """
        from ..checkpoint import load_pretrained_state
        from ..checkpoint.loader import init_like_hf, resolve_model_dtype

        config = GlmMoeDsaConfig.from_pretrained(path, **config_overrides)
        dtype = resolve_model_dtype(dtype, config)
        with _skip_random_init():  # every parameter is overwritten below: do not draw random numbers
            model = cls(config, dtype=dtype)
        report = load_pretrained_state(model, path, dtype=dtype, strict=strict)
        params = model.state_dict()
        unfilled = set(params) - set(report.loaded) - set(report.initialized)
        if unfilled:  # strict=False: what the checkpoint lacks is initialised as HF does
            init_like_hf({k: params[k] for k in sorted(unfilled)}, config.initializer_range)
        _LOG.info("%s", report.summary())
        model.source_path = os.path.abspath(os.fspath(path))
        return (model, report) if output_loading_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> str:
        """Official HF layout by default (`layout="fleet"` for the Paddle names; `quantization="fp8"`
        for the block-FP8 release format); all or nothing. A model loaded from a folder carries that
        folder's tokenizer / generation config / chat template files along."""
        from ..checkpoint import save_pretrained_state

        kwargs.setdefault("carry_from", getattr(self, "source_path", None))
        return save_pretrained_state(self, self.config, save_directory, **kwargs)

    # ------------------------------------------------------------------ forward
    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Full-vocabulary logits [B, S, V] (the trainer feeds the vocab-parallel ones to a parallel CE)."""
        logits = self.lm_head(hidden)
        if self.lm_head.world > 1:
            logits = comm.gather_from_tp(logits, axis=-1)
        return logits

    def mtp_forward(
        self,
        input_ids: paddle.Tensor,
        hidden: paddle.Tensor,
        main_topk: paddle.Tensor | None,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        attention_mask: paddle.Tensor | None,
        dense_reference: bool = False,
    ) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
        """Per MTP depth d: logits [B, S, V] predicting token i+d+1, and indexer KL losses."""
        logits, kls = [], []
        B, S = input_ids.shape
        for d, mtp in enumerate(self.model.mtp_layers, start=1):
            shifted = paddle.concat([input_ids[:, d:], paddle.zeros([B, min(d, S)], dtype=input_ids.dtype)], 1)[:, :S]
            emb = self.model.embedding(shifted)
            hidden, _, kl = mtp(hidden, emb, cos, sin, attention_mask, main_topk, dense_reference=dense_reference)
            if kl is not None:
                kls.append(kl)
            logits.append(self.logits(mtp.norm(hidden)))
        return logits, kls

    def forward(
        self,
        input_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
        labels: paddle.Tensor | None = None,
        add_mtp_loss: bool = False,
        compute_mtp: bool | None = None,
        dense_reference: bool = False,
    ) -> CausalLMOutput:
        model = self.model
        cos, sin = model.rope(input_ids, position_ids)
        hidden = model.embedding(input_ids)
        hidden, topk, kls = model.run_layers(hidden, cos, sin, attention_mask, None, dense_reference=dense_reference)
        hidden = model.norm(hidden)
        out = CausalLMOutput(logits=self.logits(hidden), last_hidden_state=hidden)
        if compute_mtp is None:
            compute_mtp = labels is not None
        if compute_mtp and model.mtp_layers:
            out.mtp_logits, mtp_kls = self.mtp_forward(
                input_ids, hidden, topk, cos, sin, attention_mask, dense_reference=dense_reference
            )
            kls += mtp_kls
        if kls:
            out.indexer_loss = paddle.add_n(kls)
        if labels is not None:
            out.loss = causal_lm_loss(out.logits, labels)
            if out.mtp_logits:
                depth_losses = [causal_lm_loss(lg, labels, shift=d + 1) for d, lg in enumerate(out.mtp_logits, 1)]
                out.mtp_loss = paddle.add_n(depth_losses) / len(depth_losses)
            if add_mtp_loss:
                total = out.loss
                if out.mtp_loss is not None:
                    total = total + self.config.mtp_loss_scaling_factor * out.mtp_loss
                if out.indexer_loss is not None:
                    total = total + self.config.indexer_loss_coeff * out.indexer_loss
                out.loss = total
        return out
