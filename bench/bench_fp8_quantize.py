#!/usr/bin/env python
"""Block-FP8 quantization throughput: ``quantize_blocks`` against the quantizer it replaced
(tests/_fp8_oracle.py, kept verbatim) and, where torch is installed, torch's own
``float8_e4m3fn`` cast of the same 128 x 128 blocks (``amax / 448`` scale, ``(w / scale).to(fp8)``;
no neighbour-scale search, so a lower bound on what any quantizer does).

Three weights of ``--shape`` (default an expert's gate/up, 2048 x 6144 fp32 = 48 MB):

* ``fresh``: bf16-rounded ``N(0, 0.02)`` (``save_pretrained(quantization="fp8")`` of a trained model);
* ``fp8``: a dequantized FP8 weight at ``amax / 448`` scales (re-saving a loaded FP8 checkpoint);
* ``fp8_hf``: the same codes at transformers' ``1 / (448 / amax)`` scales, some of which are one or
  two fp32 ulps from ``amax / 448`` (the neighbour-scale searches run).

MB/s are of fp32 input, best of ``--repeat``; the old quantizer runs on the first ``--old-rows`` rows
only (it is ~100x slower) and its bytes are compared with the new one's on those rows. One thread
each (numpy is single-threaded; torch is pinned with ``torch.set_num_threads``).

    python bench/bench_fp8_quantize.py                       # ~1 min on 2 cores
    python bench/bench_fp8_quantize.py --shape 6144x2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BLOCK = (128, 128)


def weights(rows: int, cols: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """``{name: (fp32 weight, the E4M3 bytes it is the dequantization of, or None)}``."""
    from paddleformers_glm.checkpoint.fp8 import dequantize, quantize_blocks

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    bits = w.view(np.uint32).astype(np.uint64)
    fresh = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
    q, s = quantize_blocks(fresh, BLOCK)
    amax = (s * np.float32(448)).astype(np.float32)
    hf = (np.float32(1) / (np.float32(448) / amax)).astype(np.float32)
    return {"fresh": (fresh, None), "fp8": (dequantize(q, s, BLOCK), q), "fp8_hf": (dequantize(q, hf, BLOCK), q)}


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_cast(torch, w):
    rows, cols = w.shape
    br, bc = BLOCK
    x = torch.from_numpy(w)

    def run():
        b = x.view(rows // br, br, cols // bc, bc)
        amax = b.abs().amax(dim=(1, 3), keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        return (b / scale).to(torch.float8_e4m3fn), scale

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2048x6144", help="ROWSxCOLS, multiples of 128 (default 2048x6144)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old-rows", type=int, default=128, help="rows the old quantizer runs on (default 128)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows, cols = (int(v) for v in args.shape.lower().split("x"))

    from paddleformers_glm.checkpoint.fp8 import quantize_blocks
    from tests._fp8_oracle import quantize_blocks as old_quantize

    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    results = []
    print(
        f"{'weight':8s} {'shape':>11s} {'new MB/s':>9s} {'old MB/s':>9s} {'new/old':>8s} {'torch cast MB/s':>16s} "
        f"{'old == new':>10s} {'scales moved':>12s} {'source blocks changed':>21s}"
    )
    for name, (w, source) in weights(rows, cols).items():
        mb = w.nbytes / 1e6
        t_new = best_seconds(lambda w=w: quantize_blocks(w, BLOCK), args.repeat)
        part = w[: args.old_rows]
        t_old = best_seconds(lambda part=part: old_quantize(part, BLOCK), 1)
        qn, sn = quantize_blocks(part, BLOCK)
        qo, so = old_quantize(part, BLOCK)
        same = bool(np.array_equal(qn, qo) and np.array_equal(sn.view(np.uint32), so.view(np.uint32)))
        q_all, s_all = quantize_blocks(w, BLOCK)
        amax = np.abs(w).reshape(rows // 128, 128, cols // 128, 128).max(axis=(1, 3))
        moved = int((s_all != (amax / np.float32(448)).astype(np.float32)).sum())
        row = {
            "weight": name,
            "shape": [rows, cols],
            "new_mb_s": mb / t_new,
            "old_mb_s": part.nbytes / 1e6 / t_old,
            "old_rows": int(part.shape[0]),
            "identical": same,
            "scales_moved": moved,
            "blocks": int(s_all.size),
            "source_blocks_changed": None
            if source is None
            else int((q_all != source).reshape(rows // 128, 128, cols // 128, 128).any(axis=(1, 3)).sum()),
        }
        if torch is not None and rows % 128 == 0 and cols % 128 == 0:
            row["torch_mb_s"] = mb / best_seconds(torch_cast(torch, w), args.repeat)
        results.append(row)
        t = f"{row['torch_mb_s']:16.0f}" if "torch_mb_s" in row else f"{'-':>16s}"
        print(
            f"{name:8s} {rows:5d}x{cols:<5d} {row['new_mb_s']:9.1f} {row['old_mb_s']:9.2f} "
            f"{row['new_mb_s'] / row['old_mb_s']:7.0f}x {t} {'yes' if same else 'NO':>10s} "
            f"{moved:6d}/{s_all.size} {'-' if source is None else row['source_blocks_changed']:>21}"
        )
    if args.json:
        meta = {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
