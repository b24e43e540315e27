"""Count the Paddle operators a piece of dygraph code runs (the per-token cost of small-model decoding
is op dispatch, not arithmetic, so this count is the number to cut and the one that load on a
shared machine does not blur).

    from op_count import count_ops
    result, ops = count_ops(lambda: model(next_ids, past_key_values=cache))
    print(sum(ops.values()), ops.most_common(10))

It runs the function once under Paddle's host profiler and counts its ``Operator`` events: every
dygraph op launched through Paddle's API, Tensor methods and operators, not the Python functions
around them; the project's compiled CPU kernels (custom ops, which the profiler does not record
as operators) are counted by wrapping their entry points for the call. ``python bench/op_count.py`` prints the count of one decode step of a
small random model, op by op.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any


def count_ops(fn: Callable[[], Any]) -> tuple[Any, Counter]:
    """(fn(), Counter of operator name -> launches) for one call of ``fn``."""
    import paddle.profiler as profiler

    from paddleformers_glm.ops.kernels import cpu_ops

    counts: Counter = Counter()
    kernels = cpu_ops()
    originals = {}
    if kernels is not None:
        for name in dir(kernels):
            if name.startswith("glm_") and callable(getattr(kernels, name)):
                originals[name] = getattr(kernels, name)

                def counted(*args: Any, _name: str = name, _fn: Any = originals[name], **kwargs: Any) -> Any:
                    counts[_name] += 1
                    return _fn(*args, **kwargs)

                setattr(kernels, name, counted)
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _p: None)
    cwd = os.getcwd()
    try:
        with tempfile.TemporaryDirectory() as tmp:  # the profiler may write a trace file into the cwd
            os.chdir(tmp)
            try:
                prof.start()
                try:
                    result = fn()
                finally:
                    prof.stop()
            finally:
                os.chdir(cwd)
    finally:
        for name, f in originals.items():
            setattr(kernels, name, f)
    operator = profiler.TracerEventType.Operator

    def walk(node: Any, inside_op: bool) -> None:
        for child in node.children_node:
            is_op = child.type == operator and not inside_op  # an op that an op runs is not a launch
            if is_op:
                counts[child.name.replace(" dygraph", "")] += 1
            walk(child, inside_op or is_op)

    for root in prof.profiler_result.get_data().values():
        walk(root, False)
    return result, counts


def _demo() -> None:
    import paddle

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_generate import SIZES

    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.modeling.cache import DSACache

    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**SIZES["small"]))
    model.eval()
    ids = paddle.randint(3, 1000, [1, 128])
    with paddle.no_grad():
        cache = DSACache.for_config(model.config, 1, capacity=160)
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        model(ids[:, :1], past_key_values=cache, logits_to_keep=1)  # warm
        _, ops = count_ops(lambda: model(ids[:, :1], past_key_values=cache, logits_to_keep=1))
    print(f"one decode step: {sum(ops.values())} ops")
    for name, n in ops.most_common():
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="No options: counts one decode step of a small random model."
    ).parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _demo()
