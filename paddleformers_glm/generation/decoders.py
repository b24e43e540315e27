"""The model's side of a generation: the prompt's forward and one token per step through the decoding
cache (or the whole sequence again), and the decoders that feed drafts into the same forward (prompt
lookup, an assistant model, the MTP layer) without changing the tokens chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GenerationConfig

if TYPE_CHECKING:
    import paddle
# paddle is imported inside the functions: the CLI imports this package at start-up


class Decoder:
    """The model's side of a generation: the prompt's forward (``prefill``), then one new token per
    row per step (``next``), through the cache allocated once (``model.decode_step`` or a capture of
    it) or, with ``use_cache=False``, the whole sequence again; ``reorder`` for beam search.
    ``hidden`` / ``attentions`` (lists, when the caller asks for hidden states / attention weights):
    each forward's ``out.hidden_states`` / ``out.attentions``; the steps then run the model's forward
    on the cache, not ``decode_step``."""

    def __init__(self, model, use_cache, input_ids, mask, inputs_embeds, decode_step, last_real) -> None:
        self.model, self.use_cache, self.input_ids, self.mask = model, use_cache, input_ids, mask
        self.inputs_embeds, self.step_fn, self.last_real = inputs_embeds, decode_step or model.decode_step, last_real
        self.cache, self.hidden, self.attentions = None, None, None
        self.past, self.cached = None, 0  # a caller's cache, and how many of the input's first tokens it holds

    def _kept(self, out: Any) -> Any:
        if self.hidden is not None:
            self.hidden.append(out.hidden_states)
        if self.attentions is not None:
            self.attentions.append(out.attentions)
        return out

    def _outputs(self) -> dict[str, bool]:
        """The forward's output flags the caller asked for."""
        return {"output_hidden_states": self.hidden is not None, "output_attentions": self.attentions is not None}

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        """The logits [B, V] after each row's last prompt token (the cache sized for ``new_tokens`` more)."""
        from ..modeling.cache import DSACache

        model, skip = self.model, self.cached
        if self.use_cache:
            prompt = self.input_ids if self.inputs_embeds is None else self.inputs_embeds
            if self.past is None:
                capacity = prompt.shape[1] + new_tokens
                self.cache = DSACache.for_config(model.config, prompt.shape[0], capacity=capacity)
            else:  # the caller's cache, grown in place to the whole generation before the prefill
                self.cache = self.past
                self.cache.reserve(self.cache.length + prompt.shape[1] - skip + new_tokens)
            prompt = self.input_ids[:, skip:] if self.inputs_embeds is None else None
            embeds = None if self.inputs_embeds is None else self.inputs_embeds[:, skip:]
            kw = {"inputs_embeds": embeds, "logits_to_keep": 1, **self._outputs()}
            out = self._kept(model(prompt, self.mask, past_key_values=self.cache, use_cache=True, **kw))
        else:
            self.seq = self.input_ids if self.inputs_embeds is None else self.inputs_embeds
            out = self._kept(_full_forward(model, self.seq, self.mask, self._outputs()))
        if self.last_real is None:
            return out.logits[:, -1]
        return _logits_at(model, out.last_hidden_state, self.last_real - skip)

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        """The logits [B, V] after each row's new token ``nxt`` [B]."""
        import paddle

        if self.use_cache and any(self._outputs().values()):  # the forward on the filled cache keeps them
            kw = {"use_cache": True, "logits_to_keep": 1, **self._outputs()}
            return self._kept(self.model(nxt[:, None], past_key_values=self.cache, **kw)).logits[:, -1]
        if self.use_cache:
            positions, _ = self.cache.begin(None, 1)
            logits = self.step_fn(nxt[:, None], positions, self.cache.slots, self.cache)
            self.cache.advance(1)
            return logits
        step_in = nxt[:, None] if self.inputs_embeds is None else self.model.model.embedding(nxt[:, None])
        self.seq = paddle.concat([self.seq, step_in.astype(self.seq.dtype)], axis=1)
        if self.mask is not None:
            self.mask = paddle.concat([self.mask, paddle.ones([self.seq.shape[0], 1], dtype=self.mask.dtype)], axis=1)
        return self._kept(_full_forward(self.model, self.seq, self.mask, self._outputs())).logits[:, -1]

    def reorder(self, idx: paddle.Tensor) -> None:
        """Row ``i`` continues row ``idx[i]``."""
        import paddle

        if self.use_cache:
            self.cache.reorder_cache(idx)
            return
        self.seq = paddle.index_select(self.seq, idx, axis=0)
        if self.mask is not None:
            self.mask = paddle.index_select(self.mask, idx, axis=0)


def unconditional_decoder(model, s: GenerationConfig, input_ids, ids, mask, copies: int) -> Decoder:
    """guidance_scale's second sequence per row, as transformers': ``negative_prompt_ids`` [B, L]
    (and its mask), else each row's last prompt token, then the chosen tokens; its own cache."""
    import paddle

    if ids is None:
        if not input_ids.shape[1]:
            raise ValueError("generate: guidance_scale with embeddings alone needs negative_prompt_ids")
        ids, mask = input_ids[:, -1:], None
    else:
        rows = input_ids.shape[0] // copies
        if ids.ndim != 2 or ids.shape[0] != rows or (mask is not None and list(mask.shape) != list(ids.shape)):
            got = list(ids.shape) if mask is None else f"{list(ids.shape)} (mask {list(mask.shape)})"
            raise ValueError(
                f"generate: negative_prompt_ids must be [{rows}, length] like the prompt's rows, got {got}"
            )
        ids = paddle.repeat_interleave(ids.astype("int64"), copies, axis=0)  # as the prompt's rows
        mask = None if mask is None else paddle.repeat_interleave(mask, copies, axis=0)
    return Decoder(model, s.use_cache, ids, mask, None, None, None)


class DraftingDecoder(Decoder):
    """One row whose fed token is followed in the same forward by up to ``most`` drafts (``_draft``),
    the logits after each kept: a later token equal to the next draft takes its kept logits without a
    forward; one that differs rolls the unused drafts out of the cache. The tokens are chosen as
    without drafts (the same processors, draw and stops), so they are plain decoding's; only the
    number of forwards changes (``stats``)."""

    def __init__(self, model, input_ids, mask, last_real, most: int) -> None:
        super().__init__(model, True, input_ids, mask, None, None, last_real)
        self.row = [int(t) for t in input_ids.numpy()[0]]  # the prompt's ids, then the chosen ones
        self.drafts, self.most, self.prompt_len = [], most, len(self.row)
        self.stats = {"drafted": 0, "accepted": 0, "main_forwards": 1}  # the prompt's forward

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        import paddle

        token = int(nxt.numpy()[0])
        self.row.append(token)
        if self.drafts and self.drafts[0][0] == token:  # the draft was right: its logits are known
            self.stats["accepted"] += 1
            return self.drafts.pop(0)[1]
        self._round_ended(all_taken=not self.drafts)
        self.cache.rollback(len(self.drafts))  # the unused drafts' rows
        drafts = self._draft(min(self.most, self.cache.capacity - self.cache.length - 1))
        out = self.model(paddle.to_tensor([[token, *drafts]]), past_key_values=self.cache, use_cache=True)
        self.stats["drafted"] += len(drafts)
        self.stats["main_forwards"] += 1
        logits = out.logits[0].astype("float32")
        self.drafts = [(t, logits[i + 1 : i + 2]) for i, t in enumerate(drafts)]
        return logits[:1]

    def _round_ended(self, all_taken: bool) -> None:
        """Before the next drafts: whether every draft of the last round was taken."""

    def _draft(self, most: int) -> list[int]:
        raise NotImplementedError


class LookupDecoder(DraftingDecoder):
    """Prompt lookup decoding (transformers' ``prompt_lookup_num_tokens``): the drafts are what
    followed the first earlier occurrence of the row's last n ids (n = ``max_matching_ngram_size``
    (2) down to 1), cut before an EOS, as transformers' PromptLookupCandidateGenerator proposes them."""

    def __init__(self, model, input_ids, mask, last_real, s: GenerationConfig) -> None:
        super().__init__(model, input_ids, mask, last_real, s.prompt_lookup_num_tokens)
        self.ngram, self.eos = s.max_matching_ngram_size or 2, set(s.eos_token_id)

    def _draft(self, most: int) -> list[int]:
        """Up to ``most`` ids that followed the first earlier occurrence of the row's last n ids."""
        row = self.row
        for n in range(min(self.ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n):
                if row[start : start + n] == tail:  # the first match decides, as transformers'
                    drafts = row[start + n : start + n + most]
                    return drafts[: next((i for i, t in enumerate(drafts) if t in self.eos), len(drafts))]
        return []


class AssistantDecoder(DraftingDecoder):
    """Assisted decoding (transformers' ``assistant_model``): a smaller model of the same vocabulary,
    with its own cache, drafts up to ``num_assistant_tokens`` greedy tokens (stopping after one it
    gives less than ``assistant_confidence_threshold``), its cache first rolled back to the row's
    tokens. ``heuristic``: 2 more drafts after a round all taken, 1 fewer otherwise (transformers
    also moves its threshold by a fitted curve; that changes how many forwards run, never the tokens)."""

    def __init__(self, model, assistant, input_ids, mask, last_real, s: GenerationConfig) -> None:
        super().__init__(model, input_ids, mask, last_real, s.num_assistant_tokens)
        V, W = int(model.config.vocab_size), int(getattr(getattr(assistant, "config", None), "vocab_size", -1))
        if V != W or not hasattr(assistant, "decode_step"):
            raise ValueError(f"generate: assistant_model must be a GLM model of the same vocabulary ({V}), got {W}")
        self.helper = Decoder(assistant, True, input_ids, mask, None, None, last_real)
        self.fed, self.last_round, self.s = [], 0, s

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        self.helper.prefill(new_tokens + self.most + 1)  # room for the drafts past the last token
        return super().prefill(new_tokens)

    def _round_ended(self, all_taken: bool) -> None:
        if self.s.num_assistant_tokens_schedule != "constant" and self.last_round:
            self.most = self.most + 2 if all_taken else max(1, self.most - 1)

    def _draft(self, most: int) -> list[int]:
        """The assistant's greedy tokens after the row; its cache holds ``fed`` after the prompt."""
        import paddle

        new, same = self.row[self.prompt_len :], 0
        while same < min(len(self.fed), len(new)) and self.fed[same] == new[same]:
            same += 1
        self.helper.cache.rollback(len(self.fed) - same)
        self.fed, feed, drafts = self.fed[:same], new[same:], []
        room = self.helper.cache.capacity - self.helper.cache.length
        while feed and len(drafts) < most and len(feed) <= room:
            out = self.helper.model(paddle.to_tensor([feed]), past_key_values=self.helper.cache, use_cache=True)
            self.fed += feed
            room -= len(feed)
            p = paddle.nn.functional.softmax(out.logits[0, -1].astype("float32"))
            drafts.append(int(p.argmax()))
            if float(p.max()) < self.s.assistant_confidence_threshold:
                break
            feed = drafts[-1:]
        self.last_round = len(drafts)
        return drafts


class MtpDecoder(Decoder):
    """Speculative decoding with the first MTP layer drafting (``use_mtp``, one row without padding):
    each fed token t is followed in the same forward by the MTP head's greedy guess for the token
    after it (from the main model's hidden state that predicted t, t, and that position's top-k); a
    later token equal to the draft takes the logits kept for it, another rolls the draft out of the
    main cache. The MTP layer's own cache holds the rows of the kept tokens only. The tokens are
    chosen as without drafts; ``stats`` counts drafts, accepted drafts and main forwards."""

    def __init__(self, model, input_ids, mask) -> None:
        super().__init__(model, True, input_ids, mask, None, None, None)
        if getattr(model, "pipelined", False):  # the MTP layer reads the last stage's hidden states
            raise NotImplementedError("generate: use_mtp on a model split into pipeline stages (build it with pp 1)")
        if not model.model.mtp_layers:
            raise ValueError("generate: use_mtp needs an MTP layer (num_nextn_predict_layers = 0)")
        if mask is not None and not bool(mask.astype("bool").all()):
            raise ValueError("generate: use_mtp drafts for one row without padding (the mask holds zeros)")
        self.mtp, self.draft = model.model.mtp_layers[0], None
        self.stats = {"drafted": 0, "accepted": 0, "main_forwards": 0}

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        from ..modeling.cache import DSACache

        model, ids = self.model, self.input_ids
        S = ids.shape[1]  # one capacity for both caches: a main top-k's slots address the MTP cache's rows
        self.cache = DSACache.for_config(model.config, 1, capacity=S + new_tokens + 2)
        self.cache.keep_topk = True  # the main top-k of each forward, for the MTP layer (_mtp_step)
        self.mtp_cache = DSACache(1, 1, capacity=self.cache.capacity)
        out = model(ids, self.mask, past_key_values=self.cache, use_cache=True)
        self.stats["main_forwards"] += 1
        h, topk = out.last_hidden_state, self.cache.topk  # [1, S, H], [1, S, k]
        if S > 1:  # MTP positions 0 .. S-2: (h_i, token i+1)
            _mtp_step(model, self.mtp, self.mtp_cache, h[:, :-1], ids[:, 1:], topk[:, :-1])
        self.h_last, self.topk_last = h[:, -1:], topk[:, -1:]  # what predicts the next token
        return out.logits[:, -1]

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        import paddle

        token, model = nxt[:, None], self.model
        if self.draft is not None:
            draft, kept, hs, topk = self.draft
            self.draft = None
            if int(nxt.numpy()[0]) == draft:  # right: its MTP row, then the state after it
                self.stats["accepted"] += 1
                _mtp_step(model, self.mtp, self.mtp_cache, hs[:, :1], token, topk[:, :1])
                self.h_last, self.topk_last = hs[:, 1:2], topk[:, 1:2]
                return kept
            self.cache.rollback(1)
            self.h_last, self.topk_last = hs[:, :1], topk[:, :1]
        guess = _mtp_step(model, self.mtp, self.mtp_cache, self.h_last, token, self.topk_last)
        draft = int(guess[0].argmax())
        self.stats["drafted"] += 1
        out = model(paddle.concat([token, paddle.to_tensor([[draft]])], axis=1), past_key_values=self.cache)
        self.stats["main_forwards"] += 1
        logits = out.logits[0].astype("float32")
        self.draft = (draft, logits[1:2], out.last_hidden_state, self.cache.topk)
        return logits[:1]


def _logits_at(model: paddle.nn.Layer, hidden: paddle.Tensor, pos: paddle.Tensor) -> paddle.Tensor:
    """The logits [B, V] of row b's position ``pos[b]`` from the final-normed hidden states [B, S, H]
    (None on a pipeline stage without the head: the last stage's logits)."""
    import paddle

    if hidden is None:
        return model.from_last_stage(None)
    B, H = hidden.shape[0], hidden.shape[2]
    rows = paddle.take_along_axis(hidden, pos.astype("int64").reshape([B, 1, 1]).expand([B, 1, H]), axis=1)
    return model.from_last_stage(model.logits(rows)[:, 0])


def _full_forward(model: paddle.nn.Layer, seq: paddle.Tensor, mask: paddle.Tensor | None, outputs: dict | None = None):
    """``use_cache=False``: the whole sequence again (ids [B, S], or embeddings [B, S, H]), positions
    counting each row's real tokens (as HF's prepare_inputs_for_generation makes them from the mask)."""
    import paddle

    pos = None if mask is None else paddle.clip(paddle.cumsum(mask.astype("int64"), axis=1) - 1, min=0)
    ids, embeds = (seq, None) if seq.ndim == 2 else (None, seq)
    kw = {"position_ids": pos, "logits_to_keep": 1, "use_cache": False, "inputs_embeds": embeds, **(outputs or {})}
    return model(ids, attention_mask=mask, **kw)  # no cache built


class CudaGraphDecodeStep:
    """`model.decode_step` captured once as a CUDA graph and replayed for every later step:
    ``generate(model, ids, decode_step=CudaGraphDecodeStep(model))`` on a GPU.

    The step's shapes follow the cache's capacity and it reads nothing back to the host (the
    cache writes by device-side index_put, MoE in its static-shape form while capturing), so one
    capture serves the whole generation; each call copies the step's inputs into the captured
    ones. The first call runs eagerly (its logits are returned) and captures; it binds to that
    call's cache. Every replay rewrites the captured output tensor in place, so each later call
    returns a copy of it (one [B, V] copy per token): the caller may keep a step's logits
    (``output_logits`` / ``output_scores``), and ``astype`` to the dtype a tensor already has returns
    that tensor itself, so a kept fp32 step would otherwise become the last step's logits. Not
    exercised without a GPU (the CPU build has no CUDA graphs).
    """

    def __init__(self, model: paddle.nn.Layer) -> None:
        self.model = model
        self.cache: object = None
        self.graph: object = None

    def __call__(self, input_ids: paddle.Tensor, positions: paddle.Tensor, slots: paddle.Tensor, cache: object):
        import paddle
        from paddle.device.cuda.graphs import CUDAGraph

        if self.graph is None:
            self.cache = cache
            self.inputs = [input_ids.clone(), positions.clone(), slots.clone()]
            logits = self.model.decode_step(*self.inputs, cache)
            graph = CUDAGraph()
            graph.capture_begin()
            self.logits = self.model.decode_step(*self.inputs, cache)
            graph.capture_end()
            self.graph = graph
            return logits
        if cache is not self.cache:
            raise ValueError("CudaGraphDecodeStep: captured for another cache; make one per generation")
        for held, new in zip(self.inputs, (input_ids, positions, slots)):
            paddle.assign(new, output=held)
        self.graph.replay()
        return self.logits.clone()


def _mtp_step(
    model: paddle.nn.Layer,
    mtp: paddle.nn.Layer,
    cache: object,
    hidden: paddle.Tensor,
    ids: paddle.Tensor,
    main_topk: paddle.Tensor,
):
    """The MTP layer on n new positions i (main hidden h_i [B, n, H], token i+1 ids [B, n]) through
    its own one-layer cache; -> logits of the last position (the draft for token i+2) [B, V].
    ``main_topk`` [B, n, k]: the main model's last top-k at the same positions (its cache slots are
    the MTP cache's), which the layer attends with under index_share_for_mtp_iteration, as the
    model's forward runs it; otherwise its own indexer selects."""
    n = ids.shape[1]
    prefill = cache.length == 0
    positions, key_valid = cache.begin(None, n)
    cos, sin = model.model.rotary_emb(positions)
    x, _, _ = mtp(
        hidden, model.model.embedding(ids), cos, sin, None if prefill else key_valid, main_topk, cache=cache.layers[0]
    )
    cache.advance(n)
    return model.logits(mtp.norm(x[:, -1:]))[:, -1]
