"""``glm52 check-loss``: compare two training loss curves step by step, bit-exact or within a tolerance
(steps 0-based; the input, the report's fields and the pass rule: docs/parity.md, "glm52 check-loss").
"""

from __future__ import annotations

import glob
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from .._io import NONFINITE_KEY, read_json
from ..cli._plot import PLOT_EXTRA_HINT, pyplot, save_png
from .ckpt_check import same_inputs, sha256_file, versions

__all__ = [
    "LossFileError",
    "NonFiniteLoss",
    "read_losses",
    "read_curve",
    "read_eval_points",
    "compare_losses",
    "detect_jumps",
    "check_losses",
    "loss_figure",
    "plot_losses",
    "run_labels",
]

EXIT_PASS, EXIT_FAIL, EXIT_UNUSABLE = 0, 1, 2


class LossFileError(ValueError):
    """A loss file that cannot be compared (not JSON, no ``losses``, a non-number, NaN/inf)."""


class NonFiniteLoss(LossFileError):
    """A loss the run itself computed as NaN / Inf, as its record says (``step``: the 0-based step of
    a per-step curve, None for an evaluation)."""

    def __init__(self, message: str, step: int | None) -> None:
        super().__init__(message)
        self.step = step


def read_curve(path: str, key: str = "losses", steps: int | None = None, notes: list[str] | None = None) -> list[float]:
    """The ``key`` list of a loss.json (``losses``, ``mtp_losses``, ...), finite numbers only;
    ``eval.<name>``: that entry of each held-out evaluation's record (``eval.losses``).  A loss the
    run computed as NaN / Inf (null, listed under the record's ``nonfinite``) is refused naming its
    step, unless ``steps`` compares only steps before it: the curve then ends there, said in ``notes``."""
    if key.startswith("eval."):
        return list(read_eval_points(path, key).values())
    data = _read_record(path)
    if not isinstance(data, dict) or key not in data:
        got = f"keys {sorted(data)[:6]}" if isinstance(data, dict) else type(data).__name__
        raise LossFileError(f"{path}: expected a JSON object with a {key!r} list, got {got}")
    losses = data[key]
    if not isinstance(losses, list):
        raise LossFileError(f"{path}: {key!r} must be a list, got {type(losses).__name__}")
    listed = _listed_nonfinite(data)
    for i, v in enumerate(losses):
        if v is None and f"{key}[{i}]" in listed:  # glm52 train's (and the reference's) own record of it
            if steps is not None and i >= steps:
                if notes is not None:
                    notes.append(f"{path}: {key}[{i}] is non-finite (the run computed NaN or Inf at step {i}): "
                                 f"its curve ends before it, past the --steps {steps} compared")  # fmt: skip
                losses = losses[:i]
                break
            raise NonFiniteLoss(
                f"{path}: {key}[{i}] is non-finite: the run computed NaN or Inf at step {i} (written null, "
                f"listed under {NONFINITE_KEY!r})",
                i,
            )
    return [_finite(v, path, f"{key}[{i}]") for i, v in enumerate(losses)]


def _listed_nonfinite(data: Any) -> set[str]:
    """The paths a record lists as the non-finite numbers it wrote as null (``_io.dumps_json``)."""
    listed = data.get(NONFINITE_KEY) if isinstance(data, dict) else None
    return set(listed) if isinstance(listed, list) and all(isinstance(x, str) for x in listed) else set()


def _read_record(path: str) -> Any:
    try:
        return read_json(path, "the loss record", None, LossFileError, unique_keys=True)
    except LossFileError:
        raise
    except ValueError as e:  # json's own: an integer of more digits than Python converts
        raise LossFileError(f"{path}: the loss record is not readable JSON ({e})") from e


def _finite(v: Any, path: str, where: str) -> float:
    """``v`` (the entry ``where`` of the record at ``path``) as a finite float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise LossFileError(f"{path}: {where} is {v!r} ({type(v).__name__}), expected a number")
    try:
        v = float(v)  # JSON integers are exact and unbounded
    except OverflowError:
        raise LossFileError(f"{path}: {where} is an integer beyond a float's range") from None
    if not math.isfinite(v):
        raise LossFileError(f"{path}: {where} is {v}, expected a finite number")
    return v


def read_eval_points(path: str, key: str) -> dict[int, float]:
    """``eval.<name>``: the training step of each held-out evaluation -> its ``name`` entry, in the
    file's order (a step evaluated twice keeps its first record: the same weights and data give the
    same value; two records of one step that disagree are refused, which one to compare is no choice
    a checker can make)."""
    name = key.split(".", 1)[1]
    data = _read_record(path)
    records = data.get("eval") if isinstance(data, dict) else None
    if not isinstance(records, list) or not records:
        raise LossFileError(f"{path}: no 'eval' records (the run had no --eval-data) for {key!r}")
    out: dict[int, float] = {}
    listed = _listed_nonfinite(data)
    for i, r in enumerate(records):
        v = r.get(name) if isinstance(r, dict) else None
        if v is None and f"eval[{i}].{name}" in listed:
            raise NonFiniteLoss(
                f"{path}: eval[{i}].{name} is non-finite: the run's evaluation of step {r.get('step')!r} computed "
                f"NaN or Inf (written null, listed under {NONFINITE_KEY!r})",
                None,
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise LossFileError(f"{path}: eval[{i}].{name} is {v!r}, expected a finite number")
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise LossFileError(f"{path}: eval[{i}].step is {step!r}, expected the training step (an integer >= 0)")
        value = _finite(v, path, f"eval[{i}].{name}")
        if step in out and out[step] != value:
            first = next(j for j, q in enumerate(records) if isinstance(q, dict) and q.get("step") == step)
            raise LossFileError(
                f"{path}: eval[{i}] evaluates step {step} again with {name} {value!r}, eval[{first}] gave "
                f"{out[step]!r}: records of other weights or data (a merged or edited file?)"
            )
        out.setdefault(step, value)
    return out


read_losses = read_curve  # the ``losses`` list of a loss.json


def compare_losses(
    a: Sequence[float], b: Sequence[float], steps: int | None = None, atol: float = 0.0, rtol: float = 0.0
) -> dict[str, Any]:
    """Step-by-step agreement of two curves: ``a == b`` or ``|a-b| <= atol + rtol*|b|`` (atol=rtol=0:
    bit-exact; an infinite tolerance is usable, as in torch.allclose).

    With ``steps`` only the first ``steps`` losses are compared and each curve must have that many
    (``enough_steps``); their lengths beyond that do not matter. Without it all common steps are
    compared, one step is enough, and the curves must be as long as each other.
    """
    n_common = min(len(a), len(b))
    n = min(n_common, steps) if steps is not None else n_common
    diffs = [abs(a[i] - b[i]) for i in range(n)]
    # equal losses agree whatever the tolerance, as in torch.isclose: else rtol inf x |b| = 0 gives NaN
    agree = [a[i] == b[i] or d <= atol + rtol * abs(b[i]) for i, d in enumerate(diffs)]
    consistent = next((i for i, ok in enumerate(agree) if not ok), n)
    need = steps if steps is not None else 1
    return {
        "len_a": len(a),
        "len_b": len(b),
        "steps_required": steps,
        "steps_compared": n,
        "length_match": len(a) == len(b),
        "enough_steps": n_common >= need and n_common > 0,
        "consistent_steps": consistent,
        "matching_steps": sum(agree),
        "first_divergent_step": consistent if consistent < n else None,
        "max_diff": max(diffs, default=0.0),
        "bit_exact": (len(a) == len(b) or steps is not None) and all(a[i] == b[i] for i in range(n)),
        "atol": atol,
        "rtol": rtol,
    }


def detect_jumps(
    a: Sequence[float], b: Sequence[float], factor: float = 10.0, floor: float = 1e-6
) -> list[dict[str, Any]]:
    """Steps where ``|a - b|`` leaps instead of growing smoothly.

    Reduction-order noise grows steadily (Adam turns it into weight differences of about lr per
    step); a near-tie in a top-k selection (DSA indexer, MoE router) that the two runs break
    differently changes which tokens or experts are used, and the difference leaps by orders of
    magnitude in one step.  A step is a jump when its difference exceeds ``factor`` times the
    largest difference before it (and ``floor``, so bit-exact prefixes do not flag the first
    rounding difference).  Steps are 0-based, like ``first_divergent_step``.
    """
    n = min(len(a), len(b))
    jumps, prev = [], 0.0
    for i in range(n):
        d = abs(a[i] - b[i])
        if d > floor and d > factor * prev:
            jumps.append({"step": i, "diff": d, "previous_max_diff": prev, "ratio": d / prev if prev else math.inf})
        prev = max(prev, d)
    return jumps


def check_losses(
    path_a: str,
    path_b: str,
    steps: int | None = None,
    bit_exact: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    plot: str | None = None,
    curve: str = "losses",
) -> dict[str, Any]:
    """Receipt for two loss files' ``curve`` (:func:`read_curve`); ``exit_code`` 0 pass, 1 fail,
    2 unusable input."""
    report: dict[str, Any] = {
        "tool": "glm52 check-loss",
        "created_unix": int(time.time()),
        "versions": versions(),
        "a": {"path": os.path.abspath(path_a), "real_path": os.path.realpath(path_a)},
        "b": {"path": os.path.abspath(path_b), "real_path": os.path.realpath(path_b)},
        "mode": "bit-exact" if bit_exact or (atol is None and rtol is None) else "tolerance",
        "curve": curve,
        "errors": [],
        "warnings": [],
    }
    if steps is not None and steps < 1:
        report["errors"].append(f"--steps must be >= 1, got {steps}")
    for flag, tol_value in (("--atol", atol), ("--rtol", rtol)):  # as torch.allclose refuses them
        if tol_value is not None and not tol_value >= 0:
            report["errors"].append(f"{flag} must be >= 0, got {tol_value}")
    if same := same_inputs(("a", "b"), path_a, path_b, "a curve"):
        report["errors"].append(same)
        report.update(exit_code=EXIT_UNUSABLE, result="unusable input")
        return report
    curves, points, hint = {}, {}, 0
    for name, p in (("a", path_a), ("b", path_b)):
        try:
            if curve.startswith("eval."):
                points[name] = read_eval_points(p, curve)
            else:
                curves[name] = read_curve(p, curve, steps, report["warnings"])
            report[name]["sha256"] = sha256_file(p)
        except NonFiniteLoss as e:  # the steps before it compare (one hint: the earliest of the two sides)
            report["errors"].append(str(e))
            if e.step:
                hint = min(e.step, hint) if hint else e.step
            continue
        except LossFileError as e:
            report["errors"].append(str(e))
            continue
        _describe_run(report[name], p)
    if failed := [f"{n} ({p})" for n, p in (("a", path_a), ("b", path_b)) if "failed_run" in report[n]]:
        what = "; ".join(
            f"{n}: {report[n]['failed_run']['file']} ({report[n]['failed_run']['message'] or 'no message'})"
            for n in ("a", "b")
            if "failed_run" in report[n]
        )
        report["warnings"].append(
            f"{' and '.join(failed)} {'is a failed run' if len(failed) == 1 else 'are failed runs'} "
            f"(failure record{'s' if len(failed) > 1 else ''} {what}): a curve holds only the steps its run did before it stopped"
        )
    if hint:
        report["errors"].append(f"--steps {hint} compares the steps before the first non-finite loss")
    if report["errors"]:
        report.update(exit_code=EXIT_UNUSABLE, result="unusable input")
        return report
    if points:  # evaluations pair by training step: runs may evaluate at different steps (a resume's start)
        common = sorted(set(points["a"]) & set(points["b"]))
        curves = {name: [points[name][s] for s in common] for name in ("a", "b")}
        report["eval_steps"] = common
        report["eval_steps_only_in"] = {n: sorted(set(points[n]) - set(common)) for n in ("a", "b")}
    tol = (0.0, 0.0) if report["mode"] == "bit-exact" else (float(atol or 0.0), float(rtol or 0.0))
    report.update(compare_losses(curves["a"], curves["b"], steps, *tol))
    n = report["steps_compared"]  # jumps within the steps compared (--steps N: none past them)
    report["jumps"] = detect_jumps(curves["a"][:n], curves["b"][:n])
    if points:
        # as long as each other: both runs evaluated up to the same step (and share an evaluation)
        report["length_match"] = bool(common) and max(points["a"]) == max(points["b"])
        report["bit_exact"] = report["bit_exact"] and (report["length_match"] or steps is not None)
        for j in report["jumps"]:
            j["eval_step"] = common[j["step"]]
        first = report["first_divergent_step"]
        report["first_divergent_eval_step"] = None if first is None else common[first]
    ok = (  # in bit-exact mode every step agrees only when it is equal
        (report["length_match"] or steps is not None)
        and report["enough_steps"]
        and report["matching_steps"] == report["steps_compared"]
    )
    report.update(exit_code=EXIT_PASS if ok else EXIT_FAIL, result="pass" if ok else "fail")
    if not ok and (differ := _cpu_math_differs(path_a, path_b)):
        report["cpu_math_differs"] = differ
    if plot:
        try:
            report["plot"] = plot_losses(
                curves["a"], curves["b"], plot, labels=(path_a, path_b), tolerance=tol, verdict=report["result"]
            )
        except ImportError:
            # the comparison stands (result, receipt); exit 2: the asked-for output could not be made
            report["errors"].append(f"--plot {plot}: {PLOT_EXTRA_HINT}")
            report.update(exit_code=EXIT_UNUSABLE, plot=None)
        except OSError as e:  # a full disk: the comparison stands, the plot could not be written
            report["errors"].append(f"--plot {plot}: cannot write the plot: {e.strerror or e}")
            report.update(exit_code=EXIT_UNUSABLE, plot=None)
    return report


def failure_records(loss_json: str) -> list[str]:
    """The failure records beside a loss record: ``glm52 train`` writes ``OUT/logs/failure.json`` (a
    node's ``OUT/logs/node<R>/failure.json`` in a multi-node job) when a run stops on an error and
    sets aside the earlier record of the folder it logs in as it starts. A record older than the loss
    record is an earlier run's (a later run logging elsewhere, e.g. in one process after a multi-node
    job, leaves the nodes' records in place): a run that failed wrote its losses before its record."""
    logs = os.path.join(os.path.dirname(os.path.abspath(loss_json)), "logs")
    found = [os.path.join(logs, "failure.json")] + sorted(glob.glob(os.path.join(logs, "node*", "failure.json")))
    try:
        since = os.stat(loss_json).st_mtime
    except OSError:
        return []
    return [f for f in found if os.path.isfile(f) and os.stat(f).st_mtime >= since]


def _describe_run(side: dict[str, Any], path: str) -> None:
    """What a loss record's run says of itself, in its side of the receipt: the steps it did (loss.json
    ``steps``) and, when its run folder holds a failure record, ``failed_run`` (``file``, ``message``):
    a crashed run's curve stops where it died, and two crashed runs can agree on the steps they did."""
    data = _read_record(path)
    steps = data.get("steps") if isinstance(data, dict) else None
    if isinstance(steps, int) and not isinstance(steps, bool):
        side["steps_done"] = steps
    records = failure_records(path)
    if not records:
        return
    try:
        doc = read_json(records[0], "the failure record")
        message = doc.get("message") if isinstance(doc, dict) else None
    except (OSError, ValueError) as e:
        message = f"unreadable failure record: {e}"
    side["failed_run"] = {"file": records[0], "message": message if isinstance(message, str) else None}
    if len(records) > 1:
        side["failed_run"]["more_records"] = records[1:]


def _cpu_math_differs(path_a: str, path_b: str) -> dict[str, Any] | None:
    """The runs' CPU math settings (loss.json ``cpu_math``, cpu_env.MATH_SETTINGS) where both
    record them and they differ: {"a": ..., "b": ...} of the differing ones, else None."""
    got = [_read_record(p) for p in (path_a, path_b)]
    a, b = (d.get("cpu_math") if isinstance(d, dict) else None for d in got)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return {"a": {k: a.get(k) for k in keys}, "b": {k: b.get(k) for k in keys}} if keys else None


def run_labels(path_a: str, path_b: str) -> tuple[str, str]:
    """Names that tell two runs apart in a legend: a run's folder (runs write OUT/loss.json), with
    as many parent folders as it takes to differ."""
    pa, pb = (os.path.abspath(p).split(os.sep) for p in (path_a, path_b))
    for parts in (pa, pb):
        if len(parts) > 1 and parts[-1] == "loss.json":
            parts.pop()
    for n in range(1, max(len(pa), len(pb)) + 1):
        la, lb = os.sep.join(pa[-n:]), os.sep.join(pb[-n:])
        if la != lb:
            return la, lb
    return "A: " + os.sep.join(pa[-1:]), "B: " + os.sep.join(pb[-1:])


def loss_figure(
    a: Sequence[float],
    b: Sequence[float],
    labels: tuple[str, str] = ("A", "B"),
    tolerance: tuple[float, float] = (0.0, 0.0),
    verdict: str | None = None,
) -> Any:
    """The matplotlib figure of :func:`plot_losses`: both curves labelled by run (top), |a - b| per
    step with the tolerance it is held to (bottom), the verdict in the title; ``save_png`` lays it out."""
    n = min(len(a), len(b))
    fig, (ax1, ax2) = pyplot().subplots(2, 1, figsize=(8, 6), sharex=True, dpi=100)
    ax1.plot(range(len(a)), a, label=labels[0] or "A", lw=1.5)
    ax1.plot(range(len(b)), b, label=labels[1] or "B", lw=1.0, ls="--")
    diff = [abs(a[i] - b[i]) for i in range(n)]
    ax2.plot(range(n), diff, color="tab:red", marker="o", ms=2, lw=1, label="|A - B|")
    atol, rtol = tolerance
    if atol == 0 and rtol == 0:
        rule = "bit-exact (|A - B| = 0)"
    else:
        rule = f"|A - B| <= {atol:g} + {rtol:g} x |B|"
        bound = [atol + rtol * abs(b[i]) for i in range(n)]
        ax2.plot(range(n), bound, color="black", ls=":", lw=1, label=f"tolerance {atol:g} + {rtol:g}|B|")
    positive = [d for d in diff if d > 0] + ([atol] if atol > 0 else [])
    if positive:
        ax2.set_yscale("symlog", linthresh=max(min(positive), 1e-300))
    ax2.set_xlabel("step")
    for ax, name in ((ax1, "loss"), (ax2, "|A - B|")):
        ax.set_ylabel(name)
        ax.legend(loc="best")
        ax.grid(alpha=0.3)
    head = f"check-loss {verdict.upper()}: " if verdict else ""
    fig.suptitle(f"{head}{rule}, max |A - B| {max(diff, default=0.0):.3g} over {n} steps", fontsize=10)
    return fig


def plot_losses(
    a: Sequence[float],
    b: Sequence[float],
    out: str,
    labels: tuple[str, str] = ("A", "B"),
    tolerance: tuple[float, float] = (0.0, 0.0),
    verdict: str | None = None,
) -> str:
    """PNG with both curves (top) and |a - b| per step against the tolerance (bottom); ``labels``
    are the loss files' paths (the legend names their run folders). Needs the ``plot`` extra
    (ImportError without matplotlib)."""
    fig = loss_figure(a, b, run_labels(*labels), tolerance, verdict)
    return os.path.abspath(save_png(fig, out, dpi=100))
