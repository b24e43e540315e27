"""A decode step's indexer top-k breaks exact ties as HF's does over its grown key cache.

HF's decode step appends the new key to its DynamicCache and takes torch.topk over the keys cached
so far: a row of exactly ``filled`` scores. The port's cache has a fixed capacity, its unfilled slots
at -inf; on distinct scores a top-k over the whole capacity chooses the same keys, but among exact
ties (the relu's zeros, equal values) torch.topk / std::nth_element choose by the row's length, so
the port must take its top-k over the filled slots only. Measured on the fixture's rows (9 to 200
filled keys, capacity 512, index_topk 8): a top-k over the whole capacity selects another set of
keys than torch over the filled row at 180 of 192 decode steps (another order at all 192).

torch's choices are committed (tests/fixtures/topk_ties/torch_topk.json, "decode";
tools/make_topk_reference.py), so these run without torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import paddle

from paddleformers_glm.modeling.cache import DSACache
from paddleformers_glm.modeling.indexer import DSAIndexer

from ._tiny import tied_index_scores, tiny_config, tiny_model, tokens

DECODE = json.loads((Path(__file__).parent / "fixtures" / "topk_ties" / "torch_topk.json").read_text())["decode"]
CAPACITY = 512


def _row(filled: int) -> np.ndarray:
    """The scores of the query at position filled - 1 against the keys 0..filled-1, as the test's indexer gives them."""
    return tied_index_scores(paddle.to_tensor([[float(filled - 1)]]), paddle.arange(filled, dtype="float32")[None])[0]


def _torch_choice(filled: int) -> np.ndarray:
    return np.array(DECODE["indices"][DECODE["filled"].index(filled)])


def _tied(ix: DSAIndexer) -> None:
    """Score by position: queries and keys carry their position in their first element."""
    ix.chunk_scores = lambda q, k, w: tied_index_scores(q[:, :, 0, 0].unsqueeze(-1), k[:, :, 0].unsqueeze(1))


def test_fixture_rows_are_the_tied_scores():
    rows = np.concatenate([_row(f).numpy() for f in DECODE["filled"]])
    got = hashlib.sha256(np.ascontiguousarray(rows, dtype=np.float32).tobytes()).hexdigest()
    assert got == DECODE["input_sha256"], "tests/_tiny.py's tied scores changed: regenerate the fixture"


def test_decode_step_selects_among_ties_as_torch_over_the_filled_slots():
    """`select` of one new token with ``slots`` over a 512-slot cache and ``n_filled`` = f: torch.topk
    over the f filled keys (indices and their order), -1 past them, for every f of the fixture."""
    cfg = tiny_config()
    ix = DSAIndexer(cfg)
    k = cfg.index_topk
    assert k == DECODE["k"]
    _tied(ix)
    keys = paddle.zeros([1, CAPACITY, ix.head_dim])
    keys[0, :, 0] = paddle.arange(CAPACITY, dtype="float32")
    w = paddle.ones([1, 1, ix.n_heads])
    wrong = []
    for f in DECODE["filled"]:
        q = paddle.zeros([1, 1, ix.n_heads, ix.head_dim])
        q[0, 0, 0, 0] = float(f - 1)
        valid = paddle.to_tensor((np.arange(CAPACITY) < f).astype("int64")[None])
        got = ix.select(q, keys, w, valid, slots=paddle.to_tensor([f - 1]), n_filled=f).numpy()[0, 0]
        assert got.shape == (k,)
        if not np.array_equal(got, _torch_choice(f)):
            wrong.append(f)
    assert not wrong, f"{len(wrong)} decode steps choose other keys than torch over the filled row: f = {wrong[:10]}"


def test_model_decode_steps_pass_the_filled_length_to_the_indexer():
    """Eager decode steps of the tiny model over a cache of capacity 512, one token at a time after an
    8-token prompt, each full layer's indexer scoring by position: every step's top-k is torch's over
    the keys cached so far (what HF's DynamicCache gives), not a choice over the whole capacity."""
    model = tiny_model(0)
    model.eval()
    P, steps = 8, 24
    chosen: dict[int, list[np.ndarray]] = {}
    L = model.config.num_hidden_layers  # the MTP layer (model.layers.L) takes no part in decoding
    indexers = [(n, ix) for n, ix in model.named_sublayers() if isinstance(ix, DSAIndexer) and int(n.split(".")[2]) < L]
    assert len(indexers) == model.config.indexer_types.count("full")
    for name, ix in indexers:
        _tied(ix)
        seen = {"next": 0}
        finish, select = ix.finish_projection, ix.select

        def finish_projection(q, k, w, cos, sin, finish=finish, seen=seen):
            q, k, w = finish(q, k, w, cos, sin)
            S = q.shape[1]
            pos = paddle.arange(seen["next"], seen["next"] + S, dtype="float32")
            seen["next"] += S
            q = paddle.zeros_like(q)
            q[:, :, 0, 0] = pos.unsqueeze(0).expand([q.shape[0], S])
            k = paddle.zeros_like(k)
            k[:, :, 0] = pos.unsqueeze(0).expand([k.shape[0], S])
            return q, k, paddle.ones_like(w)

        def recording_select(*a, select=select, name=name, **kw):
            out = select(*a, **kw)
            if kw.get("slots") is not None:
                chosen.setdefault(name, []).append(out.numpy()[0, 0])
            return out

        ix.finish_projection, ix.select = finish_projection, recording_select
    ids = tokens(1, P + steps)
    cache = DSACache.for_config(model.config, 1, capacity=CAPACITY)
    with paddle.no_grad():
        model(ids[:, :P], past_key_values=cache, use_cache=True)
        for t in range(P, P + steps):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    assert sorted(chosen) == sorted(n for n, _ in indexers)
    for name, got in chosen.items():
        assert len(got) == steps
        wrong = [P + 1 + i for i, g in enumerate(got) if not np.array_equal(g, _torch_choice(P + 1 + i))]
        assert not wrong, f"{name}: {len(wrong)} of {steps} decode steps choose other keys than torch: f = {wrong[:8]}"
