"""``generate``: the settings resolved, the prompt's forward, then greedy decoding, sampling or beam
search one token per step, with transformers' outputs; and ``generate_speculative`` (MTP drafts)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import GenerationConfig, eos_list, generation_config_of, resolve_settings
from .decoders import AssistantDecoder, Decoder, DraftingDecoder, LookupDecoder, MtpDecoder, unconditional_decoder
from .logits_process import Hooks, Processors

if TYPE_CHECKING:
    import paddle
# paddle is imported inside the functions: the CLI imports this package at start-up


@dataclass
class GenerateDecoderOnlyOutput:
    """``return_dict_in_generate=True``: ``sequences`` [B, S + n] (beam search: also ``sequences_scores``
    [B * num_return_sequences] and ``beam_indices``, as HF's beam output); per step the processed scores
    (``output_scores``) and the raw logits (``output_logits``), each [B, V], as HF returns them. Read as
    HF's ModelOutput: ``out["scores"]`` / ``out[1]`` / ``keys()`` / ``to_tuple()`` see the fields that are
    set (``hidden_states`` with ``output_hidden_states``: per step the forward's tuple of num_hidden_layers
    + 1 [B, L, H], L the prompt's length first, then 1, or the whole sequence without a cache; ``attentions``
    with ``output_attentions``: per step the forward's tuple of num_hidden_layers [B, heads, L, T], T the keys)."""

    sequences: Any
    sequences_scores: Any = None
    scores: tuple | None = None
    logits: tuple | None = None
    beam_indices: Any = None
    attentions: tuple | None = None
    hidden_states: tuple | None = None
    past_key_values: Any = None

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]


def generate(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor | None = None,
    attention_mask: paddle.Tensor | None = None,
    generation_config: GenerationConfig | dict | None = None,
    *,
    seed: int | None = None,
    streamer: Callable[[np.ndarray], None] | Any | None = None,
    tokenizer: Any = None,
    decode_step: Callable[..., paddle.Tensor] | None = None,
    inputs_embeds: paddle.Tensor | None = None,
    logits_processor: Sequence[Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]] | None = None,
    stopping_criteria: Sequence[Callable[[paddle.Tensor, Any], Any]] | None = None,
    prefix_allowed_tokens_fn: Callable[[int, paddle.Tensor], Sequence[int]] | None = None,
    stats: dict | None = None,
    negative_prompt_ids: paddle.Tensor | None = None,
    negative_prompt_attention_mask: paddle.Tensor | None = None,
    assistant_model: paddle.nn.Layer | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """The prompt and up to ``max_new_tokens`` new tokens per row, [B * num_return_sequences, S + n] int64
    (a :class:`GenerateDecoderOnlyOutput` with ``return_dict_in_generate=True``); ``kwargs``: HF's options
    (docs/model.md, "Decoding"). Each token after the first goes through ``model.decode_step`` (or
    ``decode_step``, same arguments: its ``paddle.jit.to_static`` capture, a :class:`CudaGraphDecodeStep`)
    on a cache allocated once for the whole generation, so the step's shapes never change.
    ``inputs_embeds`` [B, S, H] (as transformers'): the prompt's embeddings are what the model reads;
    without ``input_ids`` only the new tokens are returned [B, n], and the prompt is nothing the
    repetition penalty or a stop string sees (HF's rules).
    ``logits_processor`` / ``stopping_criteria`` / ``prefix_allowed_tokens_fn``: transformers' hooks with
    Paddle tensors (``proc(input_ids [N, L], scores [N, V]) -> scores``, ``crit(input_ids, scores) -> bool
    or [N] bool``, ``fn(batch_id, row_ids) -> allowed ids``), called where transformers calls them.
    ``stats`` (a dict) receives a drafter's counts (``use_mtp`` / ``prompt_lookup_num_tokens``):
    drafted, accepted, acceptance_rate, main_forwards. ``negative_prompt_ids`` / ``_attention_mask``
    [B, L]: what ``guidance_scale`` conditions away from (default: each row's last prompt token).
    ``assistant_model``: a smaller GLM model of the same vocabulary that drafts (transformers' assisted
    decoding; ``num_assistant_tokens``, its schedule and ``assistant_confidence_threshold``).
    ``past_key_values``: a cache of this model (an earlier ``generate``'s ``out.past_key_values``, or a
    forward's) holding the first ``cache.get_seq_length()`` tokens of ``input_ids`` (or of
    ``inputs_embeds``), as transformers continues a conversation: only the rest is prefilled, into
    that cache (grown in place and returned), the attention_mask covering the whole input; or, as
    there too, ``input_ids`` the uncached tokens only with an attention_mask over the cached ones and
    them. Greedy or sampling with one sequence per row (see ``_cached_prefix`` for what is refused).
    """
    import paddle

    started = time.time()  # max_time counts from here, as transformers' MaxTimeCriteria from generate's start
    _check_decodable(model)
    hooks = Hooks.checked(logits_processor, stopping_criteria, prefix_allowed_tokens_fn)

    if inputs_embeds is not None:
        if inputs_embeds.ndim != 3:
            raise ValueError(f"generate: inputs_embeds must be [batch, seq, hidden], got {list(inputs_embeds.shape)}")
        if input_ids is not None and list(input_ids.shape) != list(inputs_embeds.shape[:2]):
            raise ValueError(
                f"generate: input_ids shape {list(input_ids.shape)} != inputs_embeds' [batch, seq] "
                f"{list(inputs_embeds.shape[:2])}"
            )
        if input_ids is None:  # transformers: an empty prompt of ids; the output holds the new tokens only
            input_ids = paddle.zeros([inputs_embeds.shape[0], 0], dtype="int64")
    elif input_ids is None:
        raise ValueError("generate: give input_ids or inputs_embeds")
    if input_ids.ndim != 2:
        raise ValueError(f"generate: input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
    B, S = input_ids.shape if inputs_embeds is None else inputs_embeds.shape[:2]
    ids_given = input_ids.shape[1] == S  # False: inputs_embeds alone
    own = getattr(model, "generation_config", None)  # the model's defaults fill what a passed config leaves unset (HF)
    own = GenerationConfig.from_dict(own, "model.generation_config") if isinstance(own, dict) else own
    own = own if isinstance(own, GenerationConfig) else generation_config_of(model)
    if not isinstance(generation_config, (GenerationConfig, dict, type(None))) and hasattr(
        generation_config, "to_dict"
    ):
        generation_config = generation_config.to_dict()  # transformers' GenerationConfig: its None keys are unset
    if isinstance(generation_config, dict):
        generation_config = GenerationConfig.from_dict(generation_config, source="generation_config argument")
    gc = own if generation_config is None else generation_config.over(own)
    s = resolve_settings(model.config, gc, kwargs, S)  # before any allocation
    cached = 0  # the input's first tokens the cache holds: not prefilled again
    if past_key_values is not None:
        cached = _cached_prefix(model, past_key_values, s, B, S, attention_mask, assistant_model)
    full_mask = attention_mask  # with a cache and uncached input_ids only: over the cached tokens too
    if attention_mask is not None and past_key_values is not None and attention_mask.shape[1] != S:
        attention_mask = attention_mask[:, -S:]  # the input's columns (_cached_prefix checked the shape)
    if attention_mask is not None and list(attention_mask.shape) != [B, S]:
        raise ValueError(f"generate: attention_mask shape {list(attention_mask.shape)} != input_ids shape {[B, S]}")
    if attention_mask is None and ids_given and S > 0:
        pad = kwargs.get("pad_token_id")
        attention_mask = full_mask = _mask_from_padding(
            input_ids, gc.pad_token_id if pad is None else pad, s.eos_token_id
        )
    if s.stop_strings and tokenizer is None:
        raise ValueError("generate: stop_strings need tokenizer= (the tokenizer that decodes the new tokens)")
    if s.num_beams > 1 and streamer is not None:  # as transformers
        raise ValueError("generate: beam search (num_beams > 1) takes no streamer")
    input_ids = input_ids.astype("int64")
    copies = s.num_beams if s.num_beams > 1 else s.num_return_sequences  # rows per prompt
    if copies > 1:
        input_ids = paddle.repeat_interleave(input_ids, copies, axis=0)
        if attention_mask is not None:  # no past_key_values here (refused): the mask is the input's
            attention_mask = full_mask = paddle.repeat_interleave(attention_mask, copies, axis=0)
        if inputs_embeds is not None:
            inputs_embeds = paddle.repeat_interleave(inputs_embeds, copies, axis=0)
        B = input_ids.shape[0]
    # right padding: each row's first new token follows its last real token, not the padded end
    # (HF continues from the pad position and warns); later tokens are real, the pads stay masked
    last_real = None
    if attention_mask is not None:
        real = attention_mask.numpy() != 0  # one host read of the mask, before any step
        if not real[:, -1].all():
            last = np.where(real.any(1), S - 1 - np.argmax(real[:, ::-1], axis=1), S - 1)
            if cached and (last < cached).any():  # right padding over every uncached token of a row
                r = int(np.argmax(last < cached))
                raise ValueError(
                    f"generate: row {r}'s tokens after the {cached} cached ones are all padding (its last real "
                    "token is in past_key_values): nothing of it to prefill"
                )
            last_real = paddle.to_tensor(last)
    tails = None
    if s.stop_strings:  # HF matches a stop string against the sequence's end, prompt included: each row's
        # last real prompt tokens (as many as the longest stop string has characters) and their text
        k, host_ids = max(map(len, s.stop_strings)), input_ids.numpy()
        real_rows = (
            np.ones(host_ids.shape, bool) if attention_mask is None or not ids_given else attention_mask.numpy() != 0
        )
        tails = [[int(t) for t in row[keep][-k:]] for row, keep in zip(host_ids, real_rows)]
        tails = [(t, len(tokenizer.decode(t))) for t in tails]
    groups = _generation_groups(model)
    rng = np.random.default_rng(_agreed_seed(seed, groups) if groups else seed)
    # transformers' streamer protocol (TextStreamer): put() the prompt, then each step's ids, then end();
    # a plain callable gets each step's ids
    put, end = getattr(streamer, "put", streamer), getattr(streamer, "end", lambda: None)
    if hasattr(streamer, "put"):
        put(input_ids.numpy())
    V = int(model.config.vocab_size)
    procs = Processors(s, input_ids, attention_mask, ids_given, V, hooks, started)
    if groups:
        procs.agree_timeout = lambda timed_out: bool(_agreed_max(int(timed_out), groups))
    if s.guidance_scale is not None:
        procs.guidance = unconditional_decoder(
            model, s, input_ids, negative_prompt_ids, negative_prompt_attention_mask, copies
        )
    elif negative_prompt_ids is not None:
        raise ValueError("generate: negative_prompt_ids is read by guidance_scale (not 1), which is not set")
    if assistant_model is not None and (s.prompt_lookup_num_tokens or s.use_mtp or s.num_beams > 1 or copies > 1):
        raise ValueError(
            "generate: assistant_model drafts for one sequence; it takes no num_beams or num_return_sequences, "
            "and one drafter (prompt_lookup_num_tokens, use_mtp or assistant_model)"
        )
    if assistant_model is not None and s.guidance_scale is not None:
        raise ValueError("generate: guidance_scale takes no drafter (assistant_model)")
    if s.prompt_lookup_num_tokens or s.use_mtp or assistant_model is not None:
        name = (
            "prompt_lookup_num_tokens" if s.prompt_lookup_num_tokens else "use_mtp" if s.use_mtp else "assistant_model"
        )
        if B != 1 or not s.use_cache or inputs_embeds is not None or s.output_hidden_states or s.output_attentions:
            raise ValueError(  # transformers: "assisted generate is only supported for batch_size = 1"
                f"generate: {name} drafts from one row's ids: one prompt of ids, use_cache=True, "
                f"no output_hidden_states or output_attentions (got {B} rows, use_cache={s.use_cache})"
            )
        if s.prompt_lookup_num_tokens:
            decoder = LookupDecoder(model, input_ids, attention_mask, last_real, s)
        elif s.use_mtp:
            decoder = MtpDecoder(model, input_ids, attention_mask)
        else:
            decoder = AssistantDecoder(model, assistant_model, input_ids, attention_mask, last_real, s)
    else:
        decoder = Decoder(model, s.use_cache, input_ids, full_mask, inputs_embeds, decode_step, last_real)
        decoder.past, decoder.cached = past_key_values, cached
    decoder.hidden = [] if s.return_dict_in_generate and s.output_hidden_states else None
    decoder.attentions = [] if s.return_dict_in_generate and s.output_attentions else None
    with _inference(model):
        if s.num_beams > 1:
            out = _beam_search(decoder, procs, s, input_ids, rng, tokenizer, tails)
        else:
            out = _sample(decoder, procs, s, input_ids, rng, put, tokenizer, tails)
    if stats is not None and isinstance(decoder, (DraftingDecoder, MtpDecoder)):
        stats.update(_counts(decoder.stats))
    end()
    return out


@contextlib.contextmanager
def _inference(model: paddle.nn.Layer):
    """The model in eval mode without autograd for a generation, its training mode given back."""
    import paddle

    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def _counts(stats: dict) -> dict:
    """A drafting decoder's counts with its acceptance rate."""
    return stats | {"acceptance_rate": stats["accepted"] / max(stats["drafted"], 1)}


def _stop_string_hits(tokenizer: Any, stops: list[str], tails: list, rows: list[tuple[int, Any]]) -> list[bool]:
    """Per (prompt row, its new tokens): whether a stop string occurs in the text of the row's prompt
    tail and those tokens, ending after the prompt (transformers' StopStringCriteria: the string
    may begin in the prompt once it overlaps the new tokens; "" ends every row at its first token)."""
    if "" in stops:
        return [True] * len(rows)
    hits = []
    for r, new in rows:
        tail, n = tails[r]
        text = tokenizer.decode(tail + [int(t) for t in new])
        hits.append(any(text.find(stop, max(n - len(stop) + 1, 0)) >= 0 for stop in stops))
    return hits


def _beam_search(
    decoder: Decoder,
    procs: Processors,
    s: GenerationConfig,
    input_ids: paddle.Tensor,
    rng: np.random.Generator,
    tokenizer: Any = None,
    tails: list | None = None,
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """transformers 5.23's beam search (``num_beams`` K > 1, no sampling), its rules on the host:
    each step the processed log-probabilities plus each beam's score, the best max(2, 1 + #EOS) x K
    continuations over all K beams; those ending in an EOS or at the length limit are finished
    (among the first K, scored / generated length ** length_penalty, the K best finished kept), the
    K best others run on (the cache and the processors' rows reordered to them). Stops as
    transformers: every continuation finished, all K finished with ``early_stopping=True``, or (its
    heuristic, with ``"never"`` judging by the longest length when length_penalty > 0) no running
    beam can beat the worst finished one. With ``do_sample`` (beam sampling) the continuations are
    drawn without replacement from the softmax of those sums (the warpers applied to the
    log-probabilities, keeping 1 + #EOS tokens), in the order drawn, as transformers' multinomial.
    A stop string ends a continuation as an EOS does (transformers applies its stopping criteria to
    every continuation)."""
    import paddle

    from ..ops import log_softmax
    from ..ops.selection import topk

    BK, S = input_ids.shape
    K, n_new, lp, stop = s.num_beams, s.max_new_tokens, s.length_penalty, s.early_stopping
    B, max_len = BK // K, S + n_new
    eos = s.eos_token_id or []
    keep = max(2, 1 + len(eos)) * K
    top_mask = np.arange(keep) < K  # only the first K continuations can finish
    # what fills a sequence that finished early: transformers' `pad or eos[0]` (pad 0 counts as unset;
    # without either, -1: transformers fails there)
    fill = s.pad_token_id or (eos[0] if eos else -1)
    run_seq = np.full((B, K, max_len), fill, np.int64)
    run_seq[:, :, :S] = input_ids.numpy().reshape(B, K, S)
    run_scores = np.zeros((B, K), np.float32)
    run_scores[:, 1:] = -1e9  # the copies of the prompt: one beam starts
    run_src = np.full((B, K, n_new), -1, np.int64)  # per new token: the flat row it continued
    fin_seq, fin_src = run_seq.copy(), run_src.copy()
    fin_scores, fin_done = np.full((B, K), -1e9, np.float32), np.zeros((B, K), bool)
    improvable = np.ones((B, 1), bool)  # the heuristic: a running beam may still beat a finished one
    rows = np.arange(B)[:, None]
    scores, raw = [], []
    last = decoder.prefill(n_new)
    for step in range(n_new):
        cur = S + step
        logits = last.astype("float32")
        if s.output_logits:
            raw.append(logits)
        logp = procs(log_softmax(logits, axis=-1), step)
        if s.output_scores:
            scores.append(logp)
        V = logp.shape[-1]
        total = logp.reshape([B, K, V]) + paddle.to_tensor(run_scores).unsqueeze(-1)
        total = total.reshape([B, K * V])
        if bool(paddle.isnan(total).any()):
            raise _no_valid_scores(f"beam search's step {step} has NaN scores")
        if s.do_sample and bool((total == math.inf).any()):  # softmax makes it NaN: transformers' multinomial fails
            raise _no_valid_scores(f"beam sampling's step {step} has +inf scores")
        if s.do_sample:
            idx = _draw_without_replacement(total, keep, rng)
            vals = paddle.take_along_axis(total, paddle.to_tensor(idx), axis=-1).numpy()
        else:
            vals, idx = (t.numpy() for t in topk(total, keep))  # ties in torch.topk's order, as HF's
        # fewer continuations with a probability than drawn (top_k=1, a forced token): the rest come last
        # with -inf scores and never win, as transformers' multinomial without replacement gives them
        # on the CPU; a prompt with none at all has nothing to continue with
        if s.do_sample and not np.isfinite(vals).any(axis=-1).all():
            raise ValueError(
                f"generate: beam sampling found no continuation with a probability at step {step} after the "
                f"warpers (top_k={s.top_k}, top_p={s.top_p} ...)"
            )
        beam, tok = idx // V, idx % V
        cand_seq, cand_src = run_seq[rows, beam], run_src[rows, beam]
        cand_seq[:, :, cur] = tok
        cand_src[:, :, step] = beam + rows * K
        hits = np.isin(tok, eos) | (cur + 1 >= max_len)
        if s.stop_strings:
            rows_new = [(b * K, cand_seq[b, j, S : cur + 1]) for b in range(B) for j in range(keep)]
            hits |= np.array(_stop_string_hits(tokenizer, s.stop_strings, tails, rows_new)).reshape(B, keep)
        if procs.stops:  # the caller's criteria and max_time end continuations too, as in transformers
            cand = (
                paddle.to_tensor(cand_seq[:, :, : cur + 1].reshape(B * keep, cur + 1))
                if procs.ids is not None
                else None
            )
            hit = procs.stopped(
                cand, tuple(scores) if s.return_dict_in_generate and s.output_scores else None, B * keep
            )
            hits = hits if hit is None else hits | hit.numpy().reshape(B, keep)
        # the running beams: the K best continuations that did not finish
        running = vals + hits.astype(np.float32) * np.float32(-1e9)
        pick = _top(running, K)
        run_seq, run_scores, run_src = cand_seq[rows, pick], running[rows, pick], cand_src[rows, pick]
        # the finished: the K best of those kept and those just finished (length-normalised)
        done_now = hits & top_mask
        ended = vals / np.float32((cur + 1 - S) ** lp)
        ended += (fin_done.all(1, keepdims=True) & (stop is True)).astype(np.float32) * np.float32(-1e9)
        ended += (~improvable).astype(np.float32) * np.float32(-1e9)
        ended += (~done_now).astype(np.float32) * np.float32(-1e9)
        merged = np.concatenate([fin_scores, ended], axis=1)
        pick = _top(merged, K)
        fin_seq = np.concatenate([fin_seq, cand_seq], axis=1)[rows, pick]
        fin_src = np.concatenate([fin_src, cand_src], axis=1)[rows, pick]
        fin_done = np.concatenate([fin_done, done_now], axis=1)[rows, pick]
        fin_scores = merged[rows, pick]
        # the rows continue the beams they extend
        src = run_src[:, :, step].reshape(BK)
        procs.reorder(src)
        decoder.reorder(paddle.to_tensor(src))
        nxt_host = run_seq[:, :, cur].reshape(BK)
        nxt = paddle.to_tensor(nxt_host)
        procs.append(nxt, nxt_host)
        best_len = (max_len - S) if stop == "never" and lp > 0.0 else (cur + 1 - S)
        best = run_scores[:, :1] / np.float32(best_len**lp)
        worst = np.where(fin_done, fin_scores.min(1, keepdims=True), np.float32(-1e9))
        improvable = improvable & (best > worst).any(1, keepdims=True)
        if not improvable.any() or (fin_done.all() and stop is True) or hits.all():
            break
        last = decoder.next(nxt)
    nrs = s.num_return_sequences
    seq, src = fin_seq[:, :nrs].reshape(B * nrs, max_len), fin_src[:, :nrs].reshape(B * nrs, n_new)
    made = int((src >= 0).sum(1).max())
    sequences = paddle.to_tensor(seq[:, : S + made])
    if not s.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=paddle.to_tensor(fin_scores[:, :nrs].reshape(-1)) if s.output_scores else None,
        scores=tuple(scores) if s.output_scores else None,
        logits=tuple(raw) if s.output_logits else None,
        beam_indices=paddle.to_tensor(src[:, :made]),
        hidden_states=None if decoder.hidden is None else tuple(decoder.hidden),
        attentions=None if decoder.attentions is None else tuple(decoder.attentions),
        past_key_values=decoder.cache,
    )


def _cached_prefix(model, cache, s: GenerationConfig, B: int, S: int, mask, assistant) -> int:
    """How many of the input's first S tokens ``cache`` (``past_key_values``) holds, to be skipped by
    the prefill, as transformers 5.23's ``_prefill`` slices them: ``cache.get_seq_length()``, or 0
    when the attention_mask is longer than the input by that many columns (the input is then the
    uncached tokens only). Refused by name: what is no cache of this model, another batch size, a
    cache holding the whole input or more (transformers then feeds the whole input again, or a
    part of it, and returns other tokens than without the cache, measured), and the options
    that cannot continue it (beams and several sequences per row: transformers fails on the
    cache's batch size; a drafter, guidance_scale or use_cache=False: transformers' tokens then
    differ from a fresh generate's, measured for prompt lookup and use_cache=False)."""
    from ..modeling.cache import DSACache

    if not isinstance(cache, DSACache):
        raise ValueError(
            f"generate: past_key_values must be this model's cache (a DSACache: an earlier generate's "
            f"out.past_key_values or a forward's), got {type(cache).__name__}"
        )
    config = model.config
    layers = int(config.num_hidden_layers)
    width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    held = next((layer.latent for layer in cache.layers if layer.latent is not None), None)
    if len(cache) != layers or (held is not None and held.shape[2] != width):
        got = f"{len(cache)} layers" + ("" if held is None else f" of latent rows {held.shape[2]} wide")
        raise ValueError(
            f"generate: past_key_values holds {got}, this model {layers} layers of {width} (kv_lora_rank + "
            "qk_rope_head_dim): a cache of another model"
        )
    for name, used in (
        ("num_beams > 1", s.num_beams > 1),
        ("num_return_sequences > 1", s.num_return_sequences > 1),
        ("use_cache=False", not s.use_cache),
        ("use_mtp", s.use_mtp),
        ("prompt_lookup_num_tokens", bool(s.prompt_lookup_num_tokens)),
        ("assistant_model", assistant is not None),
        ("guidance_scale", s.guidance_scale is not None),
    ):
        if used:
            raise ValueError(
                f"generate: past_key_values (continuing a cache) takes no {name}: greedy decoding or sampling "
                "of one sequence per row continues it"
            )
    if cache.batch_size != B:
        raise ValueError(f"generate: past_key_values holds {cache.batch_size} rows, the input {B}")
    n = cache.get_seq_length()
    if mask is not None and n and list(mask.shape) == [B, n + S]:
        return 0  # transformers' other form: input_ids the uncached tokens, the mask over all
    if mask is not None and list(mask.shape) != [B, S]:
        raise ValueError(
            f"generate: attention_mask shape {list(mask.shape)}: with past_key_values of {n} tokens, expected "
            f"{[B, S]} (input_ids the whole sequence) or {[B, n + S]} (input_ids the uncached tokens only)"
        )
    if n >= S:
        raise ValueError(
            f"generate: past_key_values holds {n} tokens, the input {S}: the input must be the cached tokens "
            f"and at least one more (nothing else to prefill; cache.crop({S - 1 - n}) forgets the input's "
            "last token and what follows it, to be fed again)"
        )
    return n


def _check_decodable(model: paddle.nn.Layer) -> None:
    """A pipeline stage holds some of the layers, the embedding or the head only, and a model built
    with sequence or context parallel splits every sequence over ranks (a decode step's few tokens,
    or a length the group does not divide, cannot be split): neither can decode."""
    topo = getattr(model, "topology", None)
    if topo is not None and (topo.sequence_parallel or topo.cp_size > 1):
        raise NotImplementedError(
            f"generate: this model splits its sequences over ranks (sequence_parallel={topo.sequence_parallel}, "
            f"cp={topo.cp_size}); build it for generation with both off (from_pretrained(path, topology=...) "
            "of tensor and expert parallel only)"
        )
    stage = getattr(model, "stage", None)
    if stage is None or getattr(model, "pipelined", False):  # a pipeline's stages run in turn each step
        return
    whole = stage.has_embedding and stage.has_head and len(stage.layers) == model.config.num_hidden_layers
    if not whole:
        first, last = (stage.layers[0], stage.layers[-1]) if stage.layers else (None, None)
        raise NotImplementedError(
            f"generate: this model is a pipeline stage (decoder layers {first}..{last} of "
            f"{model.config.num_hidden_layers}, embedding {stage.has_embedding}, LM head {stage.has_head}); "
            "generate runs on a model with every layer (pipeline parallel size 1; tensor and expert "
            "parallel split it over ranks instead)"
        )


def _mask_from_padding(input_ids: paddle.Tensor, pad: int | None, eos: list[int]) -> paddle.Tensor | None:
    """The attention_mask transformers' ``generate`` gives a prompt passed without one
    (``_prepare_attention_mask_for_generation``): ``input_ids != pad`` where the prompt holds the pad
    token and the pad token is no EOS; else None, every token real."""
    import paddle

    if pad is None or pad in eos:
        return None
    real = input_ids.numpy() != pad
    return None if real.all() else paddle.to_tensor(real.astype("int64"))


def _generation_groups(model: paddle.nn.Layer) -> list[Any]:
    """The ranks that run one generation together on a model split over ranks, as the groups whose
    product they are (none in one process): the tensor-parallel group and the pipeline group, or
    every rank of the job when experts are laid out beyond the tensor-parallel group (expert
    parallel: the ranks' MoE layers exchange tokens each step). They run the same steps on the same
    logits, so they must choose the same tokens and stop together: a rank that went on alone would
    wait on the others' collectives forever."""
    topo = getattr(model, "topology", None)
    if topo is None or topo.world_size == 1:
        return []
    if topo.tp_size % (topo.size("ep") * topo.size("etp")):  # the expert groups (etp fastest) leave the tp group
        import paddle.distributed as dist

        return [dist.get_group(0)]  # the job's global group
    return [g for g, n in ((topo.tp_group, topo.tp_size), (topo.pp_group, topo.pp_size)) if n > 1]


def _agreed_seed(seed: int | None, groups: list[Any]) -> int:
    """``seed``, or without one a fresh seed drawn by the first rank and sent to the others (over each
    group in turn: the first group's first rank's, then the second group's first rank's, which now
    holds it): each rank's own entropy would draw different tokens from the same logits."""
    import paddle

    if seed is not None:
        return seed
    from ..parallel import comm  # here: the CLI imports this package before Paddle

    fresh = paddle.to_tensor([int(np.random.SeedSequence().entropy % 2**62)], dtype="int64")
    for group in groups:
        fresh = comm.broadcast(fresh, src=group.ranks[0], group=group)
    return int(fresh.item())


def _agreed_max(value: int, groups: list[Any]) -> int:
    """The largest ``value`` of all the ranks that generate together (the max over each group in turn)."""
    import paddle

    from ..parallel import comm

    x = paddle.to_tensor([value])
    for group in groups:
        x = comm.all_reduce(x, group, op="max")
    return int(x.item())


def _draw_without_replacement(scores: paddle.Tensor, k: int, rng: np.random.Generator) -> np.ndarray:
    """k indices per row [B, k] drawn without replacement from softmax(``scores``) [B, N], in the
    order drawn (the Gumbel top-k: the k largest of scores + Gumbel noise, a sequential draw's law);
    the noise from ``rng`` (float64, so no key ties). What has no probability in float32 (a -inf score,
    or one whose softmax underflows to 0, as the placeholder beams' -1e9 do) comes after everything
    drawn, as transformers' multinomial gives it."""
    import paddle

    from ..ops.selection import topk

    noise = -np.log(-np.log(rng.random(scores.shape)))  # Gumbel(0, 1)
    keys = scores.astype("float64") + paddle.to_tensor(noise)
    none = paddle.nn.functional.softmax(scores.astype("float32"), axis=-1) == 0
    keys = paddle.where(none, paddle.full_like(keys, float("-inf")), keys)
    return topk(keys, k)[1].numpy()


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's k largest values, largest first, ties in torch.topk's order (HF picks
    the running beams and the finished hypotheses with it; paddle.topk breaks ties as it does, where
    a stable sort's earlier-first order picked other beams among equal scores)."""
    import paddle

    from ..ops.selection import topk

    return topk(paddle.to_tensor(x, place=paddle.CPUPlace()), k)[1].numpy()


def _sample(
    decoder: Decoder,
    procs: Processors,
    s: GenerationConfig,
    input_ids: paddle.Tensor,
    rng: np.random.Generator,
    put: Callable[[np.ndarray], None] | None,
    tokenizer: Any,
    tails: list | None,
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """Greedy decoding or sampling, one token per row per step."""
    import paddle

    B = input_ids.shape[0]
    eos_t = paddle.to_tensor(s.eos_token_id, dtype="int64") if s.eos_token_id else None
    scores, raw, new, host_new = [], [], [], []  # per step: processed scores, raw logits, ids (device, host)
    last = decoder.prefill(s.max_new_tokens)
    finished = paddle.zeros([B], dtype="bool")
    for step in range(s.max_new_tokens):
        logits = last.astype("float32")  # [B, V], stays on the device
        if s.output_logits:
            raw.append(logits)
        x = procs(logits, step)
        if s.do_sample:
            nxt = _draw(x, rng.random(B))
        else:
            nxt = paddle.argmax(x, axis=-1).astype("int64")
        if s.output_scores:
            scores.append(x)
        nxt = paddle.where(finished, paddle.full_like(nxt, s.pad_token_id), nxt)
        if eos_t is not None:
            finished = paddle.logical_or(finished, paddle.isin(nxt, eos_t))
        new.append(nxt)
        host = None
        if put is not None or s.stop_strings or procs.host_held:
            host = nxt.numpy()  # the chosen ids only
            host_new.append(host)
            if put is not None:
                put(host)
            if s.stop_strings:
                stopped = _stop_string_hits(tokenizer, s.stop_strings, tails, list(enumerate(np.stack(host_new, 1))))
                finished = paddle.logical_or(finished, paddle.to_tensor(stopped))
        procs.append(nxt, host)
        if procs.stops:  # the caller's criteria and max_time, on the rows with this step's token
            hit = procs.stopped(procs.ids, tuple(scores) if s.return_dict_in_generate and s.output_scores else None, B)
            finished = finished if hit is None else paddle.logical_or(finished, hit)
        if step == s.max_new_tokens - 1 or (
            (eos_t is not None or s.stop_strings or procs.stops) and bool(finished.all())
        ):
            break
        last = decoder.next(nxt)
    sequences = paddle.concat([input_ids, paddle.stack(new, axis=1)], axis=1)
    if not s.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if s.output_scores else None,
        logits=tuple(raw) if s.output_logits else None,
        hidden_states=None if decoder.hidden is None else tuple(decoder.hidden),
        attentions=None if decoder.attentions is None else tuple(decoder.attentions),
        past_key_values=decoder.cache,
    )


def compute_transition_scores(
    sequences: paddle.Tensor,
    scores: Sequence[paddle.Tensor],
    beam_indices: paddle.Tensor | None = None,
    normalize_logits: bool = False,
) -> paddle.Tensor:
    """transformers' ``compute_transition_scores``: the score of each generated token at the step that
    chose it, [rows, steps], from ``generate``'s ``sequences`` [rows, S + n] and ``scores`` (per step
    [N, V]; ``output_scores``) or ``logits`` (``output_logits``, with ``normalize_logits=True`` for
    log-probabilities). Row r's token t is read from step t's row r, or with beam search from the beam
    ``beam_indices[r, t]`` it came from (steps where that is negative, after the sequence ended, give 0,
    and the steps are those of the longest sequence)."""
    import paddle

    from ..ops import log_softmax

    if not isinstance(scores, (list, tuple)) or not scores:
        raise ValueError(
            "compute_transition_scores: scores must be the non-empty tuple generate returns per step "
            "(return_dict_in_generate=True with output_scores=True or output_logits=True)"
        )
    steps = paddle.stack([s.astype("float32") for s in scores])  # [T, N, V]
    T, N, V = steps.shape
    R = sequences.shape[0]
    if beam_indices is None:
        if R != N:
            raise ValueError(
                f"compute_transition_scores: {R} sequences and scores of {N} rows: beam search needs its "
                "beam_indices (generate's output.beam_indices)"
            )
        beam_indices = paddle.arange(N, dtype="int64").unsqueeze(1).expand([N, T])
    if normalize_logits:
        steps = log_softmax(steps, axis=-1)
    ended = beam_indices < 0
    length = int((~ended).astype("int64").sum(axis=-1).max()) if R else 0
    if length > T or length > sequences.shape[1]:
        raise ValueError(f"compute_transition_scores: beam_indices run {length} steps, scores hold {T}")
    ended = ended[:, :length]
    beams = paddle.where(ended, paddle.zeros_like(beam_indices[:, :length]), beam_indices[:, :length])
    tokens = sequences[:, sequences.shape[1] - length :].astype("int64")
    flat = steps[:length].transpose([1, 2, 0]).reshape([N * V, length])  # row beam * V + token, column step
    picked = paddle.take_along_axis(flat, beams.astype("int64") * V + tokens, axis=0)  # [R, length]
    return paddle.where(ended, paddle.zeros_like(picked), picked)


def _no_valid_scores(what: str) -> RuntimeError:
    """The error for scores no token can be chosen from, where transformers' torch.multinomial raises
    ("probability tensor contains either inf, nan or element < 0") or its beam search goes on with
    NaN scores: a token chosen anyway (the last of the vocabulary, or none) would be silently wrong."""
    return RuntimeError(
        f"generate: {what}: the logits or a logits_processor's scores hold NaN or +inf, or every token "
        "was removed (suppress_tokens, bad_words_ids, the warpers ...); remove_invalid_values=True turns "
        "NaN into 0 and +-inf into the largest finite value"
    )


def _draw(scores: paddle.Tensor, uniforms: np.ndarray) -> paddle.Tensor:
    """One token per row from the softmax of ``scores`` [B, V] by inverting its CDF at the given
    uniform numbers [B] in [0, 1): the host data is those B numbers and one flag read back, whether
    every row has a probability to draw from (NaN or +inf scores, or every token removed: an error,
    as transformers' multinomial raises)."""
    import paddle

    # float64: a float32 CDF steps by 6e-8 near 1.0, so over a 150k vocabulary the many tokens below
    # that after the bulk of the mass got probability 0 or a whole step
    p = paddle.nn.functional.softmax(scores.astype("float64"), axis=-1)
    # exact zeros for removed tokens (Paddle's CPU softmax gives exp(-inf) as ~1e-28, not 0)
    p = paddle.where(paddle.isinf(scores), paddle.zeros_like(p), p)
    cdf = paddle.cumsum(p, axis=-1)
    if not bool((cdf[:, -1] > 0).all()):  # NaN > 0 is False too
        raise _no_valid_scores("sampling finds no token with a valid probability")
    target = paddle.to_tensor(np.asarray(uniforms, dtype=np.float64)[:, None]) * cdf[:, -1:]
    idx = paddle.searchsorted(cdf, target, right=True).squeeze(-1)  # first token whose CDF exceeds the target
    # rounding can put the target at the CDF's end: take the last token with probability then
    V = p.shape[-1]
    last = (V - 1) - paddle.argmax(paddle.flip((p > 0).astype("int32"), axis=[-1]), axis=-1)
    return paddle.where(idx >= V, last, idx).astype("int64")


def generate_speculative(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor,
    max_new_tokens: int = 20,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[paddle.Tensor, dict]:
    """Greedy decoding with the first MTP layer drafting (one row, no padding; docs/model.md): the
    loop of ``generate(..., use_mtp=True)`` without the model's generation_config.json, returning
    (prompt + new tokens [1, S + n], {"drafted", "accepted", "acceptance_rate", "main_forwards"});
    the tokens are greedy decoding's."""

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate_speculative: one row [1, seq] expected, got shape {list(input_ids.shape)}")
    input_ids = input_ids.astype("int64")
    eos = eos_list(model.config.eos_token_id if eos_token_id is None else eos_token_id)
    options = {"max_new_tokens": max_new_tokens, "eos_token_id": eos, "use_mtp": True}
    s = resolve_settings(model.config, GenerationConfig(), options, input_ids.shape[1])
    procs = Processors(s, input_ids, None, True, int(model.config.vocab_size), Hooks([], [], None), time.time())
    decoder = MtpDecoder(model, input_ids, None)
    with _inference(model):
        out = _sample(decoder, procs, s, input_ids, np.random.default_rng(0), None, None, None)
    return out, _counts(decoder.stats)
