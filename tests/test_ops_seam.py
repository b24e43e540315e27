"""The ops seam: modeling code calls paddleformers_glm.ops only, and `disabled()` reaches every op."""

import pathlib
import re

import numpy as np
import pytest

from paddleformers_glm import ops
from paddleformers_glm.ops import kernels

from ._tiny import tiny_model, tokens

MODELING = pathlib.Path(ops.__file__).parent.parent / "modeling"
# what asking for the compiled kernels looks like: the availability check, the loader, a kernel
# function of the library (all named glm_*), the kernel module itself
KERNEL_USE = re.compile(
    r"\busable\(|\bcpu_ops\b|\.glm_[a-z_]+\(|cpu_kernels|\bkernels\s+import|\bimport\s+kernels\b|\bkernels\.\w+\("
)


def test_modeling_has_no_kernel_availability_checks():
    files = sorted(MODELING.glob("*.py"))
    assert len(files) >= 8, f"modeling/ not found at {MODELING}"
    hits = [
        f"{f.name}:{i}: {line.strip()}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if KERNEL_USE.search(line)
    ]
    assert not hits, "modeling code asks for the compiled kernels; call an op in paddleformers_glm/ops:\n" + "\n".join(
        hits
    )


def test_the_pattern_catches_a_kernel_check():
    """The grep above would fail on each form a kernel check has taken in modeling code."""
    for line in (
        "ops = cpu_kernels.usable(x, w)",
        "from ..ops.kernels import usable",
        "grads = cpu_ops().glm_rms_norm_backward(x, w, r, dy)",
        "y = lib.glm_swiglu(h, s)",
        "from ..ops import kernels",
        "if kernels.usable_for(x):",
    ):
        assert KERNEL_USE.search(line), line


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "latent"])
def test_disabled_reaches_every_op_forward_and_backward(monkeypatch, dense):
    """Inside `disabled()` a whole training step (forward with the LM, MTP and indexer losses,
    backward) never touches the kernel library: the loader is replaced by one that fails."""
    model = tiny_model(seed=3, indexer_loss_coeff=0.01)
    model.train()
    model.set_attn_implementation("dense" if dense else "latent")

    def no_kernels():
        raise AssertionError("an op asked for the compiled kernels inside disabled()")

    monkeypatch.setattr(kernels, "cpu_ops", no_kernels)
    ids = tokens(2, 12, seed=4)
    with ops.disabled():
        out = model(ids, labels=ids, add_mtp_loss=True)
        out.loss.backward()
    assert np.isfinite(float(out.loss))
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    for part in ("embed_tokens", "q_a_layernorm", "kv_b_proj", "up_gate_proj", "lm_head", "model.norm"):
        assert any(part in n for n in grads), part
