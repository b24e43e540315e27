"""Cache-blocked 2-D transposes for the checkpoint load's copies (HF ``[out, in]`` -> Paddle
``[in, out]``), on numpy arrays.

Nearly every GLM weight is transposed on load, and numpy runs a transposed copy element by element
through strided memory: for 2-byte elements a few hundred MB/s, many times slower than a plain
copy. The compiled transposes (the last section of ``cpu_kernels.cc``, part of the package's one
native build, ``kernels.py``) are called through ctypes, which releases the GIL, so the loader's
thread pool runs row chunks in parallel. Without the build (no compiler, ``GLM52_CPU_KERNELS=0``),
or with ``GLM52_FAST_COPY=0``, :func:`transpose_into` returns False and the caller keeps its numpy
path; the bytes are the same either way (tested).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._io import env_flag
from .kernels import library_path

__all__ = ["transpose_into", "available"]

_NAMES = ("glm52_transpose16", "glm52_transpose32", "glm52_transpose64", "glm52_transpose_bf16_f32")
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]


@functools.cache
def _lib() -> Any:
    """The transposes of the package's native build (ops/kernels.py), or None (looked up once)."""
    if not env_flag("GLM52_FAST_COPY", True, strict=False):
        return None
    path = library_path()
    if path is None:
        return None
    try:
        handle = ctypes.CDLL(str(path))
        for name in _NAMES:
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = _ARGS, None
        return handle
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether the compiled transposes can be used here."""
    return _lib() is not None


def _row_stride(a: np.ndarray) -> int | None:
    """Row stride in elements of a 2-D array whose rows are contiguous, else None."""
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize or a.strides[0] < 0:
        return None
    return a.strides[0] // a.itemsize


def transpose_into(
    src: np.ndarray, dst: np.ndarray, widen_bf16: bool = False, run: Callable[..., Any] | None = None
) -> bool:
    """``dst[...] = src.T`` (``widen_bf16``: bf16 bits in ``src`` -> float32 in ``dst``); False when
    not done (no compiled library, an unsupported dtype or memory layout) so the caller does it.

    ``run(fn, starts)`` may map a function over row-chunk starts on a thread pool.
    """
    if src.ndim != 2 or dst.shape != (src.shape[1], src.shape[0]) or not dst.flags.writeable:
        return False
    lds, ldd = _row_stride(src), _row_stride(dst)
    if widen_bf16:
        ok, name = src.dtype == np.uint16 and dst.dtype == np.float32, "glm52_transpose_bf16_f32"
    else:  # glm52_transpose16 / 32 / 64
        ok, name = src.dtype == dst.dtype and src.itemsize in (2, 4, 8), f"glm52_transpose{8 * src.itemsize}"
    if not ok or lds is None or ldd is None or (lib := _lib()) is None:
        return False
    fn = getattr(lib, name)
    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return True
    s0, d0 = src.ctypes.data, dst.ctypes.data
    si, di = src.itemsize, dst.itemsize
    chunk = max(64, (1 << 20) // max(1, cols * si) // 64 * 64)  # ~1 MiB of source rows per task

    def part(r0: int) -> None:
        n = min(chunk, rows - r0)
        fn(s0 + r0 * lds * si, d0 + r0 * di, n, cols, lds, ldd)

    starts = range(0, rows, chunk)
    if run is not None and len(starts) > 1:
        run(part, starts)
    else:
        for r0 in starts:
            part(r0)
    return True
