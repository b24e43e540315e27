"""GLM-5.2 (`glm_moe_dsa`) as one stage-aware model: embedding -> decoder layers (the top-k flows from
layer to layer) -> final norm -> LM head, the MTP layers, and one loss function.

The HF-API `forward`, a trainer's pipeline stage (`forward_stage`), context parallel and `generate`
all run one body (`_run`) over the pipeline carry (hidden states and the top-k of the last full
indexer layer); docs/model.md ("One stage-aware model") lists the paths. Parameter names follow the
PaddleFormers / PaddleFleet layout whatever the stage holds; the checkpoint package maps them to
and from the official HF names.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import paddle
from paddle import nn

from ..configuration import HF_ATTN_IMPLEMENTATIONS, IGNORE_INDEX, GlmMoeDsaConfig
from ..ops import cpu_bf16, cross_entropy_sum
from ..ops.norm import building_graph
from ..parallel import comm
from ..parallel.layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    default_dtype,
    mark_sequence_parallel,
    parallel_cross_entropy,
)
from ..parallel.pipeline import LossTerm, StageOutput, StageSpec, rank_spec, split_stages
from ..parallel.recompute import run_layer
from ..parallel.topology import Topology
from .attention_forms import FORMS, SelectionCache
from .cache import DSACache, LayerCache
from .decoder import DecoderLayer
from .indexer_stages import (
    IndexerTraining,
    check_coeff_stage,
    kl_term,
    objective_weights,
    own_indexer_layers,
    recall_term,
    trains_in_warmup,
)
from .indexer_training import IndexerRecord, IndexerRun, IndexerTerms, indexer_terms
from .moe import TopkRouter, frozen_training_forward
from .mtp import MTPLayer, mtp_token_valid
from .norms import RMSNorm
from .packing import Packing, packed_sequences
from .pretrained import GlmMoeDsaPreTrainedModel, dtype_name
from .rope import RotaryEmbedding

# the fields of transformers 5.23's causal-LM output, in its order (aux_loss: never set here)
HF_OUTPUT_FIELDS = ("loss", "logits", "past_key_values", "hidden_states", "attentions", "router_logits")


@dataclass
class CausalLMOutput:
    """The forward's outputs. Like transformers' ``ModelOutput``: read by attribute or by name
    (``out["logits"]``, ``keys()``: every field that is set, in this order); by position (``out[0]``)
    and ``to_tuple()`` (what ``return_dict=False`` returns) over the set fields transformers' output
    has (loss, logits, past_key_values, hidden_states, attentions, router_logits), so that
    ``loss, logits, past_key_values = model(..., return_dict=False)`` unpacks as there; this
    package's own fields (MTP, indexer, ``last_hidden_state``) are read by name."""

    loss: paddle.Tensor | None = None  # main LM loss (+ extras only when asked)
    logits: paddle.Tensor | None = None  # [B, S, V]
    past_key_values: DSACache | None = None  # the decoding cache, when use_cache
    hidden_states: tuple[paddle.Tensor, ...] | None = None  # output_hidden_states: as transformers'
    attentions: tuple[paddle.Tensor, ...] | None = None  # output_attentions: per decoder layer [B, heads, S, T]
    router_logits: tuple[paddle.Tensor, ...] | None = None  # output_router_logits: per MoE layer [B*S, E]
    mtp_loss: paddle.Tensor | None = None  # mean CE over MTP depths, unscaled
    mtp_logits: list[paddle.Tensor] = field(default_factory=list)  # per depth [B, S, V]
    indexer_loss: paddle.Tensor | None = None  # sum of per-layer indexer KL losses, unscaled
    last_hidden_state: paddle.Tensor | None = None  # after the final norm
    indexer_recall: paddle.Tensor | None = None  # mean over the indexer layers of the top-k recall
    lm_loss: paddle.Tensor | None = None  # the LM loss, where out.loss is an indexer stage's objective
    # transformers' MoeCausalLMOutputWithPast.aux_loss, None for this model there (its router has no
    # auxiliary loss): readable, so an MoE training loop's `if out.aux_loss is not None` runs; never set,
    # so it is in neither keys() nor to_tuple(), as transformers leaves a None field out of both
    aux_loss: paddle.Tensor | None = None

    def keys(self) -> list[str]:
        """Names of the fields that are set (None and empty lists are not)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return [k for k, v in values.items() if v is not None and not (isinstance(v, list) and not v)]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys() if k in HF_OUTPUT_FIELDS)

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


# ---------------------------------------------------------------------------------------------- losses
def shift_labels(labels: paddle.Tensor, shift: int, fill: int | None = None) -> paddle.Tensor:
    """HF's causal shift: position i's target is labels[i + shift] ([B, S]; past the end: ``fill``,
    default IGNORE_INDEX: ignored).  (No module constant as a default value: to_static's
    full-graph translation re-creates the function where the module's names are not defined.)"""
    fill = IGNORE_INDEX if fill is None else fill
    B, S = labels.shape
    return paddle.concat([labels[:, shift:], paddle.full([B, min(shift, S)], fill, dtype=labels.dtype)], 1)[:, :S]


_shift_by = shift_labels  # for forward, whose `shift_labels` keyword (transformers' name) hides the function


def token_loss(logits: paddle.Tensor, target: paddle.Tensor, vocab_parallel: bool, group: Any = None) -> LossTerm:
    """Summed cross entropy of logits [B, S, V(/tp)] against target [B, S] and the count of targets
    that are not IGNORE_INDEX.

    ``vocab_parallel``: the LM head's raw output (the trainer's stages: split over the TP ``group``,
    Fleet's parallel cross entropy; ``F.cross_entropy`` at tp 1, whose rounding every layout of the
    trainer shares); else full-vocabulary logits (the HF-API forward: the fused CPU op
    ``ops.cross_entropy_sum``, the one the parity fixtures were measured with)."""
    if vocab_parallel:
        total = parallel_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none", group=group).sum()
    else:
        flat = logits.reshape([-1, logits.shape[-1]]).astype("float32")
        total = cross_entropy_sum(flat, target.reshape([-1]).astype("int64"), IGNORE_INDEX)
    return LossTerm(total, (target != IGNORE_INDEX).astype("int64").sum())


def mean_loss(term: LossTerm) -> paddle.Tensor:
    """The sum over the counted tokens (a term without any is 0, where transformers' mean is NaN)."""
    return term.sum / paddle.clip(term.count.astype("float32"), min=1.0)


def causal_lm_loss(logits: paddle.Tensor, labels: paddle.Tensor, shift: int = 1) -> paddle.Tensor:
    """HF convention on full-vocabulary logits: position i predicts labels[i + shift]; the mean over
    labels that are not IGNORE_INDEX."""
    return mean_loss(token_loss(logits, shift_labels(labels, shift), vocab_parallel=False))


def for_causal_lm_loss(
    logits: paddle.Tensor,
    labels: paddle.Tensor | None,
    vocab_size: int,
    num_items_in_batch: int | paddle.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: paddle.Tensor | None = None,
    **kwargs: Any,
) -> paddle.Tensor:
    """transformers' ``ForCausalLMLoss`` (``model.loss_function``'s default) with its signature: the
    fp32 cross entropy of logits [B, S, V] against labels shifted by one (or ``shift_labels`` as
    they are), the mean over the targets that are not ``ignore_index`` or, with
    ``num_items_in_batch``, the sum over that count. The forward's LM loss is this, bit for bit
    (as the forward's, a mean without any counted target is 0 where transformers' is NaN)."""
    target = shift_labels if shift_labels is not None else _shift_by(labels, 1, fill=ignore_index)
    target = target.reshape([-1]).astype("int64")
    total = cross_entropy_sum(logits.reshape([-1, vocab_size]).astype("float32"), target, ignore_index)
    if num_items_in_batch is not None:
        n = num_items_in_batch
        return total / (n.astype("float32") if isinstance(n, paddle.Tensor) else float(n))
    return mean_loss(LossTerm(total, (target != ignore_index).astype("int64").sum()))


def causal_lm_losses(
    logits: Sequence[paddle.Tensor],
    batch: Mapping[str, paddle.Tensor],
    indexer: IndexerTerms | None,
    vocab_parallel: bool,
    group: Any = None,
) -> dict[str, LossTerm]:
    """The model's one loss function: ``lm`` (``logits[0]``: position i predicts labels[i + 1]),
    ``mtp_<d>`` (``logits[d]``, MTP depth d: labels[i + d + 1]) and, from the indexer's training,
    ``indexer_kl`` (the sum of the layers' indexer KL losses, one term per micro-batch) and per layer
    ``indexer_kl@<id>`` (its KL, detached: a report) and ``indexer_recall@<id>`` (its top-k recall).

    Under context parallel the batch carries each shift's targets already shifted over the whole
    sequence and sliced to this rank (``cp_target_<shift>``, parallel/context.py); so does the
    forward's ``labels_shifted`` (PaddleFormers' label convention)."""
    losses: dict[str, LossTerm] = {}
    for d, lg in enumerate(logits):
        target = batch.get(f"cp_target_{d + 1}")
        if target is None:
            target = shift_labels(batch["labels"], d + 1)
        losses["lm" if d == 0 else f"mtp_{d}"] = token_loss(lg, target, vocab_parallel, group)
    if indexer:
        losses["indexer_kl"] = LossTerm(indexer.kl_sum(), 1)
        for i in sorted(indexer.kl):
            losses[kl_term(i)] = LossTerm(indexer.kl[i].detach(), 1)
            losses[recall_term(i)] = LossTerm(indexer.recall[i], 1)
    return losses


# ---------------------------------------------------------------------------------------------- layers
class Embedding(nn.Layer):
    """Token embedding under the Fleet name `embedding.embed_tokens` (vocabulary split over TP;
    under sequence parallel its output is this rank's sequence shard).

    Like torch's `padding_idx`, the pad row gets no gradient but still returns its stored vector
    (Paddle's own `padding_idx` would return zeros and break parity with the reference).
    """

    def __init__(self, config: GlmMoeDsaConfig, topo: Topology) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, topo.sequence_parallel, padding_idx=config.pad_token_id, topo=topo
        )

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        return self.embed_tokens(input_ids)


@paddle.jit.not_to_static  # a check in Python: to_static's translation leaves it as it is
def _check_token_ids(ids: paddle.Tensor, vocab: int) -> None:
    """An id outside [0, vocab) is an IndexError, as torch's embedding raises (transformers 5.23:
    "index out of range in self"); Paddle's CPU embedding reads -1 out of bounds instead, and a
    tensor-parallel rank reads an id it does not own as zeros. Checked where the ids sit on the host
    (a CPU tensor, outside a graph being built), so an accelerator's forward waits on nothing; the
    forward's entry only (generate's decode step feeds the ids it chose)."""
    if building_graph() or ids.size == 0 or not ids.place.is_cpu_place():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise IndexError(f"input_ids holds {bad}, outside the vocabulary [0, {vocab}) (the input embedding's rows)")


def build_layer(config: GlmMoeDsaConfig, index: int, topo: Topology) -> DecoderLayer | MTPLayer:
    """Layer ``index`` of the stack (a decoder layer below ``num_hidden_layers``, else an MTP layer),
    built on its own so a pipeline stage can make just its layers."""
    L = config.num_hidden_layers
    if 0 <= index < L:
        return DecoderLayer(config, config.indexer_types[index] == "full", config.mlp_layer_types[index], topo)
    if L <= index < L + config.num_mtp_layers:
        return MTPLayer(config, topo)
    raise IndexError(
        f"layer {index} does not exist: {L} decoder layers (0..{L - 1}) and {config.num_mtp_layers} MTP layers"
    )


class Layers(nn.LayerDict):
    """The layers a model owns, keyed by their global id (``layers.<id>.*``, the full model's names,
    which a checkpoint's keys follow), and read as transformers' ``model.model.layers`` (an
    ``nn.ModuleList`` of the decoder layers) is read: code written for it (a hook on every layer,
    unfreezing the last n) must reach the decoder layers, never the MTP layers, which transformers
    drops on load.

    ``len()`` and iteration count the decoder layers this model holds (in id order); ``layers[i]``
    is the layer of id ``i``; a negative ``i`` counts back from the last decoder layer held and a
    slice gives an ``nn.LayerList`` of the decoder layers held, as a list's (on a whole model the
    positions are the ids). The MTP layers stay where their names put them:
    ``layers[num_hidden_layers + j]`` (``model.model.mtp_layers``); ``keys()`` / ``values()`` /
    ``items()`` and ``"<id>" in layers`` cover every layer held, MTP included. On a pipeline stage
    an id is still global (``layers[3]`` is layer 3, ``model.layers.3.*``): a layer another stage
    holds is a KeyError naming it."""

    def __init__(self, sublayers: Mapping[str, nn.Layer], num_decoder_layers: int) -> None:
        super().__init__(sublayers)
        self._num_decoder_layers = int(num_decoder_layers)

    def _decoder_ids(self) -> list[int]:
        return sorted(int(k) for k in self._sub_layers if int(k) < self._num_decoder_layers)

    def __getitem__(self, key: int | str | slice) -> nn.Layer | nn.LayerList:
        L = self._num_decoder_layers
        if isinstance(key, slice):
            return nn.LayerList([self._sub_layers[str(i)] for i in self._decoder_ids()[key]])
        if isinstance(key, str):
            return super().__getitem__(key)
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"layers indices must be integers, slices or ids as strings, not {type(key).__name__}")
        if key < 0:  # a position among the decoder layers held (an id otherwise: no sort per access)
            held = self._decoder_ids()
            if -key > len(held):
                raise IndexError(f"layer index {int(key)} is out of range: {len(held)} decoder layers held")
            return self._sub_layers[str(held[key])]
        i = int(key)
        if str(i) not in self._sub_layers:
            raise (KeyError if i < L else IndexError)(
                f"layer {i} is not held here (this model holds layers {sorted(int(k) for k in self._sub_layers)}: "
                f"ids 0..{L - 1} are decoder layers, {L}.. the MTP layers)"
            )
        return self._sub_layers[str(i)]

    def __len__(self) -> int:
        return len(self._decoder_ids())

    def __iter__(self) -> Iterator[nn.Layer]:
        return iter([self._sub_layers[str(i)] for i in self._decoder_ids()])

    def __contains__(self, key: object) -> bool:
        if isinstance(key, nn.Layer):  # a list's membership, as transformers' ModuleList
            return any(layer is key for layer in self)
        return str(key) in self._sub_layers

    def __bool__(self) -> bool:  # a Layer is true whatever it holds (an MTP-only stage too)
        return True


class GlmMoeDsaModel(nn.Layer):
    """The decoder stack, or the part of it one pipeline stage holds: the decoder and MTP layers
    ``layer_ids`` (default all: the L decoder layers, then the MTP layers as ids L + j), the
    embedding and the final norm where asked. Only those are constructed: a stage of a 744B model
    never allocates the other stages' layers, not even transiently."""

    def __init__(
        self,
        config: GlmMoeDsaConfig,
        topo: Topology | None = None,
        *,
        layer_ids: Sequence[int] | None = None,
        embedding: bool = True,
        norm: bool = True,
    ) -> None:
        super().__init__()
        topo = topo or Topology.single()
        self.config = config
        L = config.num_hidden_layers
        ids = list(range(L + config.num_mtp_layers)) if layer_ids is None else [int(i) for i in layer_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"GlmMoeDsaModel: layer ids repeat: {ids}")
        if embedding:
            self.embedding = Embedding(config, topo)
        self.layers = Layers({str(i): build_layer(config, i, topo) for i in ids}, L)
        self.layer_ids = ids
        # one cache of top-k index forms for all layers (a shared layer reuses its full layer's top-k,
        # so its forms are built once) and one indexer-training state (the stage, the warm-up's dense
        # selection); both are released at the end of each forward
        self.selections, self.indexer_run = SelectionCache(), IndexerRun(IndexerTraining.from_config(config))
        for layer in self.layers.values():
            attn = (layer.transformer_layer if isinstance(layer, MTPLayer) else layer).self_attn
            attn.selections, attn.indexer_run = self.selections, self.indexer_run
        if norm:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            mark_sequence_parallel(self.norm, enabled=topo.sequence_parallel)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.layers[i] for i in self.layer_ids if i < self.config.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return [self.layers[i] for i in self.layer_ids if i >= self.config.num_hidden_layers]

    def rope(self, input_ids: paddle.Tensor, position_ids: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos/sin for position_ids, or for arange(S) where S = input_ids.shape[1] (ids or embeddings)."""
        if position_ids is None:
            position_ids = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        return self.rotary_emb(position_ids)

    def run_layers(
        self,
        layer_ids: Sequence[int],
        hidden: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        topk: paddle.Tensor | None,
        *,
        caches: Sequence[LayerCache] | None = None,
        recompute: str = "none",
        recompute_every: int = 1,
        collect: list[paddle.Tensor] | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[tuple[int, IndexerRecord]]]:
        """Decoder layers ``layer_ids`` in turn: hidden [B, S, H] and the top-k in effect flow from
        layer to layer (``topk``: the one carried from the stage before, None on the first).
        -> (hidden, top-k, (layer id, indexer-training record) of each layer that left one).
        ``caches``: the decoding cache of every decoder layer; ``recompute``: the recompute mode of
        the layers whose id is a multiple of ``recompute_every`` (the others keep their activations);
        ``collect``: a list each layer's output hidden is appended to."""
        records = []
        for i in layer_ids:
            if caches is not None:
                hidden, topk, rec = self.layers[i](hidden, cos, sin, key_padding, topk, cache=caches[i])
            else:
                mode = recompute if i % recompute_every == 0 else "none"
                hidden, topk, rec = run_layer(self.layers[i], hidden, cos, sin, key_padding, topk, mode=mode)
            if rec is not None:
                records.append((i, rec))
            if collect is not None:
                collect.append(hidden)
        return hidden, topk, records

    def forward(
        self,
        input_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, list[paddle.Tensor]]:
        """-> (final-normed hidden [B, S, H], top-k of the last decoder layer, indexer KL losses)."""
        cos, sin = self.rope(input_ids, position_ids)
        ids = [i for i in self.layer_ids if i < self.config.num_hidden_layers]
        hidden, topk, records = self.run_layers(ids, self.embedding(input_ids), cos, sin, attention_mask, None)
        terms = self.end_forward(records)
        return self.norm(hidden), topk, [terms.kl[i] for i in sorted(terms.kl)]

    def end_forward(self, records: list[tuple[int, IndexerRecord]]) -> IndexerTerms:
        """The indexer's losses from a forward's records (``run_layers``); the state the layers
        share for one forward (the top-k's index forms, the dense selection) is released."""
        terms = indexer_terms(records, self.indexer_run.training)
        self.selections.release()
        self.indexer_run.release()
        return terms


def GlmMoeDsaStageModel(  # noqa: N802 - the former class's name, kept for its callers
    config: GlmMoeDsaConfig, layer_ids: Sequence[int], *, embedding: bool, norm: bool, topo: Topology | None = None
) -> GlmMoeDsaModel:
    """The part of the stack one pipeline stage holds: :class:`GlmMoeDsaModel` built for ``layer_ids``."""
    return GlmMoeDsaModel(config, topo, layer_ids=layer_ids, embedding=embedding, norm=norm)


# DataCollatorWithFlattening(return_flash_attn_kwargs=True / return_seq_idx=True)'s keys: the packed
# sequences' bounds, for a varlen attention kernel
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@paddle.jit.not_to_static  # a check in Python: to_static's translation leaves it as it is
def _check_cache_position(cache_position: Any, tokens: paddle.Tensor, cache: DSACache | None) -> None:
    """``cache_position`` is the next ``n`` slots of ``cache`` (0.. without one): what a decoding loop
    written for transformers passes; a value that is not is a caller's bug, refused rather than
    ignored (transformers 5.23 ignores any value)."""
    n = tokens.shape[1]
    past = 0 if cache is None else int(cache.get_seq_length())
    got = np.asarray(cache_position.numpy() if hasattr(cache_position, "numpy") else cache_position).reshape(-1)
    if got.tolist() != list(range(past, past + n)):
        raise ValueError(
            f"forward: cache_position {got.tolist()[:8]} is not the next {n} slots of the cache "
            f"({past}..{past + n - 1}); positions come from the cache and the mask, it may be left out"
        )


def _check_packing_keys(kwargs: dict[str, Any], packing: Packing | None) -> None:
    """``forward(**kwargs)``: the collator's packed-sequence keys are taken beside packed position_ids
    (as transformers' eager and sdpa attention, which read the sequences from the position_ids;
    ``cu_seq_lens_q`` / ``_k`` must then give the same bounds) and refused by name without them; any
    other key is Python's TypeError."""
    keys = [k for k in kwargs if k in _PACKING_KEYS and kwargs[k] is not None]  # None: not given
    if keys and packing is None:
        raise ValueError(
            f"forward: {', '.join(keys)} (packed sequences, transformers' DataCollatorWithFlattening) need the "
            "collator's position_ids, restarting at each sequence, without an attention_mask and a cache "
            "(use_cache=False), as transformers reads packed sequences; or pass the sequences as rows with "
            "padding and an attention_mask"
        )
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(key) is not None:
            bounds = np.asarray(kwargs[key].numpy() if hasattr(kwargs[key], "numpy") else kwargs[key]).reshape(-1)
            if bounds.tolist() != packing.bounds():
                raise ValueError(
                    f"forward: {key} {bounds.tolist()} disagrees with position_ids' sequences {packing.bounds()}"
                )
    other = [k for k in kwargs if k not in _PACKING_KEYS]
    if other:
        raise TypeError(f"GlmMoeDsaForCausalLM.forward() got an unexpected keyword argument {other[0]!r}")


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _packing_of(model: GlmMoeDsaForCausalLM, position_ids: paddle.Tensor, rows: int) -> Packing | None:
    """transformers 5.23 reads ``position_ids`` that do not step by 1 within a row as packed sequences
    (a new one wherever they restart or jump) and attends within each only, when the forward has
    neither an attention_mask nor a cache (``use_cache=False``, or ``config.use_cache`` false):
    their packing (modeling/packing.py), None when each row is one sequence or a graph is being built."""
    if not paddle.in_dynamic_mode():  # a graph being built: the values are not known yet
        return None
    if position_ids.shape[0] == 1 and rows > 1:  # one row for the batch: transformers expands it
        position_ids = position_ids.expand([rows, position_ids.shape[1]])
    packing = packed_sequences(position_ids, grouped=not model.indexer_training.active)
    if packing is None:
        return None
    if packing.batch != rows:
        raise ValueError(f"forward: packed position_ids of {packing.batch} rows for {rows} rows of input")
    if model.distributed:
        raise NotImplementedError("forward: packed sequences (position_ids restarting within a row) run in one process")
    return packing


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _start_router_logits(model: GlmMoeDsaForCausalLM, enabled: bool) -> dict[int, paddle.Tensor] | None:
    """``output_router_logits``: a hook on each decoder MoE layer's router (not the MTP layer's:
    transformers has none) keeps its logits [tokens, experts] by layer, one entry per pass of the
    layers (packed sequences run a pass per group of them); None when off. Hooks a failed forward
    left are removed first."""
    _stop_router_logits(model, None)
    if not enabled:
        return None
    kept: dict[int, list[paddle.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.decoder_layers):
        for m in layer.sublayers():
            if isinstance(m, TopkRouter):
                hooks.append(
                    m.register_forward_post_hook(lambda _m, _in, out, i=i: kept.setdefault(i, []).append(out[0]))
                )
    model.__dict__["_router_hooks"] = hooks
    return kept


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _stop_router_logits(model: GlmMoeDsaForCausalLM, kept: dict[int, list[paddle.Tensor]] | None):
    """The hooks removed; -> transformers' ``router_logits``: the kept logits by layer, or None."""
    for hook in model.__dict__.pop("_router_hooks", []):
        hook.remove()
    return None if kept is None else tuple(paddle.concat(kept[i]) for i in sorted(kept))


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _start_attentions(model: GlmMoeDsaForCausalLM, enabled: bool) -> dict[int, list[paddle.Tensor]] | None:
    """``output_attentions``: each decoder layer's attention (not the MTP layer's: transformers
    records none) hands its weights [B, heads, S, T] to a dict by layer, one entry per pass of the
    layers (packed sequences run a pass per group); None when off. What a failed forward left is
    cleared first."""
    _stop_attentions(model, None)
    if not enabled:
        return None
    if model.distributed:
        raise NotImplementedError(
            "output_attentions=True runs in one process (tensor and context parallel split the heads and queries)"
        )
    kept: dict[int, list[paddle.Tensor]] = {}
    for i, layer in enumerate(model.model.decoder_layers):
        layer.self_attn.keep_attention = lambda p, i=i: kept.setdefault(i, []).append(p)
    return kept


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _stop_attentions(
    model: GlmMoeDsaForCausalLM, kept: dict[int, list[paddle.Tensor]] | None, packing: Packing | None = None
):
    """The layers stop handing weights on; -> transformers' ``attentions``: the kept ones by layer
    (packed sequences: their groups' weights as one block-diagonal [B, heads, S, S]), or None."""
    for layer in model.model.decoder_layers:
        layer.self_attn.keep_attention = None
    if kept is None:
        return None
    return tuple(packing.block_diagonal(kept[i]) if packing is not None else kept[i][0] for i in sorted(kept))


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _with_shift_labels(
    labels: paddle.Tensor | None, shift_labels: paddle.Tensor | None, labels_shifted: bool
) -> tuple[paddle.Tensor | None, bool]:
    """(labels, labels_shifted) for the loss: transformers' ``shift_labels`` given with ``labels`` are
    taken as they are (already shifted); without labels there is no loss, as in transformers."""
    if shift_labels is not None and labels is not None:
        return shift_labels, True
    return labels, labels_shifted


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _custom_loss_call(
    model: GlmMoeDsaForCausalLM,
    labels: paddle.Tensor | None,
    shift_labels: paddle.Tensor | None,
    labels_shifted: bool,
    num_items_in_batch: int | paddle.Tensor | None,
    ignore_index: int | None = None,
) -> tuple[Callable[..., paddle.Tensor], dict[str, Any]] | None:
    """A ``model.loss_function`` the caller set and the keywords transformers' forward calls it with
    (``labels``, and ``num_items_in_batch`` / ``shift_labels`` / ``ignore_index`` where given;
    ``labels_shifted=True`` labels as ``shift_labels``); None without one, or without labels (no loss)."""
    fn = model.__dict__.get("_loss_function")
    if fn is None or labels is None:
        return None
    kw: dict[str, Any] = {"labels": labels}
    if num_items_in_batch is not None:
        kw["num_items_in_batch"] = num_items_in_batch
    if shift_labels is not None or labels_shifted:
        kw["shift_labels"] = labels if shift_labels is None else shift_labels
    if ignore_index is not None:
        kw["ignore_index"] = ignore_index
    return fn, kw


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _flag(value: bool | None, config: GlmMoeDsaConfig, name: str) -> bool:
    """A forward flag: ``value``, else (None) the config's ``name`` (false when it has none)."""
    return bool(value) if value is not None else bool(getattr(config, name, False))


@paddle.jit.not_to_static
def _check_pipelined_forward(
    model: GlmMoeDsaForCausalLM,
    labels: bool,
    packed: bool,
    flags: list[bool | None],
) -> None:
    """A pipelined model's forward (an evaluation chain of its stages, for ``generate``) computes the
    last stage's logits only: training and losses go through the trainer's pipeline engine."""
    asked = [n for n, f in zip(("output_hidden_states", "output_attentions", "output_router_logits"), flags) if f]
    asked += ["compute_mtp"] if flags[3] else []
    asked += ["labels"] if labels else []
    asked += ["packed sequences"] if packed else []
    asked += ["training mode"] if model.training else []
    if asked:
        s = model.stage
        raise NotImplementedError(
            f"forward on pipeline stage {s.stage} of {s.num_stages}: {', '.join(asked)} not supported; the "
            "forward of a model split into pipeline stages returns the logits in evaluation mode (what "
            "generate needs); train it with the trainer (glm52 train --pp), or build it with pp 1"
        )


@paddle.jit.not_to_static  # a check in Python: to_static's translation leaves it as it is
def _check_labels_shape(labels: paddle.Tensor, inputs: paddle.Tensor) -> None:
    """``labels`` are [B, S] integer ids as the input's first two axes (transformers 5.23 raises
    "Expected input batch_size (20) to match target batch_size (16)" otherwise, and a RuntimeError on
    float labels, which Paddle's cross entropy truncated); the loss read past their end."""
    want, got = list(inputs.shape[:2]), list(labels.shape)
    if -1 not in want + got and got != want:
        raise ValueError(f"forward: labels of shape {got}: expected {want}, the input's [batch, seq]")
    if labels.dtype not in (paddle.int64, paddle.int32, paddle.int16, paddle.int8, paddle.uint8):
        raise ValueError(f"forward: labels must be integer token ids, got {str(labels.dtype).replace('paddle.', '')}")


@paddle.jit.not_to_static  # plain Python: to_static's translation leaves it as it is
def _ignoring(labels: paddle.Tensor | None, ignore_index: int | None) -> paddle.Tensor | None:
    """transformers' ``forward(..., ignore_index=i)`` (passed on to its loss): labels equal to ``i``
    count in no loss, as the package's ``IGNORE_INDEX`` (-100)."""
    if labels is None or ignore_index is None or ignore_index == IGNORE_INDEX:
        return labels
    return paddle.where(labels == ignore_index, paddle.full_like(labels, IGNORE_INDEX), labels)


@paddle.jit.not_to_static  # a check in Python: to_static's translation leaves it as it is
def _keep_rows(logits_to_keep: int | paddle.Tensor) -> paddle.Tensor | None:
    """A 2-D ``logits_to_keep`` (transformers' ``slice_logits_to_keep``: [B, n] positions per row, or
    a bool [B, S] mask), else None; more dimensions are refused."""
    if not isinstance(logits_to_keep, paddle.Tensor) or logits_to_keep.ndim < 2:
        return None
    if logits_to_keep.ndim > 2:
        raise ValueError(
            f"logits_to_keep must be an int, a 1-D tensor of positions, [batch, n] positions or a bool "
            f"[batch, seq] mask, got shape {list(logits_to_keep.shape)}"
        )
    return logits_to_keep


@paddle.jit.not_to_static  # a check in Python: to_static's translation leaves it as it is
def _check_keep_with_labels(logits_to_keep: int, keep_index: paddle.Tensor | None, seq_len: int) -> None:
    """``logits_to_keep`` with ``labels``: the loss needs every position's logits. transformers 5.23
    computes the loss from the kept logits and so raises for fewer than all ("Expected input
    batch_size (2) to match target batch_size (20)"); refused here by name (it computed the whole
    sequence's loss beside the kept logits). Keeping all positions (an int >= S, or the tensor
    arange(S)) is the plain forward, in both."""
    if keep_index is None:
        if 0 < logits_to_keep < seq_len:
            kept = f"logits_to_keep={logits_to_keep} keeps the last {logits_to_keep}"
        else:
            return
    elif not paddle.in_dynamic_mode():  # a graph being built: the positions are not known yet
        return
    else:
        positions = keep_index.numpy().tolist()
        if [p % seq_len for p in positions] == list(range(seq_len)):
            return
        kept = f"logits_to_keep={positions if len(positions) <= 8 else positions[:8] + ['...']} keeps {len(positions)}"
    raise ValueError(
        f"forward: {kept} of the {seq_len} positions' logits, but labels need every position's for the loss "
        "(transformers raises too); pass logits_to_keep without labels, or labels without logits_to_keep"
    )


class GlmMoeDsaForCausalLM(GlmMoeDsaPreTrainedModel):
    """GLM-5.2 with its LM head, MTP heads and losses; the whole model or one pipeline stage of it.

    ``stage`` (default the whole model, or with a pipeline-parallel ``topology`` this rank's stage
    of an even split) says which layers it owns and whether it embeds tokens, holds the head and the
    MTP layers; ``topology`` (default one process) the groups its layers are split over.
    `add_mtp_loss=True` adds the scaled MTP loss into `out.loss`; a training forward in an indexer
    stage makes `out.loss` that stage's objective (:meth:`set_indexer_training`).
    """

    def __init__(
        self,
        config: GlmMoeDsaConfig,
        dtype: str = "float32",
        *,
        topology: Topology | None = None,
        stage: StageSpec | None = None,
    ) -> None:
        topo = topology or Topology.single()
        L, D = config.num_hidden_layers, config.num_mtp_layers
        if stage is None and topo.pp_size > 1:  # a stage never builds the other stages' layers
            stage = rank_spec(split_stages(L, topo.pp_size, has_mtp=D > 0), topo.pp_size, topo.stage)
        stage = stage or StageSpec.whole(L, D > 0)
        mtp_ids = list(range(L, L + D)) if stage.has_mtp else []
        name = dtype_name(dtype)  # a Paddle / numpy dtype or a name ("bf16"): kept as the name the forward compares
        if name is None:
            raise ValueError(f"GlmMoeDsaForCausalLM: dtype {dtype!r} is not a model dtype (float32, bfloat16, ...)")
        dtype = name
        cpu_bf16.check_model_dtype(dtype)
        if dtype == "bfloat16":
            cpu_bf16.install()  # a CPU-only Paddle build gets the bf16 kernels it lacks; no-op elsewhere
        with default_dtype(dtype):
            super().__init__()
            self.config = config
            self.model = GlmMoeDsaModel(
                config,
                topo,
                layer_ids=list(stage.layers) + mtp_ids,
                embedding=stage.has_embedding or stage.has_mtp,  # MTP embeds the shifted tokens
                norm=stage.has_head,
            )
            if stage.has_head:  # vocabulary split over TP: vocab-parallel logits
                self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, topo.sequence_parallel, topo=topo)
        self.stage, self.topology, self.tp_group = stage, topo, topo.tp_group
        self.distributed = topo.world_size > 1
        self.compute_dtype = dtype
        self.recompute = "none"  # the trainer's --recompute (parallel/recompute.py)
        self.recompute_every = 1  # every n-th decoder layer recomputed (activation_checkpointing_enable)

    # ------------------------------------------------------------------ indexer training, attention form
    @property
    def indexer_training(self) -> IndexerTraining:
        """How training forwards train the DSA indexer (default: the sparse stage when the config's
        ``indexer_loss_coeff`` > 0, else none); see :meth:`set_indexer_training`."""
        return self.model.indexer_run.training

    @property
    def carry_takes_gradient(self) -> bool:
        """Whether the hidden states a pipeline stage hands on take a gradient: not while every
        parameter that makes them is frozen (the indexer's warm-up; parallel/fleet_pipeline.py)."""
        return not self.indexer_training.dense

    def set_indexer_training(self, training: IndexerTraining | str, loss_coeff: float | None = None) -> None:
        """Train the indexer in ``training``'s stage (modeling/indexer_training.py, docs/indexer.md):
        ``"warmup"`` attends densely and freezes (``stop_gradient``) every parameter but the indexers
        that run; ``"sparse"`` and ``"none"`` leave every parameter trainable.  A training forward with
        labels then returns the stage's objective as ``out.loss`` (``glm52 train``'s, by
        :func:`objective_weights`): the warm-up's the dense KL alone (``out.lm_loss`` and
        ``out.mtp_loss`` reported), the sparse stage's LM (+ the scaled MTP loss with
        ``add_mtp_loss=True``) + ``loss_coeff`` x the sparse KL; ``loss_coeff`` (the sparse stage's
        only, > 0) defaults to the config's ``indexer_loss_coeff``, and a sparse forward with a
        coefficient of 0 is refused, as ``glm52 train --indexer-stage sparse`` refuses it."""
        if isinstance(training, str):
            training = IndexerTraining(training)
        if not isinstance(training, IndexerTraining):
            raise TypeError(f"set_indexer_training: a stage name (none, warmup, sparse), got {training!r}")
        if loss_coeff is not None and (isinstance(loss_coeff, bool) or not isinstance(loss_coeff, (int, float))):
            raise TypeError(f"set_indexer_training: loss_coeff must be a number, got {loss_coeff!r}")
        check_coeff_stage(training.stage, loss_coeff, "loss_coeff")
        if loss_coeff is not None:
            objective_weights("sparse", loss_coeff)  # refuses a coefficient that is not finite and > 0
        self._indexer_loss_coeff = None if loss_coeff is None else float(loss_coeff)
        self.model.indexer_run.training = training
        own = own_indexer_layers(self.config)
        for name, p in self.named_parameters():
            p.stop_gradient = training.dense and not trains_in_warmup(name, own)

    def indexer_objective_weights(self) -> tuple[float, float]:
        """(weight of the LM and MTP losses, weight of the indexer KL) in ``out.loss`` of a training
        forward in the indexer stage set (:meth:`set_indexer_training`)."""
        coeff = getattr(self, "_indexer_loss_coeff", None)
        coeff = float(getattr(self.config, "indexer_loss_coeff", 0.0) or 0.0) if coeff is None else coeff
        try:
            return objective_weights(self.indexer_training.stage, coeff)
        except ValueError as e:
            raise ValueError(
                f"{e}: give it as set_indexer_training('sparse', loss_coeff=c) (the config's indexer_loss_coeff "
                "is 0; PaddleFleet's default is 0.01, the GLM-5 recipe of Megatron-Bridge 0.001)"
            ) from None

    @property
    def loss_function(self) -> Callable[..., paddle.Tensor]:
        """transformers' ``model.loss_function``: the LM loss as a function of (logits, labels,
        vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None)
        (:func:`for_causal_lm_loss`), or the one assigned to it, which the forward then computes
        ``out.loss`` with, called as transformers calls it (the MTP and indexer losses stay this
        model's)."""
        return self.__dict__.get("_loss_function") or for_causal_lm_loss

    @loss_function.setter
    def loss_function(self, fn: Callable[..., paddle.Tensor] | None) -> None:
        self.__dict__["_loss_function"] = fn

    def set_attn_implementation(self, name: str) -> None:
        """Pick the attention form for the following forwards (transformers' name): "auto" (by
        size), "reference", "dense", "sparse" or "latent" (see modeling/attention_forms.py), or
        transformers' "eager" (the reference form) or "sdpa" ("auto"). It is the config key
        `attn_implementation`, so a config or Fleet-layout save after this records it; an
        official-layout checkpoint leaves it out (transformers refuses forms it lacks)."""
        name = HF_ATTN_IMPLEMENTATIONS.get(name, name)
        if name not in FORMS:
            raise ValueError(
                f"attn_implementation must be one of {FORMS} (or transformers' {tuple(HF_ATTN_IMPLEMENTATIONS)}), "
                f"got {name!r}"
            )
        self.config.attn_implementation = name

    # ------------------------------------------------------------------ the forward
    def _run(
        self,
        part: StageSpec,
        batch: Mapping[str, paddle.Tensor],
        hidden: paddle.Tensor | None,
        topk: paddle.Tensor | None,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        *,
        caches: Sequence[LayerCache] | None = None,
        with_mtp: bool = True,
        collect: list[paddle.Tensor] | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor | None, IndexerTerms, list[paddle.Tensor]]:
        """The one body every path runs, over ``part`` of the model (its layers, and the embedding,
        head and MTP where ``part`` has them): -> (hidden [B, S, H], final-normed on a part with
        the head; the top-k in effect; the indexer's losses (a training forward with an indexer
        stage: modeling/indexer_training.py, taken once every layer reusing a top-k has run); per
        MTP depth d the normed hidden state that predicts token i + d + 1).

        ``hidden`` / ``topk``: the carry from the stage before (or the caller's embeddings);
        ``batch``: ``input_ids``, ``attention_mask`` (key padding) and, under context parallel,
        ``cp_ids_<d>`` (the ids shifted by d over the whole sequence) for MTP; ``collect``: a list
        the embedding output and each layer's output are appended to."""
        # the indexer's warm-up: every layer is frozen, so they record no graph (the indexers' KL,
        # taken below from the layers' detached records, is the step's only graph)
        frozen = self.training and self.indexer_training.dense
        with frozen_training_forward() if frozen else contextlib.nullcontext():  # routers still count
            mask = batch.get("attention_mask")
            if part.has_embedding and hidden is None:
                hidden = self.model.embedding(batch["input_ids"])  # [B, S, H]
            if collect is not None:
                collect.append(hidden)
            hidden, topk, records = self.model.run_layers(
                part.layers,
                hidden,
                cos,
                sin,
                mask,
                topk,
                caches=caches,
                recompute=self.recompute,
                recompute_every=self.recompute_every,
                collect=collect,
            )
            mtp_hidden: list[paddle.Tensor] = []
            if part.has_head:
                hidden = self.model.norm(hidden)
                if part.has_mtp and with_mtp:
                    h = hidden
                    real = mask
                    if real is None:  # every token real, but the window's last d are not, for depth d
                        B, S = batch["input_ids"].shape
                        real = paddle.ones([B, S * self.topology.cp_size], "int64")  # by global position
                    for d, mtp in enumerate(self.model.mtp_layers, start=1):  # depth d sees token i + d
                        shifted = batch.get(f"cp_ids_{d}")
                        if shifted is None:
                            shifted = shift_labels(batch["input_ids"], d, fill=0)
                        valid = mtp_token_valid(real, d) if self.training else None  # the inputs' real tokens
                        h, _, rec = mtp(h, self.model.embedding(shifted), cos, sin, mask, topk, token_valid=valid)
                        if rec is not None:
                            records.append((self.config.num_hidden_layers + d - 1, rec))
                        mtp_hidden.append(mtp.norm(h))
        return hidden, topk, self.model.end_forward(records), mtp_hidden

    def forward_stage(
        self, carry: tuple[paddle.Tensor, ...] | None, batch: Mapping[str, paddle.Tensor], part: StageSpec | None = None
    ) -> StageOutput:
        """The trainer's stage contract: ``carry`` = (hidden, top-k) from the stage before (None on a
        stage that embeds), ``batch`` the micro-batch tensors; ``part`` runs only that chunk of the
        stage (a virtual pipeline stage), default all of it. -> the carry for the next stage, or on
        the last stage the loss terms (sums and token counts over vocab-parallel logits)."""
        spec = part or self.stage
        ids = batch["input_ids"]  # [B, S]
        cos, sin = self.model.rope(ids, batch.get("position_ids"))
        hidden, topk = None, None
        if not spec.has_embedding:
            hidden, topk = carry
            topk = topk if topk.shape[-1] else None
        hidden, topk, terms, mtp_hidden = self._run(spec, batch, hidden, topk, cos, sin)
        if not spec.has_head:
            empty = paddle.zeros([ids.shape[0], ids.shape[1], 0], dtype="int64")
            losses = causal_lm_losses([], batch, terms, True)
            return StageOutput(carry=(hidden, topk if topk is not None else empty), losses=losses or None)
        logits = [self.lm_head(h) for h in [hidden, *mtp_hidden]]  # vocab-parallel [B, S, V/tp]
        return StageOutput(losses=causal_lm_losses(logits, batch, terms, True, self.tp_group))

    def carry_topk_width(self, batch: Mapping[str, paddle.Tensor]) -> int:
        """The width k of the top-k ``[B, S, k]`` a decoder layer of this stage carries for ``batch``:
        ``min(index_topk, T)``, T the keys of the whole sequence (this rank's ``input_ids`` length
        times the context-parallel degree).  The interleaved pipeline sends every carry at this width
        (parallel/fleet_pipeline.py)."""
        return min(int(self.config.index_topk), int(batch["input_ids"].shape[1]) * self.topology.cp_size)

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Full-vocabulary logits [B, S, V] (the vocab-parallel ones gathered over TP)."""
        return comm.gather_from_tp(self.lm_head(hidden), axis=-1, group=self.tp_group)

    # ------------------------------------------------------------------ the stages of a pipeline in turn
    @property
    def pipelined(self) -> bool:
        """Whether this model is this rank's stage of a model split into pipeline stages over ranks
        (``from_pretrained(path, topology=...)`` with pp > 1): its forward and decode steps then run
        the stages in turn, each handing its carry to the next, and return the last stage's logits
        on every stage (as tensor parallel returns them on every rank), so that ``generate`` runs
        the same steps on every rank of the pipeline."""
        return self.stage.num_stages > 1 and self.topology.pp_size > 1

    def _run_stages(
        self, batch: Mapping[str, paddle.Tensor], inputs_embeds: paddle.Tensor | None, cos, sin, **kw
    ) -> tuple[paddle.Tensor | None, paddle.Tensor | None, IndexerTerms, list[paddle.Tensor]]:
        """``_run`` over the whole model: this rank's stage, and on a pipelined model (above) the
        carry (hidden, top-k) received from the stage before and handed to the next; a stage
        without the head returns hidden None."""
        if not self.pipelined:
            return self._run(self.stage, batch, inputs_embeds, None, cos, sin, **kw)
        tokens = batch["input_ids"] if inputs_embeds is None else inputs_embeds
        hidden, topk = (inputs_embeds, None) if self.stage.has_embedding else self._received_carry(tokens.shape[:2])
        hidden, topk, terms, mtp_hidden = self._run(self.stage, batch, hidden, topk, cos, sin, **kw)
        if not self.stage.has_head:
            self._hand_on(hidden, topk)
            hidden = None
        return hidden, topk, terms, mtp_hidden

    def _received_carry(self, tokens: Sequence[int]) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """The carry from the stage before, for this stage's input of ``tokens`` = [B, n]."""
        src, group = self.topology.stage_peer(self.stage.stage - 1)
        hidden, topk = comm.recv_tensors(src, group, 2)
        if list(hidden.shape[:2]) != list(tokens):  # every rank must run the same input (generate: the same prompts)
            raise ValueError(
                f"pipeline stage {self.stage.stage} was given input of [batch, seq] {list(tokens)} but stage "
                f"{self.stage.stage - 1} (rank {src}) ran {list(hidden.shape[:2])}: every rank of a pipeline "
                "must run the same input"
            )
        return hidden, topk if topk.shape[-1] else None

    def _hand_on(self, hidden: paddle.Tensor, topk: paddle.Tensor | None) -> None:
        dst, group = self.topology.stage_peer(self.stage.stage + 1)
        comm.send_tensors(
            [hidden, topk if topk is not None else paddle.zeros([*hidden.shape[:2], 0], "int64")], dst, group
        )

    def from_last_stage(self, x: paddle.Tensor | None) -> paddle.Tensor | None:
        """On a pipelined model, the last stage's ``x`` (the others pass None) on every stage; else ``x``."""
        if not self.pipelined:
            return x
        topo = self.topology
        return comm.broadcast_tensor(x if self.stage.has_head else None, topo.stage_ranks[-1], topo.pp_group)

    def forward(
        self,
        input_ids: paddle.Tensor | None = None,
        attention_mask: paddle.Tensor | None = None,
        position_ids: paddle.Tensor | None = None,
        past_key_values: DSACache | None = None,
        inputs_embeds: paddle.Tensor | None = None,
        labels: paddle.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | paddle.Tensor = 0,
        *,
        add_mtp_loss: bool = False,
        compute_mtp: bool | None = None,
        return_dict: bool | None = None,
        labels_shifted: bool = False,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        num_items_in_batch: int | paddle.Tensor | None = None,
        num_logits_to_keep: int | None = None,
        shift_labels: paddle.Tensor | None = None,
        output_router_logits: bool | None = None,
        cache_position: paddle.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput | tuple:
        """`use_cache` (default `config.use_cache`, as transformers, but only in evaluation mode on a
        whole one-process model: a training-mode forward never builds one, its step would hold every
        layer's latent rows without reading them and it records the indexer's training; under
        activation checkpointing a training forward builds none even with `use_cache=True`, as
        transformers, which warns and turns it off) without a cache: the plain forward (same logits, losses and MTP fields, bit for bit), which also returns
        a new `out.past_key_values`; `model(next_ids, past_key_values=out.past_key_values)` then
        continues it as transformers' `DynamicCache` (positions after the filled slots). A
        `past_key_values` cache given runs the decoding path: an empty one is filled by this forward
        (prefill, with rope positions counting each row's real tokens, as `generate` needs), a filled
        one makes `input_ids` the next tokens only. `logits_to_keep=n` computes the logits
        of the last n positions only (with `labels` it must keep every position: the loss needs them,
        and transformers raises too). `return_dict=False` returns `out.to_tuple()`.
        `labels_shifted=True`: ``labels[i]`` is position i's target already (Megatron's and
        PaddleFormers' convention: input tokens[:-1], labels tokens[1:]), not token i to be
        shifted as HF does; MTP depth d then predicts labels[i + d]. `shift_labels` (transformers' name
        for such targets, what its Trainer passes under context parallel) given with `labels` is
        taken instead of them, as `labels_shifted=True`; without `labels` there is no loss, as there.
        `output_hidden_states=True` (None: `config.output_hidden_states`, as transformers): `out.hidden_states`, transformers' tuple of num_hidden_layers + 1
        [B, S, H]: the embedding output, each decoder layer's output but the last, and the
        final-normed one. `output_attentions=True` (None: the config's): `out.attentions`, transformers'
        eager attention weights, per decoder layer [B, heads, S, T] (T keys: S, or the cache's filled
        slots when decoding), 0 off the keys the layer attended, whatever `attn_implementation`
        (transformers returns them with "eager" only); one process only. `num_items_in_batch` (transformers' Trainer): the LM loss is
        the summed cross entropy over it instead of the mean over the counted labels.
        `num_logits_to_keep` (the name before `logits_to_keep`, still in older callers) is accepted
        and ignored, as transformers 5.23 ignores it (all positions' logits; a warning says so).
        `output_router_logits=True` (None: the config's): `out.router_logits`, transformers' tuple of
        each decoder MoE layer's router logits [B * S, n_routed_experts] (fp32, before the sigmoid).
        Packed sequences (`position_ids` that restart within a row, no attention_mask, no cache, where
        transformers attends per sequence) attend and select their top-k per sequence
        (`_forward_packed`); the collator's `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` /
        `max_length_k` / `seq_idx` are taken beside them, refused by name otherwise; see docs/model.md.
        `cache_position` (older transformers' decoding loops pass it) is checked, never read: it must
        be the next slots of the cache (transformers 5.23 takes it and ignores it, even a wrong one;
        the positions come from the cache and the mask)."""
        if cache_position is not None:
            _check_cache_position(
                cache_position, input_ids if inputs_embeds is None else inputs_embeds, past_key_values
            )
        if self.training and self.is_activation_checkpointing and use_cache is not False:
            # transformers 5.23 (merge_with_config_defaults): a training forward under activation
            # checkpointing builds no cache, even asked to (the recomputed layers would fill it twice)
            if use_cache:
                warnings.warn(
                    "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.",
                    stacklevel=2,
                )
            use_cache = False
        ignore_index = kwargs.pop("ignore_index", None)
        custom_loss = _custom_loss_call(self, labels, shift_labels, labels_shifted, num_items_in_batch, ignore_index)
        labels, labels_shifted = _with_shift_labels(labels, shift_labels, labels_shifted)
        labels = _ignoring(labels, ignore_index)
        packing = None
        if position_ids is not None and attention_mask is None and past_key_values is None:
            hf_cache = use_cache if use_cache is not None else bool(getattr(self.config, "use_cache", False))
            if not hf_cache:  # where transformers reads restarting position_ids as packed sequences
                rows = (input_ids if inputs_embeds is None else inputs_embeds).shape[0]
                packing = _packing_of(self, position_ids, rows)
                if packing is not None and position_ids.shape[0] != rows:  # one row, expanded as there
                    position_ids = position_ids.expand([rows, position_ids.shape[1]])
        _check_packing_keys(kwargs, packing)
        if num_logits_to_keep is not None:
            warnings.warn(
                "forward: num_logits_to_keep is ignored, as in transformers 5.23 (all logits are computed); "
                "use logits_to_keep",
                stacklevel=2,
            )
        # not given: the config's, as transformers (from_pretrained(..., output_hidden_states=True))
        output_hidden_states = _flag(output_hidden_states, self.config, "output_hidden_states")
        if self.pipelined:
            flags = [output_hidden_states, _flag(output_attentions, self.config, "output_attentions")]
            flags += [_flag(output_router_logits, self.config, "output_router_logits"), compute_mtp]
            _check_pipelined_forward(self, labels is not None, packing is not None, flags)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward: give exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                f"attention_mask must be a [batch, seq] padding mask (1 = real token), got shape "
                f"{list(attention_mask.shape)}; 4-D attention masks are not supported (transformers takes them)"
            )
        tokens = input_ids if inputs_embeds is None else inputs_embeds
        if inputs_embeds is not None and str(inputs_embeds.dtype).replace("paddle.", "") != self.compute_dtype:
            raise ValueError(  # else a kernel error naming bf16 kernels; transformers refuses a bf16 model's too
                f"inputs_embeds is {str(inputs_embeds.dtype).replace('paddle.', '')}, the model computes in "
                f"{self.compute_dtype}: cast it first (inputs_embeds.astype('{self.compute_dtype}'))"
            )
        held = next((c.latent for c in getattr(past_key_values, "layers", ()) if c.latent is not None), None)
        if held is not None and str(held.dtype).replace("paddle.", "") != self.compute_dtype:
            raise ValueError(  # else a kernel error naming bf16 kernels or a dtype mismatch deep in the step
                f"past_key_values holds {str(held.dtype).replace('paddle.', '')} rows, the model computes in "
                f"{self.compute_dtype}: a cache of a model in another dtype"
            )
        if input_ids is not None:  # the embedding's rows (a caller may set a larger one), at least the vocab
            rows = getattr(self.get_input_embeddings(), "weight", None)
            _check_token_ids(input_ids, max(self.config.vocab_size, int(rows.shape[0]) if rows is not None else 0))
        if attention_mask is not None and past_key_values is None and attention_mask.shape[:2] != tokens.shape[:2]:
            raise ValueError(  # with a cache: [batch, past + seq], checked by the cache
                f"attention_mask shape {list(attention_mask.shape)} != the input's [batch, seq] "
                f"{list(tokens.shape[:2])}"
            )
        # transformers: a tensor of logits_to_keep is the sequence positions to keep, per row when
        # 2-D (a bool [B, S] keeps its True positions, flattened) (no if statement rebinding
        # logits_to_keep: to_static's whole-graph translation loses it)
        keep_rows = _keep_rows(logits_to_keep)
        keep_index = (
            logits_to_keep.astype("int64").reshape([-1])
            if isinstance(logits_to_keep, paddle.Tensor) and keep_rows is None
            else None
        )
        logits_to_keep = 0 if isinstance(logits_to_keep, paddle.Tensor) else logits_to_keep
        if labels is not None:
            _check_labels_shape(labels, tokens)
            if keep_rows is not None:
                raise ValueError(
                    f"forward: logits_to_keep of shape {list(keep_rows.shape)} with labels: the loss needs every "
                    "position's logits (transformers raises too)"
                )
            _check_keep_with_labels(logits_to_keep, keep_index, labels.shape[1])
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if labels is not None and labels_shifted:  # the targets as causal_lm_losses takes them already shifted
            for d in range(len(self.model.mtp_layers) + 1):
                batch[f"cp_target_{d + 1}"] = _shift_by(labels, d) if d else labels
        if labels is not None and packing is not None:  # an MTP target in the next sequence is none
            for d in range(1, len(self.model.mtp_layers) + 1):  # depth d's target: token i + d + 1, the
                # label of position i + d (shifted labels) or position i + d + 1's token (HF's labels)
                target = batch.get(f"cp_target_{d + 1}", _shift_by(labels, d + 1))
                same = packing.same(d if labels_shifted else d + 1)
                batch[f"cp_target_{d + 1}"] = paddle.where(same, target, paddle.full_like(target, IGNORE_INDEX))
        cache = past_key_values
        collect = [] if output_hidden_states else None
        routers = _start_router_logits(self, _flag(output_router_logits, self.config, "output_router_logits"))
        attentions = _start_attentions(self, _flag(output_attentions, self.config, "output_attentions"))
        if use_cache is None:  # transformers: config.use_cache; see the docstring for where it is off
            use_cache = bool(getattr(self.config, "use_cache", False)) and self._builds_cache_by_default()
        if cache is None and use_cache:  # transformers' forward: the plain forward, building a cache
            cache = DSACache.for_config(self.config, (input_ids if inputs_embeds is None else inputs_embeds).shape[0])
            hidden, terms, mtp_hidden = self._forward_filling(
                cache, batch, inputs_embeds, position_ids, labels, compute_mtp, collect
            )
        elif cache is not None:  # decoding over the caller's cache: no MTP
            B, n = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
            if cache.batch_size != B:
                raise ValueError(f"past_key_values holds {cache.batch_size} rows, the input has {B}")
            positions, key_valid = cache.begin(attention_mask, n)
            cos, sin = self.model.rotary_emb(positions if position_ids is None else position_ids)
            if cache.length > 0:  # new tokens against the cache: padding marked per cached slot
                batch["attention_mask"] = key_valid
            hidden, topk, terms, mtp_hidden = self._run_stages(
                batch, inputs_embeds, cos, sin, caches=cache.layers, with_mtp=False, collect=collect
            )
            cache.topk = topk if cache.keep_topk else None
            cache.advance(n)
        elif packing is not None:  # one sequence per row, then packed back
            compute_mtp = self._compute_mtp(compute_mtp, labels, input_ids)
            hidden, terms, mtp_hidden = self._forward_packed(
                packing, input_ids, inputs_embeds, position_ids, compute_mtp, collect
            )
        else:
            compute_mtp = self._compute_mtp(compute_mtp, labels, input_ids)
            cos, sin = self.model.rope(input_ids if inputs_embeds is None else inputs_embeds, position_ids)
            hidden, _, terms, mtp_hidden = self._run_stages(
                batch, inputs_embeds, cos, sin, with_mtp=compute_mtp, collect=collect
            )
        # the decoding path computes only the kept logits; the plain forward (with or without the cache it
        # builds) all of them, then slices: its kept logits are the full ones bit for bit
        # (on a pipelined model the last stage's, sent to every stage)
        sliced = past_key_values is not None and logits_to_keep and labels is None
        keep = hidden[:, -logits_to_keep:] if sliced and hidden is not None else hidden
        logits = self.from_last_stage(self.logits(keep) if keep is not None else None)
        out = CausalLMOutput(logits=logits, last_hidden_state=hidden, past_key_values=cache)
        out.router_logits = _stop_router_logits(self, routers)
        if packing is not None and out.router_logits is not None:  # the groups' slots -> the packed [B S, E]
            out.router_logits = tuple(packing.pack_slots(r).reshape([-1, r.shape[-1]]) for r in out.router_logits)
        out.attentions = _stop_attentions(self, attentions, packing)
        if collect is not None:  # transformers' last entry is the final-normed hidden
            out.hidden_states = tuple(collect[:-1]) + (hidden,)
        out.mtp_logits = [self.logits(h) for h in mtp_hidden]
        losses = causal_lm_losses([out.logits, *out.mtp_logits] if labels is not None else [], batch, terms, False)
        if "indexer_kl" in losses:
            out.indexer_loss = losses["indexer_kl"].sum
            out.indexer_recall = paddle.add_n([terms.recall[i] for i in sorted(terms.recall)]) / len(terms.recall)
        if labels is not None:
            out.loss = mean_loss(losses["lm"])  # 0 without a label (transformers' mean: NaN); see docs
            if num_items_in_batch is not None:  # transformers' Trainer: the sum over the step's count
                n = num_items_in_batch
                out.loss = losses["lm"].sum / (n.astype("float32") if isinstance(n, paddle.Tensor) else float(n))
            if out.mtp_logits:
                depth_losses = [mean_loss(losses[f"mtp_{d}"]) for d in range(1, len(out.mtp_logits) + 1)]
                out.mtp_loss = paddle.add_n(depth_losses) / len(depth_losses)
            if custom_loss is not None:  # model.loss_function set by the caller, as transformers calls it
                out.loss = custom_loss[0](logits=out.logits, vocab_size=self.config.vocab_size, **custom_loss[1])
            if out.indexer_loss is not None:  # an indexer stage's objective (docs/indexer.md, "The stages")
                lm_weight, kl_weight = self.indexer_objective_weights()
                out.lm_loss = out.loss
            if add_mtp_loss and out.mtp_loss is not None:
                out.loss = out.loss + self.config.mtp_loss_scaling_factor * out.mtp_loss
            if out.indexer_loss is not None:  # the warm-up: the KL alone (the frozen LM has no gradient)
                kl = kl_weight * out.indexer_loss
                out.loss = kl if lm_weight == 0 else out.loss + kl
        if logits_to_keep and out.logits is not None:
            out.logits = out.logits[:, -logits_to_keep:]
        if keep_index is not None:  # negative positions count from the end, as torch indexing
            out.logits = paddle.index_select(out.logits, keep_index % out.logits.shape[1], axis=1)
        if keep_rows is not None and keep_rows.dtype == paddle.bool:  # the True positions, [N, V]
            out.logits = out.logits[keep_rows]
        elif keep_rows is not None:  # [B, n] positions per row
            idx = (keep_rows.astype("int64") % out.logits.shape[1]).unsqueeze(-1)
            out.logits = paddle.take_along_axis(out.logits, idx, axis=1)
        if return_dict is None or return_dict:
            return out
        # to_tuple() spelled out: paddle.jit.to_static's bytecode tracer reads dataclass fields but
        # cannot call their methods
        fields_ = (out.loss, out.logits, out.past_key_values, out.hidden_states, out.attentions, out.router_logits)
        return tuple(v for v in fields_ if v is not None)

    def _forward_packed(
        self,
        packing: Packing,
        input_ids: paddle.Tensor | None,
        inputs_embeds: paddle.Tensor | None,
        position_ids: paddle.Tensor,
        compute_mtp: bool,
        collect: list | None,
    ) -> tuple[paddle.Tensor, IndexerTerms, list[paddle.Tensor]]:
        """Packed sequences (modeling/packing.py): each group of them as a padded batch, one sequence
        per row with its own positions, through the one body; the outputs packed back."""
        n = len(packing.groups)
        ids = packing.unpack(input_ids) if input_ids is not None else [None] * n
        embeds = packing.unpack(inputs_embeds) if inputs_embeds is not None else [None] * n
        positions = packing.unpack(position_ids.reshape([packing.batch, -1]))
        hidden, mtp_hidden, kept = [], [], []
        for g, group in enumerate(packing.groups):
            rows = {"input_ids": ids[g], "attention_mask": group.mask}
            cos, sin = self.model.rope(group.mask, positions[g])
            states = [] if collect is not None else None
            h, _, terms, mtp = self._run(
                self.stage, rows, embeds[g], None, cos, sin, with_mtp=compute_mtp, collect=states
            )
            hidden.append(h)
            mtp_hidden.append(mtp)
            kept.append(states)
        if collect is not None:
            collect.extend(packing.pack(list(layer)) for layer in zip(*kept))
        return packing.pack(hidden), terms, [packing.pack(list(depth)) for depth in zip(*mtp_hidden)]

    def _compute_mtp(self, compute_mtp: bool | None, labels: paddle.Tensor | None, input_ids: paddle.Tensor | None):
        """Whether a plain forward runs the MTP heads (default: with labels, from ids: they embed the
        shifted ids, none come with inputs_embeds)."""
        if compute_mtp is None:
            compute_mtp = labels is not None and input_ids is not None
        if compute_mtp and self.model.mtp_layers and input_ids is None:
            raise ValueError("the MTP heads need input_ids (they embed the shifted tokens)")
        return compute_mtp

    def _builds_cache_by_default(self) -> bool:
        """``use_cache=None`` builds a cache (with ``config.use_cache``) only where one can be read and
        costs nothing else: an evaluating (``eval()``) whole model, in one process or split over tensor
        and expert parallel ranks without sequence or context parallel (where a cache is refused),
        outside a graph being built. Not in training mode: a training step never reads it, it would
        hold every layer's latent rows for the step, and a forward filling a cache records nothing for
        the indexer's training (transformers turns it off in training under gradient checkpointing)."""
        whole = self.stage.has_embedding and self.stage.has_head
        whole = (whole and len(self.stage.layers) == self.config.num_hidden_layers) or self.pipelined
        readable = not self.topology.sequence_parallel and self.topology.cp_size == 1
        return whole and readable and not self.training and not building_graph()

    def _forward_filling(
        self,
        cache: DSACache,
        batch: dict,
        inputs_embeds: paddle.Tensor | None,
        position_ids: paddle.Tensor | None,
        labels: paddle.Tensor | None,
        compute_mtp: bool | None,
        collect: list | None,
    ) -> tuple[paddle.Tensor, IndexerTerms, list[paddle.Tensor]]:
        """transformers' forward with ``use_cache`` and no cache given: the plain forward (its rope
        positions, position_ids or arange(S); its mask; MTP as without a cache: logits and losses bit
        for bit) that also fills the new ``cache``. The cache then continues as transformers'
        ``DynamicCache`` does: the next tokens' default positions follow the S filled slots."""
        x = batch["input_ids"] if inputs_embeds is None else inputs_embeds
        B, n = x.shape[:2]
        compute_mtp = self._compute_mtp(compute_mtp, labels, batch["input_ids"])
        cache.begin(batch["attention_mask"], n)  # the slots, and which hold pads (masked in later steps)
        cos, sin = self.model.rope(x, position_ids)
        hidden, topk, terms, mtp_hidden = self._run_stages(
            batch, inputs_embeds, cos, sin, caches=cache.layers, with_mtp=compute_mtp, collect=collect
        )
        cache.topk = topk if cache.keep_topk else None
        cache.advance(n)
        cache.positions = paddle.full([B], n, dtype="int64")  # transformers: past_seen_tokens + arange
        return hidden, terms, mtp_hidden

    # ------------------------------------------------------------------ decoding
    def decode_step(
        self, input_ids: paddle.Tensor, positions: paddle.Tensor, slots: paddle.Tensor, cache: DSACache
    ) -> paddle.Tensor:
        """One decode step: logits [B, V] of the last of the new tokens input_ids [B, n], which sit
        at rope ``positions`` [B, n] and cache ``slots`` [n] (both from ``cache.begin``; the caller
        then calls ``cache.advance(n)``). The same layers' code as ``forward`` with a filled cache,
        without its output bookkeeping; it reads the cache only through tensors of fixed shapes
        (its buffers and ``key_valid`` at their capacity), so ``paddle.jit.to_static`` captures it
        once for every step of a generation (``generation.generate(..., decode_step=...)``)."""
        if self.distributed and building_graph():
            raise NotImplementedError(
                "decode_step traced by paddle.jit.to_static on a model split over ranks: Paddle 3.3's "
                "collectives take no process group inside a static graph; decode eagerly (no decode_step)"
            )
        cos, sin = self.model.rotary_emb(positions)
        if self.stage.has_embedding:
            hidden, topk = self.model.embedding(input_ids), None
        else:  # a later pipeline stage
            hidden, topk = self._received_carry(input_ids.shape[:2])
        for i in self.stage.layers:
            hidden, topk = self.model.layers[i].decode(hidden, cos, sin, cache.key_valid, topk, cache.layers[i], slots)
        if not self.stage.has_head:
            self._hand_on(hidden, topk)
            return self.from_last_stage(None)
        return self.from_last_stage(self.logits(self.model.norm(hidden[:, -1:]))[:, -1])
