"""GLM-5.2 at its official widths: our forward and training step beside HF transformers', at long
sequences, with time and peak memory (few layers and experts, so that it fits one machine).

One command per measurement set (the lead's machine; each official-width run needs ~10 GB):

    python bench/bench_realwidth.py --seqlens 2304 --json rw2304.json          # ~15 min, 2 threads
    python bench/bench_realwidth.py --seqlens 4096,8192 --json rw8192.json     # HF stops at its limit
    python bench/bench_realwidth.py --preset small --seqlens 288               # smoke, a minute

What it measures, and why this way:

* the official attention widths (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, rope 64 / nope
  192 / v 256, DSA indexer 32 x 128 with top-k 2048, the official full / shared indexer schedule)
  with few layers (`--layers`, 4; the training step `--train-layers`, 2, so that weights,
  gradients and HF's activations fit) and 4 routed experts (top-2, one shared, width 2048) and a
  16384-token vocabulary; S = 2304 puts the top-k close to the sequence (k / S = 0.89), where the
  form of the sparse attention decides the cost;
* the checkpoint is written once in the official HF layout (bf16, shard by shard, never a whole
  model in memory; matrices N(0, 1 / fan_in), norms near 1), and each side loads it with its own
  `from_pretrained` in fp32;
* every measurement is its own subprocess with pinned, equal threads (`--threads`); time is wall
  clock and the process's CPU time (`cpu s`: all its threads; less blurred by other processes on a
  shared machine); peak memory is the child's `ru_maxrss` (load included); a watchdog kills a child whose RSS passes
  `--mem-limit-gb` (20) and reports where it stopped (seconds and the phase it was in), so HF's
  dense S x S scores at long S never take the machine down;
* forward: the logits of every position, no gradient; the two sides' logits are compared (max
  abs difference of the last 8 positions, argmax agreement over all);
* train step: forward + backward of the causal-LM loss (no optimizer), as bench/bench_train_step.py;
  the two sides' losses are compared (abs difference);
* `KMP_BLOCKTIME=0` (`--kmp-blocktime`): Paddle's OpenMP runtime (libiomp5) otherwise keeps its
  threads spinning long after each parallel region, torch's libgomp only briefly; on a machine
  shared with other processes the spinning threads take the cores the work needs (each op here
  is large, so waking the threads costs nothing measurable). docs/performance.md has both.

Ratios: ours / HF speed (HF time over ours) and memory (ours over HF).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_train_step import bench_env, run_worker  # noqa: E402

_OFFICIAL_SCHEDULE = ["full", "full", "full", "shared"]  # the first layers of the official config
_OFFICIAL_WIDTHS = dict(
    hidden_size=6144,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    qk_head_dim=256,
    head_dim=64,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    moe_intermediate_size=2048,
    intermediate_size=12288,
    vocab_size=16384,
)
PRESETS: dict[str, dict[str, Any]] = {
    "official": _OFFICIAL_WIDTHS,
    # the official per-head and latent widths and top-k with a quarter of the heads: the forms'
    # costs relative to each other as at the official widths (all linear in the heads), ~1 GB
    "medium": dict(
        _OFFICIAL_WIDTHS,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=16,
        index_n_heads=8,
        moe_intermediate_size=1024,
        intermediate_size=4096,
        vocab_size=8192,
    ),
    # the same ratios (k / S at S = 288, heads : latent : head widths) at an eighth of the widths
    "small": dict(
        hidden_size=768,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=256,
        kv_lora_rank=64,
        qk_rope_head_dim=8,
        qk_nope_head_dim=24,
        qk_head_dim=32,
        head_dim=8,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=256,
        moe_intermediate_size=256,
        intermediate_size=1536,
        vocab_size=4096,
    ),
}


def bench_config(preset: str, layers: int) -> dict[str, Any]:
    cfg = dict(
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        dtype="bfloat16",
        num_hidden_layers=layers,
        first_k_dense_replace=0,
        mlp_layer_types=["sparse"] * layers,
        indexer_types=(_OFFICIAL_SCHEDULE * layers)[:layers],
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        index_share_for_mtp_iteration=True,
        indexer_rope_interleave=True,
        rope_interleave=True,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 8000000, "rope_type": "default"},
        rms_norm_eps=1e-5,
        pad_token_id=None,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    cfg.update(PRESETS[preset])
    return cfg


# ----------------------------------------------------------------------------- workers
def worker_prepare(preset: str, layers: int, folder: str) -> dict[str, Any]:
    """The official-layout checkpoint, bf16, written a shard at a time with the safetensors library."""
    import numpy as np
    import paddle
    from safetensors.paddle import save_file

    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.checkpoint.layout import param_specs

    cfg = bench_config(preset, layers)
    config = GlmMoeDsaConfig(**cfg)
    specs = param_specs(config, "hf")
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    shard_bytes, shards, current, size, total = 1 << 30, [], {}, 0, 0
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, os.path.join(folder, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in current})
            shards.append(name)
        current, size = {}, 0

    for key in sorted(specs):
        shape, kind = specs[key]
        if key.endswith("e_score_correction_bias"):
            arr = paddle.to_tensor((rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32))
        else:
            if len(shape) == 2:
                std = 1.0 if "embed_tokens" in key else shape[-1] ** -0.5
                x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            elif key.endswith(".bias"):
                x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
            else:  # norm weights
                x = 1.0 + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
            u = x.astype(np.float32).view(np.uint32)  # bf16, rounded to nearest even
            arr = paddle.to_tensor(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)).view(paddle.bfloat16)
        current[key] = arr
        nbytes = math.prod(shape) * (4 if arr.dtype == paddle.float32 else 2)
        size += nbytes
        total += nbytes
        if size >= shard_bytes:
            flush()
    flush()
    final = {}
    for i, old in enumerate(shards):  # the conventional names once the count is known
        new = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(folder, old), os.path.join(folder, new))
        final[old] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    Path(folder, "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(folder)
    params = sum(math.prod(s) for s, _ in specs.values())
    return {"params": params, "bytes": total}


def _ids(S: int, vocab: int) -> Any:
    import numpy as np

    return np.random.default_rng(1234).integers(3, vocab, size=(1, S)).astype("int64")


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _phase(name: str) -> None:
    print(f"PHASE {name}", flush=True)


def worker_ours(folder: str, mode: str, S: int, threads: int, out_npz: str) -> dict[str, Any]:
    import numpy as np
    import paddle

    paddle.set_device("cpu")
    from paddle.base import core

    if hasattr(core, "set_num_threads"):
        core.set_num_threads(threads)
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype="float32")
    load_gb = _peak_gb()
    ids = paddle.to_tensor(_ids(S, model.config.vocab_size))
    _phase(mode)
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "forward":
        model.eval()
        with paddle.no_grad():
            logits = model(ids).logits
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        np.savez(out_npz, last=logits[0, -8:].numpy(), argmax=logits[0].argmax(-1).numpy())
        res = {}
    else:
        model.train()
        out = model(ids, labels=ids, compute_mtp=False)
        out.loss.backward()
        loss = float(out.loss)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        res = {"loss": loss}
    return dict(res, seconds=seconds, cpu_s=cpu_s, peak_gb=_peak_gb(), load_gb=load_gb)


def worker_hf(folder: str, mode: str, S: int, threads: int, out_npz: str) -> dict[str, Any]:
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    load_gb = _peak_gb()
    ids = torch.from_numpy(_ids(S, model.config.vocab_size))
    _phase(mode)
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "forward":
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        np.savez(out_npz, last=logits[0, -8:].numpy(), argmax=logits[0].argmax(-1).numpy())
        res = {}
    else:
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        loss = float(out.loss)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        res = {"loss": loss}
    return dict(res, seconds=seconds, cpu_s=cpu_s, peak_gb=_peak_gb(), load_gb=load_gb)


WORKERS = {"prepare": worker_prepare, "ours": worker_ours, "hf": worker_hf}


# ----------------------------------------------------------------------------- driver
def compare(ours_npz: str, hf_npz: str) -> dict[str, float]:
    import numpy as np

    a, b = np.load(ours_npz), np.load(hf_npz)
    return {
        "logits_max_diff": float(np.abs(a["last"] - b["last"]).max()),
        "argmax_agree": float((a["argmax"] == b["argmax"]).mean()),
    }


def _cell(r: dict[str, Any] | None, key: str, fmt: str) -> str:
    if r is None:
        return "skipped"
    if "error" in r:
        where = f" ({r['last_phase']})" if r.get("last_phase") else ""
        return r["error"] + where
    return format(r[key], fmt)


def _number(cmp_: dict[str, float], key: str, other: str | None, fmt: str) -> str:
    """A comparison cell: ``key``'s value, else ``other``'s, else "-" (nothing compared)."""
    value = cmp_.get(key, cmp_.get(other) if other else None)
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]], limit_gb: float) -> str:
    head = (
        "| mode | S | layers | ours s | HF s | speed ours/HF | ours cpu s | HF cpu s | on CPU time | ours peak GB "
        "| HF peak GB | memory ours/HF | max diff (forward: logits, train: loss) | argmax agree |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        o, h = r["ours"], r.get("hf")
        ok = h is not None and "error" not in o and "error" not in h
        speed = f"**{h['seconds'] / o['seconds']:.2f}x**" if ok else "-"
        cpu = f"{h['cpu_s'] / o['cpu_s']:.2f}x" if ok else "-"
        mem = f"**{o['peak_gb'] / h['peak_gb']:.2f}**" if ok else "-"
        cmp_ = r.get("compare") or {}
        lines.append(
            f"| {r['mode']} | {r['S']} | {r['layers']} | {_cell(o, 'seconds', '.1f')} | {_cell(h, 'seconds', '.1f')} "
            f"| {speed} | {_cell(o, 'cpu_s', '.1f')} | {_cell(h, 'cpu_s', '.1f')} | {cpu} "
            f"| {_cell(o, 'peak_gb', '.2f')} | {_cell(h, 'peak_gb', '.2f')} | {mem} "
            f"| {_number(cmp_, 'logits_max_diff', 'loss_abs_diff', '.2e')} | {_number(cmp_, 'argmax_agree', None, '.4f')} |"
        )
    return "\n".join(lines) + f"\n(memory limit per run: {limit_gb:g} GB RSS)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="official", choices=sorted(PRESETS))
    p.add_argument("--seqlens", default="2304,4096,8192")
    p.add_argument("--modes", default="forward,train")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the forward runs")
    p.add_argument("--train-layers", type=int, default=2, help="decoder layers of the training-step runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-limit-gb", type=float, default=20.0, help="kill a run whose RSS passes this")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    p.add_argument("--mkl-cpu-type", default="auto", choices=["auto", "5", "unset"])
    p.add_argument(
        "--kmp-blocktime",
        default="0",
        help="KMP_BLOCKTIME for both sides ('unset': the runtime's default; see the module doc)",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        kind, args = ns.worker
        print("RESULT " + json.dumps(WORKERS[kind](*json.loads(args))), flush=True)
        return 0
    env = bench_env(ns.threads, ns.mkl_cpu_type)
    if ns.kmp_blocktime != "unset":
        env["KMP_BLOCKTIME"] = ns.kmp_blocktime
    script = Path(__file__).resolve()

    def run(kind: str, args: list[Any]) -> dict[str, Any]:
        return run_worker(["--worker", kind, json.dumps(args)], env, ns.mem_limit_gb, ns.timeout, script=script)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(ns.workdir or tmp)
        for mode in [m for m in ns.modes.split(",") if m]:
            layers = ns.layers if mode == "forward" else ns.train_layers
            folder = work / f"rw_{ns.preset}_{layers}l"
            if not (folder / "config.json").exists():
                made = run("prepare", [ns.preset, layers, str(folder)])
                if "error" in made:
                    print(f"[bench_realwidth] prepare failed: {made['error']}", file=sys.stderr)
                    return 1
                print(f"[bench_realwidth] {layers} layers: {made['params'] / 1e9:.2f} B parameters written", flush=True)
            for S in [int(s) for s in ns.seqlens.split(",") if s]:
                row: dict[str, Any] = {"mode": mode, "S": S, "layers": layers, "preset": ns.preset}
                npz = {side: str(work / f"{side}_{mode}_{S}.npz") for side in ("ours", "hf")}
                row["ours"] = run("ours", [str(folder), mode, S, ns.threads, npz["ours"]])
                if not ns.skip_hf:
                    row["hf"] = run("hf", [str(folder), mode, S, ns.threads, npz["hf"]])
                    if "error" not in row["ours"] and "error" not in row["hf"]:
                        if mode == "forward":
                            row["compare"] = compare(npz["ours"], npz["hf"])
                        else:  # the loss both sides backpropagated
                            row["compare"] = {"loss_abs_diff": abs(row["ours"]["loss"] - row["hf"]["loss"])}
                rows.append(row)
                print(f"[bench_realwidth] {json.dumps(row)}", flush=True)
    if ns.json:
        tmp_json = f"{ns.json}.{os.getpid()}"
        Path(tmp_json).write_text(json.dumps({"rows": rows, "args": vars(ns)}, indent=2))
        os.replace(tmp_json, ns.json)
    print(table(rows, ns.mem_limit_gb))
    return 1 if any("error" in r["ours"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
