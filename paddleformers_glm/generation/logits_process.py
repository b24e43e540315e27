"""transformers' logits processors, warpers and stopping criteria on the device, in HF's order:
what turns a step's logits into the scores a token is chosen from, for greedy, sampling and beam
search alike."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import GenerationConfig

if TYPE_CHECKING:
    import paddle

    from .decoders import Decoder
# paddle is imported inside the functions: the CLI imports this package at start-up


def _warp(logits: paddle.Tensor, s: GenerationConfig, keep: int = 1) -> paddle.Tensor:
    """Temperature, then top-k (ties with the k-th kept), then top-p (the smallest set of most
    likely tokens whose probability reaches top_p), min-p, typical-p, the cutoffs, as HF's warpers:
    removed tokens get -inf, at least ``keep`` tokens stay (HF's min_tokens_to_keep: 1 + #EOS in
    beam sampling)."""
    import paddle

    neg_inf = paddle.full_like(logits, -math.inf)
    x = logits / s.temperature if s.temperature != 1.0 else logits
    if s.top_h is not None:
        x = paddle.where(_entropy_tail(x, s.top_h), neg_inf, x)
    if s.top_k and max(s.top_k, keep) < x.shape[-1]:
        kth = paddle.topk(x, max(s.top_k, keep), axis=-1)[0][:, -1:]
        x = paddle.where(x < kth, neg_inf, x)
    if s.top_p < 1.0:
        # as HF's TopPLogitsWarper: from the least likely up, a token goes while the probability summed
        # to it is <= 1 - top_p; the most likely always stays. Probabilities and their sum in float64:
        # float32 ones over a 150k vocabulary (summed most likely first, near 1.0) moved the cut by tens of tokens
        order = paddle.argsort(x, axis=-1)  # ascending
        p = paddle.nn.functional.softmax(x.astype("float64"), axis=-1)
        cum = paddle.cumsum(paddle.take_along_axis(p, order, axis=-1), axis=-1)
        drop_sorted = (cum <= 1.0 - s.top_p).astype("float64")
        drop_sorted[:, -keep:] = 0.0
        drop = paddle.put_along_axis(paddle.zeros_like(p), order, drop_sorted, axis=-1) > 0
        x = paddle.where(drop, neg_inf, x)
    if s.min_p is not None:  # HF's MinPLogitsWarper: a token goes below min_p x the top probability
        p = paddle.nn.functional.softmax(x, axis=-1)
        top = _topk(p, min(keep, x.shape[-1]))[1]  # ties in torch.topk's order, as HF's
        x = paddle.where(_spared(p < s.min_p * p.max(axis=-1, keepdim=True), top), neg_inf, x)
    if s.typical_p is not None and s.typical_p < 1.0:
        x = paddle.where(_atypical(x, s.typical_p, keep), neg_inf, x)
    for cutoff, scaled in ((s.epsilon_cutoff, False), (s.eta_cutoff, True)):
        if cutoff:
            x = paddle.where(_below_top(_below_cutoff(x, cutoff, scaled), x, keep), neg_inf, x)
    return x


def _topk(x: paddle.Tensor, k: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``ops.topk`` (imported here: the generation settings are read before Paddle is)."""
    from ..ops.selection import topk

    return topk(x, k)


def _entropy_tail(x: paddle.Tensor, top_h: float) -> paddle.Tensor:
    """The tokens HF's TopHLogitsWarper removes: of the 100 most likely (renormalised among
    themselves), those after the entropy summed from the most likely passes top_h x their entropy
    (the most likely always stays), and every other token."""
    import paddle

    top, idx = _topk(x, min(100, x.shape[-1]))
    logp, p, ent = _entropy(top)
    terms = paddle.where(p > 0, -p * logp, paddle.zeros_like(p))
    keep = ((paddle.cumsum(terms, axis=-1) <= ent * top_h) & (p > 0)).astype("int32")
    keep[:, 0] = 1
    return paddle.put_along_axis(paddle.zeros_like(x, dtype="int32"), idx, keep, axis=-1) == 0


def _below_top(remove: paddle.Tensor, x: paddle.Tensor, keep: int) -> paddle.Tensor:
    """``remove`` [N, V] less each row's ``keep`` highest scores (HF's min_tokens_to_keep)."""
    import paddle

    return remove & (x < paddle.topk(x, min(keep, x.shape[-1]), axis=-1)[0][:, -1:])


def _spared(remove: paddle.Tensor, kept: paddle.Tensor) -> paddle.Tensor:
    """``remove`` [N, V] less the tokens ``kept`` [N, k]: exactly those, in HF's order, where HF's
    min_tokens_to_keep scatters them (MinP, Typical), not every token tied with the last of them."""
    import paddle

    spared = paddle.put_along_axis(paddle.zeros(remove.shape, "int32"), kept, paddle.ones(kept.shape, "int32"), 1)
    return remove & (spared == 0)


def _entropy(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """log-probabilities, probabilities and entropy [N, 1] of logits x (removed tokens: -inf, no share)."""
    import paddle

    from ..ops import log_softmax

    logp = log_softmax(x, axis=-1)
    kept, zero = paddle.isfinite(logp), paddle.zeros_like(logp)
    p = paddle.where(kept, paddle.exp(logp), zero)  # Paddle's vectorised CPU exp(-inf) is 2.9e-39, not 0
    return logp, p, -paddle.where(kept, p * logp, zero).sum(-1, keepdim=True)


def _atypical(x: paddle.Tensor, mass: float, keep: int = 1) -> paddle.Tensor:
    """Tokens outside the locally typical set (HF's TypicalLogitsWarper): ranked by how far their
    information -log p lies from the entropy, the closest tokens are kept until their probability
    summed in that order reaches ``mass`` (the token that reaches it included, and any token as
    close as it); the ``keep`` first in that order always stay."""
    import paddle

    logp, _, ent = _entropy(x)
    distance = paddle.abs(-logp - ent)
    order = paddle.argsort(distance, axis=-1)  # closest first
    probs = paddle.nn.functional.softmax(paddle.take_along_axis(x, order, axis=-1), axis=-1)
    reached = (paddle.cumsum(probs, axis=-1) < mass).astype("int64").sum(-1, keepdim=True)
    last = paddle.clip(reached, max=x.shape[-1] - 1)
    far = distance > paddle.take_along_axis(paddle.take_along_axis(distance, order, axis=-1), last, axis=-1)
    return _spared(far, order[:, :keep])


def _below_cutoff(x: paddle.Tensor, cutoff: float, entropy_scaled: bool) -> paddle.Tensor:
    """Tokens whose probability is below ``cutoff`` (HF's EpsilonLogitsWarper) or, entropy-scaled,
    below min(cutoff, sqrt(cutoff) * exp(-entropy)) (its EtaLogitsWarper)."""
    import paddle

    _, p, ent = _entropy(x)
    bar = (
        paddle.minimum(paddle.full_like(ent, cutoff), math.sqrt(cutoff) * paddle.exp(-ent))
        if entropy_scaled
        else cutoff
    )
    return p < bar


def _banned(x: paddle.Tensor, pairs: list[tuple[int, int]]) -> paddle.Tensor:
    """``x`` [B, V] with -inf at each (row, token) of ``pairs`` (the host-side processors' bans)."""
    import paddle

    if not pairs:
        return x
    rows, cols = (paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in zip(*pairs))
    return paddle.index_put(x, (rows, cols), paddle.full([len(pairs)], -math.inf, dtype=x.dtype))


class _HostRows:
    """Each row's ids on the host (the prompt's, padding included, then the chosen ones), for the
    processors that look at how a row ends."""

    def __init__(self, prompt: np.ndarray) -> None:
        self.rows = [[int(t) for t in row] for row in prompt]

    def append(self, ids: np.ndarray) -> None:
        for row, t in zip(self.rows, ids.tolist()):
            row.append(int(t))

    def reorder(self, idx: np.ndarray) -> None:
        """Row ``i`` becomes a copy of row ``idx[i]`` (beam search)."""
        self.rows = [list(self.rows[i]) for i in idx.tolist()]

    def ending_with(self, head: list[int]) -> list[int]:
        """The rows whose ids end with ``head``."""
        return [b for b, row in enumerate(self.rows) if len(row) >= len(head) and row[len(row) - len(head) :] == head]


class _NGrams(_HostRows):
    """transformers' NoRepeatNGramLogitsProcessor on the host: each row's n-grams so far (the whole
    ``input_ids``, padding included, as HF's; then the chosen ids), and the tokens that would repeat
    one after the row's last n - 1 tokens."""

    def __init__(self, n: int, prompt: np.ndarray) -> None:
        super().__init__(prompt)
        self.n = n
        self.seen: list[dict[tuple, set]] = [{} for _ in self.rows]
        for row, seen in zip(self.rows, self.seen):
            for i in range(len(row) - n + 1):
                seen.setdefault(tuple(row[i : i + n - 1]), set()).add(row[i + n - 1])

    def append(self, ids: np.ndarray) -> None:
        for row, seen, t in zip(self.rows, self.seen, ids.tolist()):
            row.append(int(t))
            if len(row) >= self.n:
                seen.setdefault(tuple(row[len(row) - self.n : -1]), set()).add(int(t))

    def reorder(self, idx: np.ndarray) -> None:
        super().reorder(idx)
        self.seen = [{k: set(v) for k, v in self.seen[i].items()} for i in idx.tolist()]

    def ban(self, x: paddle.Tensor) -> paddle.Tensor:
        if len(self.rows[0]) + 1 < self.n:  # HF: no n-gram can be completed yet
            return x
        pairs = [
            (b, t)
            for b, (row, seen) in enumerate(zip(self.rows, self.seen))
            for t in sorted(seen.get(tuple(row[len(row) - self.n + 1 :]), ()))
        ]
        return _banned(x, pairs)


class _SequenceBias(_HostRows):
    """transformers' SequenceBiasLogitsProcessor (the first of its processors): a one-token
    sequence's bias is added at every step, a longer one's to its last token where the row's ids
    (the prompt's, padding included, then the chosen ones) end with the rest; biases on one token add."""

    def __init__(self, biases: list[tuple[list[int], float]], prompt: np.ndarray, vocab: int) -> None:
        import paddle

        super().__init__(prompt)
        single = np.zeros(vocab, np.float32)
        for ids, bias in biases:
            if len(ids) == 1:
                single[ids[0]] = bias
        self.single = paddle.to_tensor(single)
        self.multi = [(ids[:-1], ids[-1], bias) for ids, bias in biases if len(ids) > 1]

    def apply(self, x: paddle.Tensor) -> paddle.Tensor:
        import paddle

        bias = paddle.zeros_like(x) + self.single
        hits = [(b, last, value) for head, last, value in self.multi for b in self.ending_with(head)]
        if hits:
            rows, cols, values = zip(*hits)
            index = tuple(paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in (rows, cols))
            bias = paddle.index_put(bias, index, paddle.to_tensor(np.asarray(values, np.float32)), accumulate=True)
        return x + bias


class _BadWords(_HostRows):
    """transformers' NoBadWordsLogitsProcessor: a one-token bad word gets -inf at every step, the
    last token of a longer one where the row's ids end with the rest (prompt ids included)."""

    def __init__(self, words: list[list[int]], prompt: np.ndarray, vocab: int) -> None:
        import paddle

        super().__init__(prompt)
        single = [w[0] for w in words if len(w) == 1]
        self.single = paddle.to_tensor(np.isin(np.arange(vocab), single)) if single else None
        self.multi = [(w[:-1], w[-1]) for w in words if len(w) > 1]

    def ban(self, x: paddle.Tensor) -> paddle.Tensor:
        import paddle

        if self.single is not None:
            x = paddle.where(self.single, paddle.full_like(x, -math.inf), x)
        return _banned(x, [(b, last) for head, last in self.multi for b in self.ending_with(head)])


@dataclass
class Hooks:
    """The caller's own logits processors, stopping criteria and prefix constraint (transformers'
    ``logits_processor`` / ``stopping_criteria`` / ``prefix_allowed_tokens_fn``, on Paddle tensors)."""

    processors: list
    criteria: list
    prefix_fn: Callable | None

    @classmethod
    def checked(cls, processors: Any, criteria: Any, prefix_fn: Any) -> Hooks:
        lists = []
        for name, given in (("logits_processor", processors), ("stopping_criteria", criteria)):
            items = [] if given is None else given
            if not isinstance(items, (list, tuple)) or not all(callable(x) for x in items):
                raise TypeError(f"generate: {name} must be a list of callables (input_ids, scores), got {given!r}")
            lists.append(list(items))
        if prefix_fn is not None and not callable(prefix_fn):
            raise TypeError(
                f"generate: prefix_allowed_tokens_fn must be callable (batch_id, input_ids), got {prefix_fn!r}"
            )
        return cls(*lists, prefix_fn)


class Processors:
    """transformers' logits processors, in its order, for every row of a generation (greedy,
    sampling and beam search alike): sequence bias, repetition penalty, n-gram and bad-word bans,
    minimum length, the prefix constraint, forced BOS / EOS, the removal of NaN / inf, the EOS
    length boost, suppressed and begin-suppressed tokens, the caller's processors, then (sampling)
    the warpers and the final renormalisation; and its stopping criteria beyond EOS."""

    def __init__(
        self,
        s: GenerationConfig,
        input_ids: paddle.Tensor,
        mask: paddle.Tensor | None,
        ids_given: bool,
        V: int,
        hooks: Hooks,
        started: float,
    ):
        import paddle

        self.s, self.hooks, self.started = s, hooks, started
        self.stops = bool(hooks.criteria) or s.max_time is not None
        # under tensor parallel: the ranks' verdict on their own clocks (any rank's timeout ends all)
        self.agree_timeout: Callable[[bool], bool] = lambda timed_out: timed_out
        self.keep = len(s.eos_token_id) + 1 if s.num_beams > 1 else 1  # HF's min_tokens_to_keep for the warpers
        uses_eos = s.min_new_tokens or s.exponential_decay_length_penalty
        self.eos_vocab = (
            paddle.to_tensor(np.isin(np.arange(V), s.eos_token_id)) if s.eos_token_id and uses_eos else None
        )
        # [V] masks: forced BOS / EOS (one step), suppressed (every step), begin-suppressed (the first)
        token_sets = {"forced_bos_token_id": [] if s.forced_bos_token_id is None else [s.forced_bos_token_id]}
        token_sets |= {
            k: getattr(s, k) or [] for k in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens")
        }
        self.vocab_mask = {k: paddle.to_tensor(np.isin(np.arange(V), ids)) for k, ids in token_sets.items() if ids}
        B, S = input_ids.shape
        # transformers' forced BOS comes where its input_ids are 1 long (they hold no embedded prompt),
        # and then the begin-suppressed tokens one step later
        held = S if ids_given else 0
        self.bos_step = 1 - held if s.forced_bos_token_id is not None and held <= 1 else None
        self.begin_step = 0 if self.bos_step is None else 1
        self.ids = input_ids if hooks.processors or hooks.criteria or hooks.prefix_fn else None  # for the hooks
        self.guidance: Decoder | None = None  # guidance_scale's unconditional sequence (set by generate)
        self.last = None  # the ids chosen last
        self.seen = None
        if s.repetition_penalty != 1.0:  # [B, V]: which tokens a row holds (its left padding excluded)
            self.seen = paddle.zeros([B, V], dtype="bool")
            if ids_given and S:
                valid = paddle.ones_like(input_ids)
                if mask is not None:  # HF's prompt_ignore_length: the slots before the first real token
                    first = paddle.argmax((mask != 0).astype("int32"), axis=1, keepdim=True)
                    valid = (paddle.arange(S, dtype="int64")[None, :] >= first).astype("int64")
                zero = paddle.zeros([B, V], dtype="int64")
                self.seen = paddle.put_along_axis(zero, input_ids, valid, axis=1, reduce="add") > 0
        # the prompt read back to the host only for the processors that track rows there
        host = input_ids.numpy() if s.no_repeat_ngram_size or s.bad_words_ids or s.sequence_bias else None
        self.ngrams = _NGrams(s.no_repeat_ngram_size, host) if s.no_repeat_ngram_size else None
        self.bad_words = _BadWords(s.bad_words_ids, host, V) if s.bad_words_ids else None
        self.biases = _SequenceBias(s.sequence_bias, host, V) if s.sequence_bias else None
        # the processors that read the chosen ids on the host each step
        self.host_held = [p for p in (self.ngrams, self.bad_words, self.biases) if p is not None]

    def __call__(self, x: paddle.Tensor, step: int) -> paddle.Tensor:
        import paddle

        from ..ops import log_softmax

        s, masks = self.s, self.vocab_mask
        neg_inf = paddle.full_like(x, -math.inf) if masks or self.eos_vocab is not None else None
        if self.guidance is not None:  # HF's first: g (log p - log p_uncond) + log p_uncond
            free = self.guidance.prefill(s.max_new_tokens) if step == 0 else self.guidance.next(self.last)
            free = log_softmax(free.astype(x.dtype), axis=-1)
            x = s.guidance_scale * (log_softmax(x, axis=-1) - free) + free
        if self.biases is not None:
            x = self.biases.apply(x)
        if self.seen is not None:  # HF's repetition penalty: a seen logit / penalty if positive, * if negative
            rp = s.repetition_penalty
            x = paddle.where(self.seen, paddle.where(x < 0, x * rp, x / rp), x)
        for ban in (self.ngrams, self.bad_words):  # after the repetition penalty, before the minimum length
            if ban is not None:
                x = ban.ban(x)
        if self.eos_vocab is not None and step < s.min_new_tokens:
            x = paddle.where(self.eos_vocab, neg_inf, x)
        if self.hooks.prefix_fn is not None:
            x = self._prefix_allowed(x)
        if step == self.bos_step:
            x = paddle.where(masks["forced_bos_token_id"], paddle.zeros_like(x), neg_inf)
        if "forced_eos_token_id" in masks and step == s.max_new_tokens - 1:  # max_length - 1 tokens
            x = paddle.where(masks["forced_eos_token_id"], paddle.zeros_like(x), neg_inf)
        if s.remove_invalid_values:  # HF's InfNanRemoveLogitsProcessor: NaN 0, +-inf the largest finite
            x = paddle.nan_to_num(x)
        decay = s.exponential_decay_length_penalty
        if decay is not None and step > decay[0]:  # HF's boost of the EOS scores: |score| (factor^n - 1)
            lift = paddle.abs(x) * (decay[1] ** (step - decay[0]) - 1)
            x = x + paddle.where(paddle.logical_and(self.eos_vocab, paddle.isfinite(x)), lift, paddle.zeros_like(x))
        if "suppress_tokens" in masks:
            x = paddle.where(masks["suppress_tokens"], neg_inf, x)
        if "begin_suppress_tokens" in masks and step == self.begin_step:
            x = paddle.where(masks["begin_suppress_tokens"], neg_inf, x)
        for proc in self.hooks.processors:
            out = proc(self.ids, x)
            if not isinstance(out, paddle.Tensor) or list(out.shape) != list(x.shape):
                got = list(out.shape) if isinstance(out, paddle.Tensor) else type(out).__name__
                raise TypeError(f"generate: logits_processor {proc!r} must return scores {list(x.shape)}, got {got}")
            x = out.astype(x.dtype)
        if s.do_sample:
            x = _warp(x, s, self.keep)
        if s.renormalize_logits:  # HF's LogitNormalization, always the last (-inf stays -inf, as ops'
            # log_softmax keeps it: Paddle's CPU one makes it finite, a score a beam could pick)
            x = log_softmax(x, axis=-1)
        return x

    def _prefix_allowed(self, x: paddle.Tensor) -> paddle.Tensor:
        """HF's PrefixConstrainedLogitsProcessor: each row keeps the tokens ``fn(batch id, row ids)``
        allows; a prompt whose every row has all its allowed tokens at -inf gets score 0 on them."""
        import paddle

        N, V = x.shape
        group = self.s.num_beams
        rows, cols = [], []
        for r in range(N):
            allowed = [int(t) for t in self.hooks.prefix_fn(r // group, self.ids[r])]
            if not allowed or not all(0 <= t < V for t in allowed):
                raise ValueError(
                    f"generate: prefix_allowed_tokens_fn returned {allowed!r} for batch id {r // group}: it must "
                    f"name at least one token id of the vocabulary ({V})"
                )
            rows += [r] * len(allowed)
            cols += allowed
        index = tuple(paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in (rows, cols))
        mask = paddle.index_put(paddle.full_like(x, -math.inf), index, paddle.zeros([len(rows)], dtype=x.dtype))
        out = x + mask
        unmet = (out.max(axis=-1) == -math.inf).reshape([N // group, group]).all(axis=-1, keepdim=True)
        return paddle.where(paddle.repeat_interleave(unmet.astype("int32"), group, axis=0) > 0, mask, out)

    def stopped(self, ids: paddle.Tensor | None, scores: tuple | None, rows: int) -> paddle.Tensor | None:
        """Which of ``rows`` rows the stopping criteria end (transformers' StoppingCriteriaList: any
        criterion; ``max_time`` ends all); ``ids`` [rows, L] what the caller's criteria read."""
        import paddle

        if self.s.max_time is not None and self.agree_timeout(time.time() - self.started > self.s.max_time):
            return paddle.ones([rows], dtype="bool")
        done = None
        for crit in self.hooks.criteria:
            hit = crit(ids, scores)
            hit = hit if isinstance(hit, paddle.Tensor) else paddle.to_tensor(np.asarray(hit))
            if hit.ndim == 0:
                hit = paddle.full([rows], bool(hit), dtype="bool")
            if list(hit.shape) != [rows]:
                raise TypeError(f"generate: stopping criterion {crit!r} must return a bool or [{rows}] bools")
            done = hit.astype("bool") if done is None else paddle.logical_or(done, hit.astype("bool"))
        return done

    def append(self, nxt: paddle.Tensor, host: np.ndarray | None) -> None:
        """The chosen ids [B] (on the device; ``host``: the same read back, when ``host_held``)."""
        import paddle

        if self.seen is not None:
            self.seen = paddle.logical_or(self.seen, paddle.nn.functional.one_hot(nxt, self.seen.shape[1]) > 0)
        if self.ids is not None:
            self.ids = paddle.concat([self.ids, nxt[:, None].astype(self.ids.dtype)], axis=1)
        self.last = nxt
        for held in self.host_held:
            held.append(host)

    def reorder(self, idx: np.ndarray) -> None:
        """Row ``i`` continues row ``idx[i]`` (beam search)."""
        import paddle

        rows = paddle.to_tensor(idx)
        if self.seen is not None:
            self.seen = paddle.index_select(self.seen, rows, axis=0)
        if self.ids is not None:
            self.ids = paddle.index_select(self.ids, rows, axis=0)
        for held in self.host_held:
            held.reorder(idx)
