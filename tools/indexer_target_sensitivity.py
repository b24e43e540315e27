"""How far one fp32 ulp in the indexer's KL target moves a training run: the torch reference trainer
run twice with the same flags, once as it is and once with every target probability multiplied by
``1 +- ulps * 2**-24`` (a fixed sign pattern), then the last weights of the two runs compared.

Why: ``glm52 align --indexer-stage warmup`` at the recipe's lr 1e-3 ends with the indexers' weights
further apart than the final-weight tolerance while every per-step curve agrees.  Paddle's and
torch's kernels compute the same target and index scores with different fp32 roundings; this tool
measures what a difference of that size does inside the reference alone, so the gap can be read
against it (docs/indexer.md, "Against the torch reference").

    python tools/indexer_target_sensitivity.py OUT -- --model TINY --steps 100 --seq-len 32 \
        --indexer-stage warmup --lr 1e-3 [other flags of the reference trainer]

Needs the ``reference`` extra (torch, transformers).  Writes OUT/plain, OUT/perturbed and
OUT/compare.json (``glm52 check-ckpt`` of the two final weight dumps); prints the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REFERENCE = "paddleformers_glm.parity.reference.train"


def _perturbed_main(ulps: float, argv: list[str]) -> int:
    import torch

    from paddleformers_glm.parity.reference import indexer as reference_indexer
    from paddleformers_glm.parity.reference import train as reference_train

    plain_group = reference_indexer.ReferenceIndexer._group

    def group(self, members):  # the same terms, each member's target probabilities nudged by `ulps`
        saved = [m["probs"] for m in members]
        for m in members:
            sign = torch.randint(0, 2, m["probs"].shape, generator=torch.Generator().manual_seed(0)) * 2.0 - 1.0
            m["probs"] = m["probs"] * (1.0 + sign * ulps * 2.0**-24)
        try:
            return plain_group(self, members)
        finally:
            for m, p in zip(members, saved):
                m["probs"] = p

    reference_indexer.ReferenceIndexer._group = group
    return reference_train.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--perturbed-run" in argv:  # the child process of the perturbed run
        i = argv.index("--perturbed-run")
        return _perturbed_main(float(argv[i + 1]), argv[:i] + argv[i + 2 :])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="after --: the reference trainer's flags")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--ulps", type=float, default=1.0, help="size of the nudge in fp32 ulps (default 1)")
    ap.add_argument("--steps", type=int, required=True, help="the run's steps (also passed to the trainer)")
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = ap.parse_args(ours)
    flags += ["--steps", str(args.steps)]
    finals = {}
    for name in ("plain", "perturbed"):
        out = os.path.join(args.out, name)
        finals[name] = os.path.join(out, "dump_final")
        cmd = [sys.executable, "-m", REFERENCE] if name == "plain" else [sys.executable, __file__]
        cmd += [*flags, "--out", out, "--dump-step", finals[name], str(args.steps)]
        if name == "perturbed":
            cmd += ["--perturbed-run", str(args.ulps)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = os.path.join(args.out, "compare.json")
    weights = [os.path.join(finals[n], "weights") for n in ("plain", "perturbed")]
    subprocess.run(
        [sys.executable, "-m", "paddleformers_glm.cli", "check-ckpt", *weights, "--json", report, "--quiet"],
        stdout=subprocess.DEVNULL,
    )
    with open(report, encoding="utf-8") as f:
        rep = json.load(f)
    if rep["exit_code"] == 2:  # nothing compared: not "identical"
        raise SystemExit(f"check-ckpt could not compare the final weights: {rep['errors']}")
    worst = rep["value_summary"]  # over every tensor (the listed differences stop at 200)
    if worst["max_abs_diff"] is None:
        print(f"{args.ulps:g} ulp in the target: last weights identical")
    else:
        print(
            f"{args.ulps:g} ulp in the target: last weights differ by up to {worst['max_abs_diff']:.3g} "
            f"({worst['max_abs_diff_key']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
