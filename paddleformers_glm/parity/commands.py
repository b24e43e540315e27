"""argparse wiring of ``glm52 check-ckpt`` and ``glm52 check-loss`` (registered by ``paddleformers_glm.cli``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._io import write_json_atomic
from ..cli._common import checkpoint_files, output_file_error, outputs_clash
from ..cli._plot import loss_json_of


def _checker(sub: argparse._SubParsersAction, name: str, inputs: dict[str, str], run: Any, **text: str) -> Any:
    """A checker's parser: its two inputs (name -> help), ``--json`` for the receipt, its runner."""
    p = sub.add_parser(name, **text)
    for arg, what in inputs.items():
        p.add_argument(arg, help=what)
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the JSON receipt here")
    p.set_defaults(func=run)
    return p


def _write_receipt(command: str, path: str, report: dict[str, Any]) -> bool:
    """Write the receipt; a filesystem error (a full disk, a folder made there meanwhile) is one line."""
    try:
        write_json_atomic(path, report)
    except OSError as e:
        print(f"{command}: --json {path}: cannot write the receipt: {e.strerror or e}", file=sys.stderr)
        return False
    return True


def register_check_ckpt(sub: argparse._SubParsersAction) -> None:
    p = _checker(
        sub,
        "check-ckpt",
        {
            "ref": "reference checkpoint folder (or .safetensors file)",
            "cand": "candidate checkpoint folder (or .safetensors file)",
        },
        _run_check_ckpt,
        help="compare two checkpoints tensor for tensor (exit 0 match, 1 mismatch, 2 unusable input)",
        description="Strictly validate REF and CAND (headers, index, no symlink/hardlink/sparse file), hash every "
        "tensor canonically, and classify every key difference as naming, structural or value.",
    )
    p.add_argument(
        "--layout",
        choices=("hf", "fleet"),
        help="the candidate's layout; when it differs from REF's, naming differences explained by the AOA mapping pass",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="report tensors holding NaN/Inf (weights or FP8 scales) as warnings instead of refusing the input",
    )


def _run_check_ckpt(args: argparse.Namespace) -> int:
    from .. import progress
    from .ckpt_check import check_checkpoints, summary_lines

    progress.set_quiet(True if args.quiet else None)
    inputs = [*checkpoint_files(args.ref), *checkpoint_files(args.cand)]
    if args.json_out and (bad := output_file_error(args.json_out, "--json", inputs)):
        print(f"check-ckpt: {bad}", file=sys.stderr)
        return 2
    report = check_checkpoints(args.ref, args.cand, layout=args.layout, allow_nonfinite=args.allow_nonfinite)
    if args.json_out and not _write_receipt("check-ckpt", args.json_out, report):
        return 2
    if report["result"] == "unusable input":  # as every glm52 command: one line a problem, on stderr
        for e in report["errors"]:
            print(f"check-ckpt: {e}", file=sys.stderr)
    else:
        print("\n".join(summary_lines(report)))
    return int(report["exit_code"])


def register_check_loss(sub: argparse._SubParsersAction) -> None:
    p = _checker(
        sub,
        "check-loss",
        {"a": "loss.json of run A (or its run folder)", "b": "loss.json of run B (or its run folder)"},
        _run_check_loss,
        help="compare two loss.json curves (exit 0 pass, 1 fail, 2 malformed input or no plot)",
        description="Read {'losses': [...]} from A and B and report length_match, enough_steps, consistent_steps, "
        "matching_steps, first_divergent_step (0-based), max_diff and bit_exact.",
    )
    p.add_argument(
        "--steps", type=int, help="compare the first N steps; each file must have at least N (longer ones are fine)"
    )
    p.add_argument(
        "--curve",
        default="losses",
        help="which curve: a list of loss.json (losses, mtp_losses, grad_norms ...) or eval.<name> for each "
        "held-out evaluation's entry (eval.losses, eval.mtp_losses); default losses",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--bit-exact", action="store_true", help="every compared loss must be identical (default)")
    mode.add_argument("--atol", type=float, help="absolute tolerance: |a-b| <= atol + rtol*|b|")
    p.add_argument("--rtol", type=float, help="relative tolerance (with --atol, or alone)")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write a PNG of both curves (labelled by run folder) and |diff| per step against the tolerance; "
        "needs the plot extra (without it: exit 2, the JSON receipt is still written)",
    )


def _lengths(report: dict, args: argparse.Namespace) -> str:
    """Which curve is shorter, by how much, and what that means for the verdict."""
    la, lb = report["len_a"], report["len_b"]
    line = f"a ({args.a}) has {la} losses, b ({args.b}) {lb}"
    if "eval_steps" in report:  # evaluations: as long as each other = evaluated up to the same step
        la, lb = (max(report["eval_steps"] + report["eval_steps_only_in"][s], default=-1) for s in ("a", "b"))
        line = f"a ({args.a}) evaluated up to step {la}, b ({args.b}) up to step {lb}"
    if report["steps_required"] is not None and not report["enough_steps"]:
        return f"{line}: --steps {report['steps_required']} needs that many on both"
    if "eval_steps" in report and not report["eval_steps"]:
        return f"{line}: no evaluation step in common"
    if la != lb:
        short = "a" if la < lb else "b"
        both = "eval_steps" not in report and min(la, lb) > 0
        steps = f"; --steps {min(la, lb)} compares the steps both did" if both else ""
        return f"{line}: {short} stopped short or ran fewer steps{steps}"
    return line


def _run_check_loss(args: argparse.Namespace) -> int:
    from .loss_check import check_losses

    if args.bit_exact and args.rtol is not None:
        print("check-loss: --rtol cannot be combined with --bit-exact", file=sys.stderr)
        return 2
    args.a, args.b = loss_json_of(args.a), loss_json_of(args.b)  # a run folder, as the plot commands take
    for flag, path in (("--json", args.json_out), ("--plot", args.plot)):
        if path and (bad := output_file_error(path, flag, [args.a, args.b])):
            print(f"check-loss: {bad}", file=sys.stderr)
            return 2
    if bad := outputs_clash(("--json", args.json_out), ("--plot", args.plot)):
        print(f"check-loss: {bad}", file=sys.stderr)
        return 2
    tolerance = {"bit_exact": args.bit_exact, "atol": args.atol, "rtol": args.rtol}
    report = check_losses(args.a, args.b, steps=args.steps, plot=args.plot, curve=args.curve, **tolerance)
    if args.json_out and not _write_receipt("check-loss", args.json_out, report):
        return 2
    for e in report["errors"]:
        print(f"check-loss: {e}", file=sys.stderr)
    for w in report.get("warnings", []):  # a crashed run's curve: the verdict holds, but only for its steps
        print(f"check-loss: warning: {w}", file=sys.stderr)
    if report["result"] != "unusable input":
        keys = "length_match enough_steps consistent_steps matching_steps first_divergent_step max_diff bit_exact"
        if "eval_steps" in report:  # evaluations: the first disagreement named by its training step
            keys = keys.replace("first_divergent_step", "first_divergent_eval_step")
        rule = f"|a-b| <= {report['atol']:g} + {report['rtol']:g}*|b| at every step"
        rule = "every loss identical" if report["mode"] == "bit-exact" else rule
        print(
            f"check-loss: {report['result']} ({report['mode']}: {rule}) "
            + " ".join(f"{k}={report[k]}" for k in keys.split())
        )
        if differ := report.get("cpu_math_differs"):
            print(
                f"check-loss: the runs' CPU math settings differ (a: {differ['a']}, b: {differ['b']}): MKL's sums "
                'depend on the thread count, so the bits may differ from the first step (docs/parity.md, "Thread counts")'
            )
        for side, steps in report.get("eval_steps_only_in", {}).items():
            if steps:
                print(f"check-loss: evaluations at steps {steps} only in {side} ({getattr(args, side)}): not compared")
        if not report["enough_steps"] or (not report["length_match"] and report["steps_required"] is None):
            print(f"check-loss: {_lengths(report, args)}")
        for j in report.get("jumps", []):
            where = f"the evaluation of step {j['eval_step']}" if "eval_step" in j else f"step {j['step']}"
            if j["previous_max_diff"] == 0:  # nothing to leap from: no rounding growth came before it
                print(f"check-loss: the curves first differ at {where}: |diff| {j['diff']:.3g} (equal before it)")
                continue
            print(
                f"check-loss: jump at {where}: |diff| {j['diff']:.3g} after at most {j['previous_max_diff']:.3g} "
                "before: a leap, not steady rounding growth (a near-tie top-k or routing flip, or a real difference; "
                "glm52 align names the reference's top-k margins at each jump)"
            )
    return int(report["exit_code"])
