"""Activation recompute through Fleet's ``fleet.utils.recompute`` (docs/parallel.md section 4).

Fleet's hook-based form (``use_reentrant=False``): inputs and outputs may be ``None`` or integer
tensors (the carried top-k), which the PyLayer form cannot carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle

from .topology import RECOMPUTE_MODES

__all__ = ["recomputing", "replaying", "run_core", "run_layer"]

# > 0 while a decoder layer runs under --recompute core (a list: to_static cannot transform `global`)
_core_depth = [0]
# > 0 while a recomputed function runs again in backward; > 0 while one runs at all (either pass)
_replay_depth = [0]
_recompute_depth = [0]


def recomputing() -> bool:
    """Whether this forward runs inside a recomputed function (its first pass or its replay): what
    it computes beside the layer's outputs must not join the graph Fleet's recompute rebuilds."""
    return _recompute_depth[0] > 0


def replaying() -> bool:
    """Whether this forward is a recomputed function's second run (in backward). Fleet's hook-based
    recompute runs the first pass with gradients on too, so a layer's training-time statistics (the
    routers' load counts) would count its tokens twice without this."""
    return _replay_depth[0] > 0


def _needs_grad(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args)


def _recompute(fn: Callable[..., Any], *args: Any) -> Any:
    from paddle.distributed.fleet.utils import recompute

    from ._compat import saving_contiguous

    runs = [0]

    def counted(*a: Any) -> Any:
        runs[0] += 1
        replay = runs[0] > 1
        _replay_depth[0] += replay
        _recompute_depth[0] += 1
        try:
            return fn(*a)
        finally:
            _replay_depth[0] -= replay
            _recompute_depth[0] -= 1

    return recompute(saving_contiguous(counted), *args, use_reentrant=False, preserve_rng_state=True)


def run_layer(layer: Callable[..., Any], *args: Any, mode: str = "none") -> Any:
    """``layer(*args)`` under recompute ``mode``: ``full`` recomputes the whole layer in backward,
    ``core`` runs it with its attention core (:func:`run_core`) recomputed."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none" or not paddle.is_grad_enabled():
        return layer(*args)
    if mode == "core":
        _core_depth[0] += 1
        try:
            return layer(*args)
        finally:
            _core_depth[0] -= 1
    if not _needs_grad(args):
        return layer(*args)  # nothing to differentiate through the inputs: nothing to save either
    return _recompute(layer, *args)


def run_core(fn: Callable[..., Any], *args: Any, active: bool = True) -> Any:
    """``fn(*args)``: the attention core of a layer.  Recomputed in backward when the layer runs
    under ``--recompute core`` and ``active`` (a caller filling a decoding cache passes False: the
    replay would write the cache twice)."""
    if not (active and _core_depth[0] > 0 and paddle.is_grad_enabled() and _needs_grad(args)):
        return fn(*args)
    return _recompute(fn, *args)
