"""Fused, multi-threaded fp32 CPU kernels (cpu_kernels.cc), built on first use; Paddle-op fallbacks.

Why: Paddle 3.3's CPU softmax, add, exp, ... run on one thread, one pass over memory each, so at
short sequences they decide a training step's time (docs/performance.md). The kernels here
do the same maths in one multi-threaded pass per row, or as MKL sgemm calls without Python in
between: the attention cores' masked softmax and its backward, the latent core's top-k tables and
masks, rope fused with its concatenation, RMSNorm, SwiGLU, the grouped expert matmul, MLA's
per-head W_uv, and the causal-LM cross entropy (each forward and backward).

Control and guarantees:

* used only for contiguous CPU tensors whose floating ones are fp32 (index tensors are int64);
  anything else (GPU, bf16) takes the Paddle-op code beside each call, which is also the fallback
  everywhere (same maths, Paddle's rounding);
* ``PADDLEFORMERS_GLM_CPU_KERNELS=0`` turns them off;
* built once with ``paddle.utils.cpp_extension`` (a C++ compiler is needed: ~15 s) into
  ``$PADDLEFORMERS_GLM_KERNEL_CACHE`` (default ``~/.cache/paddleformers_glm/kernels``), in a folder
  keyed by the source, the flags, Paddle's version and the CPU's instruction sets (the build uses
  ``-march=native``), under a file lock so that parallel processes build it once;
* a build that fails warns once, naming the error, and the fallbacks run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import paddle

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
ENV_SWITCH = "PADDLEFORMERS_GLM_CPU_KERNELS"
ENV_CACHE = "PADDLEFORMERS_GLM_KERNEL_CACHE"
# -ffp-contract=off: no fused multiply-adds the source does not write, so products and sums round
# as in the op-by-op forms (rope is then bitwise rope_heads)
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]

_state: dict[str, object] = {"tried": False, "ops": None, "error": None, "off": 0}
_lock = threading.Lock()


def _cpu_isa() -> str:
    """The CPU's model name and instruction-set flags: a build made with -march=native is only
    valid where these are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _build_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags. OpenMP links against the libiomp5 Paddle ships (its MKL's runtime):
    one thread pool for both; with gcc's own libgomp beside it, the two runtimes' spinning threads
    fight for the cores. The grouped matmul needs Paddle's MKL (libmklml_intel); without it that
    op is left out and the MoE keeps its per-expert loop."""
    libs = Path(paddle.__file__).parent / "libs"
    cflags, ldflags = list(CXX_FLAGS), []
    if (libs / "libiomp5.so").exists():
        ldflags += [f"-L{libs}", "-Wl,--as-needed", "-liomp5"]
    else:
        ldflags += ["-fopenmp"]
    if (libs / "libmklml_intel.so").exists():
        cflags.append("-DGLM_WITH_MKL")
        ldflags += [f"-L{libs}", "-lmklml_intel"]
    return cflags, ldflags + [f"-Wl,-rpath,{libs}"]


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors: the compiler runs in a subprocess)
    to `log` for the duration: Paddle's loader prints and logs on every load."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def build(source: Path = SOURCE, cache_root: str | None = None) -> ModuleType:
    """Compile (or reuse) the kernels and load them; raises on any failure, with the end of the
    build log (build.log in the cache folder) in the message."""
    with warnings.catch_warnings():  # "No ccache found", at import
        warnings.simplefilter("ignore")
        from paddle.utils.cpp_extension import load

    cflags, ldflags = _build_flags()
    key_src = "\0".join([source.read_text(), *cflags, *ldflags, paddle.__version__, _cpu_isa()])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    root = Path(cache_root or os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "paddleformers_glm" / "kernels")
    folder = root / key
    folder.mkdir(parents=True, exist_ok=True)
    name = f"glm_cpu_kernels_{key[:8]}"
    log, done = folder / "build.log", folder / "built"
    if done.exists():  # built before: load the library without Paddle's build step (~2 s a process)
        try:
            from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

            with _output_to(log):
                return _import_module_from_library(name, str(folder / name), False)
        except Exception:  # that private helper moved or failed: take the public route below
            pass
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build; the other processes wait, then reuse it
        try:
            with _output_to(log), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = load(
                    name=name,
                    sources=[str(source)],
                    extra_cxx_cflags=cflags,
                    extra_ldflags=ldflags,
                    build_directory=str(folder),
                )
            done.touch()
            return module
        except Exception as e:
            raise RuntimeError(f"{e}\n--- end of {log} ---\n{_tail(log)}") from e
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cpu_ops() -> ModuleType | None:
    """The loaded kernels, or None when switched off or the build failed (warned once)."""
    if _state["tried"]:
        return _state["ops"]  # type: ignore[return-value]
    with _lock:
        if not _state["tried"]:
            if os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no"):
                try:
                    _state["ops"] = build()
                except Exception as e:  # no compiler, a compile error, a read-only cache, ...
                    _state["error"] = f"{type(e).__name__}: {e}"
                    warnings.warn(
                        f"paddleformers_glm: the fused CPU kernels ({SOURCE.name}) could not be built, "
                        f"so Paddle's own (slower) ops run instead. {_state['error']}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            _state["tried"] = True
    return _state["ops"]  # type: ignore[return-value]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside, `usable` answers None, so the Paddle-op fallbacks run (tests and A/B benchmarks)."""
    _state["off"] = int(_state["off"]) + 1  # type: ignore[call-overload]
    try:
        yield
    finally:
        _state["off"] = int(_state["off"]) - 1  # type: ignore[call-overload]


def usable(*tensors: paddle.Tensor) -> ModuleType | None:
    """The kernels when every tensor is contiguous and on the CPU, and every floating one fp32
    (integer index tensors pass), and they are built; else None."""
    if _state["off"]:
        return None
    for t in tensors:
        if (t.is_floating_point() and t.dtype != paddle.float32) or not t.place.is_cpu_place() or not t.is_contiguous():
            return None
    return cpu_ops()
