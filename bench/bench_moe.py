"""MoE routed-expert compute: per-expert loop vs padded batched matmuls (forward + backward).

Why: issue 7 asks for grouped expert compute "where Paddle allows" and to measure which form is
faster. Both forms give the same routing; this times one MoE layer of the bench model's shape.

    python bench/bench_moe.py [--tokens 512,2048,8192] [--threads 1]
"""

from __future__ import annotations

import argparse
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

    cfg = GlmMoeDsaConfig(**BENCH_CONFIG)
    moe = MoE(cfg)
    rng = np.random.default_rng(0)
    for prm in moe.parameters():
        prm.set_value(paddle.to_tensor((rng.standard_normal(prm.shape) * prm.shape[0] ** -0.5).astype("float32")))
    print(
        f"experts {cfg.n_routed_experts} top-{cfg.num_experts_per_tok} H {cfg.hidden_size} I {cfg.moe_intermediate_size}"
    )
    print("| tokens | loop ms | grouped ms | loop / grouped |")
    print("|---:|---:|---:|---:|")
    for n in (int(t) for t in ns.tokens.split(",")):
        x = paddle.to_tensor(rng.standard_normal((n, cfg.hidden_size)).astype("float32"))
        x.stop_gradient = False
        best = {}
        for rep in range(ns.repeats):
            for grouped in (False, True):  # alternate the two forms
                MoE.grouped = grouped
                t0 = time.perf_counter()
                moe(x).sum().backward()
                dt = time.perf_counter() - t0
                moe.clear_gradients()
                x.clear_gradient()
                if rep:
                    best[grouped] = min(best.get(grouped, 1e9), dt)
        print(f"| {n} | {best[False] * 1e3:.1f} | {best[True] * 1e3:.1f} | {best[False] / best[True]:.2f}x |")


if __name__ == "__main__":
    main()
