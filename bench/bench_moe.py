"""MoE routed-expert compute, three forms (forward + backward of one MoE layer, bench model's shape):

* loop: one matmul pair per expert on its sorted rows (the form without compiled kernels: GPU, bf16);
* padded: `MoE(config, routed_form="padded")`, two batched matmuls over a zero-padded [E, capacity, H] layout;
* kernel: the compiled grouped matmul (paddleformers_glm/ops/experts.py; the default for fp32 CPU tensors).

Why: grouped expert compute is used where Paddle allows it; this measures which form is
faster. All forms give the same routing.

    python bench/bench_moe.py [--tokens 512,2048,8192] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    if ns.repeats < 2:  # the first repeat warms up and is not timed
        p.error(f"--repeats must be >= 2 (the first is a warm-up), got {ns.repeats}")
    os.environ.setdefault("OMP_NUM_THREADS", str(ns.threads))
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import paddle

    paddle.set_device("cpu")
    from paddle.base import core

    core.set_num_threads(ns.threads)
    from bench.bench_train_step import BENCH_CONFIG
    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.modeling.moe import MoE
    from paddleformers_glm.ops import kernels as cpu_kernels

    cfg = GlmMoeDsaConfig(**BENCH_CONFIG)
    moe = MoE(cfg)
    rng = np.random.default_rng(0)
    for prm in moe.parameters():
        prm.set_value(paddle.to_tensor((rng.standard_normal(prm.shape) * prm.shape[0] ** -0.5).astype("float32")))
    padded = MoE(cfg, routed_form="padded")
    padded.set_state_dict(moe.state_dict())  # the same weights in the padded form
    print(
        f"experts {cfg.n_routed_experts} top-{cfg.num_experts_per_tok} H {cfg.hidden_size} I {cfg.moe_intermediate_size}"
    )
    forms = {  # name -> (module, kernels on)
        "loop": (moe, False),
        "padded": (padded, False),
        "kernel": (moe, True),
    }
    print("| tokens | loop ms | padded ms | kernel ms | loop / kernel |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(t) for t in ns.tokens.split(",")):
        x = paddle.to_tensor(rng.standard_normal((n, cfg.hidden_size)).astype("float32"))
        x.stop_gradient = False
        best: dict[str, float] = {}
        for rep in range(ns.repeats):
            for name, (module, kernels) in forms.items():  # alternate the forms
                with contextlib.nullcontext() if kernels else cpu_kernels.disabled():
                    t0 = time.perf_counter()
                    module(x).sum().backward()
                    dt = time.perf_counter() - t0
                module.clear_gradients()
                x.clear_gradient()
                if rep:
                    best[name] = min(best.get(name, 1e9), dt)
        ms = {k: v * 1e3 for k, v in best.items()}
        print(
            f"| {n} | {ms['loop']:.1f} | {ms['padded']:.1f} | {ms['kernel']:.1f} | {ms['loop'] / ms['kernel']:.2f}x |"
        )


if __name__ == "__main__":
    main()
