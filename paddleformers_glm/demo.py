"""`glm52 demo`: the main job on the embedded default, end to end, leaving receipts in OUT/ (README.md):
make the tiny official-layout checkpoint, load, run, generate and export it (HF and Fleet layouts,
each proven by `check-ckpt`), then train it in the headline layout and in one process and compare
the two runs with `check-loss` and `check-ckpt`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ._io import read_json
from ._io import write_json_atomic as _write_json

DEMO_PROMPT = "Hello! What is the capital of France?"


def generate_from_text(model: Any, folder: Path, prompt: str, max_new_tokens: int = 8) -> dict[str, Any]:
    """Greedy tokens from a text prompt with the checkpoint's own tokenizer (the tiny weights are
    random, so the text is not meaningful; the path from text to text is what is shown)."""
    import paddle

    from .tokenizer import GlmTokenizer

    tok = GlmTokenizer.from_pretrained(folder)
    ids = tok.encode(prompt, add_special_tokens=False)
    out = model.generate(paddle.to_tensor([ids], dtype="int64"), max_new_tokens=max_new_tokens, eos_token_id=[])
    new = [int(t) for t in out.numpy()[0, len(ids) :]]
    return {"prompt": prompt, "prompt_ids": ids, "new_ids": new, "text": tok.decode(new, skip_special_tokens=True)}


def run_parity_demo(out: Path, steps: int = 3, seq: int = 64, seed: int = 0) -> dict[str, Any]:
    import numpy as np
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
    print(f"[1/5] tiny official-layout checkpoint: {src} ({len(list(src.iterdir()))} files)")

    model = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    cfg = model.config
    ids = paddle.to_tensor(np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(2, seq), dtype=np.int64))
    model.eval()
    with paddle.no_grad():
        ev = model(ids, labels=ids)
    summary["eval_loss"], summary["eval_mtp_loss"] = float(ev.loss), float(ev.mtp_loss)
    print(f"[2/5] loaded ({sum(int(p.numel()) for p in model.parameters())} params); eval loss {float(ev.loss):.6f}")
    summary["generate"] = gen = generate_from_text(model, src, DEMO_PROMPT, max_new_tokens=8)
    print(f"      generate: {gen['prompt']!r} -> {gen['text']!r} ({len(gen['new_ids'])} new tokens)")

    # the exports are of the loaded weights in the source's dtype ("auto": the one config.json
    # states), so they must equal the source tensor for tensor
    hf_out, fleet_out = out / "export-hf", out / "export-fleet"
    model.save_pretrained(hf_out, max_shard_size="1MB", dtype="auto")
    model.save_pretrained(fleet_out, layout="fleet", max_shard_size="1MB", dtype="auto")
    print(f"[3/5] exported: {hf_out} (official HF layout), {fleet_out} (Paddle/Fleet layout)")

    receipts = {}
    for name, cand, layout in (("hf", hf_out, None), ("fleet", fleet_out, "fleet")):
        receipts[name] = rep = check_checkpoints(str(src), str(cand), layout=layout)
        _write_json(out / f"check-ckpt-{name}.json", rep)
        for line in summary_lines(rep)[:3]:
            print(f"      {name}: {line}")
    c_hf, fleet_counts = receipts["hf"].get("counts", {}), receipts["fleet"].get("counts", {})
    print(
        f"      hf: no tolerance: every one of the {c_hf.get('ref_tensors')} tensors hashes equal to the source's "
        f"(hash_match={receipts['hf'].get('hash_match')}): the export writes the loaded values back unchanged"
    )
    print(
        f"      fleet: no tolerance: the same tensors under PaddleFleet's names ({fleet_counts.get('naming')} renamings "
        f"the AOA mapping explains, structural={fleet_counts.get('structural')}, value={fleet_counts.get('value')})"
    )
    summary["check_ckpt_hf"] = {k: receipts["hf"].get(k) for k in ("exit_code", "hash_match")}
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
    print(f"[4/5] {steps} SGD steps (loss + 0.1 * mtp_loss): {losses}")

    ok = (
        receipts["hf"]["exit_code"] == 0
        and receipts["hf"].get("hash_match") is True
        and receipts["fleet"]["exit_code"] == 0
        and fleet_counts.get("structural", 1) == 0
    )
    summary["ok"] = ok
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    _write_json(out / "summary.json", summary)
    print(f"      checkpoint checks {'PASSED' if ok else 'FAILED'} ({summary['seconds']} s)")
    return summary


def _glm52(args: list[str], log: Path) -> int:
    """Run a glm52 subcommand in a child process (as a user would), output teed into `log`."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "paddleformers_glm.cli", *args]
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ glm52 " + " ".join(args) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode


LOSS_ATOL = 1e-5  # check-loss bound between layouts (fp32; docs/parity.md, "Which tolerance")
TRAIN_LR = 3e-4


def _train_line(src: Path, steps: int, seq: int = 64, gbs: int = 4, seed: int = 1234) -> list[str]:
    """The glm52 train flags both runs of :func:`run_training_parity` share (their layout aside)."""
    common = ["--model", str(src), "--steps", str(steps), "--seq-len", str(seq), "--global-batch-size", str(gbs)]
    return [*common, "--micro-batch-size", "1", "--seed", str(seed), "--lr", str(TRAIN_LR)]


def run_training_parity(
    out: Path, layout: list[str], steps: int = 5, seq: int = 64, gbs: int = 4, seed: int = 1234
) -> dict[str, Any]:
    """Train the tiny checkpoint in `layout` and in one process; compare with the checkers."""
    from .parity.ckpt_check import check_checkpoints, summary_lines
    from .parity.loss_check import check_losses

    common = [*_train_line(out / "tiny-official", steps, seq, gbs, seed), "--export"]
    result: dict[str, Any] = {"layout": " ".join(layout)}
    for name, extra in {"parallel": layout, "single": []}.items():
        what = " ".join(extra) or "(1 process)"
        t = time.perf_counter()
        rc = _glm52(["train", *common, *extra, "--out", str(out / name)], out / f"train-{name}.log")
        secs = round(time.perf_counter() - t, 1)
        result[f"{name}_seconds"], result[f"{name}_exit"] = secs, rc
        if rc != 0:
            print(f"      glm52 train {what} FAILED (exit {rc}):")
            for line in (out / f"train-{name}.log").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]:
                print("      " + line)
            result["ok"] = False
            return result
        record = read_json(out / name / "loss.json", "the loss record")
        print(f"      glm52 train {what}: {secs} s, losses {', '.join(f'{x:.6f}' for x in record['losses'])}")
        if off := _layout_not_run(
            extra, record.get("profile") or {}
        ):  # a comparison of two one-process runs proves nothing
            print(f"      glm52 train {what}: the run recorded another layout: {off}: FAIL")
            result["ok"], result["layout_mismatch"] = False, off
            return result

    plot = str(out / "loss-parallel-vs-single.png")
    loss_args = (str(out / "single" / "loss.json"), str(out / "parallel" / "loss.json"))
    loss_rep = check_losses(*loss_args, steps=steps, atol=LOSS_ATOL, rtol=0.0, plot=plot)
    if loss_rep["exit_code"] == 2 and loss_rep.get("plot", "") is None:  # no matplotlib: the comparison stands
        print(f"      (no loss plot: {loss_rep['errors'][-1]})")
        loss_rep = check_losses(*loss_args, steps=steps, atol=LOSS_ATOL, rtol=0.0)
    _write_json(out / "check-loss.json", loss_rep)
    result["check_loss"] = {k: loss_rep.get(k) for k in ("exit_code", "max_diff", "consistent_steps", "bit_exact")}
    verdict = "pass" if loss_rep["exit_code"] == 0 else "FAIL"
    print(
        f"      check-loss single vs parallel: max |loss diff| {loss_rep.get('max_diff', float('nan')):.3g} over "
        f"{loss_rep.get('steps_compared')} steps, bound atol {LOSS_ATOL:g}: {verdict} (the layouts sum in different "
        "orders, fp32 rounding; a routing flip would be a jump, not this)"
    )

    ck = check_checkpoints(str(out / "single" / "export"), str(out / "parallel" / "export"))
    _write_json(out / "check-ckpt-trained.json", ck)
    counts = ck.get("counts", {})
    # over every differing tensor (the receipt lists at most 200); a shape or dtype difference has no
    # max_abs_diff but is a layout difference all the same
    values = ck.get("value_summary") or {}
    worst = values.get("max_abs_diff")
    worst = 0.0 if worst is None else worst
    # each AdamW step moves a weight by at most about lr (betas 0.9 / 0.95): two runs of `steps`
    # steps from the same weights stay within 2 x steps x lr of each other, whatever their rounding
    bound = 2 * steps * TRAIN_LR
    result["check_ckpt_trained"] = dict(
        exit_code=ck["exit_code"], counts=counts, max_abs_diff=worst, bound=bound, value_summary=values
    )
    same_layout = (
        ck["exit_code"] in (0, 1)
        and counts.get("structural", 1) == 0
        and counts.get("naming", 1) == 0
        and counts.get("ref_tensors") == counts.get("cand_tensors")
        and values.get("shape", 1) == 0
        and values.get("dtype", 1) == 0
        and ck.get("config_match") is True  # both exports write the model's config
    )
    print(f"      trained exports: {summary_lines(ck)[1].strip()}")
    print(
        f"      trained exports: same keys, shapes, dtypes and config: {'yes' if same_layout else 'NO'}; weights differ by "
        f"at most {worst:.3g} <= {bound:.3g} = 2 x {steps} steps x lr {TRAIN_LR:g} (AdamW turns rounding-level "
        f"gradient differences into weight steps of up to lr, so bitwise equality is not expected): "
        f"{'pass' if worst <= bound else 'FAIL'}"
    )
    result["ok"] = loss_rep["exit_code"] == 0 and same_layout and worst <= bound
    return result


def _not_layout_flags(layout: list[str]) -> str | None:
    """The flags of ``--layout`` that are no layout (``--out``, ``--lr``, ``--steps`` ...): the demo
    compares the layout's run with one process, so any other setting would apply to one side only
    (``--out`` even replaced the parallel run's folder: two one-process runs, "PASSED")."""
    import argparse

    from .train.command import add_layout_arguments

    ours = argparse.ArgumentParser(add_help=False)
    add_layout_arguments(ours)
    ours.add_argument("--recompute")
    known = {o for a in ours._actions for o in a.option_strings}
    other = [f for f in layout if f.startswith("--") and f.split("=")[0] not in known]
    return (
        f"--layout {' '.join(layout)!r}: {', '.join(other)} not a layout flag (the layout flags: "
        + ", ".join(sorted(known))
        + ")"
        if other
        else None
    )


def _layout_not_run(layout: list[str], profile: dict[str, Any]) -> str:
    """The degrees ``layout`` (glm52 train flags) asks for that the run's loss.json ``profile`` does
    not show ('' when it shows them all)."""
    import argparse

    from .train.command import add_train_arguments

    args = add_train_arguments(argparse.ArgumentParser()).parse_args(["--model", "-", "--out", "-", *layout])
    want = {k: getattr(args, k) for k in ("tp", "pp", "dp", "cp", "ep", "etp", "sp")}
    return ", ".join(f"{k} {profile.get(k)!r} (asked {v!r})" for k, v in want.items() if profile.get(k) != v)


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded tiny checkpoint and prove parity")
    p.add_argument("--out", default="runs/demo", help="output folder for checkpoints and receipts (default runs/demo)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps of the in-process check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout",
        default="--tp 2 --pp 2 --sp",
        help="glm52 train layout compared with one process (default '--tp 2 --pp 2 --sp'); '' skips training",
    )
    p.add_argument("--train-steps", type=int, default=5)

    def run(args) -> int:
        from .cli._common import output_folder_error

        bad = output_folder_error(args.out, "--out")  # before the work: a file there was a traceback at mkdir
        for flag, value, low in (
            ("--steps", args.steps, 1),
            ("--train-steps", args.train_steps, 1),
            ("--seed", args.seed, 0),
        ):
            bad = bad or (f"{flag} must be >= {low}, got {value}" if value < low else None)
        if not bad and args.layout.strip():  # a layout glm52 train refuses, refused before the in-process check
            from .tiny import TINY_CONFIG
            from .train.command import train_line_error

            line = _train_line(TINY_CONFIG.parent, args.train_steps)
            bad = (e := train_line_error([*line, *args.layout.split()])) and f"--layout {args.layout!r}: {e}"
            bad = bad or _not_layout_flags(args.layout.split())
        out = Path(args.out)
        if not bad:  # made last: a refused line leaves no folder behind
            from .train.command import make_folder

            try:
                make_folder(os.path.abspath(out))  # the parents it made go again when it cannot
            except OSError as e:  # a read-only place, no permission, a name over 255 bytes
                bad = f"--out {args.out}: {e.strerror or e}"
        if bad:
            print(f"glm52 demo: error: {bad}", file=sys.stderr)
            return 2
        summary = run_parity_demo(out, steps=args.steps, seed=args.seed)
        if args.layout.strip():
            print(f"[5/5] training {args.layout} vs 1 process ({args.train_steps} steps)")
            summary["training"] = run_training_parity(out, args.layout.split(), steps=args.train_steps)
            summary["ok"] = summary["ok"] and summary["training"]["ok"]
            _write_json(out / "summary.json", summary)
        print(f"demo {'PASSED' if summary['ok'] else 'FAILED'}; receipts in {out}")
        return 0 if summary["ok"] else 1

    p.set_defaults(func=run)
