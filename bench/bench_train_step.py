"""Training-step benchmark: our Paddle GLM-5.2 against HF transformers on the same checkpoint and batch.

One command (README "Performance"; ~50 min on 2 cores, most of it HF at S=8192):

    python bench/bench_train_step.py                 # S = 512, 2048, 8192; index_topk 64 and 256
    python bench/bench_train_step.py --tiny          # seconds: end-to-end smoke run

What it does, and why this way:

* builds a GLM-5.2-shaped model of ~12M parameters (MLA with q/kv LoRA, DSA indexer with 8 heads
  and the freq/offset top-k sharing schedule, MoE with expert groups and a shared expert, one MTP
  layer) with our library and saves it ONCE in the official HF layout; every top-k variant is a
  folder with that config changed and symlinks to the same weight files; both sides load it with
  their own `from_pretrained`, so they run the same weights on the same token batch (fp32);
* every measurement runs in its own subprocess, alternating ours, HF, ours, HF, ... (`--runs`
  each), so drift of a shared machine hits both sides alike; tables give the median step and the
  best step over all runs;
* the environment is set before either library loads: the same thread count for both (OMP/MKL env
  + `torch.set_num_threads` / Paddle's `core.set_num_threads`), and `MKL_DEBUG_CPU_TYPE=5` on AMD
  CPUs: Paddle 3.3.1's bundled MKL takes a slow non-AVX2 path there without it (~2.5x slower fp32
  matmuls), torch is unaffected; on Intel AVX-512 CPUs the same variable forces AVX2 and costs
  Paddle ~35%, so `--mkl-cpu-type auto` (default) sets it on AMD only; `5` / `unset` force either;
* a training step is forward + backward of the causal-LM loss (no optimizer update), batch 1;
  MTP is not run (HF has no MTP), so both sides compute the same loss (printed in `--json`);
* HF runs with `attn_implementation="sdpa"` (its fastest supported path for this model; `eager`
  is available via `--hf-attn`); HF realises DSA with a dense S x S mask, so its cost and memory
  grow with S^2. When the plain HF run exceeds the memory limit, HF is also run with its own
  gradient checkpointing (`--hf-grad-ckpt auto`) and both results are reported;
* peak memory is the RSS high-water mark (`ru_maxrss`) of each subprocess; a watchdog kills a
  subprocess whose RSS passes `--mem-limit-gb` (20) and reports it as "OOM" (a valid result);
* our per-module times (indexer, attention core, MoE, rest) come from one extra step with
  forward/backward timing hooks (CPU kernels run synchronously, so wall time is exact).

Run with `--help` for options; `--json FILE` keeps the raw numbers (every step, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from paddleformers_glm.cpu_env import cpu_vendor  # noqa: E402  (no Paddle import: the parent stays light)

# GLM-5.2 structure (official config.json), scaled down to ~9M parameters.
BENCH_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "float32",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 3,
    "intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 48,
    "head_dim": 16,
    "v_head_dim": 32,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 64,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "index_share_for_mtp_iteration": True,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 16384,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "rms_norm_eps": 1e-5,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}

# --tiny: same structure, a fraction of the size, for the smoke test.
TINY_CHANGES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "index_topk": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
}


# ----------------------------------------------------------------------------- environment
def bench_env(threads: int, mkl_cpu_type: str) -> dict[str, str]:
    """Environment for every subprocess: pinned threads and MKL's code path (see module doc).

    mkl_cpu_type "auto": MKL_DEBUG_CPU_TYPE=5 on AMD CPUs only (it selects the AVX2 kernels that
    Paddle's bundled MKL otherwise withholds from AMD); on Intel AVX-512 CPUs the same setting
    forces AVX2 and costs Paddle ~35% of its matmul speed. "5": always; "unset": never. A value
    already in the environment is kept in every mode.
    """
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    if "MKL_DEBUG_CPU_TYPE" not in env:
        if mkl_cpu_type == "5" or (mkl_cpu_type == "auto" and cpu_vendor() == "AuthenticAMD"):
            env["MKL_DEBUG_CPU_TYPE"] = "5"
    env["GLOG_minloglevel"] = "2"
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_worker(
    args: list[str], env: dict[str, str], mem_limit_gb: float, timeout_s: float, script: Path | None = None
) -> dict[str, Any]:
    """Run one measurement subprocess (this script, or ``script``, with ``args``); kill it (and
    report OOM, with how long it ran) if its RSS passes the limit."""
    cmd = [sys.executable, str(script or Path(__file__).resolve()), *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = {"oom": False, "peak_kb": 0}

    def watch() -> None:
        while proc.poll() is None:
            kb = _rss_kb(proc.pid)
            state["peak_kb"] = max(state["peak_kb"], kb)
            if kb > mem_limit_gb * 1024 * 1024:
                state["oom"] = True
                proc.kill()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"timeout after {timeout_s:.0f} s"}
    watcher.join()
    if state["oom"]:
        killed_after = time.perf_counter() - t0
        phases = [ln[len("PHASE ") :] for ln in (out or "").splitlines() if ln.startswith("PHASE ")]
        return {
            "error": f"OOM: RSS passed {mem_limit_gb:g} GB after {killed_after:.0f} s",
            "peak_gb": state["peak_kb"] / 2**20,
            "killed_after_s": killed_after,
            "last_phase": phases[-1] if phases else None,  # a worker's "PHASE <name>" progress lines
        }
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (err or out).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


# ----------------------------------------------------------------------------- workers
def _set_threads_paddle(threads: int) -> None:
    import paddle

    paddle.set_device("cpu")
    from paddle.base import core

    if hasattr(core, "set_num_threads"):
        core.set_num_threads(threads)


def worker_prepare(ckpt: str, tiny: bool) -> dict[str, Any]:
    """Build the bench model with O(1) activations (like tests/_tiny.randomize) and save it (HF layout)."""
    cfg = dict(BENCH_CONFIG, **(TINY_CHANGES if tiny else {}))
    return {"params": build_random_checkpoint(cfg, ckpt), "config": cfg}


def build_random_checkpoint(cfg: dict[str, Any], ckpt: str, dtype: str | None = None) -> int:
    """A model of config ``cfg`` with O(1) activations at every layer (scaled normal matrices, norms
    near 1), saved in the official HF layout (``dtype`` overrides the config's); returns its size."""
    import numpy as np
    import paddle

    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg))
    rng = np.random.default_rng(0)
    n_params = 0
    for name, p in model.state_dict().items():
        shape = list(p.shape)
        n_params += int(np.prod(shape))
        if len(shape) == 2:
            v = rng.standard_normal(shape) * (1.0 if "embed_tokens" in name else shape[0] ** -0.5)
        elif name.endswith("e_score_correction_bias"):
            v = rng.standard_normal(shape) * 0.05
        elif name.endswith("bias"):
            v = rng.standard_normal(shape) * 0.1
        else:
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        p.set_value(paddle.to_tensor(v.astype("float32")))
    model.save_pretrained(ckpt, **({"dtype": dtype} if dtype else {}))
    return n_params


def topk_variant(ckpt: str, topk: int) -> str:
    """A folder with the same weight files (symlinks) and config.json with this index_topk.

    The weights are saved once; each top-k is a config change, loaded by both sides' own
    `from_pretrained(folder)` exactly as a user would.
    """
    out = os.path.join(os.path.dirname(os.path.abspath(ckpt)), f"topk{topk}")
    if not os.path.exists(os.path.join(out, "config.json")):
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(ckpt):
            if name != "config.json" and not os.path.exists(os.path.join(out, name)):
                os.symlink(os.path.join(os.path.abspath(ckpt), name), os.path.join(out, name))
        cfg = json.loads(Path(ckpt, "config.json").read_text())
        cfg["index_topk"] = topk
        tmp = os.path.join(out, f"config.json.{os.getpid()}")
        Path(tmp).write_text(json.dumps(cfg, indent=2))
        os.replace(tmp, os.path.join(out, "config.json"))
    return out


def _batch(seqlen: int, vocab: int) -> Any:
    import numpy as np

    return np.random.default_rng(1234).integers(3, vocab, size=(1, seqlen)).astype("int64")


def _packed(seqlen: int, n: int, ids: Any) -> tuple[Any, Any]:
    """``--packed n``: the row as n sequences of random lengths (fixed seed), as transformers'
    DataCollatorWithFlattening packs them: position_ids restarting at each, labels -100 at each
    sequence's first token. -> (position_ids, labels) [1, S] int64."""
    import numpy as np

    cuts = np.sort(np.random.default_rng(7).choice(np.arange(1, seqlen), size=n - 1, replace=False))
    bounds = [0, *cuts.tolist(), seqlen]
    pos = np.concatenate([np.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None].astype("int64")
    labels = ids.copy()
    labels[0, bounds[:-1]] = -100
    return pos, labels


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker_ours(
    ckpt: str, seqlen: int, topk: int, steps: int, warmup: int, threads: int, modules: bool, packed: int = 0
) -> dict:
    import paddle

    _set_threads_paddle(threads)
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(topk_variant(ckpt, topk), dtype="float32")
    model.train()
    batch = _batch(seqlen, model.config.vocab_size)
    ids, kw = paddle.to_tensor(batch), {"labels": paddle.to_tensor(batch)}
    if packed:
        pos, labels = _packed(seqlen, packed, batch)
        kw = {"labels": paddle.to_tensor(labels), "position_ids": paddle.to_tensor(pos), "use_cache": False}
    load_gb = _peak_gb()

    def step() -> float:
        t0 = time.perf_counter()
        out = model(ids, compute_mtp=False, **kw)
        out.loss.backward()
        loss = float(out.loss)
        dt = time.perf_counter() - t0
        model.clear_gradients(set_to_zero=False)
        del out
        return dt, loss

    for _ in range(warmup):
        step()
    times, loss = [], 0.0
    for _ in range(steps):
        dt, loss = step()
        times.append(dt)
    res = {"times": times, "loss": loss, "peak_gb": _peak_gb(), "load_gb": load_gb}
    if modules:
        res["modules"] = module_times(model, step)
    return res


def module_times(model: Any, step: Any) -> dict[str, float]:
    """Seconds per module kind in one training step, forward and backward, via timing hooks.

    Forward: pre/post hooks (or a wrapper around the attention core function). Backward: a hook on
    the module output's gradient (backward of the module starts) and on its inputs' gradients
    (it ends); CPU kernels are synchronous so these wall-clock stamps are exact.
    """
    import paddle

    from paddleformers_glm.modeling import attention as attn_mod
    from paddleformers_glm.modeling.indexer import DSAIndexer
    from paddleformers_glm.modeling.moe import MoE

    acc: dict[str, float] = {}

    def add(key: str, dt: float) -> None:
        acc[key] = acc.get(key, 0.0) + dt

    def bwd_span(kind: str, outs: list, ins: list) -> None:
        span = {"t0": None, "left": sum(1 for t in ins if not t.stop_gradient)}

        def start(g: Any) -> None:
            if span["t0"] is None:
                span["t0"] = time.perf_counter()

        def end(g: Any) -> None:
            span["left"] -= 1
            if span["left"] == 0 and span["t0"] is not None:
                add(kind + " bwd", time.perf_counter() - span["t0"])

        for t in outs:
            if not t.stop_gradient:
                t.register_hook(start)
        for t in ins:
            if not t.stop_gradient:
                t.register_hook(end)

    handles = []
    stamps: dict[int, float] = {}
    for layer in model.sublayers():
        if isinstance(layer, (DSAIndexer, MoE)):
            kind = "indexer" if isinstance(layer, DSAIndexer) else "moe"

            def pre(lyr: Any, inputs: Any, kind: str = kind) -> None:
                stamps[id(lyr)] = time.perf_counter()

            def post(lyr: Any, inputs: Any, output: Any, kind: str = kind) -> None:
                add(kind + " fwd", time.perf_counter() - stamps[id(lyr)])
                if kind == "moe" and paddle.is_grad_enabled():
                    bwd_span(kind, [output], [inputs[0]])

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_post_hook(post))

    def timed(fn: Any) -> Any:
        def core(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            add("attention core fwd", time.perf_counter() - t0)
            bwd_span(
                "attention core", [out[0]], [t for t in a if isinstance(t, paddle.Tensor) and t.dtype.name != "INT64"]
            )
            return out

        return core

    originals = {
        name: getattr(attn_mod, name)
        for name in ("sparse_attention", "sparse_latent_attention", "dense_head_attention")
    }
    for name, fn in originals.items():
        setattr(attn_mod, name, timed(fn))
    try:
        step()  # settle
        acc.clear()
        total, _ = step()
    finally:
        for name, fn in originals.items():
            setattr(attn_mod, name, fn)
        for h in handles:
            h.remove()
    acc["step"] = total
    return acc


def worker_hf(
    ckpt: str,
    seqlen: int,
    topk: int,
    steps: int,
    warmup: int,
    threads: int,
    attn: str,
    grad_ckpt: bool,
    packed: int = 0,
) -> dict:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        topk_variant(ckpt, topk), dtype=torch.float32, attn_implementation=attn
    )
    if grad_ckpt:  # HF's own memory saver: recompute each decoder layer in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    vocab = model.config.vocab_size
    batch = _batch(seqlen, vocab)
    ids, kw = torch.from_numpy(batch), {"labels": torch.from_numpy(batch)}
    if packed:
        pos, labels = _packed(seqlen, packed, batch)
        kw = {"labels": torch.from_numpy(labels), "position_ids": torch.from_numpy(pos), "use_cache": False}
    load_gb = _peak_gb()

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = model(input_ids=ids, **kw)
        out.loss.backward()
        loss = float(out.loss)
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        del out
        return dt, loss

    for _ in range(warmup):
        step()
    times, loss = [], 0.0
    for _ in range(steps):
        dt, loss = step()
        times.append(dt)
    return {
        "times": times,
        "loss": loss,
        "peak_gb": _peak_gb(),
        "load_gb": load_gb,
        "attn": attn,
        "grad_ckpt": grad_ckpt,
    }


def worker_main(ns: argparse.Namespace) -> None:
    if ns.worker == "prepare":
        res = worker_prepare(ns.ckpt, ns.tiny)
    elif ns.worker == "ours":
        res = worker_ours(ns.ckpt, ns.seqlen, ns.topk, ns.steps, ns.warmup, ns.threads, ns.modules, ns.packed)
    else:
        res = worker_hf(
            ns.ckpt, ns.seqlen, ns.topk, ns.steps, ns.warmup, ns.threads, ns.hf_attn, ns.grad_ckpt, ns.packed
        )
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- driver
def have_hf() -> bool:
    """torch + transformers with glm_moe_dsa importable (the `reference` extra)?"""
    code = "import torch, transformers.models.glm_moe_dsa"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _fmt_mem(r: dict) -> str:
    return f"{r['peak_gb']:.2f}" if "peak_gb" in r and "error" not in r else r.get("error", "-")


def summarize(r: list[dict]) -> dict[str, Any]:
    """Median step time over all timed steps of all runs; max peak RSS over runs."""
    ok = [x for x in r if "error" not in x]
    if not ok:
        err = r[0] if r else {"error": "not run"}
        return {"error": err.get("error", "failed"), "peak_gb": err.get("peak_gb")}
    times = [t for x in ok for t in x["times"]]
    return {
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "peak_gb": max(x["peak_gb"] for x in ok),
        "loss": ok[-1]["loss"],
        "runs": len(ok),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="512,2048,8192", help="comma-separated sequence lengths")
    p.add_argument("--topks", default="64,256", help="comma-separated index_topk values")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--runs", type=int, default=3, help="alternating subprocess runs per side and shape")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--long", type=int, default=4096, help="from this S on, use --long-steps/--long-warmup")
    p.add_argument("--long-steps", type=int, default=1)
    p.add_argument("--long-warmup", type=int, default=0)
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="HF attn_implementation")
    p.add_argument(
        "--hf-grad-ckpt",
        default="auto",
        choices=["auto", "off", "on"],
        help="HF gradient checkpointing: auto = also run it when the plain HF run fails (OOM)",
    )
    p.add_argument(
        "--mkl-cpu-type", default="auto", choices=["auto", "5", "unset"], help="MKL_DEBUG_CPU_TYPE policy (see doc)"
    )
    p.add_argument("--skip-hf", action="store_true", help="run our side only")
    p.add_argument(
        "--packed",
        type=int,
        default=0,
        help="the row as N packed sequences (position_ids restarting, use_cache=False; 0: one sequence)",
    )
    p.add_argument("--no-modules", action="store_true", help="skip the per-module time table")
    p.add_argument("--mem-limit-gb", type=float, default=20.0, help="kill a run whose RSS passes this")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    p.add_argument("--tiny", action="store_true", help="tiny model, S=64, one run of one step: a smoke test")
    p.add_argument("--ckpt", default=None, help="checkpoint folder to write/reuse (default: a temp dir)")
    p.add_argument("--json", default=None, help="write raw results here")
    # worker-mode arguments (internal)
    p.add_argument("--worker", choices=["prepare", "ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, help=argparse.SUPPRESS)
    p.add_argument("--topk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--modules", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--grad-ckpt", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        worker_main(ns)
        return
    if ns.tiny:
        ns.seqlens, ns.topks, ns.runs, ns.steps, ns.warmup = "64", "16", 1, 1, 1
    results = run_benchmark(ns)
    print()
    print_tables(results, ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"args": vars(ns), "results": results}, indent=1))


def run_benchmark(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Prepare the checkpoint, then per (top-k, S): ours / HF subprocesses, alternating."""
    seqlens = [int(s) for s in ns.seqlens.split(",")]
    topks = [int(k) for k in ns.topks.split(",")]
    env = bench_env(ns.threads, ns.mkl_cpu_type)
    hf = not ns.skip_hf and have_hf()
    print(
        f"threads {ns.threads}; CPU vendor {cpu_vendor()}; MKL_DEBUG_CPU_TYPE="
        f"{env.get('MKL_DEBUG_CPU_TYPE', '(unset)')}; HF attn_implementation={ns.hf_attn}"
        + (f"; each row {ns.packed} packed sequences" if ns.packed else "")
    )
    if not ns.skip_hf and not hf:
        print("NOTE: torch/transformers not importable: HF side SKIPPED (no comparison made)")
    tmp = None
    ckpt = ns.ckpt
    if ckpt is None:
        tmp = tempfile.TemporaryDirectory(prefix="glm52_bench_")
        ckpt = os.path.join(tmp.name, "ckpt")
    try:
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            prep = run_worker(["--worker", "prepare", "--ckpt", ckpt] + (["--tiny"] if ns.tiny else []), env, 20, 600)
            if "error" in prep:
                raise SystemExit(f"prepare failed: {prep['error']}")
            print(f"model: {prep['params'] / 1e6:.2f} M parameters, saved (HF layout) to {ckpt}")
        results = []
        for topk in topks:
            topk_variant(ckpt, topk)
            for S in seqlens:
                results.append(run_shape(ns, env, ckpt, S, topk, hf))
                print_row(results[-1], flush=True)
        return results
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_shape(ns: argparse.Namespace, env: dict[str, str], ckpt: str, S: int, topk: int, hf: bool) -> dict:
    """ours, HF, ours, HF, ... for one shape; HF with gradient checkpointing as asked/needed."""
    long = S >= ns.long
    steps, warmup = (ns.long_steps, ns.long_warmup) if long else (ns.steps, ns.warmup)
    common = ["--ckpt", ckpt, "--threads", str(ns.threads), "--steps", str(steps), "--warmup", str(warmup)]
    common += ["--seqlen", str(S), "--topk", str(topk), "--packed", str(ns.packed)]
    hf_args = ["--worker", "hf", "--hf-attn", ns.hf_attn, *common]
    ours, plain, ckpted = [], [], []
    for r in range(ns.runs):
        mods = not ns.no_modules and r == ns.runs - 1
        ours.append(_run(["--worker", "ours", *common] + (["--modules"] if mods else []), env, ns))
        if not hf:
            continue
        if ns.hf_grad_ckpt != "on" and not (plain and "error" in plain[0]):
            plain.append(_run(hf_args, env, ns))  # a shape that failed once is not retried
        if ns.hf_grad_ckpt == "on" or (ns.hf_grad_ckpt == "auto" and plain and "error" in plain[0]):
            ckpted.append(_run([*hf_args, "--grad-ckpt"], env, ns))
    row = {"S": S, "topk": topk, "steps": steps, "warmup": warmup, "ours": summarize(ours)}
    row["hf"] = summarize(plain) if hf and plain else None
    row["hf_ckpt"] = summarize(ckpted) if ckpted else None
    row["modules"] = next((o["modules"] for o in ours if "modules" in o), None)
    row["raw"] = {"ours": ours, "hf": plain, "hf_ckpt": ckpted}
    return row


def _run(args: list[str], env: dict[str, str], ns: argparse.Namespace) -> dict[str, Any]:
    load0 = os.getloadavg()[0]
    res = run_worker(args, env, ns.mem_limit_gb, ns.timeout)
    res["loadavg_before"] = load0
    return res


def _tok_s(s: dict | None, S: int) -> float | None:
    return S / s["step_s"] if s and "step_s" in s else None


def _cell(s: dict | None, S: int) -> str:
    if s is None:
        return "-"
    return f"{_tok_s(s, S):8.0f} tok/s {s['peak_gb']:.2f} GB" if "step_s" in s else s.get("error", "?")


def print_row(row: dict, flush: bool = False) -> None:
    S, o = row["S"], row["ours"]
    line = f"S={S:5d} topk={row['topk']:4d}  ours: {_cell(o, S)}"
    for key, name in (("hf", "HF"), ("hf_ckpt", "HF+grad-ckpt")):
        h = row.get(key)
        if h is None:
            continue
        line += f"  {name}: {_cell(h, S)}"
        if "step_s" in o and "step_s" in h:
            line += f" (ours {h['step_s'] / o['step_s']:.2f}x)"
    print(line, flush=flush)


def print_tables(results: list[dict], ns: argparse.Namespace) -> None:
    """Markdown tables, ready for docs/performance.md.

    tok/s from the median step time over all timed steps of all runs, and (in brackets) from the
    best step: on a shared machine other jobs slow some runs down, and the best of alternating
    runs is the least disturbed view of each side.
    """
    hf_name = f"HF {ns.hf_attn}"
    print(
        f"| index_topk | S | ours tok/s (best) | {hf_name} tok/s (best) | ours / HF (best) | ours step s "
        "| HF step s | ours peak GB | HF peak GB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        S, o = row["S"], row["ours"]
        for key, tag in (("hf", ""), ("hf_ckpt", " (HF grad-ckpt)")):
            h = row.get(key)
            if h is None:
                if key == "hf_ckpt":
                    continue
                h = {"error": "skipped"}
            ot, ht = _tok_s(o, S), _tok_s(h, S)
            err = h.get("error", "-")
            cells = [
                str(row["topk"]),
                str(S) + tag,
                f"{ot:.0f} ({S / o['step_s_min']:.0f})" if ot else o.get("error", "-"),
                f"{ht:.0f} ({S / h['step_s_min']:.0f})" if ht else err,
                f"{ot / ht:.2f}x ({h['step_s_min'] / o['step_s_min']:.2f}x)" if ot and ht else "-",
                f"{o['step_s']:.3f}" if ot else "-",
                f"{h['step_s']:.3f}" if ht else "-",
                f"{o['peak_gb']:.2f}" if o.get("peak_gb") else "-",
                f"{h['peak_gb']:.2f}" if ht else (f"> {ns.mem_limit_gb:g} (killed)" if "OOM" in err else "-"),
            ]
            print("| " + " | ".join(cells) + " |")
    print()
    print("Our per-module time per training step (ms; forward / backward):")
    print("| index_topk | S | indexer fwd | attention core fwd / bwd | MoE fwd / bwd | rest | step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        m = row.get("modules")
        if not m:
            continue

        def g(key: str, m: dict = m) -> float:
            return m.get(key, 0.0) * 1e3

        known = sum(v for k, v in m.items() if k != "step")
        cells = [
            str(row["topk"]),
            str(row["S"]),
            f"{g('indexer fwd'):.0f}",
            f"{g('attention core fwd'):.0f} / {g('attention core bwd'):.0f}",
            f"{g('moe fwd'):.0f} / {g('moe bwd'):.0f}",
            f"{(m['step'] - known) * 1e3:.0f}",
            f"{g('step'):.0f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
