"""Activation recompute for the decoder layers, through Fleet's ``fleet.utils.recompute``.

``--recompute full`` keeps only each decoder layer's inputs in forward and runs the layer again in
backward.  Fleet's hook-based form (``use_reentrant=False``) is used: a layer's inputs and outputs
may be ``None`` or integer tensors (the carried top-k indices) and the layer may return a
``None`` loss term, which the PyLayer form cannot carry.  The RNG state is restored for the
replay, so the recomputed forward is the same computation: fp32 losses and gradients are
bit-identical to no recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle

__all__ = ["RECOMPUTE_MODES", "run_layer"]

RECOMPUTE_MODES = ("none", "full")


def run_layer(layer: Callable[..., Any], *args: Any, mode: str = "none") -> Any:
    """``layer(*args)``, recomputed in backward when ``mode`` is ``"full"`` and a gradient is being built."""
    if mode == "none" or not paddle.is_grad_enabled():
        return layer(*args)
    if mode != "full":
        raise ValueError(f"--recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if not any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args):
        return layer(*args)  # nothing to differentiate through the inputs: nothing to save either
    from paddle.distributed.fleet.utils import recompute

    return recompute(layer, *args, use_reentrant=False, preserve_rng_state=True)
