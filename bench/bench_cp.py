"""Context-parallel benchmark: activation memory per rank and step time at S = 8192 for CP 1/2/4.

    python bench/bench_cp.py                        # S = 8192, CP 1, 2, 4 (a few minutes on 2 cores)
    python bench/bench_cp.py --seq-len 1024 --cp 1 2 --steps 2    # quick

Each CP degree is one `glm52 train` run of the tiny official-layout GLM-5.2 checkpoint (the
reduced config: hidden 64, 8 decoder layers with full and shared DSA indexer layers, MoE, one MTP
layer; fp32 on CPU), `--cp N` on N processes, global batch 1. Printed side by side:

* activations per rank: the trainer's own measurement (`loss.json` "memory", `activations_bytes`:
  the peak bytes autograd keeps saved for backward during the first step, parameters excluded),
  the largest over the ranks; the expectation is ~1/CP of CP 1 (each rank holds S / CP tokens;
  only the gathered latent rows, S x (kv_lora_rank + qk_rope_head_dim), are whole-sequence);
* step time: the median of the steps after the first (rank 0's log line), wall clock. On a
  machine with fewer cores than CP ranks the ranks share cores, so the time shows the
  communication and the contention, not the speed-up a rank per device gives;
* peak RSS per rank (host memory high-water mark: parameters, optimizer, allocator caches too).

`--json FILE` keeps the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(threads: int) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e["OMP_NUM_THREADS"] = str(threads)
    e.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    e["GLOG_minloglevel"] = "2"
    return e


def run_one(ckpt: str, cp: int, seq: int, steps: int, out: Path, threads: int, timeout: float) -> dict:
    args = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", "--model", ckpt, "--cp", str(cp)]
    args += ["--seq-len", str(seq), "--steps", str(steps), "--global-batch-size", "1", "--micro-batch-size", "1"]
    args += ["--lr", "1e-5", "--out", str(out)]
    t0 = time.monotonic()
    p = subprocess.run(args, env=_env(threads), capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        logs = "".join(f.read_text(errors="replace")[-2000:] for f in sorted((out / "logs").glob("workerlog.*")))
        raise RuntimeError(f"cp {cp} failed (rc {p.returncode}):\n{p.stderr[-3000:]}\n{logs}")
    result = json.loads((out / "loss.json").read_text())
    # rank 0's step lines: its worker log when launched (the launcher may echo it too: read one copy)
    log = (out / "logs" / "workerlog.0").read_text(errors="replace") if cp > 1 else p.stdout + p.stderr
    times = [float(m) for m in re.findall(r"step \d+/\d+ \|.*\| ([0-9.]+) s$", log, flags=re.M)]
    mem = result["memory"]
    return {
        "cp": cp,
        "seq_len": seq,
        "ranks": len(mem),
        "activations_bytes": [r["activations_bytes"] for r in mem],
        "peak_rss_bytes": [r["peak_bytes"] for r in mem],
        "step_seconds": times,
        "step_median_s": statistics.median(times[1:] if len(times) > 1 else times) if times else None,
        "losses": result["losses"],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens of the one sequence per step")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel degrees, one run each")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    from paddleformers_glm.tiny import make_tiny_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt")
        for cp in a.cp:
            rows.append(run_one(ckpt, cp, a.seq_len, a.steps, Path(tmp) / f"cp{cp}", a.threads, a.timeout))
            print(f"  cp {cp}: done in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    base = max(rows[0]["activations_bytes"])
    MiB = 1 << 20
    print(f"GLM-5.2 tiny, S = {a.seq_len}, global batch 1, fp32 CPU, {a.threads} thread(s) per rank")
    print(
        f"{'cp':>3} {'ranks':>5} {'activ MiB/rank (max)':>21} {'vs cp 1':>8} {'peak RSS MiB (max)':>19} {'step s':>8}"
    )
    for r in rows:
        act = max(r["activations_bytes"])
        print(
            f"{r['cp']:>3} {r['ranks']:>5} {act / MiB:>21.1f} {act / base:>8.3f} "
            f"{max(r['peak_rss_bytes']) / MiB:>19.0f} {r['step_median_s'] or float('nan'):>8.2f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"seq_len": a.seq_len, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
