#!/usr/bin/env python
"""How torch (the reference) breaks exact ties in a top-k: tests/fixtures/topk_ties/torch_topk.json.

torch.topk's indices on rows full of equal values at row lengths 64 k - 1, 64 k and 64 k + 1 (the
length where Paddle's and torch's CPU kernels pick different algorithms, ops.topk), and HF's
router choice (1 of 64 experts) on tied scores. The inputs come from fixed numpy seeds; their
sha256 is recorded so a numpy that draws other numbers is caught before any index is compared.
tests/test_topk_ties.py holds ops.topk and the router to these indices without torch.

"decode": HF's decode-step choice over its grown key cache: torch.topk(index_topk 8) of the row of
the query at position f - 1 against the keys 0..f-1 (f = 9..200), the scores tests/_tiny.py's
`tied_index_scores` gives (relu((7 q + 3 k) mod 5 - 2): exact zeros and equal values).
tests/test_indexer_decode_ties.py holds a decode step's selection to them.

    python tools/make_topk_reference.py            # rewrite the fixture
    python tools/make_topk_reference.py --check    # compare with the committed file, exit 1 if it differs
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "topk_ties" / "torch_topk.json"
ROWS = 64
ROUTER_SEED, ROUTER_WIDTH = 5, 64


def tied_rows(k: int, extra: int) -> np.ndarray:
    """ROWS rows of 64 k + extra values in {0, 1, 2, 3}; row 0 half -inf, row 1 one NaN."""
    n = 64 * k + extra
    v = np.random.default_rng(k).integers(0, 4, size=(ROWS, n)).astype(np.float32)
    v[0, : n // 2] = -np.inf
    v[1, 3] = np.nan
    return v


def router_weight() -> np.ndarray:
    """[hidden 64, experts 64] router weight of tied values; the router's inputs are the identity."""
    w = np.random.default_rng(ROUTER_SEED).integers(0, 4, size=(ROUTER_WIDTH, ROUTER_WIDTH)) * 0.25
    return w.astype("float32")


DECODE_TOPK, DECODE_FILLED = 8, range(9, 201)


def decode_row(filled: int) -> np.ndarray:
    """The index scores of the query at position filled - 1 against the keys 0..filled-1."""
    j = np.arange(filled, dtype=np.float32)
    return np.maximum(np.mod(np.float32(7 * (filled - 1)) + 3 * j, np.float32(5)) - np.float32(2), 0).astype(np.float32)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def build() -> dict:
    import torch
    import transformers
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    cases = []
    for k in (1, 2, 8):
        for extra in (-1, 0, 1):
            v = tied_rows(k, extra)
            idx = torch.topk(torch.from_numpy(v), k, dim=-1).indices.numpy()
            cases.append({"k": k, "extra": extra, "input_sha256": sha(v), "indices": idx.tolist()})
    w = router_weight()
    cfg = GlmMoeDsaConfig(hidden_size=ROUTER_WIDTH, n_routed_experts=ROUTER_WIDTH, num_experts_per_tok=1)
    cfg.n_group = cfg.topk_group = 1
    router = GlmMoeDsaTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w.T.copy()))
        _, _, choice = router(torch.eye(ROUTER_WIDTH))
    rows = [decode_row(f) for f in DECODE_FILLED]
    decode = {
        "k": DECODE_TOPK,
        "filled": list(DECODE_FILLED),
        "input_sha256": sha(np.concatenate(rows)),
        "indices": [torch.topk(torch.from_numpy(r), DECODE_TOPK).indices.tolist() for r in rows],
    }
    return {
        "decode": decode,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "topk": cases,
        "router": {"weight_sha256": sha(w), "choice": choice.numpy().tolist()},
    }


def main(argv: list[str] | None = None) -> int:
    from make_nonfinite_reference import write_or_check  # tools/ is the script's own folder

    text = json.dumps(build(), separators=(",", ":"), sort_keys=True) + "\n"
    return write_or_check(OUT, text, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
