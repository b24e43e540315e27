"""Text generation for GlmMoeDsaForCausalLM: a prefill into the decoding cache, then one token per
step (``modeling/cache.py``, ``MLAttention.forward_decode``).

Greedy decoding gives HF transformers' ``generate`` tokens (tests/test_generate.py holds it to the
HF fixtures). Sampling applies, as HF's default processors do, temperature, then top-k, then
top-p, and draws from a NumPy generator seeded by ``seed`` (reproducible, independent of Paddle's
global RNG). Left padding is supported: rope positions count each row's real tokens and padding
slots are never selected, so a padded row generates what it generates alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import paddle
# paddle is imported inside the functions: the CLI imports this module at start-up


def eos_ids(eos_token_id: int | Sequence[int] | None, config: object) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> np.ndarray:
    """One token per row from logits [B, V] (float64)."""
    x = logits / max(float(temperature), 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:  # keep the smallest set of most likely tokens whose mass reaches top_p
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        drop_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p >= top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p], dtype=np.int64)


def generate(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor,
    attention_mask: paddle.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
    streamer: Callable[[np.ndarray], None] | None = None,
    decode_step: Callable[..., paddle.Tensor] | None = None,
) -> paddle.Tensor:
    """The prompt followed by up to ``max_new_tokens`` new tokens per row, [B, S + n] int64.

    ``attention_mask`` [B, S] (1 = token, 0 = padding) allows left-padded batches. A row that
    produced an EOS token (``eos_token_id``, default the config's; ``[]`` for none) continues with
    ``pad_token_id`` (default the config's, else 0); generation stops early once every row has
    finished. ``streamer`` is called with each step's new tokens [B] as they are chosen.
    ``decode_step`` replaces ``model.decode_step`` (same arguments), e.g. by its
    ``paddle.jit.to_static`` capture; the cache is allocated once for the whole generation, so the
    step's shapes never change.
    """
    import paddle

    from .modeling.cache import DSACache

    if input_ids.ndim != 2:
        raise ValueError(f"generate: input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    config = model.config
    input_ids = input_ids.astype("int64")
    B, S = input_ids.shape
    if attention_mask is not None and list(attention_mask.shape) != [B, S]:
        raise ValueError(f"generate: attention_mask shape {list(attention_mask.shape)} != input_ids shape {[B, S]}")
    eos = eos_ids(eos_token_id, config)
    if pad_token_id is None:
        pad_token_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    rng = np.random.default_rng(seed)
    if max_new_tokens == 0:
        return input_ids
    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            cache = DSACache.for_config(config, B, capacity=S + max_new_tokens)
            out = model(input_ids, attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits_t = out.logits[:, -1]
            step_fn = decode_step or model.decode_step
            finished = np.zeros([B], dtype=bool)
            new: list[np.ndarray] = []
            for step in range(max_new_tokens):
                logits = logits_t.astype("float32").numpy().astype(np.float64)  # [B, V]: the one host read
                if do_sample:
                    nxt = _sample(logits, temperature, top_k, top_p, rng)
                else:
                    nxt = logits.argmax(axis=-1).astype(np.int64)
                nxt = np.where(finished, pad_token_id, nxt)
                if eos:
                    finished |= np.isin(nxt, eos)
                new.append(nxt)
                if streamer is not None:
                    streamer(nxt)
                if finished.all() or step == max_new_tokens - 1:
                    break
                positions, _ = cache.begin(None, 1)
                logits_t = step_fn(paddle.to_tensor(nxt[:, None]), positions, cache.slots, cache)
                cache.advance(1)
    finally:
        if was_training:
            model.train()
    return paddle.concat([input_ids, paddle.to_tensor(np.stack(new, axis=1))], axis=1)


class CudaGraphDecodeStep:
    """`model.decode_step` captured once as a CUDA graph and replayed for every later step:
    ``generate(model, ids, decode_step=CudaGraphDecodeStep(model))`` on a GPU.

    The step's shapes follow the cache's capacity and it reads nothing back to the host (the
    cache writes by device-side index_put, MoE in its static-shape form while capturing), so one
    capture serves the whole generation; each call copies the step's inputs into the captured
    ones. The first call runs eagerly (its logits are returned) and captures; it binds to that
    call's cache. Not exercised without a GPU (the CPU build has no CUDA graphs).
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
        return self.logits


def _mtp_step(model: paddle.nn.Layer, mtp: paddle.nn.Layer, cache: object, hidden: paddle.Tensor, ids: paddle.Tensor):
    """The MTP layer on n new positions i (main hidden h_i [B, n, H], token i+1 ids [B, n]) through
    its own one-layer cache; -> logits of the last position (the draft for token i+2) [B, V]."""

    n = ids.shape[1]
    prefill = cache.length == 0
    positions, key_valid = cache.begin(None, n)
    cos, sin = model.model.rotary_emb(positions)
    x, _, _ = mtp(
        hidden, model.model.embedding(ids), cos, sin, None if prefill else key_valid, None, cache=cache.layers[0]
    )
    cache.advance(n)
    return model.logits(mtp.norm(x[:, -1:]))[:, -1]


def generate_speculative(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor,
    max_new_tokens: int = 20,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[paddle.Tensor, dict]:
    """Greedy decoding with the first MTP layer as the draft model (one row, no padding).

    Each step the MTP layer drafts the token after the next from the main model's last hidden
    state; the main model then scores [next, draft] in one forward and keeps the draft only if it
    is its own greedy choice (a rejected draft's cache slot is rolled back). The tokens are
    therefore greedy decoding's; the MTP layer, run with its own indexer and cache, only decides how
    many forwards that takes. Returns (prompt + new tokens [1, S + n], {"drafted", "accepted",
    "acceptance_rate", "main_forwards"}).
    """
    import paddle

    from .modeling.cache import DSACache

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate_speculative: one row [1, seq] expected, got shape {list(input_ids.shape)}")
    if not model.model.mtp_layers:
        raise ValueError("generate_speculative: the model has no MTP layer (num_nextn_predict_layers = 0)")
    mtp = model.model.mtp_layers[0]
    eos = set(eos_ids(eos_token_id, model.config))
    input_ids = input_ids.astype("int64")
    S = input_ids.shape[1]
    stats = {"drafted": 0, "accepted": 0, "main_forwards": 1}
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            cache = DSACache.for_config(model.config, 1, capacity=S + max_new_tokens + 2)
            mtp_cache = DSACache([True], 1, capacity=S + max_new_tokens + 2)
            out = model(input_ids, past_key_values=cache, use_cache=True)
            h = out.last_hidden_state  # [1, S, H]
            nxt = int(out.logits[0, -1].argmax())
            if S > 1:  # MTP positions 0 .. S-2: (h_i, token i+1)
                _mtp_step(model, mtp, mtp_cache, h[:, :-1], input_ids[:, 1:])
            h_last = h[:, -1:]
            while len(new) < max_new_tokens:
                new.append(nxt)
                if nxt in eos or len(new) == max_new_tokens:
                    break
                draft = int(_mtp_step(model, mtp, mtp_cache, h_last, paddle.to_tensor([[nxt]]))[0].argmax())
                stats["drafted"] += 1
                out = model(paddle.to_tensor([[nxt, draft]]), past_key_values=cache)
                stats["main_forwards"] += 1
                y = out.logits[0].argmax(axis=-1).numpy()  # greedy after `nxt`, after `draft`
                hs = out.last_hidden_state
                if int(y[0]) == draft:
                    stats["accepted"] += 1
                    new.append(draft)
                    if draft in eos or len(new) == max_new_tokens:
                        break
                    _mtp_step(model, mtp, mtp_cache, hs[:, :1], paddle.to_tensor([[draft]]))
                    h_last, nxt = hs[:, 1:2], int(y[1])
                else:
                    cache.rollback(1)
                    h_last, nxt = hs[:, :1], int(y[0])
    finally:
        if was_training:
            model.train()
    stats["acceptance_rate"] = stats["accepted"] / max(stats["drafted"], 1)
    out_ids = paddle.concat([input_ids, paddle.to_tensor([new], dtype="int64")], axis=1)
    return out_ids, stats
