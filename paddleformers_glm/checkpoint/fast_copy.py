"""Cache-blocked 2-D transposes for the load's copies (HF ``[out, in]`` -> Paddle ``[in, out]``).

Nearly every GLM weight is transposed on load, and numpy runs a transposed copy element by element
through strided memory: for 2-byte elements a few hundred MB/s, many times slower than a plain
copy. The C source below moves 8 x 8 blocks of 16-bit values (4 x 4 of 32-bit ones) through SSE2
registers inside 64 x 64 tiles (cache-resident on both sides), with a scalar loop for the edges and
for machines without SSE2; bf16 -> fp32 widening (the bits shifted into the high half) happens in
the same pass. It is compiled once with the system C compiler into a per-user cache and called
through ctypes, which releases the GIL, so the loader's thread pool runs row chunks in parallel.
Without a compiler, or with ``GLM52_FAST_COPY=0``, :func:`transpose_into` returns False and the
caller keeps its numpy path; the bytes are the same either way (tested).
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
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_SSE2 1
#endif
#define TILE 64
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* dst[c * ldd + r] = f(src[r * lds + c]) for r in [r0, r1), c in [c0, c1) (strides in elements) */
#define EDGE(NAME, S, D, F) \
static void NAME(const S *src, D *dst, size_t r0, size_t r1, size_t c0, size_t c1, size_t lds, size_t ldd) { \
  for (size_t r = r0; r < r1; ++r) { \
    const S *s = src + r * lds; \
    for (size_t c = c0; c < c1; ++c) dst[c * ldd + r] = F(s[c]); \
  } \
}
#define SAME(x) (x)
#define WIDEN(x) (((uint32_t)(x)) << 16)
EDGE(edge16, uint16_t, uint16_t, SAME)
EDGE(edge16w, uint16_t, uint32_t, WIDEN)
EDGE(edge32, uint32_t, uint32_t, SAME)
EDGE(edge64, uint64_t, uint64_t, SAME)

#ifdef HAVE_SSE2
/* rows s[0], s[lds], ... s[7 * lds] (8 values each) -> o[i] = column i */
static inline void t8x8(const uint16_t *s, size_t lds, __m128i o[8]) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * lds));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * lds));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * lds));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * lds));
  __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * lds));
  __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * lds));
  __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * lds));
  __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * lds));
  __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
  __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
  __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
  __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
  o[0] = _mm_unpacklo_epi64(c0, c4); o[1] = _mm_unpackhi_epi64(c0, c4);
  o[2] = _mm_unpacklo_epi64(c1, c5); o[3] = _mm_unpackhi_epi64(c1, c5);
  o[4] = _mm_unpacklo_epi64(c2, c6); o[5] = _mm_unpackhi_epi64(c2, c6);
  o[6] = _mm_unpacklo_epi64(c3, c7); o[7] = _mm_unpackhi_epi64(c3, c7);
}
#endif

/* Each function tiles [rows, cols]; the vector part of a tile is [r0, rv) x [c0, cv), the two
   edge calls cover [r0, rv) x [cv, c1) and [rv, r1) x [c0, c1): every element exactly once. */
void glm52_transpose16(const uint16_t *src, uint16_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  for (size_t r0 = 0; r0 < rows; r0 += TILE) {
    size_t r1 = MIN(r0 + TILE, rows);
    for (size_t c0 = 0; c0 < cols; c0 += TILE) {
      size_t c1 = MIN(c0 + TILE, cols), rv = r0, cv = c0;
#ifdef HAVE_SSE2
      rv = r0 + (r1 - r0) / 8 * 8;
      cv = c0 + (c1 - c0) / 8 * 8;
      for (size_t r = r0; r < rv; r += 8)
        for (size_t c = c0; c < cv; c += 8) {
          __m128i o[8];
          t8x8(src + r * lds + c, lds, o);
          uint16_t *d = dst + c * ldd + r;
          for (int i = 0; i < 8; ++i) _mm_storeu_si128((__m128i *)(d + i * ldd), o[i]);
        }
#endif
      edge16(src, dst, r0, rv, cv, c1, lds, ldd);
      edge16(src, dst, rv, r1, c0, c1, lds, ldd);
    }
  }
}

void glm52_transpose_bf16_f32(const uint16_t *src, uint32_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  for (size_t r0 = 0; r0 < rows; r0 += TILE) {
    size_t r1 = MIN(r0 + TILE, rows);
    for (size_t c0 = 0; c0 < cols; c0 += TILE) {
      size_t c1 = MIN(c0 + TILE, cols), rv = r0, cv = c0;
#ifdef HAVE_SSE2
      const __m128i zero = _mm_setzero_si128();
      rv = r0 + (r1 - r0) / 8 * 8;
      cv = c0 + (c1 - c0) / 8 * 8;
      for (size_t r = r0; r < rv; r += 8)
        for (size_t c = c0; c < cv; c += 8) {
          __m128i o[8];
          t8x8(src + r * lds + c, lds, o);
          uint32_t *d = dst + c * ldd + r;
          for (int i = 0; i < 8; ++i) { /* zero low halves: bf16 bits become the fp32's high half */
            _mm_storeu_si128((__m128i *)(d + i * ldd), _mm_unpacklo_epi16(zero, o[i]));
            _mm_storeu_si128((__m128i *)(d + i * ldd + 4), _mm_unpackhi_epi16(zero, o[i]));
          }
        }
#endif
      edge16w(src, dst, r0, rv, cv, c1, lds, ldd);
      edge16w(src, dst, rv, r1, c0, c1, lds, ldd);
    }
  }
}

void glm52_transpose32(const uint32_t *src, uint32_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  for (size_t r0 = 0; r0 < rows; r0 += TILE) {
    size_t r1 = MIN(r0 + TILE, rows);
    for (size_t c0 = 0; c0 < cols; c0 += TILE) {
      size_t c1 = MIN(c0 + TILE, cols), rv = r0, cv = c0;
#ifdef HAVE_SSE2
      rv = r0 + (r1 - r0) / 4 * 4;
      cv = c0 + (c1 - c0) / 4 * 4;
      for (size_t r = r0; r < rv; r += 4)
        for (size_t c = c0; c < cv; c += 4) {
          const uint32_t *s = src + r * lds + c;
          __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * lds));
          __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * lds));
          __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * lds));
          __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * lds));
          __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
          __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
          uint32_t *d = dst + c * ldd + r;
          _mm_storeu_si128((__m128i *)(d + 0 * ldd), _mm_unpacklo_epi64(t0, t1));
          _mm_storeu_si128((__m128i *)(d + 1 * ldd), _mm_unpackhi_epi64(t0, t1));
          _mm_storeu_si128((__m128i *)(d + 2 * ldd), _mm_unpacklo_epi64(t2, t3));
          _mm_storeu_si128((__m128i *)(d + 3 * ldd), _mm_unpackhi_epi64(t2, t3));
        }
#endif
      edge32(src, dst, r0, rv, cv, c1, lds, ldd);
      edge32(src, dst, rv, r1, c0, c1, lds, ldd);
    }
  }
}

void glm52_transpose64(const uint64_t *src, uint64_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  for (size_t r0 = 0; r0 < rows; r0 += TILE) {
    size_t r1 = MIN(r0 + TILE, rows);
    for (size_t c0 = 0; c0 < cols; c0 += TILE) edge64(src, dst, r0, r1, c0, MIN(c0 + TILE, cols), lds, ldd);
  }
}
"""

_NAMES = ("glm52_transpose16", "glm52_transpose32", "glm52_transpose64", "glm52_transpose_bf16_f32")
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
        for name in _NAMES:
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = _ARGS, None
        return handle
    except (OSError, AttributeError, subprocess.SubprocessError):
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
    if src.ndim != 2 or dst.shape != (src.shape[1], src.shape[0]) or not dst.flags.writeable:
        return False
    lds, ldd = _row_stride(src), _row_stride(dst)
    if lds is None or ldd is None:
        return False
    if widen_bf16:
        if src.dtype != np.uint16 or dst.dtype != np.float32:
            return False
        name = "glm52_transpose_bf16_f32"
    elif src.dtype != dst.dtype or src.itemsize not in (2, 4, 8):
        return False
    else:
        name = {2: "glm52_transpose16", 4: "glm52_transpose32", 8: "glm52_transpose64"}[src.itemsize]
    lib = _lib()
    if lib is None:
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
