#!/usr/bin/env python
"""The HF reference on a GPU, fp32 and bf16, against the committed CPU fixtures (tests/fixtures).

Why: a parity report compares a Paddle run with a reference run. Users run that reference on their
GPUs, and train in bf16. This script measures, on the fixture checkpoints and inputs, how far

* the reference on a GPU in fp32 (TF32 off) lands from the CPU fixtures our tests pin at 1e-5, and
* the reference in bf16 (weights and activations, as clusters train) lands from fp32,

so `glm52 check-loss --atol` for a bf16 run can be set from a measured noise floor, not a guess.
It runs HF transformers only (paddlepaddle-gpu is not installable where it was run; see
docs/parity.md), with the same procedure as tools/make_reference.py: eval logits / loss, the
padded batch, first-step gradients, 4 SGD steps (lr 0.1); plus 30 AdamW steps (lr 1e-3) on the
same batch, whose bf16 curve is compared with the fp32 one of the same device.

    python tools/gpu_reference_check.py [--device cuda] [--json OUT.json]

Needs torch + transformers (the `reference` extra); prints a table, last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_reference as mr  # noqa: E402

ADAM_STEPS, ADAM_LR = 30, 1e-3


def load_state(ckpt: Path) -> OrderedDict:
    """The official-layout checkpoint as fp32 tensors (its bf16 values are exact in fp32)."""
    import torch
    from safetensors.torch import load_file

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    state: OrderedDict = OrderedDict()
    for shard in sorted(set(index.values())):
        for k, v in load_file(str(ckpt / shard)).items():
            state[k] = v.to(torch.float32)
    return state


def run(case: str, device: str, dtype_name: str) -> dict:
    import torch
    from safetensors.torch import load_file

    dtype = getattr(torch, dtype_name)
    fx = ROOT / "tests" / "fixtures" / case
    cfg = mr.case_config(case)
    state = load_state(fx / "checkpoint")
    ref = load_file(str(fx / "reference.safetensors"))
    t = {k: ref[k].to(device) for k in ("input_ids", "labels", "pad_input_ids", "pad_attention_mask", "pad_labels")}

    def fresh():
        return mr.fresh_model(cfg, fx / "checkpoint", state).to(device=device, dtype=dtype)

    out: dict = {}
    model = fresh().eval()
    with torch.no_grad():
        o = model(input_ids=t["input_ids"], labels=t["labels"])
        out["logits"], out["loss"] = o.logits.float().cpu(), o.loss.float().cpu()
        o = model(input_ids=t["pad_input_ids"], attention_mask=t["pad_attention_mask"], labels=t["pad_labels"])
        out["pad_logits"], out["pad_loss"] = o.logits.float().cpu(), o.loss.float().cpu()
    del model

    model = fresh().train()
    opt = torch.optim.SGD(model.parameters(), lr=mr.LR, momentum=0.0, weight_decay=0.0)
    losses = []
    for step in range(mr.TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=t["input_ids"], labels=t["labels"]).loss
        loss.backward()
        losses.append(float(loss.detach().float()))
        if step == 0:
            out.update({k: v.float().cpu() for k, v in mr.hf_grads_to_official(model, cfg).items()})
        opt.step()
    out["train_losses"] = torch.tensor(losses)
    del model, opt

    model = fresh().train()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.0)
    curve = []
    for _ in range(ADAM_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=t["input_ids"], labels=t["labels"]).loss
        loss.backward()
        curve.append(float(loss.detach().float()))
        opt.step()
    out["adamw_losses"] = torch.tensor(curve)
    return out


def diffs(got: dict, ref: dict) -> dict:
    """Max abs diff per quantity; gradients as max abs diff over the fixture's gradient keys and
    the same relative to the largest reference gradient entry."""
    d = {}
    for k in ("logits", "loss", "pad_logits", "pad_loss", "train_losses", "adamw_losses"):
        if k in ref and k in got:
            d[k] = float((got[k].double() - ref[k].double()).abs().max())
    if "logits" in ref and "logits" in got:  # max diff is set by the few rows where a top-k flipped
        d["logits_rel_l2"] = float(
            (got["logits"].double() - ref["logits"].double()).norm() / ref["logits"].double().norm()
        )
    gk = [k for k in ref if k.startswith("grad.")]
    if gk:
        d["grads"] = max(float((got[k].double() - ref[k].double()).abs().max()) for k in gk)
        d["grads_rel"] = d["grads"] / max(float(ref[k].abs().max()) for k in gk)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="tiny,tiny_pattern_yarn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import transformers
    from safetensors.torch import load_file

    transformers.logging.set_verbosity_error()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 is the PyTorch default for cuDNN)
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
    }
    report: dict = {"env": env, "cases": {}}
    rows = []
    for case in args.cases.split(","):
        fixture = load_file(str(ROOT / "tests" / "fixtures" / case / "reference.safetensors"))
        fp32 = run(case, args.device, "float32")
        fp32_again = run(case, args.device, "float32")
        bf16 = run(case, args.device, "bfloat16")
        rep = {
            "fp32_vs_cpu_fixture": diffs(fp32, fixture),
            "fp32_repeat": diffs(fp32_again, fp32),
            "bf16_vs_cpu_fixture": diffs(bf16, fixture),
            "bf16_vs_fp32_same_device": diffs(bf16, fp32),
            "fp32_adamw_losses": fp32["adamw_losses"].tolist(),
            "bf16_adamw_losses": bf16["adamw_losses"].tolist(),
        }
        report["cases"][case] = rep
        for name in ("fp32_vs_cpu_fixture", "fp32_repeat", "bf16_vs_cpu_fixture", "bf16_vs_fp32_same_device"):
            rows.append((case, name, rep[name]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"# {env}")
    keys = ["logits", "logits_rel_l2", "loss", "pad_logits", "train_losses", "grads_rel", "adamw_losses"]
    print("| case | comparison | " + " | ".join(keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for case, name, d in rows:
        print(f"| {case} | {name} | " + " | ".join(f"{d[k]:.2e}" if k in d else "-" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
