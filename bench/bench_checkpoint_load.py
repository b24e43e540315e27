#!/usr/bin/env python
"""Checkpoint load benchmark: our AOA-driven loader vs a plain ``safetensors`` read of the same files.

A synthetic official-layout GLM-5.2 checkpoint (bf16, real key set and shapes of a scaled-down
config, ``--size-gb`` total, ``--shard-mb`` per shard) is written with the ``safetensors`` library.
Each measurement runs in a fresh subprocess so peak RSS is its own:

* ``plain``: ``safe_open(framework="paddle")`` + ``get_tensor(k).clone()`` of every tensor, all
  kept (``get_tensor`` alone only maps the file; ``clone`` makes it a real read into Paddle memory,
  no renaming, no transposes);
* ``ours``: ``load_pretrained_state`` into a model-shaped state (``--model-dtype``): header and
  index validation, AOA mapping, transposes, fused ``up_gate_proj``, casts.

Reported: best-of-``--repeat`` seconds, GB/s of checkpoint bytes, the throughput ratio ours/plain,
and peak RSS (``ru_maxrss``) with the RSS before the model was allocated (Paddle's own import
footprint) so that "peak - baseline" is what loading costs. The page cache is warm for both (the
files were just written or read); that is the honest comparison of the code paths, not of the disk.

    python bench/bench_checkpoint_load.py                 # ~2 GB, a few minutes on 2 cores
    python bench/bench_checkpoint_load.py --size-gb 8 --model-dtype float32 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def synthetic_config(size_bytes: int):
    """A scaled-down GLM-5.2 config (same structure: dense + MoE layers, DSA indexer schedule, MTP)
    with as many layers as needed to reach ``size_bytes`` of bf16 weights."""
    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.checkpoint.layout import hf_param_specs

    base = {
        "hidden_size": 1024,
        "vocab_size": 32768,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 512,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 2816,
        "moe_intermediate_size": 512,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 64,
        "first_k_dense_replace": 1,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "dtype": "bfloat16",
    }
    for layers in range(2, 1000):
        cfg = GlmMoeDsaConfig(**base, num_hidden_layers=layers)
        size = sum(math.prod(s) * (4 if k == "float32" else 2) for s, k in hf_param_specs(cfg).values())
        if size >= size_bytes:
            return cfg, size
    raise ValueError("size too large for the synthetic config")


def rss_now_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _time_phases() -> dict[str, float]:
    """Wrap the phases of ``from_pretrained`` to sum their CPU time (process-wide, so copies on the
    load threads count): module construction, AOA engine planning, the data copies, and everything
    of the load that is neither (header and index checks, key contracts, target views)."""
    from paddleformers_glm import checkpoint as ck
    from paddleformers_glm.checkpoint import engine
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    acc: dict[str, float] = {}

    def wrap(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            c = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.process_time() - c

        setattr(owner, name, timed)

    wrap(GlmMoeDsaForCausalLM, "__init__", "construct (no init)")
    wrap(ck, "load_pretrained_state", "load (all)")
    wrap(engine, "_planner_for", "load: AOA engine plans")
    wrap(engine, "_apply_entry", "load: copies")
    return acc


def child(mode: str, folder: str, model_dtype: str) -> dict:
    """One measurement in this (fresh) process."""
    import glob

    import paddle

    paddle.set_device("cpu")
    from paddleformers_glm import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig.from_pretrained(folder)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    nbytes = sum(os.path.getsize(f) for f in files)
    if mode == "plain":
        from safetensors import safe_open

        base = rss_now_kb()
        c0, t0 = time.process_time(), time.perf_counter()
        tensors = {}
        for f in files:
            with safe_open(f, framework="paddle") as h:
                for k in h.keys():
                    # get_tensor maps the file lazily; clone() makes it a real read into memory
                    tensors[k] = h.get_tensor(k).clone()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = len(tensors)
    elif mode == "model":
        from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

        phases = _time_phases() if os.environ.get("GLM52_BENCH_PHASES") == "1" else None
        base = rss_now_kb()
        c0, t0 = time.process_time(), time.perf_counter()
        model, rep = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=model_dtype, output_loading_info=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = len(rep.loaded)
        if phases is not None:
            print(json.dumps({"phases_cpu_seconds": phases}), file=sys.stderr)
    else:
        from paddleformers_glm.checkpoint.convert import empty_state
        from paddleformers_glm.checkpoint.loader import load_pretrained_state

        base = rss_now_kb()
        state = empty_state(cfg, model_dtype)
        for v in state.values():  # touch the memory so the model's pages are resident before timing
            v.fill_(0.0)
        c0, t0 = time.process_time(), time.perf_counter()
        rep = load_pretrained_state(state, folder, dtype=model_dtype, config=cfg)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = len(rep.loaded)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "bytes": nbytes,
        "tensors": n,
        "baseline_rss_kb": base,
        "peak_rss_kb": peak,
    }


def run_child(mode: str, folder: str, model_dtype: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--workdir", folder, "--model-dtype", model_dtype],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (1e9 bytes), default 2")
    ap.add_argument("--shard-mb", type=float, default=256, help="shard size in MB, default 256")
    ap.add_argument(
        "--model-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="dtype of the loaded model"
    )
    ap.add_argument("--repeat", type=int, default=2, help="measurements per method (best time, max RSS), default 2")
    ap.add_argument("--workdir", help="where the synthetic checkpoint lives (default: a temp folder, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--whole",
        action="store_true",
        help="also time the whole GlmMoeDsaForCausalLM.from_pretrained (model construction + load)",
    )
    ap.add_argument("--child", choices=("plain", "ours", "model"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.workdir, args.model_dtype)))
        return 0

    from paddleformers_glm.ops import transpose as fast_copy
    from paddleformers_glm.testing import write_synthetic_checkpoint

    # the compiled transpose is built once per machine (user cache); build it here, not in a timed child
    compiled = fast_copy.available()
    print(f"compiled transposes: {'yes' if compiled else 'no (numpy fallback)'}", flush=True)

    folder = args.workdir or tempfile.mkdtemp(prefix="glm52-bench-")
    cfg, size = synthetic_config(int(args.size_gb * 1e9))
    if size > 1.25 * args.size_gb * 1e9:  # the synthetic config's smallest (2 layers + MTP) is larger
        print(
            f"note: --size-gb {args.size_gb:g} is below the smallest synthetic checkpoint: {size / 1e9:.2f} GB",
            flush=True,
        )
    n_shards = max(1, math.ceil(size / (args.shard_mb * 1e6)))
    marker = os.path.join(folder, ".bench-ok")
    stamp = f"{size} {n_shards}"
    if not (os.path.exists(marker) and open(marker).read() == stamp):
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        write_synthetic_checkpoint(cfg, folder, n_shards=n_shards, dtype="bfloat16", seed=0)
        with open(marker, "w") as f:
            f.write(stamp)
        print(
            f"wrote {size / 1e9:.2f} GB in {n_shards} shards ({cfg.num_hidden_layers} layers + MTP) in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
    modes = ("plain", "ours", "model") if args.whole else ("plain", "ours")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for mode in modes:
            r = run_child(mode, folder, args.model_dtype)
            runs[mode].append(r)
            print(
                f"  {mode:5s} {r['seconds']:.2f}s (CPU {r['cpu_seconds']:.2f}s) peak {r['peak_rss_kb'] / 1e6:.2f} GB",
                flush=True,
            )
    if args.whole:  # one more model run with its phases timed (the wrappers cost a little)
        env = dict(os.environ, GLM52_BENCH_PHASES="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run(
            [sys.executable, __file__, "--child", "model", "--workdir", folder, "--model-dtype", args.model_dtype],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        phases = next(json.loads(x) for x in out.stderr.splitlines() if x.startswith('{"phases_cpu_seconds"'))
        total = json.loads(out.stdout.strip().splitlines()[-1])["cpu_seconds"]
        print(
            f"  phases of one from_pretrained, CPU s (total {total:.2f}): "
            + ", ".join(f"{k} {v:.2f}" for k, v in phases["phases_cpu_seconds"].items()),
            flush=True,
        )
    best = {m: min(rs, key=lambda r: r["seconds"]) for m, rs in runs.items()}
    peak = {m: max(r["peak_rss_kb"] for r in rs) * 1024 for m, rs in runs.items()}
    base = {m: min(r["baseline_rss_kb"] for r in rs) * 1024 for m, rs in runs.items()}
    nbytes = best["plain"]["bytes"]
    from paddleformers_glm.checkpoint.layout import fleet_param_specs, resolve_dtype

    model_bytes = sum(
        math.prod(s) * (4 if resolve_dtype(k, args.model_dtype) == "float32" else 2)
        for s, k in fleet_param_specs(cfg).values()
    )
    largest_shard = max(
        os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")
    )
    budget = (model_bytes + largest_shard) * 1.10
    res = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
        "python": platform.python_version(),
        "command": "python bench/bench_checkpoint_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint_bytes": nbytes,
        "tensors": best["plain"]["tensors"],
        "shards": n_shards,
        "largest_shard_bytes": largest_shard,
        "compiled_transposes": compiled,
        "model_dtype": args.model_dtype,
        "model_bytes": model_bytes,
        "plain_seconds": best["plain"]["seconds"],
        "ours_seconds": best["ours"]["seconds"],
        "plain_gbps": nbytes / best["plain"]["seconds"] / 1e9,
        "ours_gbps": nbytes / best["ours"]["seconds"] / 1e9,
        "throughput_ratio": best["plain"]["seconds"] / best["ours"]["seconds"],
        "plain_peak_rss": peak["plain"],
        "ours_peak_rss": peak["ours"],
        "ours_baseline_rss": base["ours"],
        "ours_load_rss": peak["ours"] - base["ours"],
        "rss_budget": budget,
        "within_budget": peak["ours"] - base["ours"] <= budget,
        "runs": runs,
    }
    gb = 1e9
    print(
        f"\n| checkpoint | model | plain read | ours | ratio (>= 0.5) | peak RSS ours (baseline) | "
        f"peak - baseline | budget: model + largest shard + 10% |\n|---|---|---|---|---|---|---|---|\n"
        f"| {nbytes / gb:.2f} GB, {res['tensors']} tensors, {n_shards} shards | {args.model_dtype} {model_bytes / gb:.2f} GB | "
        f"{res['plain_seconds']:.2f} s ({res['plain_gbps']:.2f} GB/s) | {res['ours_seconds']:.2f} s ({res['ours_gbps']:.2f} GB/s) | "
        f"{res['throughput_ratio']:.2f} | {res['ours_peak_rss'] / gb:.2f} GB ({res['ours_baseline_rss'] / gb:.2f} GB) | "
        f"{res['ours_load_rss'] / gb:.2f} GB{'' if res['within_budget'] else ' **over the budget**'} | {budget / gb:.2f} GB |"
    )
    print(f"plain read peak RSS: {res['plain_peak_rss'] / gb:.2f} GB")
    if args.whole:
        res["from_pretrained_seconds"] = best["model"]["seconds"]
        res["from_pretrained_peak_rss"] = peak["model"]
        res["from_pretrained_baseline_rss"] = base["model"]
        res["from_pretrained_over_plain"] = best["model"]["seconds"] / best["plain"]["seconds"]
        cpu = {m: min(r["cpu_seconds"] for r in rs) for m, rs in runs.items()}
        res["from_pretrained_cpu_seconds"], res["plain_cpu_seconds"] = cpu["model"], cpu["plain"]
        res["from_pretrained_over_plain_cpu"] = cpu["model"] / cpu["plain"]
        print(
            f"whole from_pretrained: {best['model']['seconds']:.2f} s vs plain read {best['plain']['seconds']:.2f} s "
            f"= {res['from_pretrained_over_plain']:.2f}x (target <= 2x); peak RSS {peak['model'] / gb:.2f} GB "
            f"(baseline {base['model'] / gb:.2f} GB), plain read peak RSS {peak['plain'] / gb:.2f} GB"
        )
        # on a shared machine the load drifts between runs: the ratio within each round (plain, ours,
        # model run back to back) is steadier than best-of over all rounds
        rounds = [m["seconds"] / p["seconds"] for p, m in zip(runs["plain"], runs["model"])]
        rounds_cpu = [m["cpu_seconds"] / p["cpu_seconds"] for p, m in zip(runs["plain"], runs["model"])]
        res["round_ratios"], res["round_ratios_cpu"] = rounds, rounds_cpu
        res["phases_cpu_seconds"] = {"total": total, **phases["phases_cpu_seconds"]}
        print(
            f"  in CPU time (all threads, best of {args.repeat}): {cpu['model']:.2f} s vs {cpu['plain']:.2f} s "
            f"= {res['from_pretrained_over_plain_cpu']:.2f}x"
        )
        print(
            f"  per round (wall): median {statistics.median(rounds):.2f}x, min {min(rounds):.2f}x; "
            f"(CPU): median {statistics.median(rounds_cpu):.2f}x, min {min(rounds_cpu):.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if not args.workdir and not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    elif args.keep:
        print(f"checkpoint kept in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
