"""Activation recompute through Fleet's ``fleet.utils.recompute``.

``--recompute full`` keeps only each decoder layer's inputs in forward and runs the layer again in
backward.  ``--recompute core`` keeps the layer's projections and recomputes only its attention
core (the indexer's top-k selection and the sparse softmax attention, whose probabilities and
gathered keys are the largest activations of a long sequence); the model marks that part with
:func:`run_core`, and :func:`run_layer` switches it on while a decoder layer runs.

Fleet's hook-based form (``use_reentrant=False``) is used: inputs and outputs may be ``None`` or
integer tensors (the carried top-k indices) and a layer may return a ``None`` loss term, which
the PyLayer form cannot carry.  The RNG state is restored for the replay, so the recomputed
forward is the same computation: fp32 losses and gradients are bit-identical to no recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import paddle

__all__ = ["RECOMPUTE_MODES", "core_recompute_active", "run_core", "run_layer"]

RECOMPUTE_MODES = ("none", "full", "core")

_core_depth = 0  # > 0 while a decoder layer runs under --recompute core


@contextlib.contextmanager
def _core_scope() -> Iterator[None]:
    global _core_depth
    _core_depth += 1
    try:
        yield
    finally:
        _core_depth -= 1


def core_recompute_active() -> bool:
    """Whether an attention core called now is recomputed in backward."""
    return _core_depth > 0 and paddle.is_grad_enabled()


def _needs_grad(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args)


def _recompute(fn: Callable[..., Any], *args: Any) -> Any:
    from paddle.distributed.fleet.utils import recompute

    return recompute(fn, *args, use_reentrant=False, preserve_rng_state=True)


def run_layer(layer: Callable[..., Any], *args: Any, mode: str = "none") -> Any:
    """``layer(*args)`` under recompute ``mode``: ``full`` recomputes the whole layer in backward,
    ``core`` runs it with its attention core (:func:`run_core`) recomputed."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none" or not paddle.is_grad_enabled():
        return layer(*args)
    if mode == "core":
        with _core_scope():
            return layer(*args)
    if not _needs_grad(args):
        return layer(*args)  # nothing to differentiate through the inputs: nothing to save either
    return _recompute(layer, *args)


def run_core(fn: Callable[..., Any], *args: Any, active: bool = True) -> Any:
    """``fn(*args)``: the attention core of a layer.  Recomputed in backward when the layer runs
    under ``--recompute core`` and ``active`` (a caller filling a decoding cache passes False: the
    replay would write the cache twice)."""
    if not (active and core_recompute_active() and _needs_grad(args)):
        return fn(*args)
    return _recompute(fn, *args)
