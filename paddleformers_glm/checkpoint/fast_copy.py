"""Cache-blocked 2-D transposes for the load's copies (HF ``[out, in]`` -> Paddle ``[in, out]``).

numpy runs a transposed copy element by element through strided memory: for 2-byte elements it
moves a few hundred MB/s, many times slower than a plain copy, and nearly every GLM weight is
transposed on load. A tiled C loop (tiles of 16 x 16 stay in L1 on both sides) is several times
faster. The C source below is compiled once with the system C compiler into a per-user cache and
called through ctypes (which releases the GIL, so the loader's thread pool runs tiles of rows in
parallel). Without a compiler, or with ``GLM52_FAST_COPY=0``, every function here returns False and
the caller keeps its numpy path; results are identical either way (tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["transpose_into", "available"]

_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#define TILE 16
#define MIN(a, b) ((a) < (b) ? (a) : (b))
/* dst[c * ldd + r] = f(src[r * lds + c]) for r < rows, c < cols (strides in elements) */
#define DEF(NAME, S, D, F) \
void NAME(const S *src, D *dst, size_t rows, size_t cols, size_t lds, size_t ldd) { \
  for (size_t r0 = 0; r0 < rows; r0 += TILE) { \
    size_t r1 = MIN(r0 + TILE, rows); \
    for (size_t c0 = 0; c0 < cols; c0 += TILE) { \
      size_t c1 = MIN(c0 + TILE, cols); \
      for (size_t r = r0; r < r1; ++r) { \
        const S *s = src + r * lds; \
        for (size_t c = c0; c < c1; ++c) dst[c * ldd + r] = F(s[c]); \
      } \
    } \
  } \
}
#define SAME(x) (x)
#define BF16_TO_F32_BITS(x) (((uint32_t)(x)) << 16)
DEF(glm52_transpose16, uint16_t, uint16_t, SAME)
DEF(glm52_transpose32, uint32_t, uint32_t, SAME)
DEF(glm52_transpose64, uint64_t, uint64_t, SAME)
DEF(glm52_transpose_bf16_f32, uint16_t, uint32_t, BF16_TO_F32_BITS)
"""

_LIB: Any = None
_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paddleformers_glm")


def _build() -> Any:
    """The compiled library, built on first use (atomically: temp file + rename); None if impossible."""
    if os.environ.get("GLM52_FAST_COPY", "1") == "0" or sys.platform == "win32":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    tag = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    folder = _cache_dir()
    lib = os.path.join(folder, f"fast_copy-{tag}.so")
    try:
        if not os.path.exists(lib):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = os.path.join(tmp, "fast_copy.c")
                with open(src, "w") as f:
                    f.write(_SOURCE)
                out = os.path.join(tmp, "fast_copy.so")
                subprocess.run(
                    [cc, "-O3", "-shared", "-fPIC", "-o", out, src], check=True, capture_output=True, timeout=120
                )
                os.replace(out, lib)
        handle = ctypes.CDLL(lib)
        for name in ("glm52_transpose16", "glm52_transpose32", "glm52_transpose64", "glm52_transpose_bf16_f32"):
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = _ARGS, None
        return handle
    except (OSError, subprocess.SubprocessError):
        return None


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        _LIB = _build() or False
    return _LIB or None


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
    lib = _lib()
    if lib is None or src.ndim != 2 or dst.shape != (src.shape[1], src.shape[0]):
        return False
    lds, ldd = _row_stride(src), _row_stride(dst)
    if lds is None or ldd is None or not dst.flags.writeable:
        return False
    if widen_bf16:
        if src.dtype != np.uint16 or dst.dtype != np.float32:
            return False
        fn = lib.glm52_transpose_bf16_f32
    elif src.dtype != dst.dtype:
        return False
    else:
        fn = {2: lib.glm52_transpose16, 4: lib.glm52_transpose32, 8: lib.glm52_transpose64}.get(src.itemsize)
        if fn is None:
            return False
    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return True
    s0, d0 = src.ctypes.data, dst.ctypes.data
    si, di = src.itemsize, dst.itemsize
    chunk = max(16, (1 << 20) // max(1, cols * si) // 16 * 16)  # ~1 MiB of source rows per task

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
