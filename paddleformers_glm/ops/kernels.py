"""Loader of the fused, multi-threaded fp32 CPU kernels (cpu_kernels.cc), built on first use.

Why: Paddle's CPU softmax, add, exp, ... run on one thread, one pass over memory each, so at
short sequences they decide a training step's time (docs/performance.md). Each op of this package
takes a kernel where :func:`usable` says so (contiguous CPU tensors, floating ones fp32) and its
Paddle-op fallback otherwise; ``GLM52_CPU_KERNELS=0`` or :func:`disabled` turn them off.

The library is built once with ``paddle.utils.cpp_extension`` in a child process (output to
``build.log``) into ``$GLM52_KERNEL_CACHE`` (default ``~/.cache/paddleformers_glm/kernels``), in a
folder keyed by the source, the flags, Paddle's version and the CPU's instruction sets (the build
uses ``-march=native``), under a file lock so parallel processes build it once.  A failed build
warns once and the fallbacks run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import paddle

from .._io import env_flag

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
ENV_SWITCH = "GLM52_CPU_KERNELS"
ENV_CACHE = "GLM52_KERNEL_CACHE"
# the names these had before the package settled on one prefix: still read, with a warning
_OLD_ENV = {ENV_SWITCH: "PADDLEFORMERS_GLM_CPU_KERNELS", ENV_CACHE: "PADDLEFORMERS_GLM_KERNEL_CACHE"}
# -ffp-contract=off: no fused multiply-adds the source does not write, so products and sums round
# as in the op-by-op forms (rope is then bitwise rope_heads)
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
# Paddle's extension loader logs through this logger (and the root logger) on every load
_PADDLE_LOGGER = "utils.cpp_extension"

_state: dict[str, object] = {"tried": False, "ops": None, "error": None, "off": 0, "path": None}
_lock = threading.Lock()


def env_setting(name: str) -> str | None:
    """The environment variable `name` (a ``GLM52_`` name), or its deprecated older name with a
    DeprecationWarning when only that one is set."""
    value = os.environ.get(name)
    old = _OLD_ENV.get(name)
    if value is None and old is not None and old in os.environ:
        warnings.warn(f"{old} is deprecated, set {name} instead", DeprecationWarning, stacklevel=3)
        value = os.environ[old]
    return value


def _cpu_isa() -> str:
    """The CPU's model name and instruction-set flags: a build made with -march=native is only
    valid where these are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"
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
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) while inside: one process
    builds, the others wait and then reuse its build. fcntl on POSIX, msvcrt on Windows."""
    with open(path, "a+b") as f:
        if os.name == "nt":
            import msvcrt

            f.seek(0)
            while True:
                with contextlib.suppress(OSError):  # gives up after 10 s: retry
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
                    break
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _python_output_to(log: Path) -> Iterator[None]:
    """Python-level output (print, warnings, Paddle's loader logger) into `log` while inside; the
    file descriptors 1 and 2 are left alone."""
    logger = logging.getLogger(_PADDLE_LOGGER)
    with open(log, "a", encoding="utf-8") as f:
        handler = logging.StreamHandler(f)
        saved = (logger.handlers[:], logger.propagate)
        logger.handlers[:] = [handler]
        logger.propagate = False  # Paddle also configures the root logger: keep it quiet too
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            logger.handlers[:], logger.propagate = saved


def _summary(path: Path, errors: int = 8, tail: int = 6) -> str:
    """The compiler's first error lines and the log's last lines (the child's own exception)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    first = [ln for ln in lines if re.search(r"\berror:", ln)][:errors]
    return "\n".join([*first, "...", *lines[-tail:]])


# The child process that compiles: Paddle's public `load` builds and imports the library there,
# with its output (compiler included, verbose) going to the log file the parent opened for it.
_CHILD = """
import json, sys, warnings
warnings.simplefilter("ignore")
from paddle.utils.cpp_extension import load
a = json.loads(sys.argv[1])
load(name=a["name"], sources=[a["source"]], extra_cxx_cflags=a["cflags"], extra_ldflags=a["ldflags"],
     build_directory=a["folder"], verbose=True)
"""


def _compile(source: Path, folder: Path, name: str, cflags: list[str], ldflags: list[str], log: Path) -> None:
    """Build the library in a child process (output to `log`); raises with the log's end."""
    args = json.dumps(
        {"name": name, "source": str(source), "cflags": cflags, "ldflags": ldflags, "folder": str(folder)}
    )
    with open(log, "ab") as f:
        f.write(f"--- building {name} from {source}\n".encode())
        f.flush()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, args], stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        raise RuntimeError(f"Failed to build {source.name} (exit {done.returncode}); from {log}:\n{_summary(log)}")


def _load_built(folder: Path, name: str, log: Path) -> ModuleType:
    """Import the built library into this process (no build step, no subprocess)."""
    with _python_output_to(log):  # importing cpp_extension warns ("No ccache found")
        try:
            # the helper Paddle's own `load` imports a built library with
            from paddle.utils.cpp_extension.extension_utils import _import_module_from_library
        except ImportError as e:
            raise RuntimeError(f"this Paddle ({paddle.__version__}) has no loader for a built extension: {e}") from e
        module = _import_module_from_library(name, str(folder / name), False)
    _drop_api_files(module, folder / name, name)
    return module


_STALE_API_FILE_S = 86400


def _drop_api_files(module: ModuleType, lib_dir: Path, name: str) -> None:
    """Remove the Python file Paddle's loader wrote beside the library to import it from
    (``<name>_<thread ident>.py``, a new name in every process), its text kept in ``linecache`` so
    ``inspect`` still finds the source; and such files older than a day, left by earlier processes.

    Paddle removes the file only from an ``atexit`` handler, which a process leaving with
    ``os._exit`` (the training workers) or killed never runs: the cache grew by 28 KB a process
    (tests/test_kernel_cache.py)."""
    import linecache

    own = getattr(module, "__file__", None)
    with contextlib.suppress(OSError):
        if own and Path(own).parent == lib_dir:
            text = Path(own).read_text()
            linecache.cache[own] = (len(text), None, text.splitlines(True), own)  # mtime None: kept
            os.remove(own)
    now = time.time()
    for f in lib_dir.glob(f"{name}_*.py"):
        if f.stem[len(name) + 1 :].isdigit():  # another process's: removed once it is a day old
            with contextlib.suppress(OSError):
                if now - f.stat().st_mtime > _STALE_API_FILE_S:
                    f.unlink()


def _compiler_identity() -> str:
    """The compiler Paddle's ``load`` runs (``$CXX``, else ``c++`` on the PATH): its path, size and
    mtime. A failed build is not retried while it stays the same (every rank of a job on a host
    without a compiler spent ~12 s finding that out again)."""
    import shutil

    cxx = os.environ.get("CXX") or ("cl" if os.name == "nt" else "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    st = os.stat(path)
    return f"{os.path.realpath(path)} {st.st_size} {st.st_mtime_ns}"


def build(source: Path = SOURCE, cache_root: str | None = None) -> ModuleType:
    """Compile (or reuse) the kernels and load them; raises on any failure, with the end of the
    build log (build.log in the cache folder) in the message."""
    cflags, ldflags = _build_flags()
    key_src = "\0".join([source.read_text(), *cflags, *ldflags, paddle.__version__, _cpu_isa()])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    default = Path.home() / ".cache" / "paddleformers_glm" / "kernels"
    root = Path(cache_root or env_setting(ENV_CACHE) or default)
    folder = root / key
    folder.mkdir(parents=True, exist_ok=True)
    name = f"glm_cpu_kernels_{key[:8]}"
    log, done, failed = folder / "build.log", folder / "built", folder / "failed"
    if not done.exists():
        with _exclusive(folder / ".lock"):
            if not done.exists():  # another process may have built it while this one waited
                compiler = _compiler_identity()
                if failed.exists() and failed.read_text(errors="replace") == compiler:
                    raise RuntimeError(
                        f"an earlier build with this compiler failed (log {log}); it is retried when the compiler "
                        f"changes or once {failed} is removed"
                    )
                _say(f"building the CPU kernels (once per Paddle version and CPU; log {log}) ...")
                t0 = time.monotonic()
                try:
                    _compile(source, folder, name, cflags, ldflags, log)
                except RuntimeError:
                    failed.write_text(compiler)  # the job's other processes do not spend the same build again
                    raise
                failed.unlink(missing_ok=True)
                done.touch()
                _say(f"CPU kernels built in {time.monotonic() - t0:.0f} s, cached in {folder}")
    module = _load_built(folder, name, log)
    _state["path"] = folder / name / f"{name}.so"
    return module


def library_path() -> Path | None:
    """The built shared library (for its plain C entry points, e.g. ops/transpose.py), or None
    when the kernels are switched off or could not be built."""
    return _state["path"] if cpu_ops() is not None else None  # type: ignore[return-value]


def _say(line: str) -> None:
    """A line on stderr while a first use compiles (silent under GLM52_QUIET=1)."""
    if not env_flag("GLM52_QUIET", False, strict=False):
        print(f"[glm52] {line}", file=sys.stderr, flush=True)


def cpu_ops() -> ModuleType | None:
    """The loaded kernels, or None when switched off or the build failed (warned once)."""
    if _state["tried"]:
        return _state["ops"]  # type: ignore[return-value]
    with _lock:
        if not _state["tried"]:
            if env_flag(ENV_SWITCH, True, value=env_setting(ENV_SWITCH), strict=False):
                try:
                    _state["ops"] = build()
                except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as e:
                    # no compiler, a compile error, a read-only cache, a library that will not load
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
    """Inside, `usable` answers None, so every op runs its Paddle-op fallback (tests, A/B benchmarks)."""
    _state["off"] = int(_state["off"]) + 1  # type: ignore[call-overload]
    try:
        yield
    finally:
        _state["off"] = int(_state["off"]) - 1  # type: ignore[call-overload]


def computes_on_cpu(x: paddle.Tensor) -> bool:
    """Whether x is computed on the CPU (while ``paddle.jit.to_static`` traces, where a tensor's place
    is not readable: whether Paddle computes on the CPU)."""
    try:
        return bool(x.place.is_cpu_place())
    except Exception:  # a symbolic tensor
        return paddle.device.get_device() == "cpu"


@paddle.jit.not_to_static
def usable(*tensors: paddle.Tensor) -> ModuleType | None:
    """The kernels when every tensor is contiguous and on the CPU, and every floating one fp32
    (integer index tensors pass), and they are built; else None (so also while ``to_static``
    translates a whole graph: Paddle's own ops there)."""
    if _state["off"] or not paddle.in_dynamic_mode():
        return None
    for t in tensors:
        # dtype membership, not is_floating_point(): this check runs before every kernel call and
        # the method costs several times the set lookup
        if t.dtype in _OTHER_FLOATS or not t.is_contiguous() or not t.place.is_cpu_place():
            return None
    return cpu_ops()


_OTHER_FLOATS = frozenset(
    getattr(paddle, name)
    for name in ("float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128")
    if hasattr(paddle, name)
)
