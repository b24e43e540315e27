"""The decoding cache of GLM-5.2: per layer the MLA latent row ``[c, rope(k_rot)]`` of every past
token and, on layers that own a DSA indexer, the indexer's key; never per-head keys and values
(docs/model.md, "Decoding").

All rows of a batch advance together: left padding occupies slots that ``key_valid`` marks
invalid, and ``positions`` counts each row's real tokens, so a padded row decodes as if alone. A
decode step sees the cache through tensors of capacity-sized shapes only (``slots``,
``key_valid``, the preallocated buffers), never the Python ``length``, so one traced or captured
step serves every step of a generation; ``begin`` grows the buffers outside the step.
"""

from __future__ import annotations

import numbers

import paddle

from ..ops.norm import capturing_cuda_graph


class LayerCache:
    """One decoder layer's cache: latent rows [B, cap, kv_lora + rope] and, for a layer with its
    own indexer, indexer keys [B, cap, index_head_dim]."""

    def __init__(self, owner: DSACache) -> None:
        self.owner = owner
        self.latent: paddle.Tensor | None = None
        self.index_keys: paddle.Tensor | None = None
        # the layer's decode-step weights, prepared by the layer on its first decode step with this
        # cache (attention.prepare_decode_weights) and kept while the cache lives
        self.decode_weights: object = None

    def _write(self, buf: paddle.Tensor | None, new: paddle.Tensor, start: int) -> paddle.Tensor:
        B, n, D = new.shape
        capacity = self.owner.capacity_for(n)
        if buf is None or buf.shape[1] < start + n:
            buf = _grown(buf, [B, max(capacity, start + n), D], new.dtype, start)
        buf[:, start : start + n] = new
        return buf

    def put_latent(self, latent: paddle.Tensor) -> None:
        """Store the latent rows [B, n, kv_lora + rope] of the tokens being processed (slots
        [length, length + n) of the owner)."""
        self.latent = self._write(self.latent, latent.detach(), self.owner.length)

    def index_keys_through(self, keys: paddle.Tensor) -> paddle.Tensor:
        """Store the indexer keys [B, n, Di] of the tokens being processed and return every cached
        key through them [B, length + n, Di] (what a prefill's indexer scores its queries against)."""
        self.index_keys = self._write(self.index_keys, keys.detach().astype("float32"), self.owner.length)
        return self.index_keys[:, : self.owner.length + keys.shape[1]]  # type: ignore[index]

    # -------------------------------------------------------------- decode steps (tensor slots)
    def write_slots(self, name: str, new: paddle.Tensor, slots: paddle.Tensor) -> paddle.Tensor:
        """Write the new tokens' rows [B, n, D] (latent rows, or indexer keys in fp32) into their
        slots (``slots`` [n] int64, consecutive) of buffer ``name`` ("latent" or "index_keys") in
        place; -> the whole buffer [B, capacity, D], what the decode step reads."""
        buf = getattr(self, name)
        if buf is None:
            raise RuntimeError("a decode step needs a prefilled cache (run the prompt through the model first)")
        if capturing_cuda_graph():  # index tensors on the device: a slice's tensor bounds are read on the host
            B, n = new.shape[0], new.shape[1]
            rows = paddle.arange(B, dtype="int64").unsqueeze(1).expand([B, n]).reshape([-1])
            buf.index_put_((rows, slots.unsqueeze(0).expand([B, n]).reshape([-1])), new.reshape([B * n, -1]))
            return buf
        first = slots[:1]
        buf[:, first : first + new.shape[1]] = new  # slice bounds as tensors: traceable (to_static)
        return buf

    def grow(self, capacity: int, filled: int) -> None:
        """Reallocate the buffers to ``capacity`` slots, keeping the first ``filled``."""
        for name in ("latent", "index_keys"):
            buf = getattr(self, name)
            if buf is not None and buf.shape[1] < capacity:
                setattr(self, name, _grown(buf, [buf.shape[0], capacity, buf.shape[2]], None, filled))


def _grown(buf: paddle.Tensor | None, shape: list[int], dtype: object, keep: int) -> paddle.Tensor:
    grown = paddle.zeros(shape, dtype=dtype if buf is None else buf.dtype)
    if buf is not None and keep > 0:
        grown[:, :keep] = buf[:, :keep]
    return grown


class DSACache:
    """The whole model's decoding cache (``past_key_values``). ``length`` slots are filled; the
    slots being written by the current forward are [length, length + n) until ``advance(n)``."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int = 0) -> None:
        self.layers = [LayerCache(self) for _ in range(num_layers)]
        self.batch_size = int(batch_size)
        self.capacity = int(capacity)
        self.length = 0
        self.key_valid: paddle.Tensor | None = None  # [B, cap] bool: slot holds a real token
        self.positions = paddle.zeros([batch_size], dtype="int64")  # next rope position per row
        self.slots: paddle.Tensor | None = None  # [n] int64: the slots of the forward in progress
        self._slot_ids: paddle.Tensor | None = None  # arange(capacity), sliced into `slots`
        # with keep_topk (speculative decoding sets it), the top-k [B, n, k] (cache slots) the last
        # decoder layer used in the latest `forward` over this cache: what an MTP layer with
        # index_share_for_mtp_iteration attends with. Off by default: a prefill's is [B, S, k] int64
        # (2 GiB per row at 128K tokens and k 2048), not to be held for a whole generation.
        self.keep_topk = False
        self.topk: paddle.Tensor | None = None

    @classmethod
    def for_config(cls, config: object, batch_size: int, capacity: int = 0) -> DSACache:
        return cls(int(config.num_hidden_layers), batch_size, capacity)  # type: ignore[attr-defined]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots filled so far (padding slots included), as HF's ``Cache.get_seq_length(layer_idx=0)``:
        every layer holds the same slots; a ``layer_idx`` past the last layer is 0 (transformers 5.23's
        DynamicCache: a layer it holds no states for), a negative one counts from the end."""
        if layer_idx >= len(self.layers):
            return 0
        if layer_idx < -len(self.layers):  # transformers' list lookup
            raise IndexError(f"get_seq_length: layer {layer_idx} of a cache of {len(self.layers)} layers")
        return self.length

    def __len__(self) -> int:
        """The number of decoder layers the cache holds, as HF's ``len(cache)``."""
        return len(self.layers)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no maximum, as transformers 5.23's DynamicCache (``capacity`` is what is allocated now;
        the buffers grow when a forward needs more)."""
        return -1

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` slots in all (allocated on the next ``begin`` when none is yet):
        a decode step's shapes follow the capacity, so a generation reserves its whole length before
        the prefill and no step reallocates."""
        if capacity <= self.capacity:
            return
        self.capacity = int(capacity)
        if self.key_valid is not None:
            self._grow_to(self.capacity)

    def _grow_to(self, cap: int) -> None:
        """Reallocate every buffer to ``cap`` slots, keeping the filled ones (the key validity, each
        layer's rows, the slot ids)."""
        self.key_valid = _grown(self.key_valid, [self.batch_size, cap], "bool", self.length)
        for layer in self.layers:
            layer.grow(cap, self.length)
        self._slot_ids = paddle.arange(cap, dtype="int64")

    def crop(self, tokens_to_remove: int) -> None:
        """transformers 5.23's ``Cache.crop``: forget the last ``-tokens_to_remove`` filled slots (a
        negative count; all of them when it exceeds the length; 0: nothing); a positive value, the
        older "crop to this length" form, is refused as there. Each row's rope position goes back by
        its real tokens among them (``rollback``)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
            raise TypeError(f"crop: tokens_to_remove must be an int, got {tokens_to_remove!r}")
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            hint = (
                f", e.g. crop({tokens_to_remove - self.length}) keeps {tokens_to_remove} of the {self.length} cached tokens"
                if tokens_to_remove < self.length
                else ""
            )
            raise ValueError(
                f"crop({tokens_to_remove}): a positive value is not supported (as transformers 5.23); pass a "
                f"negative number of tokens to remove{hint}"
            )
        self.rollback(min(-tokens_to_remove, self.length))

    def batch_select_indices(self, indices: paddle.Tensor | list[int]) -> None:
        """Keep the rows ``indices`` (HF's ``Cache.batch_select_indices``: an index list or tensor,
        repeats allowed; a bool mask of the batch keeps its True rows), in this order."""
        idx = paddle.to_tensor(indices) if not isinstance(indices, paddle.Tensor) else indices
        if idx.dtype == paddle.bool:
            if list(idx.shape) != [self.batch_size]:
                raise IndexError(f"batch_select_indices: a bool mask of {list(idx.shape)} for {self.batch_size} rows")
            idx = paddle.nonzero(idx).reshape([-1])
        elif idx.dtype not in (paddle.int32, paddle.int64, paddle.int16, paddle.int8, paddle.uint8) or idx.ndim > 1:
            raise IndexError(  # torch: "tensors used as indices must be long, int, byte or bool"
                f"batch_select_indices: indices must be a 1-D list or tensor of ints or a bool mask, got "
                f"{str(idx.dtype).replace('paddle.', '')} of shape {list(idx.shape)}"
            )
        idx = idx.astype("int64").reshape([-1])
        bad = [int(i) for i in idx.numpy() if not -self.batch_size <= int(i) < self.batch_size]
        if bad:
            raise IndexError(f"batch_select_indices: index {bad[0]} is out of bounds for {self.batch_size} rows")
        self._select_rows(paddle.where(idx < 0, idx + self.batch_size, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (HF's ``Cache.batch_repeat_interleave``; an int >= 1)."""
        if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
            raise ValueError(f"batch_repeat_interleave: repeats must be an int >= 1, got {repeats!r}")
        self._select_rows(paddle.repeat_interleave(paddle.arange(self.batch_size, dtype="int64"), int(repeats)))

    def _select_rows(self, idx: paddle.Tensor) -> None:
        """The cache of rows ``idx`` [N] (new buffers: the batch size may change; a decode step
        captured for the old ones no longer applies)."""

        def pick(buf: paddle.Tensor | None) -> paddle.Tensor | None:
            return None if buf is None else paddle.index_select(buf, idx, axis=0)

        self.key_valid, self.positions, self.topk = pick(self.key_valid), pick(self.positions), pick(self.topk)
        if getattr(self, "_pending_positions", None) is not None:
            self._pending_positions = pick(self._pending_positions)
        for layer in self.layers:
            layer.latent, layer.index_keys = pick(layer.latent), pick(layer.index_keys)
        self.batch_size = int(idx.shape[0])

    def capacity_for(self, n: int) -> int:
        if self.length + n > self.capacity:
            self.capacity = max(2 * self.capacity, self.length + n)
        return self.capacity

    def begin(self, attention_mask: paddle.Tensor | None, n: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Start a forward over n new tokens per row. attention_mask (1 = real token, None = all
        real) covers the new tokens [B, n] or, as HF callers pass it, past and new [B, length + n]:
        its past columns then replace the cached slots' validity, as transformers applies the whole
        mask at every step (a [B, n] mask or None keeps the validity stored when each slot was filled).

        Returns (rope positions [B, n] int64: each real token's counts the row's real tokens before
        it, a padding slot's is its offset after the row's past; key validity [B, capacity] bool: slots past the new
        tokens are False or, after a rollback, stale, so readers also compare slots with the
        queries'). ``slots`` becomes the new tokens' slots [n]."""
        B = self.batch_size
        past_valid = None
        if attention_mask is None:
            new_valid = None
            ids = self._slot_ids  # arange(capacity): a slice of it, not a new arange per step
            steps = ids[1 : n + 1] if ids is not None and n < ids.shape[0] else paddle.arange(1, n + 1, dtype="int64")
            steps = steps.unsqueeze(0)  # [1, n]: 1, 2, ..., n
        else:
            shape = list(attention_mask.shape)
            if shape not in ([B, n], [B, self.length + n]):
                raise ValueError(
                    f"attention_mask shape {shape}: expected [{B}, {n}] (new tokens) or "
                    f"[{B}, {self.length + n}] (cached + new tokens)"
                )
            new_valid = attention_mask[:, shape[1] - n :].astype("bool")
            if shape[1] > n:
                past_valid = attention_mask[:, : self.length].astype("bool")
            steps = paddle.cumsum(new_valid.astype("int64"), axis=1)  # real tokens up to and including each slot
        positions = self.positions.unsqueeze(1) + steps - 1
        if new_valid is not None:  # a padding slot: the position its slot would have without padding,
            # as transformers' forward gives it (arange): only the pad's own output depends on it (no
            # query sees a pad key), which then equals transformers' on right padding (its logits count
            # in a loss whose pad labels are not -100)
            offsets = paddle.arange(n, dtype="int64").unsqueeze(0)
            positions = paddle.where(new_valid, positions, self.positions.unsqueeze(1) + offsets)
        cap = self.capacity_for(n)
        if self.key_valid is None or self.key_valid.shape[1] < cap:
            self._grow_to(cap)
        if past_valid is not None:
            self.key_valid[:, : self.length] = past_valid
        self.key_valid[:, self.length : self.length + n] = True if new_valid is None else new_valid
        self.slots = self._slot_ids[self.length : self.length + n]
        self._pending_positions = self.positions + steps[:, -1]
        return positions, self.key_valid

    def advance(self, n: int) -> None:
        """The forward over n new tokens is complete: they become part of the past."""
        self.length += n
        self.positions = self._pending_positions

    def reorder_cache(self, beam_idx: paddle.Tensor) -> None:
        """Row ``i`` becomes what row ``beam_idx[i]`` was (beam search keeps its best beams; HF's
        ``Cache.reorder_cache``), in place: the buffers keep their storage, so a captured decode
        step still reads them."""
        idx = beam_idx.astype("int64")
        bufs = [self.key_valid, self.positions, self.topk]
        bufs += [buf for layer in self.layers for buf in (layer.latent, layer.index_keys)]
        for buf in bufs:
            if buf is not None:
                paddle.assign(paddle.index_select(buf, idx, axis=0), output=buf)

    def rollback(self, n: int) -> None:
        """Forget the last n filled slots (rejected speculative tokens): their rows are overwritten
        by the next forward, and each row's rope position goes back by its real tokens among them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"rollback({n}) with {self.length} filled slots")
        if n:
            gone = self.key_valid[:, self.length - n : self.length].astype("int64").sum(axis=1)
            self.positions = self.positions - gone
            self.length -= n
