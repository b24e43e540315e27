"""World-1 training on one GPU: our trainer (`glm52 train`, bf16, activation recompute) beside HF
transformers on the same GPU, the same checkpoint and the same batch shape.

One prepared command for a lent GPU (about 5 minutes on one H200; `--budget-s` stops it early):

    python bench/bench_gpu_train.py --json gpu_train.json

What it runs, and why this way:

* two GLM-5.2-shaped checkpoints, built once by our library and saved in the official HF layout
  (bf16): `tiny` (the structure of bench/bench_train_step.py, ~1M parameters, to show the fixed
  costs) and `1b` (~1.06B parameters: hidden 2048, 6 layers, 20 routed experts of width 1024, MLA
  ranks 768 / 512, DSA indexer 16 x 128 with top-k 512, one MTP layer);
* ours is the trainer users run, `glm52 train --dtype bfloat16 --recompute full` at world size 1
  (Fleet's recompute, Paddle's AdamW with fp32 master weights, clip 1.0, Paddle's own bf16 kernels:
  a GPU run whose loss.json reports `run.cpu_bf16_ops` > 0 is an error), as a subprocess; tokens/s
  are read from its step lines after the warm-up steps, peak memory from its loss.json
  (`max_memory_allocated`);
* HF transformers loads the same folder in bf16 with `gradient_checkpointing_enable()` (its
  recompute of each decoder layer) and runs the same number of forward + backward + clip + AdamW
  steps on a batch of the same shape; peak memory is `torch.cuda.max_memory_allocated`. HF has no
  MTP head and realises DSA with a dense S x S mask; ours trains the MTP layer too (more work);
* every side runs in its own process, so one side's allocator cache never counts against the other.

It then decodes with each checkpoint (`--decode-tokens` greedy tokens after a `--decode-prompt`
prompt, bench/bench_generate.py's workers): our `generate` eagerly and with its decode step captured
as a CUDA graph (`generation.CudaGraphDecodeStep`), beside HF's `generate` with its cache, ms per
token and tokens/s, and whether the tokens agree (bf16 rounding may part them).

`--device cpu --dtype float32 --sizes tiny` runs the same code on a CPU in seconds (the smoke test
in tests/test_bench_gpu_train.py; no CUDA graph there); numbers from it say nothing about a GPU.
Needs torch + transformers for the HF side (`--skip-hf` runs ours only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import run_worker as run_generate_worker  # noqa: E402
from bench_train_step import BENCH_CONFIG, TINY_CHANGES  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(BENCH_CONFIG, **TINY_CHANGES),
    "1b": dict(
        BENCH_CONFIG,
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=6,
        first_k_dense_replace=1,
        intermediate_size=6144,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        qk_head_dim=192,
        head_dim=64,
        v_head_dim=128,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=20,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=1024,
    ),
}
_STEP_LINE = re.compile(r"step (\d+)/\d+ \| loss ([0-9.eE+-]+|nan|inf).*\| ([0-9.]+) tok/s \| ([0-9.]+) s")


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    env["GLOG_minloglevel"] = "2"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timeout after {timeout_s:.0f} s")


def prepare(size: str, folder: Path, dtype: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Build and save the ``size`` checkpoint in a subprocess (CPU: it never holds GPU memory)."""
    code = (
        "import json, sys; sys.path.insert(0, 'bench'); from bench_train_step import build_random_checkpoint; "
        f"print('PARAMS', build_random_checkpoint(json.loads(sys.argv[1]), sys.argv[2], {dtype!r}))"
    )
    cfg = dict(SIZES[size], dtype=dtype)
    proc = _run(
        [sys.executable, "-c", code, json.dumps(cfg), str(folder)], dict(env, CUDA_VISIBLE_DEVICES=""), timeout_s
    )
    if proc.returncode != 0:
        return {"error": f"prepare exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"}
    params = int(re.search(r"PARAMS (\d+)", proc.stdout).group(1))
    return {"params": params}


def run_ours(ckpt: Path, ns: argparse.Namespace, out: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """``glm52 train`` at world size 1; tokens/s from its step lines after the warm-up steps."""
    cmd = [
        sys.executable, "-m", "paddleformers_glm.cli", "train", "--model", str(ckpt), "--dtype", ns.dtype,
        "--recompute", ns.recompute, "--steps", str(ns.warmup + ns.steps), "--seq-len", str(ns.seq_len),
        "--global-batch-size", str(ns.batch), "--micro-batch-size", str(ns.batch), "--lr", "1e-5",
        "--out", str(out), "--no-progress",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = _run(cmd, env, timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"}
    steps = [(int(m[1]), float(m[2]), float(m[3]), float(m[4])) for m in _STEP_LINE.finditer(proc.stdout)]
    timed = [s for s in steps if s[0] > ns.warmup]
    if not timed:
        return {"error": f"no step lines after warm-up in: {proc.stdout[-800:]}"}
    report = json.loads((out / "loss.json").read_text())
    mem = report.get("memory") or [{}]
    converted = report["run"].get("cpu_bf16_ops", 0)
    if ns.device != "cpu" and converted:  # a GPU run computes with Paddle's own bf16 kernels
        return {"error": f"ops/cpu_bf16 routed {converted} ops through fp32 on a GPU run"}
    return {
        "tok_s": sum(s[2] for s in timed) / len(timed),
        "step_s": sum(s[3] for s in timed) / len(timed),
        "losses": [s[1] for s in steps],
        "peak_gb": (mem[0].get("peak_bytes") or 0) / 2**30,
        "peak_kind": mem[0].get("peak_kind"),
        "wall_s": wall,
        "cpu_bf16_ops": converted,
    }


def hf_worker(ckpt: str, device: str, dtype: str, seq_len: int, batch: int, warmup: int, steps: int) -> dict:
    """HF transformers: forward + backward + clip + AdamW per step, gradient checkpointing on."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda" if device == "gpu" else "cpu")
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=tdtype, attn_implementation="sdpa").to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(1234)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    for i in range(warmup + steps):
        ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(batch, seq_len))).to(dev)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        losses.append(float(loss))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    if dev.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated() / 2**30, "max_memory_allocated"
    else:
        import resource

        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_rss"
    return {"tok_s": batch * seq_len / step_s, "step_s": step_s, "losses": losses, "peak_gb": peak, "peak_kind": kind}


def run_hf(ckpt: Path, ns: argparse.Namespace, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    args = [str(ckpt), ns.device, ns.dtype, ns.seq_len, ns.batch, ns.warmup, ns.steps]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", json.dumps(args)]
    t0 = time.perf_counter()
    proc = _run(cmd, env, timeout_s)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"}
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    return dict(json.loads(line[len("RESULT ") :]), wall_s=time.perf_counter() - t0)


def run_decode(ckpt: Path, ns: argparse.Namespace, env: dict[str, str], left: Any) -> dict[str, Any]:
    """Greedy decoding with the checkpoint: ours eager, ours with a CUDA graph (GPU), HF."""
    common = [str(ckpt), ns.decode_prompt, ns.decode_tokens, 1]
    out: dict[str, Any] = {"prompt": ns.decode_prompt, "new": ns.decode_tokens}
    out["ours"] = run_generate_worker("ours", [*common, False, ns.device, ns.dtype, False], env, left())
    if ns.device == "gpu" and left() > 0:
        out["ours_graph"] = run_generate_worker("ours", [*common, False, ns.device, ns.dtype, True], env, left())
    if not ns.skip_hf and left() > 0:
        out["hf"] = run_generate_worker("hf", [*common, ns.device, ns.dtype], env, left())
        ok = [out.get(k) for k in ("ours", "hf")]
        if all(r and "error" not in r for r in ok):
            out["tokens_equal"] = out["ours"]["tokens"] == out["hf"]["tokens"]
    return out


def decode_table(rows: list[dict[str, Any]]) -> str:
    head = "| size | prompt | new | ours ms/token | ours + CUDA graph ms/token | HF ms/token | ours tok/s | HF tok/s | ours / HF | tokens equal |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        d = r.get("decode")
        if not d:
            continue
        o, g, h = d.get("ours"), d.get("ours_graph"), d.get("hf")
        best = min((x["ms_per_token"] for x in (o, g) if x and "error" not in x), default=None)
        ratio = f"{h['ms_per_token'] / best:.2f}x" if best and h and "error" not in h else "-"
        tok = lambda x: f"{1e3 / x['ms_per_token']:.1f}" if x and "error" not in x else _cell(x, "", "")  # noqa: E731
        lines.append(
            f"| {r['size']} | {d['prompt']} | {d['new']} | {_cell(o, 'ms_per_token', '.2f')} | {_cell(g, 'ms_per_token', '.2f')} "
            f"| {_cell(h, 'ms_per_token', '.2f')} | {tok(o)} | {tok(h)} | {ratio} | {d.get('tokens_equal', '-')} |"
        )
    return "\n".join(lines)


def _cell(res: dict[str, Any] | None, key: str, fmt: str) -> str:
    if res is None:
        return "skipped"
    return "error" if "error" in res else format(res[key], fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| size | params | ours tok/s | HF tok/s | ours / HF | ours peak GiB | HF peak GiB |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        ours, hf = r.get("ours"), r.get("hf")
        ratio = "-"
        if ours and hf and "error" not in ours and "error" not in hf:
            ratio = f"{ours['tok_s'] / hf['tok_s']:.2f}x"
        lines.append(
            f"| {r['size']} | {r.get('params', 0) / 1e6:.1f}M | {_cell(ours, 'tok_s', '.0f')} | {_cell(hf, 'tok_s', '.0f')} "
            f"| {ratio} | {_cell(ours, 'peak_gb', '.2f')} | {_cell(hf, 'peak_gb', '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sizes", default="tiny,1b", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--recompute", default="full", choices=["none", "full", "core"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new runs after this many seconds")
    p.add_argument("--decode-prompt", type=int, default=512, help="decoding: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=64, help="decoding: new tokens (0: no decoding)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.hf_worker:
        print("RESULT " + json.dumps(hf_worker(*json.loads(ns.hf_worker))), flush=True)
        return 0
    sizes = [s for s in ns.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; known {sorted(SIZES)}")
    env = _env(ns.device)
    start = time.perf_counter()
    left = lambda: ns.budget_s - (time.perf_counter() - start)  # noqa: E731
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(ns.workdir or tmp)
        for size in sizes:
            row: dict[str, Any] = {"size": size, "seq_len": ns.seq_len, "batch": ns.batch, "dtype": ns.dtype}
            rows.append(row)
            if left() <= 0:
                row["error"] = "budget spent before this size"
                continue
            ckpt = work / f"ckpt_{size}"
            row.update(prepare(size, ckpt, ns.dtype, env, left()))
            if "error" in row:
                continue
            row["ours"] = run_ours(ckpt, ns, work / f"out_{size}", env, left())
            if not ns.skip_hf and left() > 0:
                row["hf"] = run_hf(ckpt, ns, env, left())
            if ns.decode_tokens > 0 and left() > 0:
                row["decode"] = run_decode(ckpt, ns, env, left)
            print(
                f"[bench_gpu_train] {size}: {json.dumps({k: row.get(k) for k in ('ours', 'hf', 'decode')})}", flush=True
            )
    result = {"device": ns.device, "recompute": ns.recompute, "rows": rows, "wall_s": time.perf_counter() - start}
    if ns.json:
        tmp_json = f"{ns.json}.{os.getpid()}"
        Path(tmp_json).write_text(json.dumps(result, indent=2))
        os.replace(tmp_json, ns.json)
    print(table(rows))
    if any(r.get("decode") for r in rows):
        print(decode_table(rows))
    failed = [r for r in rows if "error" in r or "error" in (r.get("ours") or {})]
    failed += [r for r in rows if "error" in ((r.get("decode") or {}).get("ours") or {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
