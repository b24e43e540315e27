"""CPU process environment that must be decided before Paddle (and its bundled MKL) loads.

Paddle 3.3's bundled MKL withholds its AVX2 kernels from AMD CPUs (a 4096x1024x1024 fp32 matmul
on one thread: ~42 GFLOP/s, ~104 with ``MKL_DEBUG_CPU_TYPE=5``). On Intel AVX-512 CPUs the same
setting forces AVX2 and costs ~35%, so it is set on AMD only, and never over a user's own value.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["cpu_vendor", "apply_mkl_default", "math_settings", "MATH_SETTINGS"]


# the settings a CPU run's floating-point results depend on: MKL splits a GEMM's sums by its thread
# count (docs/parity.md, "Thread counts"), so runs agree bit for bit only where these are equal
MATH_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE")


def math_settings(env: MutableMapping[str, str] | None = None) -> dict[str, str | None]:
    """This process's :data:`MATH_SETTINGS` (None: unset), as a run's loss.json records them."""
    env = os.environ if env is None else env
    return {k: env.get(k) for k in MATH_SETTINGS}


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``"AuthenticAMD"``, ``"GenuineIntel"``, ... or ``"unknown"`` (no /proc, other OS)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def apply_mkl_default(env: MutableMapping[str, str] | None = None, vendor: str | None = None) -> str | None:
    """Set ``MKL_DEBUG_CPU_TYPE=5`` in ``env`` (default ``os.environ``) on AMD when unset; returns its value."""
    env = os.environ if env is None else env
    if "MKL_DEBUG_CPU_TYPE" not in env and (vendor or cpu_vendor()) == "AuthenticAMD":
        env["MKL_DEBUG_CPU_TYPE"] = "5"
    return env.get("MKL_DEBUG_CPU_TYPE")
