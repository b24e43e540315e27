"""Patches of Paddle internals, each guarded by Paddle version and signature (measured on Paddle 3.3.1
CPU; why: docs/parallel.md section 6).

* Gloo sub-groups all connect over the global, un-prefixed TCPStore, so sibling groups race in
  fleet.init at world >= 3: the fix gives each its own TCPStore, hosted by the group's rank 0.
  Nothing here is needed, or applied, on NCCL.
* Fleet's hook-based recompute hands a PyLayer's backward each saved tensor rebuilt over the
  replay's buffer with its shape but not its strides or offset, so a saved view (a transpose, a
  split) comes back with its elements misplaced and the gradient is silently wrong, on any device
  (docs/parallel.md section 4): :func:`saving_contiguous` makes PyLayers save contiguous tensors
  while a recomputed function runs.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import warnings
from collections.abc import Callable
from typing import Any

import paddle

from ..ops.cpu_bf16 import warn_untested

__all__ = ["TESTED_PADDLE", "apply_gloo_subgroup_store_fix", "saving_contiguous"]

TESTED_PADDLE = ((3, 0, 0), (3, 4, 0))  # [low, high): versions whose internals were read

_store_refs: list = []  # keep sub-group TCPStores alive for the process lifetime


def _not_applied(what: str, note: str = "") -> bool:
    warnings.warn(
        f"paddleformers_glm: Paddle {paddle.__version__} {what}; gloo sub-group store fix not applied{note}",
        stacklevel=3,
    )
    return False


def apply_gloo_subgroup_store_fix() -> bool:
    """Give every gloo sub-group its own TCPStore (see module doc). Returns True when active.

    Guarded: applied only when ``paddle.distributed.collective._new_process_group_impl`` exists
    with the parameters read in Paddle 3.3.1; otherwise a warning says what was skipped.
    """
    from paddle.distributed import collective

    orig = getattr(collective, "_new_process_group_impl", None)
    if orig is None:
        return _not_applied("has no collective._new_process_group_impl", " (fleet.init may race at world >= 3 on CPU)")
    if getattr(orig, "_glm52_patched", False):
        return True
    params = list(inspect.signature(orig).parameters)
    expected = ["backend", "store", "rank", "world_size", "group_name", "pg_options", "group_id"]
    if params[: len(expected)] != expected:
        return _not_applied(f"changed _new_process_group_impl{tuple(params)}")
    warn_untested("gloo sub-group store fix applied", TESTED_PADDLE)
    from paddle.base import core

    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args, **kwargs):
        if backend == "gloo" and group_id != 0:
            key = f"glm52/gloo_subgroup_store/{group_id}"
            if rank == 0:  # this host (its endpoint's), a free port
                host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rpartition(":")[0] or "127.0.0.1"
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("", 0))
                    port = s.getsockname()[1]
                store.set(key, f"{host}:{port}".encode())
            else:
                store.wait(key)
                host, port = bytes(store.get(key)).decode().rsplit(":", 1)
            sub = core.TCPStore(host, int(port), rank == 0, world_size, 900)
            _store_refs.append(sub)
            store = sub
        return orig(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)

    _new_process_group_impl._glm52_patched = True  # type: ignore[attr-defined]
    collective._new_process_group_impl = _new_process_group_impl
    return True


# > 0 while a recomputed function runs, in its forward or its backward replay (a list: to_static
# cannot transform `global`)
_contiguous_saves = [0]


@functools.cache
def _install_contiguous_saves() -> bool:
    """Route ``PyLayerContext.save_for_backward`` through a copy of each non-contiguous tensor while
    ``_contiguous_saves`` is set (stock behaviour otherwise). Guarded like the store fix; once per
    process (every recomputed call asks)."""
    from paddle.autograd.py_layer import PyLayerContext

    orig = getattr(PyLayerContext, "save_for_backward", None)
    if getattr(orig, "_glm52_patched", False):
        return True
    if orig is None or list(inspect.signature(orig).parameters) != ["self", "tensors"]:
        warnings.warn(
            f"paddleformers_glm: Paddle {paddle.__version__} changed PyLayerContext.save_for_backward; PyLayers "
            "recomputed by --recompute may save views, which Fleet's recompute restores misplaced",
            stacklevel=3,
        )
        return False

    def save_for_backward(self: Any, *tensors: Any) -> None:
        if _contiguous_saves[0] > 0 and paddle.in_dynamic_mode():
            tensors = tuple(
                t.contiguous() if isinstance(t, paddle.Tensor) and not t.is_contiguous() else t for t in tensors
            )
        orig(self, *tensors)

    save_for_backward._glm52_patched = True  # type: ignore[attr-defined]
    PyLayerContext.save_for_backward = save_for_backward  # type: ignore[method-assign]
    return True


def saving_contiguous(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for Fleet's recompute: while it runs (the forward, and the replay in backward) every
    PyLayer saves contiguous tensors (see the module doc)."""
    _install_contiguous_saves()

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _contiguous_saves[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _contiguous_saves[0] -= 1

    return run
