"""Print the parity margins of tests/test_model_parity.py (max abs diffs against the HF fixtures).

Why: the parity tests only say pass/fail; a performance change must not eat the margin under the
1e-5 bounds, so we print the measured diffs before and after every optimisation.

    python bench/parity_margins.py [--form auto|reference|dense|sparse|latent]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")  # as tests/conftest.py: the MKL code path changes rounding

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM  # noqa: E402
from tests.test_model_parity import _official_grad  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def _maxdiff(a: object, b: object) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def margins(case: str, form: str = "auto") -> dict[str, float]:
    """Max abs diff per checked quantity (eval logits/loss, padding case, 4 SGD steps, gradients)."""
    ref = load_file(str(FIXTURES / case / "reference.safetensors"))
    t = paddle.to_tensor
    res: dict[str, float] = {}
    model = GlmMoeDsaForCausalLM.from_pretrained(
        FIXTURES / case / "checkpoint", dtype="float32", attn_implementation=form
    )
    model.eval()
    out = model(t(ref["input_ids"]), labels=t(ref["labels"]))
    res["logits (1e-5)"] = _maxdiff(out.logits.numpy(), ref["logits"])
    res["loss (1e-6)"] = abs(float(out.loss) - float(ref["loss"]))
    res["mtp_logits (2e-5)"] = _maxdiff(out.mtp_logits[0].numpy(), ref["mtp_logits"])
    out = model(t(ref["pad_input_ids"]), attention_mask=t(ref["pad_attention_mask"]), labels=t(ref["pad_labels"]))
    res["pad_logits (1e-5)"] = _maxdiff(out.logits.numpy(), ref["pad_logits"])
    res["pad_loss (1e-6)"] = abs(float(out.loss) - float(ref["pad_loss"]))
    model.train()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    losses, gmax = [], 0.0
    for step in range(4):
        out = model(t(ref["input_ids"]), labels=t(ref["labels"]), compute_mtp=False)
        out.loss.backward()
        losses.append(float(out.loss))
        if step == 0:
            for gk in (k for k in ref if k.startswith("grad.")):
                gmax = max(gmax, _maxdiff(_official_grad(model, gk[5:], model.config), ref[gk]))
        opt.step()
        opt.clear_grad()
    res["train_losses (1e-5)"] = _maxdiff(losses, ref["train_losses"])
    res["grads (1e-5)"] = gmax
    return res


def main() -> None:
    import argparse

    from paddleformers_glm.modeling.attention_forms import FORMS

    ap = argparse.ArgumentParser(description="parity margins against the HF fixtures")
    ap.add_argument(
        "--form",
        choices=FORMS,
        default="auto",
        help="the attn_implementation to load with: auto (what the model picks; per-head sparse at "
        "fixture sizes) or a set form",
    )
    form = ap.parse_args().form
    for case in ("tiny", "tiny_pattern_yarn"):
        for k, v in margins(case, form).items():
            print(f"{case:18s} {k:22s} {v:.3e}")


if __name__ == "__main__":
    main()
