"""Measure the DSA indexer's dense warm-up on the tiny model (the curve docs/indexer.md quotes).

1. Train the tiny model's backbone (``--indexer-stage none``) on a copy task, so that its attention
   looks at specific keys: each sequence is random segments each followed by its copy, so a query
   in a copy attends to the token one segment back.
2. Replace every indexer weight by a fresh random initialisation (the tiny checkpoint of another
   seed): a trained backbone whose indexer selects at random.
3. Run the dense warm-up (``--indexer-stage warmup``, backbone frozen) on the same data and print
   the mean top-k recall per step (first / last), per layer, and the share of tensors that changed.

usage: python tools/indexer_recall_curve.py OUT [--backbone-steps 300] [--warmup-steps 100]
Writes OUT/backbone, OUT/reinit, OUT/warmup (``glm52 plot-indexer OUT/warmup`` draws it) and
OUT/recall_curve.json.  CPU, a few minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np


def copy_task(path: Path, vocab: int, seq: int, n_seqs: int, segment: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_seqs):
        row = []
        while len(row) < seq:
            s = rng.integers(10, vocab, segment)
            row += list(s) + list(s)
        rows.append(row[:seq])
    np.save(path, np.asarray(rows, dtype=np.int64).reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--backbone-steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--backbone-lr", type=float, default=3e-3)
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    args = ap.parse_args()

    from safetensors.numpy import load_file, save_file

    from paddleformers_glm.configuration import GlmMoeDsaConfig
    from paddleformers_glm.tiny import make_tiny_checkpoint
    from paddleformers_glm.train.loop import TrainConfig, run_training

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(make_tiny_checkpoint(out / "tiny", seed=0))
    other = Path(make_tiny_checkpoint(out / "tiny_seed1", seed=1))
    vocab = GlmMoeDsaConfig.from_pretrained(str(src)).vocab_size
    data = out / "copy.npy"
    copy_task(data, vocab, args.seq_len, 4096, segment=8, seed=0)

    def train(model: Path, run: str, stage: str, steps: int, lr: float) -> dict:
        cfg = TrainConfig(
            model="glm", model_args={"model_dir": str(model)}, steps=steps, seq_len=args.seq_len,
            global_batch_size=8, micro_batch_size=8, lr=lr, warmup_steps=min(10, steps), data=str(data),
            out=str(out / run), progress=False, indexer_stage=stage, export=True,
        )  # fmt: skip
        return run_training(cfg)

    backbone = train(src, "backbone", "none", args.backbone_steps, args.backbone_lr)
    # the trained backbone, its indexers replaced by another seed's fresh ones
    reinit = out / "reinit"
    shutil.rmtree(reinit, ignore_errors=True)
    shutil.copytree(out / "backbone" / "export", reinit)
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
    block = warm["indexer"]
    mean = block["mean_recall"]
    result = {
        "backbone_loss_first_last": [backbone["losses"][0], backbone["losses"][-1]],
        "indexer_tensors_replaced": n_replaced,
        "warmup_mean_recall_first_last": [mean[0], mean[-1]],
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
