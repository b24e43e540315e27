"""Greedy generation: our `generate` (latent cache, absorbed projections) beside HF transformers'
`generate` with its own cache, on the same HF-made checkpoint, the same prompt, one thread each.

One command (about 3 minutes on an idle 2-core machine):

    python bench/bench_generate.py --json gen.json
    python bench/bench_generate.py --sizes small --new-tokens 8 --runs 1   # smoke, under a minute

What it measures, and why this way:

* two GLM-5.2-shaped checkpoints made by transformers itself (`from_config`, weights redrawn with
  O(1) activations so greedy choices are not near-ties, `save_pretrained`): ``small`` (hidden 256,
  4 layers: 1 dense + 3 MoE of 16 experts, DSA top-k 64) and ``wide`` (hidden 1024, 16 heads,
  kv_lora 256, 4 layers, 32 experts, top-k 256); each side loads it with its own `from_pretrained`;
* prefill = from the call to the first new token; ms/token = the time between the first and the
  last new token over their count - 1 (both read by a streamer callback, the same on both sides),
  wall clock and the process's CPU time (`time.process_time`: what the process itself spent,
  less blurred by other processes on a shared machine); each run is its own subprocess,
  alternating ours / HF (`--runs` each), medians reported;
* the new tokens of both sides are compared (they must be equal) and the ratios printed;
* ours also reports the Paddle operators one decode step launches (bench/op_count.py).

Threads: `--threads 1` (default) for both sides (OMP/MKL env, torch.set_num_threads, Paddle's).

Split over ranks, `--tp N` (N processes a side, `--threads` each): ours is the checkpoint loaded by
`from_pretrained(path, topology=...)` at TP N x EP N under Paddle's launcher (each rank half the heads
and half the experts at N = 2), transformers' is its own tensor parallel plan (`tp_plan="auto"`,
which splits the heads and each expert's FFN; it needs `accelerate`) under torchrun, both over gloo:

    python bench/bench_generate.py --sizes small --tp 2 --json gen_tp2.json

Pipeline stages, `--pp P` (ours on tp x P processes, each rank its stage's layers, the stages in
turn each step; transformers has no pipeline split of `generate`, so its side stays on --tp
processes): the ratio is what the pipeline costs a token (the carry's transfers and the logits'
broadcast) beside the same model unsplit by stages:

    python bench/bench_generate.py --sizes small --pp 2 --json gen_pp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_train_step import BENCH_CONFIG, bench_env  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "small": dict(BENCH_CONFIG, num_hidden_layers=4, first_k_dense_replace=1, num_nextn_predict_layers=0),
    "wide": dict(
        BENCH_CONFIG,
        vocab_size=8192,
        hidden_size=1024,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        qk_head_dim=96,
        head_dim=32,
        v_head_dim=64,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=256,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=256,
        num_nextn_predict_layers=0,
    ),
}
PROMPTS = {"small": 512, "wide": 1024}


# ----------------------------------------------------------------------------- workers
def worker_prepare(size: str, folder: str) -> dict[str, Any]:
    """The checkpoint made by transformers: its own model class and `save_pretrained`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SIZES[size])
    cfg.pop("architectures", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) activations: matrices ~ N(0, 1 / fan_in), norms ~ 1 + 0.1 N
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p.shape[-1]
                std = 1.0 if "embed_tokens" in name else fan_in**-0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    model.save_pretrained(folder)
    return {"params": sum(p.numel() for p in model.parameters())}


def _prompt(length: int, vocab: int) -> Any:
    import numpy as np

    return np.random.default_rng(1234).integers(3, vocab, size=(1, length)).astype("int64")


class _Clock:
    """Wall and CPU time stamps of each new token (the streamer both sides call)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.start()

    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.wall.clear()
        self.cpu.clear()

    def stamp(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def result(self) -> dict[str, float]:
        n = len(self.wall)
        return {
            "prefill_s": self.wall[0] - self.t0,
            "prefill_cpu_s": self.cpu[0] - self.c0,
            "ms_per_token": 1e3 * (self.wall[-1] - self.wall[0]) / max(n - 1, 1),
            "cpu_ms_per_token": 1e3 * (self.cpu[-1] - self.cpu[0]) / max(n - 1, 1),
        }


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker_ours(
    ckpt: str,
    prompt: int,
    new_tokens: int,
    threads: int,
    count: bool,
    device: str = "cpu",
    dtype: str = "float32",
    cuda_graph: bool = False,
    tp: int = 1,
    ep: int | None = None,
    pp: int = 1,
) -> dict[str, Any]:
    import numpy as np
    import paddle

    paddle.set_device(device)
    from paddle.base import core

    if hasattr(core, "set_num_threads"):
        core.set_num_threads(threads)
    from paddleformers_glm.generation import CudaGraphDecodeStep
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    topology = None
    if tp * pp > 1:  # under Paddle's launcher (run_worker): every rank runs this, rank 0 reports
        from paddleformers_glm.parallel.topology import ParallelConfig, init_topology
        from paddleformers_glm.train.glm_adapter import GlmAdapter

        ep = ep or tp
        pc = ParallelConfig.from_world(tp * pp, tp=tp, ep=ep, pp=pp)
        topology = init_topology(pc, **GlmAdapter(ckpt).parallel_sizes())
        count = False
    model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=dtype, topology=topology)
    ids = paddle.to_tensor(_prompt(prompt, model.config.vocab_size))

    def step() -> Any:  # a CUDA graph is captured per generation (per cache)
        return CudaGraphDecodeStep(model) if cuda_graph else None

    clock = _Clock()
    model.generate(ids[:, :16], max_new_tokens=4, eos_token_id=[], decode_step=step())  # warm-up
    clock.start()
    out = model.generate(
        ids, max_new_tokens=new_tokens, eos_token_id=[], streamer=lambda _t: clock.stamp(), decode_step=step()
    )
    res = dict(clock.result(), tokens=np.asarray(out.numpy()[0, prompt:]).tolist(), peak_gb=_peak_gb())
    if count and device == "cpu":
        from op_count import count_ops

        from paddleformers_glm.modeling.cache import DSACache

        with paddle.no_grad():
            cache = DSACache.for_config(model.config, 1, capacity=prompt + 4)
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = ids[:, :1]
            model(nxt, past_key_values=cache, logits_to_keep=1)
            _, ops = count_ops(lambda: model(nxt, past_key_values=cache, logits_to_keep=1))
        res["ops_per_step"] = sum(ops.values())
        res["top_ops"] = ops.most_common(12)
    return res


def worker_hf(
    ckpt: str, prompt: int, new_tokens: int, threads: int, device: str = "cpu", dtype: str = "float32", tp: int = 1
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda" if device == "gpu" else "cpu")
    if tp > 1:  # under torchrun (run_worker): transformers' own tensor parallel plan over gloo
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).to(dev)
    model.eval()
    ids = torch.from_numpy(_prompt(prompt, model.config.vocab_size)).to(dev)
    clock = _Clock()

    class Streamer:  # transformers' streamer protocol: put(prompt), put(token) per step, end()
        def __init__(self) -> None:
            self.seen_prompt = False

        def put(self, _value: Any) -> None:
            if self.seen_prompt:
                clock.stamp()
            self.seen_prompt = True

        def end(self) -> None:
            pass

    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        clock.start()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=Streamer(), **kw)
    return dict(clock.result(), tokens=out[0, prompt:].tolist(), peak_gb=_peak_gb())  # peak: host RSS


WORKERS = {"prepare": worker_prepare, "ours": worker_ours, "hf": worker_hf}


# ----------------------------------------------------------------------------- driver
def run_worker(kind: str, args: list[Any], env: dict[str, str], timeout_s: float, ranks: int = 1) -> dict[str, Any]:
    """One worker in its own process, or on ``ranks`` processes (ours under Paddle's launcher, HF's
    under torchrun); the first rank's RESULT (in a file: the launchers keep the ranks' output)."""
    me = [str(Path(__file__).resolve()), "--worker", kind, json.dumps(args)]
    cmd = [sys.executable, *me]
    with tempfile.TemporaryDirectory() as logs:
        env = dict(env, BENCH_RESULT_FILE=os.path.join(logs, "result.json"))
        if ranks > 1 and kind == "ours":
            cmd = [
                sys.executable,
                "-m",
                "paddle.distributed.launch",
                "--nproc_per_node",
                str(ranks),
                "--log_dir",
                logs,
                *me,
            ]
        elif ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), *me]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout_s:.0f} s"}
        if os.path.exists(env["BENCH_RESULT_FILE"]):
            return json.loads(Path(env["BENCH_RESULT_FILE"]).read_text())
        for log in sorted(Path(logs).glob("workerlog.*")):  # Paddle's launcher: the ranks' own output
            proc.stderr += log.read_text(errors="replace")
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


KEYS = ("prefill_s", "prefill_cpu_s", "ms_per_token", "cpu_ms_per_token")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1] if runs else {"error": "not run"}
    out = {k: statistics.median(r[k] for r in ok) for k in KEYS}
    out.update(tokens=ok[0]["tokens"], runs=len(ok), peak_gb=max(r["peak_gb"] for r in ok))
    for k in ("ops_per_step", "top_ops"):
        if k in ok[0]:
            out[k] = ok[0][k]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| size | prompt | new | ours prefill s | HF prefill s | prefill ours/HF speed | ours ms/token | HF ms/token "
        "| tok/s ours | tok/s HF | decode ours/HF speed | same on CPU time | tokens equal | ops/step |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        o, h = r["ours"], r.get("hf") or {"error": "skipped"}
        if "error" in o:
            lines.append(f"| {r['size']} | {r['prompt']} | {r['new']} | error: {o['error'][:80]} |")
            continue
        hf_ok = "error" not in h

        def ratio(key: str, o: dict = o, h: dict = h, hf_ok: bool = hf_ok) -> str:
            return f"**{h[key] / o[key]:.2f}x**" if hf_ok else "-"

        lines.append(
            f"| {r['size']} | {r['prompt']} | {r['new']} | {o['prefill_s']:.3f} | "
            f"{h['prefill_s'] if hf_ok else float('nan'):.3f} | {ratio('prefill_s')} | {o['ms_per_token']:.2f} | "
            f"{h['ms_per_token'] if hf_ok else float('nan'):.2f} | {1e3 / o['ms_per_token']:.1f} | "
            f"{1e3 / h['ms_per_token'] if hf_ok else float('nan'):.1f} | {ratio('ms_per_token')} | "
            f"{ratio('cpu_ms_per_token')} | {r.get('tokens_equal', '-')} | {o.get('ops_per_step', '-')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,wide", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--prompt", type=int, default=None, help=f"prompt tokens (default per size: {PROMPTS})")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="subprocess runs per side, alternating")
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--tp", type=int, default=1, help="processes a side: ours at TP x EP this, HF's tp_plan='auto'")
    p.add_argument("--ep", type=int, default=None, help="with --tp: our expert parallel size (default: --tp)")
    p.add_argument("--pp", type=int, default=1, help="our pipeline stages (tp x pp processes; HF's side stays on --tp)")
    p.add_argument("--mkl-cpu-type", default="auto", choices=["auto", "5", "unset"])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        kind, args = ns.worker
        result = WORKERS[kind](*json.loads(args))
        rank = int(os.environ.get("PADDLE_TRAINER_ID", os.environ.get("RANK", "0")) or 0)
        if rank == 0:
            Path(os.environ["BENCH_RESULT_FILE"]).write_text(json.dumps(result))
        if "PADDLE_TRAINER_ID" in os.environ:  # Paddle's launched rank: no gloo teardown to hang on
            sys.stdout.flush()
            os._exit(0)
        return 0
    sizes = [s for s in ns.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; known {sorted(SIZES)}")
    env = bench_env(ns.threads, ns.mkl_cpu_type)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(ns.workdir or tmp)
        for size in sizes:
            ckpt = work / f"gen_{size}"
            if not (ckpt / "config.json").exists():
                made = run_worker("prepare", [size, str(ckpt)], env, ns.timeout)
                if "error" in made:
                    print(f"[bench_generate] {size}: prepare failed: {made['error']}", file=sys.stderr)
                    return 1
            prompt = ns.prompt or PROMPTS[size]
            runs: dict[str, list] = {"ours": [], "hf": []}
            for i in range(ns.runs):
                ours = [str(ckpt), prompt, ns.new_tokens, ns.threads, i == 0, "cpu", "float32", False, ns.tp, ns.ep]
                runs["ours"].append(run_worker("ours", [*ours, ns.pp], env, ns.timeout, ns.tp * ns.pp))
                if not ns.skip_hf:
                    hf = [str(ckpt), prompt, ns.new_tokens, ns.threads, "cpu", "float32", ns.tp]
                    runs["hf"].append(run_worker("hf", hf, env, ns.timeout, ns.tp))
            row = {"size": size, "prompt": prompt, "new": ns.new_tokens, "tp": ns.tp, "ep": ns.ep or ns.tp, "pp": ns.pp}
            row["ours"] = _median(runs["ours"])
            row["raw"] = runs
            if not ns.skip_hf:
                row["hf"] = _median(runs["hf"])
                if "error" not in row["hf"] and "error" not in row["ours"]:
                    row["tokens_equal"] = row["hf"]["tokens"] == row["ours"]["tokens"]
            rows.append(row)
            print(f"[bench_generate] {size}: {json.dumps({k: row.get(k) for k in ('ours', 'hf')})[:600]}", flush=True)
    if ns.json:
        tmp_json = f"{ns.json}.{os.getpid()}"
        Path(tmp_json).write_text(json.dumps({"rows": rows, "threads": ns.threads}, indent=2))
        os.replace(tmp_json, ns.json)
    print(table(rows))
    bad = [r for r in rows if "error" in r["ours"] or r.get("tokens_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
