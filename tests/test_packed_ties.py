"""Packed sequences under exact ties in the DSA index scores.

transformers 5.23 selects a packed sequence's top-k keys with one torch.topk over the whole packed
row (length S; the other sequences' keys and the future masked), and torch breaks exact ties
(the relu's zeros; every score 0 when an indexer's weights_proj is zero) by the row's length
(std::nth_element / partial_sort, tests/test_topk_ties.py). Our packed forward runs each sequence
as a row of a padded batch (modeling/packing.py), so its top-k must be taken as over the packed
row, not over the padded row: it picked other keys there (logits off by up to 3.9 on the tiny
fixture with every weights_proj zeroed). A consequence, measured in transformers and pinned here:
under such ties a sequence's output depends on the sequences packed beside it (it is not the
sequence's output alone).

The transformers logits are committed (tests/fixtures/packed_ties/hf_logits.json, written by
running this file with the reference extra: ``python tests/test_packed_ties.py``), so the first test
runs without torch; the reference tier checks them live and the indexer against torch.topk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
FIXTURE = ROOT / "tests" / "fixtures" / "packed_ties" / "hf_logits.json"
COLS = 16  # logits kept per position in the fixture (the first COLS of the vocabulary)
# sequences packed per row (each row's lengths sum to its length); index_topk is 8, so the
# sequences longer than 8 have queries choosing among more keys than they keep
CASES = {"one_row": [[12, 10, 8]], "two_rows": [[20, 10], [9, 9, 9, 3]]}


def _inputs(rows: list[list[int]], seed: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(3, 256, (len(rows), sum(rows[0]))).astype(np.int64)
    pos = np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]).astype(np.int64)
    return ids, pos


def _spans(rows: list[list[int]]) -> list[tuple[int, int, int]]:
    """(row, first token, end) of every packed sequence."""
    out = []
    for b, row in enumerate(rows):
        bounds = np.cumsum([0, *row]).tolist()
        out += [(b, s0, s1) for s0, s1 in zip(bounds, bounds[1:])]
    return out


def _tied_paddle():
    """The tiny fixture with every indexer's weights_proj zeroed: every index score is exactly 0."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.modeling.indexer import DSAIndexer

    model = GlmMoeDsaForCausalLM.from_pretrained(CHECKPOINT, dtype="float32")
    model.eval()
    n = 0
    for layer in model.sublayers():
        if isinstance(layer, DSAIndexer):
            layer.weights_proj.weight.set_value(paddle.zeros_like(layer.weights_proj.weight))
            n += 1
    assert n >= 3
    return model


def _tied_torch():
    import torch
    import transformers

    torch.set_num_threads(1)
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(CHECKPOINT), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "indexer.weights_proj" in name:
                p.zero_()
    return torch, hf


def _ours(model, ids: np.ndarray, pos: np.ndarray, rows: list[list[int]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits of the packed rows, and of each sequence run alone."""
    packed = model(paddle.to_tensor(ids), position_ids=paddle.to_tensor(pos), use_cache=False).logits.numpy()
    alone = [
        model(paddle.to_tensor(ids[b : b + 1, s0:s1]), use_cache=False).logits.numpy()[0] for b, s0, s1 in _spans(rows)
    ]
    return packed, alone


def hf_reference(cols: int | None = COLS) -> dict:
    """transformers 5.23 on the tied tiny fixture, per case: the inputs, the packed logits and each
    sequence's logits alone (the first ``cols`` of the vocabulary; None: all)."""
    torch, hf = _tied_torch()
    out = {}
    for seed, (name, rows) in enumerate(CASES.items()):
        ids, pos = _inputs(rows, seed)
        with torch.no_grad():
            packed = hf(torch.tensor(ids), position_ids=torch.tensor(pos), use_cache=False).logits.numpy()
            alone = [
                hf(torch.tensor(ids[b : b + 1, s0:s1]), use_cache=False).logits.numpy()[0] for b, s0, s1 in _spans(rows)
            ]
        out[name] = {
            "rows": rows,
            "input_ids": ids.tolist(),
            "position_ids": pos.tolist(),
            "packed": packed[..., :cols],
            "alone": [a[..., :cols] for a in alone],
        }
    return out


def _depends_on_neighbours(packed: np.ndarray, alone: list[np.ndarray], rows: list[list[int]]) -> float:
    """The largest difference between a sequence's packed logits and its logits alone."""
    return max(float(np.abs(packed[b, s0:s1] - a).max()) for (b, s0, s1), a in zip(_spans(rows), alone))


def test_packed_ties_break_as_transformers():
    """Every index score 0 (weights_proj zeroed): the packed forward's logits are transformers'
    (committed, within 5e-5; measured 4.8e-6 and 7.2e-6 over all logits), where the top-k over the
    padded rows gave 3.4 and 3.3 off; and so are each sequence's logits alone, which differ from its
    packed ones by up to 3.3 in transformers: a sequence's selection depends on its packed row."""
    want = json.loads(FIXTURE.read_text())
    model = _tied_paddle()
    for name, rows in CASES.items():
        case = want[name]
        assert case["rows"] == rows
        ids, pos = np.array(case["input_ids"]), np.array(case["position_ids"])
        packed, alone = _ours(model, ids, pos, rows)
        np.testing.assert_allclose(packed[..., :COLS], np.array(case["packed"]), atol=5e-5, err_msg=name)
        hf_alone = [np.array(a) for a in case["alone"]]
        for got, a in zip(alone, hf_alone):
            np.testing.assert_allclose(got[..., :COLS], a, atol=5e-5, err_msg=name)
        assert _depends_on_neighbours(np.array(case["packed"]), hf_alone, rows) > 0.5, name  # transformers'


@pytest.mark.reference
def test_packed_ties_equal_transformers_live():
    """The live twin, every logit: transformers 5.23 and ours on the tied fixture, packed and each
    sequence alone; the committed fixture is what transformers gives."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    live = hf_reference(cols=None)
    committed = json.loads(FIXTURE.read_text())
    model = _tied_paddle()
    for name, rows in CASES.items():
        case = live[name]
        np.testing.assert_allclose(np.array(committed[name]["packed"]), case["packed"][..., :COLS], atol=1e-5)
        packed, alone = _ours(model, np.array(case["input_ids"]), np.array(case["position_ids"]), rows)
        np.testing.assert_allclose(packed, case["packed"], atol=5e-5, err_msg=name)
        for got, a in zip(alone, case["alone"]):
            np.testing.assert_allclose(got, a, atol=5e-5, err_msg=name)
        assert _depends_on_neighbours(case["packed"], case["alone"], rows) > 0.5, name


@pytest.mark.reference
@pytest.mark.parametrize("lengths", [[12, 10, 8], [3, 20, 7, 30], [300, 200, 12]], ids=lambda x: "_".join(map(str, x)))
def test_packed_indexer_selects_as_torch_topk_over_the_packed_row(lengths):
    """The indexer's selection for packed sequences (one padded batch, its mask carrying their
    placement) on scores full of exact ties but not all equal (tests/_tiny.py's pattern, by position
    within the sequence): each query's keys and their order are torch.topk's over the whole packed
    row, the other sequences' keys and the future at finfo.min as transformers' eager mask puts
    them (the -1 slots where the query sees fewer keys than it keeps). 512 keys: 64 k, where
    partial_sort takes over."""
    torch = pytest.importorskip("torch")
    from paddleformers_glm.modeling.indexer import DSAIndexer
    from paddleformers_glm.modeling.packing import packed_sequences

    from ._tiny import score_indexer_by_position, tied_index_scores, tiny_config

    cfg = tiny_config()
    ix = DSAIndexer(cfg)
    k, S = cfg.index_topk, sum(lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    (group,) = packed_sequences(paddle.to_tensor(pos[None]), grouped=False).groups
    n, width = group.mask.shape
    score_indexer_by_position(ix, n, width)
    got = ix(
        paddle.zeros([n, width, cfg.hidden_size]), paddle.zeros([n, width, cfg.q_lora_rank]), None, None, group.mask
    )
    got = got.numpy()
    p = paddle.to_tensor(pos.astype(np.float32))
    full = torch.from_numpy(tied_index_scores(p.unsqueeze(-1), p.unsqueeze(0)).numpy())  # [S, S] by position
    seq = np.repeat(np.arange(len(lengths)), lengths)
    visible = torch.from_numpy((seq[:, None] == seq[None]) & (np.arange(S)[None] <= np.arange(S)[:, None]))
    masked = torch.where(visible, torch.zeros(()), torch.full((), torch.finfo(torch.float32).min))
    want = (full + masked).topk(min(k, S), dim=-1).indices.numpy()
    for r, (_, s0, s1) in enumerate(group.spans):
        for i in range(s1 - s0):
            seen = min(i + 1, k)
            np.testing.assert_array_equal(
                got[r, i, :seen], want[s0 + i, :seen] - s0, err_msg=f"{lengths} seq {r} query {i}"
            )
            assert (got[r, i, seen:] == -1).all()


if __name__ == "__main__":  # regenerate the fixture (needs torch + transformers 5.23)
    doc = hf_reference()
    for case in doc.values():
        case["packed"] = np.round(case["packed"].astype(np.float64), 6).tolist()
        case["alone"] = [np.round(a.astype(np.float64), 6).tolist() for a in case["alone"]]
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print("wrote", FIXTURE, file=sys.stderr)
