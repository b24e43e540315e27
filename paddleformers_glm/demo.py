"""`glm52 demo`: the main job on the embedded default, end to end, leaving receipts in OUT/.

1. make the tiny official-layout checkpoint (deterministic, bf16, two shards)
2. load it with `from_pretrained` (AOA engine, strict) and run it (eval loss + a few SGD steps)
3. export it again in the official HF layout and in the Paddle/Fleet layout
4. prove parity with the checkers: HF export vs source (hash_match, exit 0) and Fleet export vs
   source (naming differences only, none structural)

When the Fleet training entry point is installed it also trains TP2/PP2 with sequence parallel
and compares that run with a single-process one (see `run_training_parity`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int):
    import numpy as np
    import paddle

    ids = np.random.default_rng(seed).integers(3, vocab, size=(batch, seq), dtype=np.int64)
    return paddle.to_tensor(ids)


def run_parity_demo(out: Path, steps: int = 3, seq: int = 64, seed: int = 0) -> dict[str, Any]:
    import paddle

    from .modeling import GlmMoeDsaForCausalLM
    from .parity.ckpt_check import check_checkpoints, summary_lines
    from .tiny import make_tiny_checkpoint

    paddle.set_device("cpu")
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"out": str(out), "steps": []}
    t0 = time.perf_counter()
    src = out / "tiny-official"
    make_tiny_checkpoint(src, seed=seed)
    print(f"[1/4] tiny official-layout checkpoint: {src} ({len(list(src.iterdir()))} files)")

    model = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    cfg = model.config
    ids = synthetic_batch(cfg.vocab_size, 2, seq, seed)
    model.eval()
    with paddle.no_grad():
        ev = model(ids, labels=ids)
    summary["eval_loss"], summary["eval_mtp_loss"] = float(ev.loss), float(ev.mtp_loss)
    print(f"[2/4] loaded ({sum(int(p.numel()) for p in model.parameters())} params); eval loss {float(ev.loss):.6f}")

    # the exports are of the loaded weights, so they must equal the source tensor for tensor
    hf_out, fleet_out = out / "export-hf", out / "export-fleet"
    model.save_pretrained(hf_out, max_shard_size="1MB")
    model.save_pretrained(fleet_out, layout="fleet", max_shard_size="1MB")
    print(f"[3/4] exported: {hf_out} (official HF layout), {fleet_out} (Paddle/Fleet layout)")

    receipts = {}
    for name, cand, layout in (("hf", hf_out, None), ("fleet", fleet_out, "fleet")):
        rep = check_checkpoints(str(src), str(cand), layout=layout)
        _write_json(out / f"check-ckpt-{name}.json", rep)
        receipts[name] = rep
        for line in summary_lines(rep)[:3]:
            print(f"      {name}: {line}")
    summary["check_ckpt_hf"] = {
        "exit_code": receipts["hf"]["exit_code"],
        "hash_match": receipts["hf"].get("hash_match"),
    }
    fleet_counts = receipts["fleet"].get("counts", {})
    summary["check_ckpt_fleet"] = {"exit_code": receipts["fleet"]["exit_code"], "counts": fleet_counts}

    model.train()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    for step in range(steps):
        o = model(ids, labels=ids, add_mtp_loss=True)
        o.loss.backward()
        opt.step()
        opt.clear_grad()
        summary["steps"].append({"step": step, "loss": float(o.loss), "mtp_loss": float(o.mtp_loss)})
    losses = ", ".join(f"{s['loss']:.4f}" for s in summary["steps"])
    print(f"[4/4] {steps} SGD steps (loss + 0.1 * mtp_loss): {losses}")

    ok = (
        receipts["hf"]["exit_code"] == 0
        and receipts["hf"].get("hash_match") is True
        and receipts["fleet"]["exit_code"] == 0
        and fleet_counts.get("structural", 1) == 0
    )
    summary["ok"] = ok
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    _write_json(out / "summary.json", summary)
    print(f"demo {'PASSED' if ok else 'FAILED'} in {summary['seconds']} s; receipts in {out}")
    return summary


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded tiny checkpoint and prove parity")
    p.add_argument("--out", default="runs/demo", help="output folder for checkpoints and receipts (default runs/demo)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)

    def run(args) -> int:
        summary = run_parity_demo(Path(args.out), steps=args.steps, seed=args.seed)
        return 0 if summary["ok"] else 1

    p.set_defaults(func=run)
