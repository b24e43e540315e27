"""Non-finite values (NaN, Inf) in weights, found by tensor name before they reach a forward pass
(docs/checkpoints.md, "Non-finite weights"): :func:`count_nonfinite_raw` tests a safetensors
tensor's stored bytes (``glm52 check-ckpt``), :func:`check_finite_state` a loaded state dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import CheckpointError
from .safetensors_io import paddle_to_st_dtype

__all__ = ["NonFiniteError", "check_finite_state", "count_nonfinite_raw", "listed_nonfinite", "nonfinite_state_counts"]

_CHUNK_BYTES = 1 << 18  # raw bytes per vectorised test: the temporary stays in cache

# safetensors dtype -> (unsigned view dtype, mask clearing the sign, threshold): an element is NaN or
# Inf exactly when (bits & mask) >= threshold (IEEE-754 and OCP FP8: exponent all ones; F8_E4M3, the
# "fn" variant without infinities, only at S.1111.111; F8_E8M0, an exponent alone, at 0xFF), so a
# chunk needs one AND and one max, and a count only if it fails.
_BIT_TESTS: dict[str, tuple[Any, int, int]] = {
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
    "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F8_E5M2": (np.uint8, 0x7F, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
    "F8_E8M0": (np.uint8, 0xFF, 0xFF),
}


class NonFiniteError(CheckpointError):
    """Weights that hold NaN or Inf; ``key`` names the first such tensor, ``counts`` all of them."""

    counts: dict[str, int] = {}


def count_nonfinite_raw(data: memoryview | bytes | np.ndarray, st_dtype: str) -> int:
    """How many elements of a tensor's raw little-endian bytes (safetensors dtype ``st_dtype``)
    are NaN or Inf; 0 for integer and boolean dtypes."""
    test = _BIT_TESTS.get(st_dtype)
    if test is None:
        return 0
    view_dtype, mask, threshold = test
    vd = np.dtype(view_dtype).newbyteorder("<")
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    bits_all = raw[: raw.shape[0] - raw.shape[0] % vd.itemsize].view(vd)
    step = _CHUNK_BYTES // vd.itemsize
    tmp = np.empty(min(step, bits_all.shape[0]), dtype=vd)
    m, t = vd.type(mask), vd.type(threshold)
    total = 0
    for lo in range(0, bits_all.shape[0], step):
        bits = bits_all[lo : lo + step]
        part = tmp[: bits.shape[0]]
        np.bitwise_and(bits, m, out=part)
        if part.max() >= t:
            total += int(np.count_nonzero(part >= t))
    return total


def listed_nonfinite(bad: Mapping[str, int], names: list[str], tag: Any = None) -> str:
    """The first five of ``names`` with their counts in ``bad`` (``tag(name)``: what each is, shown in
    brackets), and how many more: the list a non-finite refusal names."""
    shown = [f"{n} ({bad[n]} values)" + (f" [{tag(n)}]" if tag else "") for n in names[:5]]
    return ", ".join(shown) + (f", ... (+{len(names) - 5} more)" if len(names) > 5 else "")


def nonfinite_state_counts(state: Mapping[str, Any]) -> dict[str, int]:
    """``{name: NaN/Inf elements}`` of the floating-point tensors of ``state`` that hold any, in its
    order. Tensors are checked where they live (``ShardedWeight`` values by their local tensor): a CPU
    one on its own memory (a numpy view, the raw bit test), any other with ``paddle.isfinite``, each
    reduced to one flag on its device and the flags read together: a finite accelerator state costs
    one device-to-host read (not one per tensor), and only a tensor that fails is counted."""
    import paddle

    from .engine import numpy_view

    counts: dict[str, int] = {}
    on_device: list[tuple[str, paddle.Tensor]] = []
    for name, t in state.items():
        t = getattr(t, "local_tensor", t)
        if not isinstance(t, paddle.Tensor) or not t.is_floating_point() or 0 in t.shape:  # (numel() is a read)
            continue
        view = numpy_view(t.detach())
        if view is not None:  # bf16 / f16 / f32 / f64
            counts[name] = count_nonfinite_raw(view, paddle_to_st_dtype(t.dtype))
        else:  # an accelerator's tensor (or another dtype)
            counts[name] = -1
            on_device.append((name, t))
    if on_device:
        finite = paddle.stack([paddle.isfinite(t).all() for _, t in on_device]).numpy()
        for (name, t), ok in zip(on_device, finite):
            counts[name] = 0 if ok else int((~paddle.isfinite(t)).astype("int64").sum())
    return {name: n for name, n in counts.items() if n}


def _has_fp8_tensors(where: str) -> bool:
    """Whether the checkpoint at ``where`` stores FP8 tensors (its headers only); False where ``where``
    is no readable checkpoint (a model's init, a folder gone since)."""
    from .safetensors_io import Checkpoint

    try:
        with Checkpoint(where, strict=False) as ckpt:
            return any(ckpt.info(k).dtype.startswith("F8") for k in ckpt.keys())
    except (OSError, ValueError):
        return False


_FP8_CAUSE = (
    "; in a block-FP8 checkpoint a NaN/Inf scale_inv, or a scale that overflows float32 in q x scale_inv, "
    "shows here as its dequantized weight"
)


def check_finite_state(state: Mapping[str, Any], where: str, note: str = "", *, fp8: bool | None = None) -> None:
    """Raise :class:`NonFiniteError` naming the floating-point tensors of ``state`` that hold NaN or Inf
    (``where``: the checkpoint they came from, for the message; ``note``: appended to it), counted by
    :func:`nonfinite_state_counts`. ``fp8``: whether ``where`` holds block-FP8 weights (None: read from
    its headers, only when refusing), whose scales are then named as a possible cause -- not for an
    unquantized checkpoint, where that would send the user looking for tensors it does not have."""
    bad = nonfinite_state_counts(state)
    if not bad:
        return
    names = sorted(bad)
    listed = listed_nonfinite(bad, names)
    if fp8 is None:
        fp8 = _has_fp8_tensors(where)
    err = NonFiniteError(
        f"{len(names)} weight tensor(s) loaded from {where} hold NaN or Inf: {listed}"
        + (_FP8_CAUSE if fp8 else "")
        + f"; `glm52 check-ckpt` names each stored tensor that holds NaN/Inf{note}",
        file=where,
        key=names[0],
    )
    err.counts = bad
    raise err
