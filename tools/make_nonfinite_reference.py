#!/usr/bin/env python
"""What torch (the reference) does with non-finite logits: tests/fixtures/nonfinite/torch_rows.json.

Cross-entropy per row (values and which gradient rows stay finite) and softmax probabilities over
six rows holding NaN, +inf and -inf in every position that matters. The Paddle fallbacks are held
to the finite/NaN pattern recorded here (tests/test_cpu_kernels.py), so the suite needs no torch.
Non-finite numbers are written as the strings "nan", "inf", "-inf" (the file is strict JSON).

    python tools/make_nonfinite_reference.py            # rewrite the fixture
    python tools/make_nonfinite_reference.py --check    # compare with the committed file, exit 1 if it differs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nonfinite" / "torch_rows.json"
NAN, INF = float("nan"), float("inf")
LOGITS = [[1, NAN, 3], [1, INF, 2], [1, -INF, 2], [-INF, 2, 1], [-INF, -INF, -INF], [1, 2, 3]]
TARGET = [0, 0, 0, 0, 1, 2]


def _enc(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(np.float32(x))


def build() -> dict:
    import torch

    x = torch.tensor(np.array(LOGITS, "float32"), requires_grad=True)
    loss = torch.nn.functional.cross_entropy(x, torch.tensor(TARGET), reduction="none")
    loss.sum().backward()
    probs = torch.softmax(x.detach(), -1)
    return {
        "torch": torch.__version__.split("+")[0],
        "logits": [[_enc(v) for v in row] for row in LOGITS],
        "target": TARGET,
        "cross_entropy": [_enc(v) for v in loss.detach().tolist()],
        "cross_entropy_grad_row_finite": [bool(np.isfinite(r).all()) for r in x.grad.numpy()],
        "softmax": [[_enc(v) for v in row] for row in probs.tolist()],
    }


def write_or_check(out: Path, text: str, argv: list[str] | None, doc: str) -> int:
    """The fixture tools' command line: write ``text`` to ``out`` atomically, or with ``--check``
    compare it with the committed file (exit 1 if it differs)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    if ap.parse_args(argv).check:
        same = out.read_text() == text
        print(f"{out}: {'equal' if same else 'DIFFERS'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    text = json.dumps(build(), indent=1, sort_keys=True, allow_nan=False) + "\n"
    return write_or_check(OUT, text, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
