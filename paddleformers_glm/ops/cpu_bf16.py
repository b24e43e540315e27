"""bfloat16 compute on Paddle's CPU build, supplied underneath Paddle's own API (docs/model.md, "bf16 on
a CPU").

:func:`install` runs each op Paddle 3.3's CPU build has no bf16 kernel for (forward or gradient) on
fp32 copies of its bf16 inputs and rounds its floating outputs back, as GPU bf16 kernels compute;
autograd records cast -> fp32 op -> cast, so gradients too are fp32 rounded. It touches (Paddle 3.3.1):

* ``paddle._C_ops.<op>`` and every alias of it bound in a loaded ``paddle`` module or on
  ``paddle.Tensor``, for each op whose CPU kernel registry has an fp32 kernel but no bf16 one,
  forward or gradient (:func:`missing_kernels`), plus the composite ``linear``;
* ``scale`` (:data:`INEXACT`), whose CPU bf16 kernel rounds its factor and bias to bf16 first;
* the C++ ``paddle.Tensor`` operators (``__add__``...) whose op is in that set;
* ``adamw_`` with an fp32 master weight: the CPU kernel ignores the master, so the update runs on
  it and the bf16 parameter becomes the master rounded, which is what the GPU kernel writes.

Only all-bf16 floating inputs convert: mixed bf16/fp32 inputs and fp32 tensors reach Paddle
unchanged.  In-place ops run on the fp32 copy, assigned back into the bf16 tensor.  CPU-only builds;
``GLM52_CPU_BF16=0`` leaves Paddle untouched; ``GLM52_CPU_BF16_RECORD=DIR`` keeps each process's
list of converted ops.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import paddle

from .._io import env_flag

__all__ = [
    "COMPOSITES",
    "INEXACT",
    "TESTED_PADDLE",
    "KernelGap",
    "converted_calls",
    "install",
    "installed",
    "missing_kernels",
    "uninstall",
]

ENV_SWITCH = "GLM52_CPU_BF16"
# A folder: each process keeps there the list of ops it routed through fp32 (converted-<pid>.json,
# rewritten when an op converts for the first time; training workers leave with os._exit)
ENV_RECORD = "GLM52_CPU_BF16_RECORD"
TESTED_PADDLE = ((3, 3, 0), (3, 4, 0))  # [low, high): builds whose registry and op signatures were read
# Ops the registry does not list (eager composites) -> the kernels they run.
COMPOSITES = {"linear": ("matmul", "add")}
# Ops whose CPU bf16 kernel exists but does not return the fp32 result rounded to bf16, as the GPU
# kernel does (Paddle 3.3.1, tests/test_cpu_bf16.py): ``scale`` (also ``x * 0.5``, ``x + 1``)
# rounds its factor and bias to bf16 first, the GPU kernel keeps them in fp32. The other stock
# bf16 arithmetic the model meets (multiply, subtract, sum, add_n, maximum) gives the rounded
# fp32 result and stays Paddle's.
INEXACT = ("scale",)
# Paddle's C++ Tensor operators -> (the op each runs with a tensor operand, with a Python scalar);
# an operator and its reflection run the same ops, but for a scalar divided or raised by a tensor.
_OPERATORS = {
    **dict.fromkeys(("__add__", "__radd__"), ("add", "scale")),
    **dict.fromkeys(("__sub__", "__rsub__"), ("subtract", "scale")),
    **dict.fromkeys(("__mul__", "__rmul__"), ("multiply", "scale")),
    **dict.fromkeys(("__div__", "__truediv__"), ("divide", "scale")),
    **dict.fromkeys(("__rdiv__", "__rtruediv__"), ("divide", "divide")),
    "__pow__": ("elementwise_pow", "pow"),
    "__rpow__": ("elementwise_pow", "elementwise_pow"),
    **dict.fromkeys(("__matmul__", "__rmatmul__"), ("matmul", "matmul")),
}


class KernelGap(NamedTuple):
    """Which bf16 CPU kernels an op lacks (each True only where an fp32 one exists)."""

    forward: bool
    backward: bool


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to undo
        self.wrapped: list[str] = []
        self.calls: dict[str, int] = {}
        self.record: str | None = None  # ENV_RECORD's folder


_STATE = _State()


def _registry() -> dict[str, list[str]]:
    from paddle.base import core

    return core._get_registered_phi_kernels("all")


def _has(reg: dict[str, list[str]], kernel: str, dtype: str) -> bool:
    return any(k.startswith("(CPU,") and k.endswith(f", {dtype})") for k in reg.get(kernel, ()))


def missing_kernels(registry: dict[str, list[str]] | None = None) -> dict[str, KernelGap]:
    """Kernel name -> its bf16 gap on CPU, for every kernel with an fp32 CPU kernel and no bf16
    one, forward (``op``) or gradient (``op_grad``); read from Paddle's kernel registry."""
    reg = _registry() if registry is None else registry
    gap = {k: _has(reg, k, "float32") and not _has(reg, k, "bfloat16") for k in reg}
    found = {k: KernelGap(gap[k], gap.get(f"{k}_grad", False)) for k in reg if not k.endswith("_grad")}
    return {k: g for k, g in found.items() if g.forward or g.backward}


def _covered_ops(c_ops: Any, reg: dict[str, list[str]]) -> dict[str, str]:
    """``_C_ops`` name -> the missing kernel that makes it need the fp32 route."""
    gaps = missing_kernels(reg)
    out = {}
    for op in dir(c_ops):
        if op.startswith("_") or op.endswith("_grad") or not callable(getattr(c_ops, op, None)):
            continue
        k = op if op in reg else op[:-1] if op.endswith("_") and op[:-1] in reg else None  # add_ runs add
        if k is not None and (k in gaps or k in INEXACT):
            out[op] = k
        elif op in COMPOSITES and any(part in gaps for part in COMPOSITES[op]):
            out[op] = op
    return out


_BF16 = paddle.bfloat16
_FP32 = paddle.float32
_WIDE = (paddle.float32, paddle.float64, paddle.float16)
_WIDE_IDS = frozenset(id(d) for d in _WIDE)  # Tensor.dtype returns these singletons; `==` costs ~1.6 us


try:  # the legacy dtype enum, which some APIs still pass
    _BF16_VAR = paddle.base.core.VarDesc.VarType.BF16
except AttributeError:  # pragma: no cover - a build without it
    _BF16_VAR = None


def _scan(values: Any) -> int:
    """0: no bf16 tensor; 1: bf16 tensors and no other floating one; 2: bf16 mixed with fp32/fp64/fp16."""
    bf16 = wide = False
    for v in values:
        for t in v if isinstance(v, (list, tuple)) and v and isinstance(v[0], paddle.Tensor) else (v,):
            if isinstance(t, paddle.Tensor):
                d = t.dtype
                if d is _BF16:
                    bf16 = True
                elif id(d) in _WIDE_IDS:
                    wide = True
    return (2 if wide else 1) if bf16 else 0


def _up(v: Any, copies: dict[int, tuple[paddle.Tensor, paddle.Tensor]]) -> Any:
    """v with bf16 tensors replaced by fp32 copies (recorded in ``copies``), bf16 dtypes by fp32."""
    if isinstance(v, paddle.Tensor):
        if v.dtype is _BF16:
            c = v.astype(_FP32)
            copies[id(c)] = (c, v)
            return c
        return v
    if isinstance(v, (list, tuple)) and v and isinstance(v[0], paddle.Tensor):
        return type(v)(_up(t, copies) for t in v)
    if v is _BF16 or (_BF16_VAR is not None and isinstance(v, type(_BF16_VAR)) and v == _BF16_VAR):
        return _FP32
    return v


def _down(out: Any, copies: dict[int, tuple[paddle.Tensor, paddle.Tensor]], cast: bool) -> Any:
    """Results back to bf16: an fp32 copy that was updated in place is assigned into its bf16
    original (which is returned instead); other fp32 results are rounded when ``cast``."""
    if isinstance(out, paddle.Tensor):
        hit = copies.get(id(out))
        if hit is not None and hit[0] is out:
            original = hit[1]
            paddle.assign(out.astype(_BF16), original)
            return original
        return out.astype(_BF16) if cast and out.dtype is _FP32 else out
    if isinstance(out, (list, tuple)):
        return type(out)(_down(o, copies, cast) for o in out)
    return out


def _count(name: str) -> None:
    _STATE.calls[name] = _STATE.calls.get(name, 0) + 1
    if _STATE.calls[name] == 1 and _STATE.record:
        _record(_STATE.record)


def _wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig`` that runs in fp32 when its floating tensor inputs are all bf16."""

    def op(*args: Any, **kwargs: Any) -> Any:
        if _scan((*args, *kwargs.values()) if kwargs else args) != 1:
            return orig(*args, **kwargs)
        _count(name)
        copies: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}
        up_args = [_up(a, copies) for a in args]
        up_kwargs = {k: _up(v, copies) for k, v in kwargs.items()}
        out = orig(*up_args, **up_kwargs)
        # an explicit non-bf16 floating dtype among the arguments chose the output's dtype: keep it
        cast = not any(isinstance(v, paddle.dtype) and id(v) in _WIDE_IDS for v in (*args, *kwargs.values()))
        return _down(out, copies, cast)

    op.__name__ = getattr(orig, "__name__", name)
    op.__doc__ = getattr(orig, "__doc__", None)
    op._glm52_bf16 = orig  # type: ignore[attr-defined]
    return op


def _wrap_adamw(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``adamw_`` for a bf16 parameter with an fp32 master weight: the update runs on the master
    (Paddle's CPU kernel would ignore it) and the parameter becomes the master rounded to bf16."""
    generic = _wrap("adamw_", orig)

    def adamw_(param: paddle.Tensor, grad: paddle.Tensor, lr: Any, m1: Any, m2: Any, m2max: Any, b1p: Any,
               b2p: Any, master: Any, *rest: Any) -> Any:  # fmt: skip
        if param.dtype is not _BF16 or master is None:
            return generic(param, grad, lr, m1, m2, m2max, b1p, b2p, master, *rest)
        _count("adamw_")
        found_inf, attrs = rest[0], list(rest[1:])
        # attrs (Paddle 3.3): beta1, beta2, epsilon, lr_ratio, coeff, with_decay, lazy_mode,
        #                     min_row_size_to_use_multithread, multi_precision, use_global_beta_pow, amsgrad
        if len(attrs) != 11 or not isinstance(attrs[8], bool):
            raise RuntimeError(
                f"paddleformers_glm.ops.cpu_bf16: _C_ops.adamw_ takes {len(rest) + 9} arguments in Paddle "
                f"{paddle.__version__}, not the 21 of the tested builds; set GLM52_CPU_BF16=0 or train in float32"
            )
        attrs[8] = False  # multi_precision: the fp32 master *is* the parameter of this update
        g32 = grad.astype(_FP32) if grad.dtype is _BF16 else grad
        outs = orig(master, g32, lr, m1, m2, m2max, b1p, b2p, None, found_inf, *attrs)
        paddle.assign(master.astype(_BF16), param)
        return (param, *outs[1:6], master)

    adamw_._glm52_bf16 = orig  # type: ignore[attr-defined]
    return adamw_


def _wrap_operator(name: str, orig: Callable[..., Any], tensor_op: bool, scalar_op: bool) -> Callable[..., Any]:
    """A C++ Tensor operator (``__add__``...) that runs in fp32 (:func:`_wrap`) for all-bf16 operands,
    where the op it runs for that operand kind (``tensor_op`` / ``scalar_op``: covered or not) needs it."""
    converted = _wrap(name, orig)

    def operator(self: paddle.Tensor, other: Any) -> Any:
        needed = tensor_op if isinstance(other, paddle.Tensor) else scalar_op
        return converted(self, other) if needed else orig(self, other)

    operator.__name__ = name
    operator._glm52_bf16 = orig  # type: ignore[attr-defined]
    return operator


def warn_untested(what: str, tested: tuple[tuple[int, int, int], tuple[int, int, int]], stacklevel: int = 3) -> None:
    """Warn that ``what`` runs on a Paddle outside ``tested`` ([low, high): versions whose internals were
    read); a develop build (0.0.0) counts as newer than any tested."""
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in paddle.__version__.split(".")[:3]]
    version = tuple(parts + [0] * (3 - len(parts)))
    if not tested[0] <= (version if version != (0, 0, 0) else (99, 0, 0)) < tested[1]:
        warnings.warn(
            f"paddleformers_glm: {what} on untested Paddle {paddle.__version__} (tested {tested[0]}..{tested[1]})",
            stacklevel=stacklevel,
        )


def check_model_dtype(dtype: str) -> None:
    """Refuse a model dtype this Paddle build cannot compute, before anything is built: float16 on a
    build without CUDA (its CPU kernels lack float16 ``where`` and more; the forward stopped inside
    Paddle). bfloat16 on CPU gets its kernels from :func:`install`."""
    import paddle

    if dtype == "float16" and not paddle.is_compiled_with_cuda():
        raise ValueError(
            "dtype float16: this Paddle build has no GPU, and its CPU kernels do not compute float16 "
            "(bfloat16 or float32 do; `glm52 convert --dtype float16` writes float16 files)"
        )


def installed() -> list[str]:
    """The ``_C_ops`` functions and Tensor operators routed through fp32 in this process (empty
    when not installed: a CUDA build, ``GLM52_CPU_BF16=0``, or not asked for yet)."""
    return list(_STATE.wrapped)


def converted_calls(reset: bool = False) -> dict[str, int]:
    """How many calls of each wrapped op ran in fp32 since install (or the last reset)."""
    out = dict(_STATE.calls)
    if reset:
        _STATE.calls.clear()
    return out


def install() -> list[str]:
    """Route the ops Paddle's CPU build lacks bf16 kernels for through fp32 (see the module doc).

    No-op (returns []) on a build compiled with CUDA, or with ``GLM52_CPU_BF16=0``. Idempotent:
    a second call returns what the first installed."""
    if paddle.is_compiled_with_cuda() or not env_flag(ENV_SWITCH, True, strict=False):
        return []
    with _STATE.lock:
        if _STATE.wrapped:
            return list(_STATE.wrapped)
        warn_untested("CPU bf16 kernels (the covered ops read from its own registry) supplied", TESTED_PADDLE)
        c_ops = paddle._C_ops
        reg = _registry()
        covered = _covered_ops(c_ops, reg)
        originals: dict[int, Callable[..., Any]] = {}
        for op in sorted(covered):
            orig = getattr(c_ops, op)
            fn = _wrap_adamw(orig) if op == "adamw_" else _wrap(op, orig)
            originals[id(orig)] = fn
            _STATE.patched.append((c_ops, op, orig))
            setattr(c_ops, op, fn)
            _STATE.wrapped.append(op)
        _replace_aliases(originals)
        _STATE.record = os.environ.get(ENV_RECORD) or None
        need = set(missing_kernels(reg)) | set(INEXACT)
        for attr, (tensor_kernel, scalar_kernel) in _OPERATORS.items():
            orig = getattr(paddle.Tensor, attr, None)
            tensor_op, scalar_op = tensor_kernel in need, scalar_kernel in need
            if orig is None or not (tensor_op or scalar_op) or getattr(orig, "_glm52_bf16", None) is not None:
                continue
            _STATE.patched.append((paddle.Tensor, attr, orig))
            setattr(paddle.Tensor, attr, _wrap_operator(attr, orig, tensor_op, scalar_op))
            _STATE.wrapped.append(f"Tensor.{attr}")
        return list(_STATE.wrapped)


def _replace_aliases(originals: dict[int, Callable[..., Any]]) -> None:
    """Point every loaded paddle module attribute and Tensor method that *is* a wrapped
    ``_C_ops`` function (bound by ``from paddle._C_ops import ...``) at its wrapper."""
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("paddle") and m not in (None, paddle._C_ops)]
    for owner in [*modules, paddle.Tensor]:
        try:
            items = list(vars(owner).items())
        except TypeError:
            continue
        for attr, value in items:
            fn = originals.get(id(value))
            if fn is None or attr.startswith("__") or getattr(owner, attr, None) is not value:
                continue
            _STATE.patched.append((owner, attr, value))
            setattr(owner, attr, fn)


def _record(folder: str) -> None:
    """Write the names of the ops this process converted so far to ``folder/converted-<pid>.json``."""
    from .._io import atomic_write_text, dumps_json

    os.makedirs(folder, exist_ok=True)
    atomic_write_text(os.path.join(folder, f"converted-{os.getpid()}.json"), dumps_json(sorted(_STATE.calls)))


def uninstall() -> None:
    """Restore everything :func:`install` replaced (for tests)."""
    with _STATE.lock:
        for owner, attr, orig in reversed(_STATE.patched):
            setattr(owner, attr, orig)
        _STATE.patched.clear()
        _STATE.wrapped.clear()
        _STATE.calls.clear()
