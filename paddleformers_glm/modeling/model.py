"""GlmMoeDsaModel and GlmMoeDsaForCausalLM: embedding -> decoder layers (top-k flows layer to layer)
-> final norm -> lm_head, plus the MTP layers and the losses.

Parameter names follow the PaddleFormers / PaddleFleet layout (`model.embedding.embed_tokens`,
`self_attn.core_attention.indexer`, fused `up_gate_proj`, MTP `transformer_layer`); the checkpoint
package maps them to and from the official HF names with Paddle's AOA engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig
from ..ops import cpu_bf16, cross_entropy_sum
from ..parallel import comm
from ..parallel.layers import ParallelLMHead, VocabParallelEmbedding, mark_sequence_parallel
from ..parallel.topology import get_topology
from .attention_forms import FORMS, SelectionCache
from .cache import DSACache
from .decoder import DecoderLayer
from .mtp import MTPLayer
from .norms import RMSNorm
from .rope import RotaryEmbedding

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    """The forward's outputs. Like transformers' ``ModelOutput``: read by attribute, by name
    (``out["logits"]``) or by position (``out[0]``) over the fields that are set, in this order;
    ``to_tuple()`` gives those fields (what ``return_dict=False`` returns)."""

    loss: paddle.Tensor | None = None  # main LM loss (+ extras only when asked)
    logits: paddle.Tensor | None = None  # [B, S, V]
    past_key_values: DSACache | None = None  # the decoding cache, when use_cache
    mtp_loss: paddle.Tensor | None = None  # mean CE over MTP depths, unscaled
    mtp_logits: list[paddle.Tensor] = field(default_factory=list)  # per depth [B, S, V]
    indexer_loss: paddle.Tensor | None = None  # sum of per-layer indexer KL losses, unscaled
    last_hidden_state: paddle.Tensor | None = None  # after the final norm

    def keys(self) -> list[str]:
        """Names of the fields that are set (None and empty lists are not)."""
        names = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and not (isinstance(v, list) and not v):
                names.append(f.name)
        return names

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key: str | int | slice) -> object:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"{key!r} is not set in this output (set: {self.keys()})")
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


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


def share_selections(layers: Iterator[DecoderLayer | MTPLayer]) -> SelectionCache:
    """One cache of top-k index forms for all `layers` (a shared layer reuses its full layer's
    top-k, so its forms are built once); the model releases it at the end of each forward."""
    shared = SelectionCache()
    for layer in layers:
        block = layer.transformer_layer if isinstance(layer, MTPLayer) else layer
        block.self_attn.selections = shared
    return shared


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
        self.selections = share_selections(self.layers)
        self.norm = _final_norm(config)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)[: self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers)[self.config.num_hidden_layers :]

    def rope(self, input_ids: paddle.Tensor, position_ids: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos/sin for position_ids, or for arange(S) where S = input_ids.shape[1] (ids or embeddings)."""
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
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[paddle.Tensor]]:
        """Decoder layers [start, end): hidden [B,S,H] and the top-k in effect flow from layer to layer.

        A pipeline stage that starts on a shared layer passes in the top-k carried from the stage before.
        """
        end = self.config.num_hidden_layers if end is None else end
        kls = []
        for layer in list(self.layers)[start:end]:
            hidden, topk, kl = layer(hidden, cos, sin, key_padding, topk)
            if kl is not None:
                kls.append(kl)
        self.selections.release()
        return hidden, topk, kls

    def forward(
        self,
        input_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[paddle.Tensor]]:
        """-> (final-normed hidden [B, S, H], top-k of the last decoder layer, indexer KL losses)."""
        cos, sin = self.rope(input_ids, position_ids)
        hidden = self.embedding(input_ids)
        hidden, topk, kls = self.run_layers(hidden, cos, sin, attention_mask, None)
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
        self.selections = share_selections(self.layers.values())
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

    config_class = GlmMoeDsaConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: GlmMoeDsaConfig, dtype: str = "float32") -> None:
        if str(dtype).replace("paddle.", "") == "bfloat16":
            cpu_bf16.install()  # a CPU-only Paddle build gets the bf16 kernels it lacks; no-op elsewhere
        with default_dtype(dtype):
            super().__init__()
            self.config = config
            self.model = GlmMoeDsaModel(config)
            # vocabulary split over TP: vocab-parallel logits, gathered below for `out.logits`
            self.lm_head = build_lm_head(config)
            # decided here, not per call: paddle.jit.to_static's bytecode tracer crashes (SIGSEGV)
            # simulating the topology lookup inside a traced forward
            self.vocab_parallel = get_topology().tp_size > 1
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
        config: GlmMoeDsaConfig | None = None,
        check_finite: bool = True,
        **config_overrides,
    ):
        """Load an official HF-layout (or Fleet-layout, or block-FP8) checkpoint folder.

        Under a multi-rank topology (tensor/expert parallel, ``parallel.topology.init_topology``)
        the model is built in its split shapes and each rank reads only its slices.

        ``dtype``: a name (``"bfloat16"``, ``"bf16"``, ``"float32"``...) or a Paddle dtype; ``"auto"``
        (default) is the config's dtype where the device computes it (an accelerator), else float32
        with an info line. See checkpoint.load_pretrained_state. The load report is logged (one
        info line, warnings as warnings); ``output_loading_info=True`` returns ``(model, report)``
        as transformers does. ``check_finite`` (default) refuses weights holding NaN or Inf, naming
        them (checkpoint/finite.py; its cost per GB is in docs/checkpoints.md).
        """
        from ..checkpoint import load_pretrained_state
        from ..checkpoint.loader import init_like_hf, resolve_model_dtype

        if config is None:
            config = GlmMoeDsaConfig.from_pretrained(path, **config_overrides)
        elif config_overrides:
            raise TypeError(
                f"from_pretrained: config overrides {sorted(config_overrides)} given with an explicit config"
            )
        dtype = resolve_model_dtype(dtype, config)
        with _skip_random_init():  # every parameter is overwritten below: do not draw random numbers
            model = cls(config, dtype=dtype)
        if get_topology().world_size > 1:  # built split over ranks: read only this rank's slices
            from ..parallel.state import sharded_state_dict

            state, shard_info = sharded_state_dict(model)
            report = load_pretrained_state(  # keys: expert parallel leaves the other ranks' experts out
                state, path, dtype=None, strict=strict, config=config, keys=set(state), shard_info=shard_info
            )
        else:
            report = load_pretrained_state(model, path, dtype=dtype, strict=strict)
        params = model.state_dict()
        unfilled = set(params) - set(report.loaded) - set(report.initialized)
        if unfilled:  # strict=False: what the checkpoint lacks is initialised as HF does
            init_like_hf({k: params[k] for k in sorted(unfilled)}, config.initializer_range)
        if check_finite:
            from ..checkpoint.finite import check_finite_state

            check_finite_state(params, os.path.abspath(os.fspath(path)))
        _LOG.info("%s", report.summary())
        model.source_path = os.path.abspath(os.fspath(path))
        return (model, report) if output_loading_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> str:
        """Official HF layout by default (`layout="fleet"` for the Paddle names; `quantization="fp8"`
        for the block-FP8 release format); all or nothing. A model loaded from a folder carries that
        folder's tokenizer / generation config / chat template files along. Built under a
        multi-rank topology (tensor/expert parallel) it is collective: every rank writes the
        tensors it owns (parallel/export.py ``save_pretrained_distributed``), no rank gathers the
        model, and the files are the same bytes as a one-process save."""
        from ..checkpoint import save_pretrained_state

        kwargs.setdefault("carry_from", getattr(self, "source_path", None))
        if get_topology().world_size > 1:
            from ..parallel.export import save_pretrained_distributed

            return save_pretrained_distributed(self, save_directory, **kwargs)
        return save_pretrained_state(self, self.config, save_directory, **kwargs)

    # ------------------------------------------------------------------ the usual model API
    def set_attn_implementation(self, name: str) -> None:
        """Pick the attention form for the following forwards (transformers' name): "auto" (by
        size), "reference", "dense", "sparse" or "latent" (see modeling/attention_forms.py). It is
        the config key `attn_implementation`, so a save after this records it."""
        if name not in FORMS:
            raise ValueError(f"attn_implementation must be one of {FORMS}, got {name!r}")
        self.config.attn_implementation = name

    def get_input_embeddings(self) -> nn.Layer:
        """The token embedding layer (its `.weight` is [vocab, hidden])."""
        return self.model.embedding.embed_tokens

    def set_input_embeddings(self, value: nn.Layer) -> None:
        self.model.embedding.embed_tokens = value

    def get_output_embeddings(self) -> nn.Layer:
        """The LM head (its `.weight` is [hidden, vocab], Paddle's orientation)."""
        return self.lm_head

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameter count of this model (this rank's share under model parallelism)."""
        skip = set()
        if exclude_embeddings:
            skip = {id(p) for p in self.get_input_embeddings().parameters()}
            skip |= {id(p) for p in self.get_output_embeddings().parameters()}
        total = 0
        for p in self.parameters():
            if id(p) in skip or (only_trainable and p.stop_gradient):
                continue
            total += int(np.prod(p.shape)) if p.shape else 1
        return total

    # ------------------------------------------------------------------ forward
    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Full-vocabulary logits [B, S, V] (the trainer feeds the vocab-parallel ones to a parallel CE)."""
        logits = self.lm_head(hidden)
        if self.vocab_parallel:
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
    ) -> tuple[list[paddle.Tensor], list[paddle.Tensor]]:
        """Per MTP depth d: logits [B, S, V] predicting token i+d+1, and indexer KL losses."""
        logits, kls = [], []
        B, S = input_ids.shape
        for d, mtp in enumerate(self.model.mtp_layers, start=1):
            shifted = paddle.concat([input_ids[:, d:], paddle.zeros([B, min(d, S)], dtype=input_ids.dtype)], 1)[:, :S]
            emb = self.model.embedding(shifted)
            hidden, _, kl = mtp(hidden, emb, cos, sin, attention_mask, main_topk)
            if kl is not None:
                kls.append(kl)
            logits.append(self.logits(mtp.norm(hidden)))
        self.model.selections.release()
        return logits, kls

    def forward(
        self,
        input_ids: paddle.Tensor | None = None,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
        labels: paddle.Tensor | None = None,
        add_mtp_loss: bool = False,
        compute_mtp: bool | None = None,
        *,
        past_key_values: DSACache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: paddle.Tensor | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput | tuple:
        """`use_cache=True` (or a `past_key_values` cache) runs the decoding path: an empty cache is
        filled by this forward (prefill), a filled one makes `input_ids` the next tokens only. Its
        default rope positions count each row's real tokens (padding-aware, as `generate` needs);
        the plain forward uses arange(S) like HF's forward. `logits_to_keep=n` computes the logits
        of the last n positions only. `return_dict=False` returns `out.to_tuple()`."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward: give exactly one of input_ids and inputs_embeds")
        if use_cache or past_key_values is not None:
            out = self._forward_cached(
                input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, labels, logits_to_keep
            )
        else:
            out = self._forward_full(
                input_ids,
                inputs_embeds,
                attention_mask,
                position_ids,
                labels,
                add_mtp_loss,
                compute_mtp,
            )
        if logits_to_keep and out.logits is not None:
            out.logits = out.logits[:, -logits_to_keep:]
        if return_dict is None or return_dict:
            return out
        # to_tuple() spelled out: paddle.jit.to_static's bytecode tracer reads dataclass fields but
        # cannot call their methods
        fields_ = (out.loss, out.logits, out.past_key_values, out.mtp_loss, out.mtp_logits or None)
        fields_ += (out.indexer_loss, out.last_hidden_state)
        return tuple(v for v in fields_ if v is not None)

    def _forward_full(
        self,
        input_ids: paddle.Tensor | None,
        inputs_embeds: paddle.Tensor | None,
        attention_mask: paddle.Tensor | None,
        position_ids: paddle.Tensor | None,
        labels: paddle.Tensor | None,
        add_mtp_loss: bool,
        compute_mtp: bool | None,
    ) -> CausalLMOutput:
        model = self.model
        hidden = model.embedding(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = model.rope(hidden, position_ids)
        hidden, topk, kls = model.run_layers(hidden, cos, sin, attention_mask, None)
        hidden = model.norm(hidden)
        out = CausalLMOutput(logits=self.logits(hidden), last_hidden_state=hidden)
        if compute_mtp is None:
            compute_mtp = labels is not None
        if compute_mtp and model.mtp_layers:
            if input_ids is None:
                raise ValueError("the MTP heads need input_ids (they embed the shifted tokens)")
            out.mtp_logits, mtp_kls = self.mtp_forward(input_ids, hidden, topk, cos, sin, attention_mask)
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

    def _forward_cached(
        self,
        input_ids: paddle.Tensor | None,
        inputs_embeds: paddle.Tensor | None,
        attention_mask: paddle.Tensor | None,
        position_ids: paddle.Tensor | None,
        cache: DSACache | None,
        labels: paddle.Tensor | None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """The decoding forward (no MTP): prefill into an empty cache, or n new tokens on a filled one."""
        model = self.model
        hidden = model.embedding(input_ids) if inputs_embeds is None else inputs_embeds
        B, n = hidden.shape[0], hidden.shape[1]
        if cache is None:
            cache = DSACache.for_config(self.config, B)
        if cache.batch_size != B:
            raise ValueError(f"past_key_values holds {cache.batch_size} rows, the input has {B}")
        prefill = cache.length == 0
        positions, key_valid = cache.begin(attention_mask, n)
        cos, sin = model.rotary_emb(positions if position_ids is None else position_ids)
        key_padding = attention_mask if prefill else key_valid
        topk = None
        for layer, lc in zip(model.decoder_layers, cache.layers):
            hidden, topk, _ = layer(hidden, cos, sin, key_padding, topk, cache=lc)
        model.selections.release()
        cache.advance(n)
        hidden = model.norm(hidden)
        keep = hidden[:, -logits_to_keep:] if logits_to_keep and labels is None else hidden  # the last rows only
        out = CausalLMOutput(logits=self.logits(keep), last_hidden_state=hidden, past_key_values=cache)
        if labels is not None:
            out.loss = causal_lm_loss(out.logits, labels)
        return out

    # ------------------------------------------------------------------ generation
    @property
    def generation_config(self):
        """`generate`'s defaults (a `generation.GenerationConfig`): the checkpoint's
        generation_config.json, else the config's special tokens; assign one to change them."""
        if self.__dict__.get("_generation_config") is None:
            from ..generation import generation_config_of

            self.__dict__["_generation_config"] = generation_config_of(self)
        return self.__dict__["_generation_config"]

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.__dict__["_generation_config"] = value

    def generate(self, input_ids: paddle.Tensor, attention_mask: paddle.Tensor | None = None, **kwargs):
        """Prompt + new tokens [B, S + n] int64 (HF's options; defaults from `generation_config`);
        see `paddleformers_glm.generation.generate`."""
        from ..generation import generate

        kwargs.setdefault("generation_config", self.generation_config)
        return generate(self, input_ids, attention_mask, **kwargs)
