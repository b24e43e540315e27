"""Measure the DSA indexer's dense warm-up on the tiny model (the curve docs/indexer.md quotes).

1. Train the tiny model's backbone (``--indexer-stage none``) on a repeat task, so that its
   attention looks at specific keys: each sequence repeats one random segment of ``--period``
   tokens, so after the first period a query finds its next token one period back.
   With ``--sharpen F`` the backbone's query projections (``q_b_proj``) are then scaled by F, which
   sharpens every attention row (a stand-in for the peaked attention of a well-trained backbone,
   when the tiny model's short training leaves its attention near uniform).
2. Replace every indexer weight by a fresh random initialisation (the tiny checkpoint of another
   seed): a trained backbone whose indexer selects at random.
3. Run the dense warm-up (``--indexer-stage warmup``, backbone frozen) on the same data and print
   the mean top-k recall per step (first / last), per layer, and the share of tensors that changed.

usage: python tools/indexer_recall_curve.py OUT [--backbone-steps 600] [--warmup-steps 100] [--period 4]
Writes OUT/backbone, OUT/reinit, OUT/warmup (``glm52 plot-indexer OUT/warmup`` draws it) and
OUT/recall_curve.json.  CPU, a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np


def repeat_task(path: Path, vocab: int, seq: int, n_seqs: int, period: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [np.resize(rng.integers(10, vocab, period), seq) for _ in range(n_seqs)]
    np.save(path, np.asarray(rows, dtype=np.int64).reshape(-1))


def fp32_tiny(out: Path, seed: int) -> Path:
    """The tiny checkpoint of ``seed`` in fp32 (config dtype too, so that exports stay fp32 and the
    byte comparison below is exact)."""
    from paddleformers_glm.checkpoint.convert import convert_checkpoint
    from paddleformers_glm.tiny import make_tiny_checkpoint

    bf16 = Path(make_tiny_checkpoint(out.with_name(out.name + "_bf16"), seed=seed))
    shutil.rmtree(out, ignore_errors=True)
    convert_checkpoint(bf16, out, layout="hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}, indent=2))
    return out


def fixed_batch_recall(model_dir: Path, seq: int) -> dict[str, float]:
    """Per full layer and mean: the top-k recall of ``model_dir`` on one fixed synthetic batch
    (8 sequences, seed 7) in a warm-up forward (dense attention)."""
    import paddle

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(model_dir), dtype="float32")
    model.set_indexer_training("warmup")
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(7).integers(10, model.config.vocab_size, (8, seq)))
    losses = model.forward_stage(None, {"input_ids": ids, "labels": ids}).losses
    out = {k.split("@")[1]: float(v.sum) for k, v in losses.items() if k.startswith("indexer_recall@")}
    out["mean"] = sum(out.values()) / len(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--backbone-steps", type=int, default=600)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--backbone-lr", type=float, default=1e-2)
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--sharpen", type=float, default=1.0, help="scale the backbone's q_b_proj by this")
    args = ap.parse_args()

    from safetensors.numpy import load_file, save_file

    from paddleformers_glm.configuration import GlmMoeDsaConfig
    from paddleformers_glm.train.loop import TrainConfig, run_training

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src, other = fp32_tiny(out / "tiny", seed=0), fp32_tiny(out / "tiny_seed1", seed=1)
    vocab = GlmMoeDsaConfig.from_pretrained(str(src)).vocab_size
    data = out / "repeat.npy"
    repeat_task(data, vocab, args.seq_len, 4096, args.period, seed=0)

    def train(model: Path, run: str, stage: str, steps: int, lr: float) -> dict:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(model)}, steps=steps, seq_len=args.seq_len,
            global_batch_size=8, micro_batch_size=8, lr=lr, warmup_steps=min(10, steps), data=str(data),
            out=str(out / run), progress=False, indexer_stage=stage, export=True,
        )  # fmt: skip
        return run_training(cfg)

    reinit = out / "reinit"
    shutil.rmtree(reinit, ignore_errors=True)
    if args.backbone_steps > 0:
        backbone = train(src, "backbone", "none", args.backbone_steps, args.backbone_lr)
        shutil.copytree(out / "backbone" / "export", reinit)
    else:
        backbone = {"losses": [math.nan]}
        shutil.copytree(src, reinit)
    # the (trained) backbone, its indexers replaced by another seed's fresh ones
    fresh = {}
    for f in other.glob("*.safetensors"):
        fresh.update({k: v for k, v in load_file(str(f)).items() if ".indexer." in k})
    n_replaced = 0
    for f in reinit.glob("*.safetensors"):
        t = load_file(str(f))
        for k in t:
            if k in fresh:
                t[k] = fresh[k]
                n_replaced += 1
            elif k.endswith("self_attn.q_b_proj.weight"):
                t[k] = t[k] * np.float32(args.sharpen)
        save_file(t, str(f), metadata={"format": "pt"})
    warm = train(reinit, "warmup", "warmup", args.warmup_steps, args.warmup_lr)

    changed, total = [], 0
    before = {}
    for f in reinit.glob("*.safetensors"):
        before.update(load_file(str(f)))
    after = {}
    for f in (out / "warmup" / "export").glob("*.safetensors"):
        after.update(load_file(str(f)))
    for k, v in before.items():
        total += 1
        if v.tobytes() != after[k].tobytes():
            changed.append(k)
    recall_fixed = [
        fixed_batch_recall(reinit, args.seq_len),
        fixed_batch_recall(out / "warmup" / "export", args.seq_len),
    ]
    block = warm["indexer"]
    mean = block["mean_recall"]
    result = {
        "backbone_loss_first_last": [backbone["losses"][0], backbone["losses"][-1]],
        "backbone_loss_last10_mean": sum(backbone["losses"][-10:]) / len(backbone["losses"][-10:]),
        "indexer_tensors_replaced": n_replaced,
        "warmup_mean_recall_first_last": [mean[0], mean[-1]],
        "mean_recall_fixed_batch_before_after": recall_fixed,
        "warmup_recall_by_layer_first_last": {
            str(i): [block["recall"][0][j], block["recall"][-1][j]] for j, i in enumerate(block["layers"])
        },
        "warmup_kl_first_last": [warm["indexer_losses"][0], warm["indexer_losses"][-1]],
        "tensors_changed": len(changed),
        "tensors_changed_all_indexer": all(".indexer." in k for k in changed),
        "tensors": total,
        "settings": vars(args),
    }
    (out / "recall_curve.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
