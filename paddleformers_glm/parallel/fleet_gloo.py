"""Fleet's tensor- and sequence-parallel ops on CPU gloo, supplied *under* Fleet's own APIs.

Paddle 3.3.1's CPU build lacks the collectives Fleet's TP / SP layers call; :func:`install`
replaces the module attributes it lists with equivalents built on what gloo implements, so the
stock Fleet layers run unchanged on CPU (docs/parallel.md section 6); pipeline p2p goes over
2-rank pair groups (:func:`_pipeline_p2p`).  :func:`flex_checkpoint_on_cpu` makes
``Tensor.cuda`` / ``pin_memory`` no-ops for flex-checkpoint's resharding load on a CPU-only build.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import paddle
import paddle.distributed as dist

from ..configuration import IGNORE_INDEX
from ..ops.cpu_bf16 import warn_untested
from . import comm
from ._compat import TESTED_PADDLE

__all__ = ["flex_checkpoint_on_cpu", "install", "installed"]

_INSTALLED: list[str] = []


def installed() -> list[str]:
    """Names of the Fleet internals replaced in this process (empty on NCCL / world 1)."""
    return list(_INSTALLED)


def _group(group: Any) -> Any:
    """``group``, None for the default one; False on a rank outside it (Fleet's ops then return None)."""
    from paddle.distributed import collective

    return collective._get_default_group() if group is None else group.is_member() and group


def _pair(tensor: paddle.Tensor, group: Any, fwd: Callable, bwd: Callable) -> paddle.Tensor | None:
    """Forward ``fwd(t, g)``, backward ``bwd(dy, g)`` over ``group`` (:func:`_group`)."""
    g = _group(group)
    return comm._FwdBwd.apply(tensor, lambda t: fwd(t, g), lambda d: bwd(d, g)) if g else None


def c_identity(tensor: paddle.Tensor, group: Any = None, skip_c_identity_dynamic: bool = False) -> paddle.Tensor:
    """Identity forward, sum of gradients over the group backward (Megatron's f)."""
    return _pair(tensor, group, lambda t, g: t, comm.all_reduce)


def mp_allreduce(
    tensor: paddle.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    use_calc_stream: bool = True,
    use_model_parallel: bool = True,
    skip_c_identity_dynamic: bool = False,
) -> paddle.Tensor:
    """Sum over the group forward, identity backward (Megatron's g)."""
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"fleet_gloo.mp_allreduce: only SUM is supported, got {op}")
    return _pair(tensor, group, comm.all_reduce, lambda d, g: d)


def c_split(tensor: paddle.Tensor, group: Any = None) -> paddle.Tensor:
    """This rank's slice of the last axis; backward all-gathers."""
    return _pair(tensor, group, lambda t, g: comm.split_take(t, g, -1), lambda d, g: comm.all_gather(d, g, -1))


def c_concat(tensor: paddle.Tensor, group: Any = None) -> paddle.Tensor:
    """All-gather along the last axis; backward keeps this rank's slice."""
    return _pair(tensor, group, lambda t, g: comm.all_gather(t, g, -1), lambda d, g: comm.split_take(d, g, -1))


def c_softmax_with_cross_entropy(
    logits: paddle.Tensor,
    label: paddle.Tensor,
    group: Any = None,
    return_softmax: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> Any:
    """Cross entropy over vocabulary-split logits (last axis split over the group); loss [..., 1].

    Max and sum of exponentials are reduced over the group; the label's logit comes from the rank
    whose vocabulary slice holds it.  Labels equal to ``ignore_index`` give a zero loss.
    """
    g = _group(group)
    if not g:
        return None
    if label.ndim == logits.ndim - 1:
        label = label.unsqueeze(-1)
    part = logits.shape[-1]
    start = int(g.rank) * part
    with paddle.no_grad():
        gmax = comm.all_reduce(logits.max(axis=-1, keepdim=True), g, op="max")
    shifted = logits - gmax
    exp = paddle.exp(shifted)
    sum_exp = mp_allreduce(exp.sum(axis=-1, keepdim=True), group=g)
    label = label.astype("int64")
    mine = paddle.logical_and(label >= start, label < start + part)
    local = paddle.where(mine, label - start, paddle.zeros_like(label))
    picked = paddle.take_along_axis(shifted, local, axis=-1) * mine.astype(logits.dtype)
    picked = mp_allreduce(picked, group=g)
    loss = (paddle.log(sum_exp) - picked) * (label != ignore_index).astype(logits.dtype)
    return (loss, exp / sum_exp) if return_softmax else loss


def _mp_group() -> Any:
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def sp_all_gather(input: paddle.Tensor) -> paddle.Tensor:
    """Sequence-parallel all-gather along axis 0 (no autograd: Fleet's PyLayers wrap it)."""
    return comm.all_gather(input, _mp_group(), 0)


def sp_reduce_scatter(input: paddle.Tensor) -> paddle.Tensor:
    """Sequence-parallel reduce-scatter along axis 0 (all-reduce, keep my rows)."""
    return comm.reduce_scatter(input, _mp_group(), 0)


@contextlib.contextmanager
def flex_checkpoint_on_cpu() -> Iterator[None]:
    """Run flex-checkpoint's stock load (``paddle.distributed.load_state_dict``) on a CPU-only build.

    Paddle 3.3.1's resharder calls ``.cuda()`` on each tensor slice it broadcasts (and
    ``pin_memory()`` on what it offloads); a CPU build raises "No available device found".  Inside
    this context, and only when Paddle has no GPU, both return the tensor itself, so the same
    stock code runs on gloo."""
    if paddle.is_compiled_with_cuda():
        yield
        return
    warn_untested("flex-checkpoint CPU shim", TESTED_PADDLE, stacklevel=4)
    saved = {name: getattr(paddle.Tensor, name) for name in ("cuda", "pin_memory")}
    try:
        for name in saved:
            setattr(paddle.Tensor, name, lambda self, *a, **k: self)
        yield
    finally:
        for name, fn in saved.items():
            setattr(paddle.Tensor, name, fn)


# The process's topology, as ``install`` was given it (this module sits below topology.py).
_TOPOLOGY: list[Callable[[], Any]] = []


def _pair_group(group: Any, peer: int) -> Any:
    """The 2-rank group of this stage and the stage at global rank ``peer``, when ``group`` is the
    pipeline group and such a group exists; else ``group`` unchanged."""
    topo = _TOPOLOGY[0]() if _TOPOLOGY else None
    pp_group = topo.pp_group if topo is not None else None
    if group is None or pp_group is None or getattr(group, "id", None) != getattr(pp_group, "id", None):
        return group
    if peer not in topo.stage_ranks:
        return group
    return topo.stage_group((topo.stage, topo.stage_ranks.index(peer))) or group


class _View:
    """Module ``real`` with the attributes ``over`` replaced, the rest unchanged."""

    def __init__(self, real: Any, **over: Any) -> None:
        self._real = real
        self.__dict__.update(over)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _pipeline_p2p(real: Any) -> _View:
    """``paddle.distributed`` as Fleet's pipeline p2p module sees it on gloo: send/recv go over the
    2-rank group of the two stages (why: :meth:`Topology.stage_group`), the rest is unchanged."""

    def send(tensor: paddle.Tensor, dst: int = 0, group: Any = None, sync_op: bool = True) -> Any:
        return real.send(tensor, dst=dst, group=_pair_group(group, dst), sync_op=sync_op)

    def recv(tensor: paddle.Tensor, src: int = 0, group: Any = None, sync_op: bool = True) -> Any:
        return real.recv(tensor, src=src, group=_pair_group(group, src), sync_op=sync_op)

    def isend(tensor: paddle.Tensor, dst: int, group: Any = None) -> Any:
        return real.isend(tensor, dst, _pair_group(group, dst))

    def irecv(tensor: paddle.Tensor, src: int | None = None, group: Any = None) -> Any:
        return real.irecv(tensor, src, _pair_group(group, src))

    return _View(real, send=send, recv=recv, isend=isend, irecv=irecv)


def install(backend: str, topology: Callable[[], Any] | None = None) -> list[str]:
    """Replace the Fleet internals listed in the module doc when ``backend`` is gloo; returns them.
    ``topology()`` gives the process's topology, whose pair groups carry pipeline p2p."""
    if backend != "gloo":
        return []
    if topology is not None:
        _TOPOLOGY[:] = [topology]
    warn_untested("Fleet gloo ops installed", TESTED_PADDLE)
    from paddle.distributed import parallel
    from paddle.distributed.fleet.layers.mpu import mp_ops
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    for module, attr, fn in (
        (mp_ops, "_c_identity", c_identity),
        (mp_ops, "_mp_allreduce", mp_allreduce),
        (mp_ops, "_c_split", c_split),
        (mp_ops, "_c_concat", c_concat),
        (mp_ops, "_c_softmax_with_cross_entropy", c_softmax_with_cross_entropy),
        (spu, "all_gather", sp_all_gather),
        (spu, "reduce_scatter", sp_reduce_scatter),
        (p2p, "paddle", _View(paddle, distributed=_pipeline_p2p(paddle.distributed))),
    ):
        if not hasattr(module, attr):
            warnings.warn(
                f"paddleformers_glm: Paddle {paddle.__version__} has no {module.__name__}.{attr}; "
                f"not replaced (the stock Fleet layer may fail on CPU gloo)",
                stacklevel=2,
            )
        elif not getattr(getattr(module, attr), "_glm52_gloo", False):
            fn._glm52_gloo = True
            setattr(module, attr, fn)
            label = f"{module.__name__.rpartition('.')[2]}.{attr}"
            _INSTALLED.append(label + (" (pipeline p2p on pair groups)" if attr == "paddle" else ""))
    if not hasattr(parallel.ParallelEnv, "_device_id"):  # CPU builds never set it; PipelineLayer reads it
        parallel.ParallelEnv._device_id = 0
        _INSTALLED.append("ParallelEnv._device_id")
    return installed()
