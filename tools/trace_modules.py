"""The path of a call through the package's modules: which modules it enters, how often, and how
many times it comes back to a module it had already left.

    python tools/trace_modules.py from_pretrained     # GlmMoeDsaForCausalLM.from_pretrained(tiny checkpoint)
    python tools/trace_modules.py train               # glm52 train --model DIR --steps 1 (one process)
    python tools/trace_modules.py train --show 40     # also the first 40 cross-module calls

A ``sys.setprofile`` hook follows every Python call and return; the module "in control" is the one of
the innermost frame that belongs to the package (frames of Paddle, numpy or the standard library
are passed through). Each distinct call from a function of one package module into a function of
another is one *cross-module call* (counted once, however often a loop repeats it); *returns*
counts those that enter a module the path had already entered. A one-way design enters each
module about once; a layering that bounces between modules shows as returns.

Imports are done before tracing starts (module bodies are not calls of the path), and the tiny
checkpoint is written first. Numbers depend only on the code, not on the machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from typing import Any

PACKAGE = "paddleformers_glm"


def _module_of(filename: str, root: str) -> str | None:
    if not filename.startswith(root):
        return None
    rel = os.path.relpath(filename, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


class ModulePath:
    """Records, in order of first occurrence, each distinct call from a function of one package
    module into a function of another (a loop repeating the same call counts once)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.calls: list[tuple[str, str, str, str]] = []  # (caller module, function, callee module, function)
        self._seen: set[tuple[int, int]] = set()
        self._cache: dict[str, str | None] = {}

    def _module(self, code: Any) -> str | None:
        fn = code.co_filename
        mod = self._cache.get(fn, "?")
        if mod == "?":
            mod = self._cache[fn] = _module_of(fn, self.root)
        return mod

    def _caller(self, frame: Any) -> tuple[str, Any] | None:
        while frame is not None:
            mod = self._module(frame.f_code)
            if mod is not None:
                return mod, frame.f_code
            frame = frame.f_back
        return None

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        mod = self._module(frame.f_code)
        if mod is None:
            return
        caller = self._caller(frame.f_back)
        if caller is None or caller[0] == mod:
            return
        key = (id(caller[1]), id(frame.f_code))
        if key not in self._seen:
            self._seen.add(key)
            self.calls.append((caller[0], caller[1].co_name, mod, frame.f_code.co_name))

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sys.setprofile(self.hook)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)

    def report(self, show: int = 0) -> str:
        entered: list[str] = [self.calls[0][0]] if self.calls else []
        returns = 0
        for _, _, callee, _ in self.calls:
            returns += callee in entered
            if callee not in entered:
                entered.append(callee)
        counts = collections.Counter(c[2] for c in self.calls)
        strip = len(PACKAGE) + 1
        lines = [
            f"modules {len(entered)}  cross-module calls {len(self.calls)}  returns to a module already entered {returns}",
            "most entered: " + ", ".join(f"{m[strip:]} {n}" for m, n in counts.most_common(8)),
        ]
        for a, f, b, g in self.calls[:show]:
            lines.append(f"  {a[strip:]}.{f} -> {b[strip:]}.{g}")
        return "\n".join(lines)


def _tiny_checkpoint(tmp: str) -> str:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(os.path.join(tmp, "ckpt")))


def trace_from_pretrained(tmp: str) -> ModulePath:
    import paddleformers_glm.checkpoint  # noqa: F401  - imports happen before tracing
    import paddleformers_glm.checkpoint.loader  # noqa: F401
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    ckpt = _tiny_checkpoint(tmp)
    GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32")  # warm: kernels built, lazy imports done
    path = ModulePath(os.path.dirname(sys.modules[PACKAGE].__file__))
    path.run(GlmMoeDsaForCausalLM.from_pretrained, ckpt, dtype="float32")
    return path


def trace_train(tmp: str) -> ModulePath:
    from paddleformers_glm.train.command import main

    ckpt = _tiny_checkpoint(tmp)
    args = ["--model", ckpt, "--steps", "1", "--seq-len", "16", "--global-batch-size", "2", "--no-progress"]
    if main([*args, "--out", os.path.join(tmp, "warm")]) != 0:  # warm: lazy imports done, kernels built
        raise SystemExit("the warm-up run failed")
    path = ModulePath(os.path.dirname(sys.modules[PACKAGE].__file__))
    rc = path.run(main, [*args, "--out", os.path.join(tmp, "run")])
    if rc != 0:
        raise SystemExit(f"glm52 train exited {rc}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=["from_pretrained", "train"])
    ap.add_argument("--show", type=int, default=0, help="print the first N cross-module calls in order")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_from_pretrained(tmp) if a.target == "from_pretrained" else trace_train(tmp)
    print(f"{a.target}: {path.report(a.show)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
