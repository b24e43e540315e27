"""The kernel cache does not grow with every process that loads the kernels.

Paddle's loader imports a built library through a Python file it writes beside the library
(``<name>_<thread ident>.py``, a fresh name in every process) and removes only from an ``atexit``
handler, which a process leaving with ``os._exit`` (the training workers, _exit.py) or killed never
runs. Measured before: 2118 such files (28 KB each, 64 MB) in one cache folder after a day of test
runs, one more per process. Now the loader keeps the file's text in ``linecache`` (``inspect`` still
finds the source) and removes the file as soon as the module is imported; files older than a day
that earlier processes left are removed on load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from paddleformers_glm.ops import kernels as cpu_kernels
from tests._dist.runner import env


@pytest.fixture(scope="module")
def built():
    if cpu_kernels.cpu_ops() is None:  # a build failure is a failure here, never a skip
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels._state['error']}")
    return cpu_kernels._state["path"]


def _private_cache(built, tmp_path):
    """A cache root holding a copy of the built library under its own key (no compile)."""
    so = built
    lib_dir, key_dir = so.parent, so.parent.parent
    root = tmp_path / "cache"
    dst = root / key_dir.name / lib_dir.name
    dst.mkdir(parents=True)
    shutil.copy2(so, dst / so.name)
    (root / key_dir.name / "built").touch()
    return root, dst, lib_dir.name


_CODE = (
    "import inspect, os, sys\n"
    "from paddleformers_glm.ops import kernels\n"
    "ops = kernels.build()\n"
    "print(inspect.getsource(ops.glm_masked_softmax).split('(')[0].split()[-1], flush=True)\n"
    "os._exit(0)\n"  # as the training workers leave: no atexit handlers
)


def test_a_process_that_loads_the_kernels_leaves_no_file_in_the_cache(built, tmp_path):
    root, lib, name = _private_cache(built, tmp_path)
    old, young = lib / f"{name}_111.py", lib / f"{name}_222.py"  # left by earlier processes
    for f in (old, young):
        f.write_text("# api file\n")
    week = time.time() - 7 * 86400
    os.utime(old, (week, week))
    p = subprocess.run(
        [sys.executable, "-c", _CODE],
        env={**env(), "GLM52_KERNEL_CACHE": str(root), "GLM52_QUIET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "glm_masked_softmax", p.stdout  # inspect still reads the source
    left = sorted(f.name for f in lib.glob(f"{name}_*.py"))
    assert left == [young.name], left  # before: the process's own file too, and the week-old one


def test_a_failed_build_is_not_retried_by_every_process_until_the_compiler_changes(tmp_path, monkeypatch):
    """On a host without a compiler every process of a job compiled again, and failed again (~12 s a
    rank). The failure is now recorded with the compiler's identity beside the build log: the next
    process fails at once, naming the log, and a changed compiler ($CXX here) is tried again."""
    calls = []
    real = cpu_kernels._compile

    def counted(*a, **kw):  # the first build runs Paddle's real one; a retry just fails again
        calls.append(os.environ.get("CXX"))
        if len(calls) > 1:
            raise RuntimeError("Failed to build (again)")
        return real(*a, **kw)

    monkeypatch.setattr(cpu_kernels, "_compile", counted)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError, match="Failed to build"):
        cpu_kernels.build(cache_root=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"an earlier build with this compiler failed \(log .*build\.log\)"):
        cpu_kernels.build(cache_root=str(tmp_path / "cache"))
    assert len(calls) == 1
    monkeypatch.setenv("CXX", str(tmp_path / "another-c++"))
    with pytest.raises(RuntimeError, match="Failed to build"):
        cpu_kernels.build(cache_root=str(tmp_path / "cache"))
    assert len(calls) == 2
