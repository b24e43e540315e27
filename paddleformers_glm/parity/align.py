"""``glm52 align``: prove a Paddle training run equals the torch reference run, and leave a receipt in
``OUT/receipt/`` (what is compared, the tolerances and the exit codes: docs/parity.md, "glm52 align").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._io import read_json, write_json_atomic
from ..cli._common import output_folder_error
from ..train.command import (
    add_dtype_argument,
    add_expert_update_argument,
    add_indexer_arguments,
    add_step_arguments,
    train_line_error,
)
from ..train.out_lock import OutInUse, OutUnusable, hold_out_folder, lock_path
from ..train.settings import effective_min_lr, indexer_stage_weight, recorded_settings
from .ckpt_check import nan_worst
from .reference.indexer import saved_indexer_coeff
from .reference.topk_gaps import NEAR_TIE
from .reference.train import DUMP_KINDS

__all__ = [
    "compare_dumps",
    "recorded_settings_mismatch",
    "record_errors",
    "inputs_mismatch",
    "compare_idle_experts",
    "compare_indexer",
    "explain_jump",
    "first_difference",
    "near_ties",
    "register_align",
    "run_align",
]

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_MODULE = "paddleformers_glm.parity.reference.train"

# defaults; docs/parity.md says why each is what it is and what was measured
LOSS_ATOL = 1e-4
REL_TOL = 1e-5
LATER_REL_TOL = 5e-5  # grads / moments after update K >= 2: their weights may already differ near eps
WEIGHT_REL_LR = 0.1  # step-K weights: absolute tolerance = this x the learning rates of steps 1..K
FINAL_WEIGHT_ATOL = 1e-5
DUMP_STEPS = (1, 2, 3)  # an expert that got tokens at step 1 and none at step 2 shows from step 2 on
NEAR_EPS_SQRT_V = 1e-7  # 10 x Adam's eps: below it a weight's update amplifies gradient rounding
NEAR_EPS_REL_LR = 2.0  # ... so such weights are held to this x the learning rates of steps 1..K
ADAM_BETA2 = 0.95  # both trainers' AdamW betas (0.9, 0.95)
INDEXER_REL_TOL = 2e-4  # indexer tensors: the KL's gradient is a difference of near-equal distributions
# the indexer KL curve and per-layer KLs, |diff| / |reference| each step: the KL (1e-5 to 4e-4) is at or below
# LOSS_ATOL, which passed a KL 22% off; fp32 pairs measured up to 4.0e-3 (a layer's KL over 100 steps)
KL_REL_TOL = 2e-2
NOISE_FLOOR = 1e-8  # relative dumps: a tensor wholly below this x the dump's largest |value| is fp32 noise
LR_REL_TOL = 1e-9  # each update's learning rate: the same closed form on both sides, float64

# the training flags both runs get (glm52 train's own: train/command.py), passed on in this order
TRAIN_FLAGS = (
    "steps seq_len global_batch_size micro_batch_size lr min_lr warmup_steps weight_decay clip_grad seed "
    "moe_bias_update_rate data dtype indexer_stage indexer_loss_coeff"
).split()
# the Paddle run's sizes (default: the headline TP2 x PP2), passed on to glm52 train in this order
LAYOUT_FLAGS = {"tp": 2, "pp": 2, "dp": 1, "ep": 1, "etp": 1, "cp": 1, "vpp": 1, "sharding": 1, "sharding_stage": 1}
# what only each trainer writes into its loss.json (reference/train.py, train/loop.py ``_snapshot``): a
# record without its side's fields was not made by that trainer (a copy of the Paddle run as the
# reference compared equal to itself, every difference 0, and the receipt said "Paddle == torch")
REFERENCE_MARKERS = ("reference", "dtype", "versions.torch", "versions.transformers")
PADDLE_MARKERS = ("profile", "versions.paddle")
INPUTS_FILE = "inputs.json"  # OUT/inputs.json: the model and data the runs were given, hashed as they started


def _rank(x: float) -> tuple[int, float]:
    """Sort key of a difference or ratio: NaN ranks above every number, +inf included (a NaN
    difference is no small one, and Python's ``max`` / ``>`` would drop it, order-dependently)."""
    return (1, 0.0) if math.isnan(x) else (0, x)


def _load(folder: str) -> dict[str, Any]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def compare_dumps(
    ref_dir: str,
    cand_dir: str,
    *,
    rel_tol: float | None = None,
    atol: float | None = None,
    near_eps: tuple[str, float, float] | None = None,
    loose_rel: tuple[str, float] | None = None,
    noise_floor: float = NOISE_FLOOR,
) -> dict:
    """Per-tensor agreement of two dumps in the same names (one of ``rel_tol`` / ``atol``).

    relative: max |cand - ref| / max |ref| per tensor. A reference tensor wholly below
    ``noise_floor`` x the dump's largest |ref| is rounding noise (a gradient that is mathematically
    zero, such as the query path's on data of one repeated token, holds fp32 noise on both sides that
    no relative measure passes): it passes within that floor, absolutely; every tensor above it is
    held to the relative tolerance alone (the second moment, a squared gradient, takes the floor
    squared). A tensor that is exactly zero in the reference must be zero in the candidate.
    absolute: max |cand - ref| per tensor.  Reports the worst tensor (the
    nearest its tolerance) and every tensor beyond it; a name on one side only fails.  A NaN or Inf
    difference (NaN or Inf on one side) fails its tensor and ranks worst, NaN above Inf: ``worst`` and
    ``max_abs_diff`` are then ``nan`` / ``inf`` (null in the strict JSON receipt, listed under
    ``nonfinite``), naming that tensor.

    ``near_eps = (reference exp_avg_sq dump, 1 - beta2**K, loose atol)`` (weights after update K):
    an element whose bias-corrected ``0 < sqrt(v) < NEAR_EPS_SQRT_V`` is held to the loose tolerance,
    since there Adam divides the gradient's rounding by a number near eps (docs/parity.md); their
    count and largest difference are reported (``near_eps``: over the dump, with ``beyond_tolerance``,
    how many are beyond the loose tolerance, and ``pass``; per tensor in its entry), and a tensor
    whose near-eps elements are beyond it fails though its other elements are within tolerance (its
    entry's ``near_eps_ok`` false, ``tolerance_ok`` true).  ``loose_rel = (name part, tolerance)``:
    the relative tolerance of the tensors whose name contains the part (INDEXER_REL_TOL).
    """
    import numpy as np

    ref, cand = _load(ref_dir), _load(cand_dir)
    second = _load(near_eps[0]) if near_eps is not None else {}
    only_ref, only_cand = sorted(set(ref) - set(cand)), sorted(set(cand) - set(ref))
    worst: dict[str, Any] = {"key": None, "value": 0.0, "ratio": 0.0}
    bad, max_abs = [], 0.0
    near = {"elements": 0, "max_abs_diff": 0.0, "key": None, "tolerance": near_eps[2] if near_eps else None}
    near["beyond_tolerance"] = 0
    finite = (np.abs(v[np.isfinite(v)]) for v in ref.values() if v.size)  # an Inf in the reference fails itself
    largest = max((float(a.max()) for a in finite if a.size), default=0.0)
    floor = noise_floor * largest if rel_tol is not None else 0.0
    for k in sorted(set(ref) & set(cand)):
        a, b = ref[k].astype(np.float64), cand[k].astype(np.float64)
        if a.shape != b.shape:
            bad.append({"key": k, "what": "shape", "ref": list(a.shape), "cand": list(b.shape)})
            continue
        with np.errstate(invalid="ignore"):  # Inf - Inf: NaN, which fails the tensor as it should
            diff = np.abs(a - b)
        d = float(np.max(diff)) if a.size else 0.0
        scale = float(np.max(np.abs(a))) if a.size else 0.0
        max_abs = nan_worst(max_abs, d)
        near_ok, near_entry = True, {}
        if k in second and second[k].shape == a.shape and a.size:
            v2 = second[k].astype(np.float64)
            small = (v2 > 0) & (np.sqrt(np.maximum(v2, 0.0) / near_eps[1]) < NEAR_EPS_SQRT_V)
            if small.any():
                dn = float(np.max(diff[small]))
                near["elements"] += int(small.sum())
                if _rank(dn) > _rank(near["max_abs_diff"]):
                    near.update(max_abs_diff=dn, key=k)
                near_ok = dn <= near_eps[2]
                beyond = int((~(diff[small] <= near_eps[2])).sum())  # NaN: beyond
                near["beyond_tolerance"] += beyond
                near_entry = {"elements": int(small.sum()), "beyond_tolerance": beyond, "max_abs_diff": dn}
                near_entry["tolerance"] = near_eps[2]
                d = float(np.max(diff[~small])) if (~small).any() else 0.0
        if rel_tol is not None:
            v = d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))
            tol = loose_rel[1] if loose_rel is not None and loose_rel[0] in k else rel_tol
        else:
            v, tol = d, float(atol or 0.0)
        ratio = v / tol if tol > 0 else (0.0 if v == 0 else math.inf)
        if 0 < scale < floor:  # rounding noise: within the floor passes, whatever its relative size
            ratio = min(ratio, d / floor)
        ok = ratio <= 1.0 and near_ok
        entry = {"key": k, "value": v, "max_abs_diff": d, "max_abs_ref": scale, "tolerance": tol}
        if near_entry:  # this tensor's elements under the near-eps rule, held to their loose tolerance
            entry["near_eps"] = near_entry
        if worst["key"] is None or _rank(ratio) > _rank(worst["ratio"]):  # nearest its own tolerance (NaN: worst)
            worst = {**entry, "ratio": ratio}
        if not ok:
            bad.append({**entry, "near_eps_ok": near_ok, "tolerance_ok": ratio <= 1.0})
    near["pass"] = near["beyond_tolerance"] == 0
    return {
        **({"near_eps": near} if near_eps is not None else {}),
        "ref": os.path.abspath(ref_dir),
        "cand": os.path.abspath(cand_dir),
        "measure": "max|diff| / max|ref| per tensor" if rel_tol is not None else "max|diff| per tensor",
        "tolerance": rel_tol if rel_tol is not None else atol,
        **({"noise_floor": floor} if rel_tol is not None else {}),
        "tensors": len(set(ref) & set(cand)),
        "only_in_ref": only_ref,
        "only_in_cand": only_cand,
        "worst": worst,
        "max_abs_diff": max_abs,
        "beyond_tolerance": bad[:50],
        "beyond_tolerance_count": len(bad),
        "pass": not bad and not only_ref and not only_cand,
    }


def near_ties(margins: list[dict[str, Any]], near: float = NEAR_TIE) -> list[dict[str, Any]]:
    """Steps (0-based) whose reference run made a top-k decision within ``near`` of a tie."""
    close = ({cat: m["min"] for cat, m in step.items() if m["min"] < near} for step in margins)
    return [{"step": i, "min_gaps": c} for i, c in enumerate(close) if c]


def explain_jump(jump: dict[str, Any], margins: list[dict[str, Any]]) -> dict[str, Any]:
    """A loss jump with the reference's smallest top-k margins at that step: a margin at or below
    fp32 rounding (exact ties included) means the two runs may have selected different keys or
    experts there, the expected cause of a jump; a jump without one points at a real difference."""
    step = jump["step"]
    if step < len(margins):
        gaps = {cat: m["min"] for cat, m in margins[step].items()}
        jump = dict(jump, reference_min_gaps=gaps, near_tie=any(g < NEAR_TIE for g in gaps.values()))
        # exact ties (margin 0) of equal values break alike on both sides; the smallest margin that
        # is not one is the decision rounding can flip (recorded by newer reference runs)
        nonzero = {
            cat: m["min_nonzero"]
            for cat, m in margins[step].items()
            # inf (null in strict JSON): every margin was an exact tie
            if m.get("min_nonzero") is not None and math.isfinite(m["min_nonzero"])
        }
        if nonzero:
            jump["reference_min_nonzero_gaps"] = nonzero
    return jump


def compare_indexer(
    ref: dict[str, Any], cand: dict[str, Any], steps: int, atol: float, kl_rel_tol: float = 0.0
) -> dict[str, Any] | None:
    """The indexer's per-layer top-k recall and KL, step by step (loss.json's ``indexer`` block; None
    when neither run trained the indexer): the mean recall as a curve (``consistent_steps`` as for
    the losses), and per layer the largest |difference| of its recall over the run within ``atol``
    and the largest |difference| / |reference| of its KL within ``kl_rel_tol`` (a KL is as small as
    an absolute loss tolerance, so only a relative one can see it).  Both sides must report the same
    stage and layers.  A failure other than the mean recall's curve says why in ``reason`` (the
    layer and measure furthest beyond its tolerance)."""
    from .loss_check import compare_losses

    blocks = (doc.get("indexer") for doc in (ref, cand))
    a, b = (x if x and x.get("stage") != "none" else None for x in blocks)  # the trainer records a stage "none" too
    if not a and not b:
        return None
    if not a or not b:
        why = "only one run trained the indexer"
        return {"pass": False, "reason": why, "consistent_steps": 0, "max_diff": math.inf, "jumps": []}
    nan = [[math.nan if v is None else v for v in x["mean_recall"]] for x in (a, b)]  # null: a NaN the run wrote
    c = compare_losses(nan[1], nan[0], steps=steps, atol=atol)
    c.update(stage={"reference": a["stage"], "paddle": b["stage"]}, layers=a["layers"], jumps=[])
    same = a["stage"] == b["stage"] and a["layers"] == b["layers"]
    per_layer = {}

    def largest(m: str, j: int, n: int, diff: Any = lambda ref, cand: abs(ref - cand)) -> float:
        """The largest ``diff(reference, paddle)`` (|difference|, or another measure) of layer j's
        measure over n steps; a value a run could not compute (NaN, or null as a record writes it)
        makes it NaN, which no tolerance passes."""
        diffs = (diff(x, y) if x is not None and y is not None else math.nan for x, y in pairs(m, j, n))
        return max(diffs, key=_rank, default=0.0)

    def pairs(m: str, j: int, n: int):
        return ((a[m][s][j], b[m][s][j]) for s in range(n))

    if same:
        for j, layer in enumerate(a["layers"]):
            n = min(len(a["recall"]), len(b["recall"]), steps)
            per_layer[str(layer)] = {
                "recall_max_diff": largest("recall", j, n),
                "kl_max_diff": largest("kl", j, n),
                "kl_max_rel_diff": largest("kl", j, n, lambda ref, cand: _rel_diff(cand, ref)),
                "recall_first": a["recall"][0][j] if n else None,
                "recall_last": a["recall"][n - 1][j] if n else None,
            }
    c["per_layer"] = per_layer
    c["kl_rel_tol"] = kl_rel_tol
    c["kl_max_rel_diff"] = max((v["kl_max_rel_diff"] for v in per_layer.values()), key=_rank, default=0.0)
    measures = {
        "recall": ("recall_max_diff", "max |diff|", atol),
        "kl": ("kl_max_rel_diff", "max |diff| / |reference|", kl_rel_tol),
    }
    beyond = [
        (layer, m, v[key], _over(v[key], tol))
        for layer, v in per_layer.items()
        for m, (key, _, tol) in measures.items()
    ]
    worst = max(beyond, key=lambda t: _rank(t[3]), default=None)
    within = worst is None or worst[3] <= 1.0
    c["pass"] = same and c["enough_steps"] and c["consistent_steps"] == steps and within
    if not same:
        c["reason"] = f"stage / layers differ: reference {a['stage']} {a['layers']}, paddle {b['stage']} {b['layers']}"
    elif not within:
        layer, measure, x, _ = worst
        _, what, tol = measures[measure]
        c["reason"] = f"layer {layer}: {measure} {what} {x:.3g} beyond {tol:g}"
    return c


def _rel_diff(x: float, ref: float) -> float:
    """|x - ref| / |ref|: 0 for equal values, inf for a difference from a zero reference, NaN with a NaN."""
    if x == ref:
        return 0.0
    d = abs(x - ref)
    return d / abs(ref) if ref != 0 else (d if math.isnan(d) else math.inf)


def _over(x: float, tol: float) -> float:
    """How many times ``tol`` the difference ``x`` is (NaN stays NaN; a 0 tolerance: 0 or inf)."""
    if math.isnan(x) or x == 0:
        return x
    return x / tol if tol > 0 else math.inf


def compare_idle_experts(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any] | None:
    """The experts each MoE layer left idle, step by step, on both sides (None when neither run
    recorded an idle expert; one run naming idle experts the other did not record fails).  A step
    where they differ is a step where the two runs routed differently.
    loss.json's ``expert_load.idle_experts``: per step, MoE layer -> the experts no token reached."""
    a, b = ((doc.get("expert_load") or {}).get("idle_experts") for doc in (ref, cand))
    if not any(a or ()) and not any(b or ()) and (a is None or b is None):
        return None  # not recorded, or recorded by one side with no idle expert (a model without routed experts)
    one_sided = a is None or b is None  # the other run left experts idle: this run must say which
    a, b = a or [], b or []
    sides = {"reference": a, "paddle": b}
    first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    if one_sided:
        first = next(i for i, x in enumerate(a or b) if x)
    out = {
        **sides,
        "steps_with_idle": {k: sum(1 for x in v if x) for k, v in sides.items()},
        "max_idle_per_step": {k: max((sum(map(len, x.values())) for x in v), default=0) for k, v in sides.items()},
        "first_mismatch_step": first,
        "length_match": len(a) == len(b),
        "pass": first is None and len(a) == len(b),
    }
    if one_sided:
        out["reason"] = f"only the {'reference' if a else 'paddle'} run recorded its idle experts"
    elif len(a) != len(b):
        out["reason"] = f"the reference recorded idle experts for {len(a)} steps, the paddle run for {len(b)}"
    return out


def recorded_settings_mismatch(args: argparse.Namespace, ref_doc: dict[str, Any], pd_doc: dict[str, Any]) -> list[str]:
    """``--no-run``: where the finished runs' ``loss.json`` records a setting other than this command
    line's (the receipt states the command line's layout, training settings and model, so they must
    be the runs'; the training settings are ``run.settings``, train/settings.py
    ``RECORDED_SETTINGS``, and the indexer's stage and KL weight); a setting a record does not hold is
    not checked here: what each record must hold is :func:`record_errors`'s."""
    prof, run = pd_doc.get("profile") or {}, pd_doc.get("run") or {}
    checks = [(f"paddle --{k}", prof.get(k), getattr(args, k)) for k in ("tp", "pp", "dp", "ep", "etp", "cp", "sp")]
    checks += [
        (f"paddle --{k.replace('_', '-')}", run.get(k), getattr(args, k)) for k in ("sharding", "sharding_stage")
    ]
    checks += [
        (f"paddle --{k.replace('_', '-')}", prof.get(k), getattr(args, k)) for k in ("seq_len", "global_batch_size")
    ]
    checks += [("paddle --micro-batch-size", prof.get("micro_batch_size"), args.micro_batch_size)]
    checks += [
        ("paddle --dtype", prof.get("dtype"), args.dtype),
        ("reference --dtype", ref_doc.get("dtype"), args.dtype),
    ]
    ref_run = ref_doc.get("run") or {}
    checks += [("reference --micro-batch-size", ref_run.get("micro_batch_size"), args.micro_batch_size)]
    tokens = args.global_batch_size * args.seq_len
    checks += [("reference tokens per step (--global-batch-size x --seq-len)", ref_run.get("tokens_per_step"), tokens)]
    model = os.path.realpath(args.model)
    for name, doc in (("reference", ref_doc), ("paddle", pd_doc)):
        checks.append((f"{name} --seed", doc.get("seed"), args.seed))
        recorded = (doc.get("run") or {}).get("settings") or {}  # lr schedule, decay, clip, MoE balancing
        given = recorded_settings(args)  # the lr floor as it takes effect on both sides
        if recorded.get("min_lr") is None and "lr" in recorded:  # a record made before that: unset
            recorded = dict(recorded, min_lr=effective_min_lr(recorded["lr"], None))
        checks += [
            (f"{name} --{k.replace('_', '-')}", recorded[k], given[k]) for k in sorted(set(recorded) & set(given))
        ]
        path = (doc.get("checkpoint") or {}).get("path")
        checks.append((f"{name} --model", path and os.path.realpath(path), model))
    stage = coeff = refused = None
    try:  # the stage and KL weight both trainers derive from the flags and the checkpoint's coefficient
        stage, coeff = indexer_stage_weight(
            args.indexer_stage, args.indexer_loss_coeff, saved_indexer_coeff(args.model)
        )
    except ValueError as e:
        refused = f"--indexer-stage / --indexer-loss-coeff: {e}"
    pd_indexer = pd_doc.get("indexer") or {}
    ref_stage = (ref_doc.get("indexer") or {}).get("stage")
    if ref_stage is None and "indexer_loss_coeff" in ref_doc:  # the reference writes no block at stage none
        ref_stage = "none"
    if refused is None:
        checks += [
            ("paddle --indexer-stage", pd_indexer.get("stage"), stage),
            ("paddle --indexer-loss-coeff (the indexer KL's weight)", pd_indexer.get("loss_weight"), coeff),
            ("reference --indexer-stage", ref_stage, stage),
            ("reference --indexer-loss-coeff (the indexer KL's weight)", ref_doc.get("indexer_loss_coeff"), coeff),
        ]
    return [refused] * (refused is not None) + [
        f"{what}: the run recorded {got!r}, this command says {want!r}"
        for what, got, want in checks
        if got is not None and got != want
    ]


def _field(doc: dict[str, Any], dotted: str) -> Any:
    """``doc``'s value at a dotted path (``versions.torch``), None where a level is missing."""
    for part in dotted.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def record_errors(
    ref_loss: str, ref_doc: dict[str, Any], pd_loss: str, pd_doc: dict[str, Any], steps: int
) -> list[str]:
    """Why the two ``loss.json`` are not a torch reference run and a Paddle run of ``steps`` updates:
    each must carry its own trainer's fields (``REFERENCE_MARKERS`` / ``PADDLE_MARKERS``), and each
    must record ``steps`` updates, since the losses are compared over ``--steps`` only while the
    last dump is labelled the last update (runs of 3 steps compared with ``--steps 2`` left a 0.5
    loss difference at step 3 inside an aligned receipt, and the step-3 weights as the "final" ones)."""
    errors = []
    for path, doc, markers, maker in (
        (ref_loss, ref_doc, REFERENCE_MARKERS, f"the torch reference ({REFERENCE_MODULE})"),
        (pd_loss, pd_doc, PADDLE_MARKERS, "glm52 train"),
    ):
        if lacks := [m for m in markers if _field(doc, m) in (None, "")]:
            errors.append(f"{path}: not written by {maker}: it lacks {', '.join(lacks)}")
        got = doc.get("steps")
        if got != steps:
            recorded = "no step count" if got is None else f"{got!r} steps"
            errors.append(f"{path}: the run recorded {recorded}, --steps asks for {steps}")
    return errors


def run_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The model folder's and the data's identity now (``OUT/inputs.json`` as the runs start;
    ``--no-run`` compares it with the one recorded then): the file hashes and the canonical weights
    hash of ``--model`` (neither run records its weights: the trainer's checkpoint block holds
    config.json's hash only), and the data as both trainers open it: its description and the
    fingerprint a resume compares (train/data.py; sample count, sequence length, three samples)."""
    from .ckpt_check import checkpoint_hash, sha256_file, tensor_hash

    model_files = sorted(
        f for f in os.listdir(args.model) if f.endswith((".safetensors", ".json")) and not f.startswith(".")
    )
    model: dict[str, Any] = {"path": os.path.abspath(args.model)}
    model["files_sha256"] = {f: sha256_file(os.path.join(args.model, f)) for f in model_files}
    try:
        from ..checkpoint.safetensors_io import Checkpoint

        with Checkpoint(args.model, strict=True) as ck:
            model_hashes = {k: tensor_hash(i.dtype, i.shape, ck.raw(k)) for k, i in ck.tensors.items()}
        model["canonical_hash"] = checkpoint_hash(model_hashes)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: the file hashes are there
        model["canonical_hash"] = f"unavailable: {e}"
    data: dict[str, Any] = {"path": os.path.abspath(args.data) if args.data else None}
    if args.data and os.path.isfile(args.data):  # the fingerprint samples three rows: the file's bytes, all
        data["sha256"] = sha256_file(args.data)
    try:
        from ..configuration import GlmMoeDsaConfig
        from ..train.data import open_data

        vocab = GlmMoeDsaConfig.from_pretrained(args.model).vocab_size  # its default where the file has none
        source = open_data(args.data, args.seq_len, vocab, args.seed)
        data.update(describe=source.describe, fingerprint=source.fingerprint())
    except Exception as e:  # noqa: BLE001 - a run given it fails on its own; --no-run names the difference
        data["fingerprint"] = f"unavailable: {e}"
    return {"model": model, "data": data}


def inputs_mismatch(
    recorded: dict[str, Any], now: dict[str, Any], ref_doc: dict[str, Any], pd_doc: dict[str, Any]
) -> list[str]:
    """``--no-run``: where this command's ``--model`` / ``--data`` are not what the runs were given
    (``recorded``: OUT/inputs.json), and where a run's own record of its data differs from that: the
    receipt hashes this command's model and names its data, so they must be the runs' (a same-path
    model folder with other weights, or another --data, passed as "aligned" before)."""
    out = []
    rm, nm = recorded.get("model") or {}, now["model"]
    if rm.get("canonical_hash") != nm["canonical_hash"]:
        out.append(
            f"--model {nm['path']}: its weights are not the ones the runs were given (canonical hash "
            f"{rm.get('canonical_hash')!r} then, {nm['canonical_hash']!r} now)"
        )
    rf, nf = rm.get("files_sha256") or {}, nm["files_sha256"]
    if changed := sorted(f for f in set(rf) | set(nf) if rf.get(f) != nf.get(f)):
        out.append(f"--model {nm['path']}: files changed since the runs: {', '.join(changed)}")
    rd, nd = recorded.get("data") or {}, now["data"]
    if (rd.get("path"), rd.get("fingerprint"), rd.get("sha256")) != (nd["path"], nd["fingerprint"], nd.get("sha256")):
        then = f"{rd.get('path') or 'synthetic'} (fingerprint {rd.get('fingerprint')}, sha256 {rd.get('sha256')})"
        out.append(
            f"--data: the runs were given {then}, this command {nd['path'] or 'synthetic'} "
            f"(fingerprint {nd['fingerprint']}, sha256 {nd.get('sha256')})"
        )
    for name, doc in (("reference", ref_doc), ("paddle", pd_doc)):
        got = (doc.get("run") or {}).get("data")
        if got is not None and rd.get("describe") is not None and got != rd["describe"]:
            out.append(f"{name} run: it recorded data {got!r}, align gave it {rd['describe']!r}")
    return out


def first_difference(comps: dict[str, Any], dump_steps: list[int]) -> dict[str, Any] | None:
    """The earliest dump (in step order; gradients, moments, then weights) with a tensor beyond
    tolerance, and its worst such tensor; None when every dump is within tolerance.  ``value`` /
    ``max_abs_diff`` / ``tolerance`` are that tensor's measure apart from its near-eps elements;
    where those are beyond their loose tolerance, ``near_eps`` holds their count, how many are
    beyond it, their largest |diff| and the tolerance, and ``near_eps_only`` says whether they alone
    failed the tensor (a tensor failing on its measure is named before one failing there alone)."""
    order = [(k, f"step{k}_{kind}") for k in sorted(dump_steps) for kind in DUMP_KINDS]
    order.append((None, "final_weights"))
    for step, key in order:
        c = comps.get(key)
        if c is None or c["pass"]:
            continue
        out: dict[str, Any] = {"comparison": key, "step": step, "tolerance": c["tolerance"]}
        if c["beyond_tolerance"]:
            bad = c["beyond_tolerance"]
            if measured := [d for d in bad if not d.get("tolerance_ok", False)]:
                worst = max(measured, key=lambda d: _rank(d.get("value", math.inf)))  # NaN: the worst
            else:  # only near-eps elements are beyond (their loose) tolerance: the largest such difference
                worst = max(bad, key=lambda d: _rank(d.get("near_eps", {}).get("max_abs_diff", 0.0)))
            out.update(tensor=worst["key"], value=worst.get("value"), max_abs_diff=worst.get("max_abs_diff"))
            if worst.get("what") == "shape":
                out["shapes"] = {"reference": worst["ref"], "paddle": worst["cand"]}
            out["tolerance"] = worst.get("tolerance", c["tolerance"])
            if "near_eps" in worst and not worst.get("near_eps_ok", True):
                out.update(near_eps=worst["near_eps"], near_eps_only=bool(worst.get("tolerance_ok")))
        else:
            out.update(tensor=None, only_in_reference=c["only_in_ref"][:5], only_in_paddle=c["only_in_cand"][:5])
        return out
    return None


def _align_data_error(args: argparse.Namespace) -> str | None:
    """What the torch reference cannot take though ``glm52 train`` can (it raised a traceback there):
    a window of one token, and text / chat records, which train tokenizes itself; and data neither
    trainer can open, refused here before either run starts (the reference failed after loading
    the model)."""
    if args.seq_len is not None and args.seq_len < 2:
        return f"--seq-len must be >= 2 for align (the reference trains windows with a target), got {args.seq_len}"
    data = getattr(args, "data", None)
    if data and os.path.isfile(data):
        from ..train.data import text_jsonl_kind

        try:
            kind = text_jsonl_kind(data)
        except ValueError as e:
            return f"--data {data}: {e}"
        if kind:
            return (
                f"--data {data}: {kind} records; align gives both runs the same token data: tokenize it with "
                "glm52 train (it writes OUT/data/train-<name>.seq<L>.npz) and pass that file"
            )
    if data:  # as both trainers open it (records with no label to train on, a bad .npy, ...)
        from ..train.data import data_problem

        if why := data_problem(data, args.model, args.seq_len, args.seed):
            return why if why.startswith("--") else f"--data {why}"
    return None


# the fp32 defaults of the tolerances a user may set (docs/parity.md, "Which tolerance")
_TOLERANCE_DEFAULTS = {
    "loss_atol": LOSS_ATOL,
    "rel_tol": REL_TOL,
    "later_rel_tol": LATER_REL_TOL,
    "final_weight_atol": FINAL_WEIGHT_ATOL,
    "kl_rel_tol": KL_REL_TOL,
}


_BF16 = "; none with --dtype bfloat16"


def _tolerance_error(args: argparse.Namespace) -> str | None:
    """The fp32 tolerances are measured bounds for two fp32 runs; a bf16 pair drifts by the
    reference's own bf16 noise (docs/parity.md: 2.8e-3 in the losses, gradients up to 71% on tiny
    random models), so no default judges it: ``--dtype bfloat16`` takes every tolerance from the
    user (set them from the reference's own bf16-vs-fp32 spread) rather than failing with fp32
    bounds. An fp32 run fills the unset ones with the fp32 defaults."""
    unset = [k for k in (*_TOLERANCE_DEFAULTS, "weight_atol") if getattr(args, k) is None]
    if not _trains_indexer(args):  # no KL curve to compare
        unset = [k for k in unset if k != "kl_rel_tol"]
    if getattr(args, "dtype", None) == "bfloat16" and unset:
        flags = ", ".join("--" + k.replace("_", "-") for k in unset)
        return (
            f"--dtype bfloat16 has no default tolerance (the fp32 ones would fail on bf16 noise): set {flags} "
            "from the reference's own bf16-vs-fp32 spread on your model and data (docs/parity.md, 'Which tolerance')"
        )
    for k, v in _TOLERANCE_DEFAULTS.items():
        if getattr(args, k) is None and getattr(args, "dtype", None) != "bfloat16":
            setattr(args, k, v)
    return None


def _trains_indexer(args: argparse.Namespace) -> bool:
    """Whether the runs train the indexer (an indexer KL to compare): the stage given, else the
    checkpoint's KL weight (train/settings.py's ``indexer_stage_weight``)."""
    stage = getattr(args, "indexer_stage", None)
    return (stage or ("sparse" if saved_indexer_coeff(args.model) > 0 else "none")) != "none"


def _out_in_use(out: str) -> str:
    """The refusal of an ``--out`` another glm52 align (or glm52 train) holds, naming the holder."""
    path = lock_path(out)
    try:
        holder = Path(path).read_text(encoding="utf-8", errors="replace").strip() or "another process"
    except OSError:
        holder = "another process"
    return (
        f"--out {out} is in use by a running glm52 align or train ({holder}; lock {path}): "
        "wait for it to end, stop it, or give another --out"
    )


def run_align(args: argparse.Namespace) -> int:
    """Both runs, every comparison, the receipt; returns the exit code (0 all within tolerance)."""
    from .ckpt_check import check_checkpoints, versions
    from .loss_check import compare_losses, detect_jumps, plot_losses, read_curve

    out = os.path.abspath(args.out)
    if args.data:  # one spelling for both runs, OUT/inputs.json and --no-run (glm52 train records it absolute)
        args.data = os.path.abspath(args.data)
    receipt = os.path.join(out, "receipt")
    ref_out, pd_out = os.path.join(out, "reference"), os.path.join(out, "paddle")
    if bad := output_folder_error(out, "--out"):
        print(f"glm52 align: error: {bad}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"glm52 align: error: --model {args.model}: no config.json", file=sys.stderr)
        return 2
    if refusal := _tolerance_error(args):
        print(f"glm52 align: error: {refusal}", file=sys.stderr)
        return 2
    absent = [] if args.no_run else [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if absent:  # --no-run compares finished runs only
        print(
            f"glm52 align: error: the torch reference needs the reference extra ({' and '.join(absent)} not "
            "installed): pip install torch==2.13.0 transformers==5.23.0 accelerate==1.16.0, or pip install -e "
            "'.[reference]' in a checkout",
            file=sys.stderr,
        )
        return 2
    N = args.steps
    if N < 1:  # glm52 train's --steps 0 only evaluates; align compares training steps
        print(f"glm52 align: error: --steps must be >= 1, got {N}", file=sys.stderr)
        return 2
    dump_steps = sorted({int(k) for k in (args.dump_step or DUMP_STEPS) if 1 <= int(k) <= N})
    bad = [k for k in (args.dump_step or []) if not 1 <= int(k) <= N]
    if bad:
        print(f"glm52 align: error: --dump-step {bad}: outside 1..--steps ({N})", file=sys.stderr)
        return 2
    tols = ("loss_atol", "rel_tol", "later_rel_tol", "weight_atol", "final_weight_atol", "kl_rel_tol", "timeout")
    for name in tols:  # a negative tolerance fails every comparison after both runs; NaN too
        v = getattr(args, name)
        if v is not None and not (v > 0 if name == "timeout" else v >= 0):
            flag = "--" + name.replace("_", "-")
            print(
                f"glm52 align: error: {flag} must be {'> 0' if name == 'timeout' else '>= 0'}, got {v}", file=sys.stderr
            )
            return 2
    if refusal := _align_data_error(args):
        print(f"glm52 align: error: {refusal}", file=sys.stderr)
        return 2
    dumps = {**{f"step{k}": k for k in dump_steps}, "final": N}
    flags = {f"--{name.replace('_', '-')}": getattr(args, name) for name in TRAIN_FLAGS}
    common = ["--model", os.path.abspath(args.model)]
    common += [x for f, v in flags.items() if v is not None for x in (f, str(v))]
    common += ["--indexer-shared-supervision"] if args.indexer_shared_supervision else []
    layout = [x for name in LAYOUT_FLAGS for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    layout += (["--sp"] if args.sp else []) + ["--expert-update", args.expert_update]
    if args.pp_layout:
        layout += ["--pp-layout", args.pp_layout]

    if not args.no_run and (bad := train_line_error([*common, *layout])):
        print(f"glm52 align: error: {bad}", file=sys.stderr)
        return 2
    # only now, with every argument checked: a refused command line leaves OUT's earlier runs as they were
    # OUT held before anything in it is cleared, by the lock glm52 train holds on its --out (train/out_lock.py):
    # a second align given the OUT of a running one cleared that run's folders while its runs wrote there
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(hold_out_folder(out))
    except OutInUse:
        print(f"glm52 align: error: {_out_in_use(out)}", file=sys.stderr)
        return 2
    except OutUnusable as e:  # its lock file cannot be made: logs is a file, a read-only place
        print(f"glm52 align: error: --out {args.out}: {e}", file=sys.stderr)
        return 2
    with lock:
        for d in (receipt,) if args.no_run else (receipt, ref_out, pd_out):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)

        def dumped(root: str) -> list[str]:  # the same dumps from both runs
            return [x for k, s in dumps.items() for x in ("--dump-step", os.path.join(root, f"dump_{k}"), str(s))]

        runs = {
            "reference": [sys.executable, "-m", REFERENCE_MODULE, *common, "--out", ref_out, *dumped(ref_out)],
            "paddle": [sys.executable, "-m", "paddleformers_glm.cli", "train", *common, *layout, "--out", pd_out]
            + ["--no-progress", *dumped(pd_out)],
        }
        verdict: dict[str, Any] = {
            "tool": "glm52 align",
            "created_unix": int(time.time()),
            "model": {"path": os.path.abspath(args.model)},
            "layout": {k: getattr(args, k) for k in (*LAYOUT_FLAGS, "sp", "pp_layout")},
            "training": {name: getattr(args, name) for name in TRAIN_FLAGS},
            "dump_steps": dump_steps,
            "commands": {k: " ".join(v) for k, v in runs.items()},
            "runs": {name: {"reused": True} for name in runs} if args.no_run else {},
            "comparisons": {},
        }
        if args.indexer_loss_coeff is None:
            verdict["training"]["indexer_loss_coeff"] = saved_indexer_coeff(args.model)
        verdict["training"]["indexer_shared_supervision"] = bool(args.indexer_shared_supervision)
        inputs = run_inputs(args)  # hashed before the runs start: the model and data they are given
        verdict["model"].update({k: inputs["model"][k] for k in ("files_sha256", "canonical_hash")})
        verdict["data"] = inputs["data"]
        inputs_file = os.path.join(out, INPUTS_FILE)
        if not args.no_run:
            write_json_atomic(inputs_file, inputs, indent=1)
        verdict["versions"] = found = versions(("paddle", "torch", "transformers", "numpy", "safetensors"))
        try:
            git = ["git", "-C", str(ROOT), "rev-parse", "HEAD"]
            found["git_commit"] = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found["git_commit"] = ""
        write_json_atomic(os.path.join(receipt, "versions.json"), found, indent=1)
        for name, cmd in {} if args.no_run else runs.items():
            print(f"[glm52 align] {name}: {' '.join(cmd)}", flush=True)
            log, t0 = os.path.join(out, f"{name}.log"), time.monotonic()
            with open(log, "w", encoding="utf-8") as f:
                f.write("$ " + " ".join(cmd) + "\n")
                f.flush()
                try:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    f.write(f"\n[glm52 align] stopped after {args.timeout} s\n")
                    rc = 124
            secs = time.monotonic() - t0
            verdict["runs"][name] = {"exit_code": rc, "seconds": round(secs, 1), "log": log}
            print(f"[glm52 align] {name}: exit {rc} in {secs:.0f} s", flush=True)
            if rc != 0:
                with open(log, encoding="utf-8", errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
                print(f"[glm52 align] {name} failed; last lines of {log}:\n{tail}", file=sys.stderr)
                verdict.update(exit_code=2, result="a run failed")
                write_json_atomic(os.path.join(receipt, "verdict.json"), verdict, indent=1)
                return 2

        comps = verdict["comparisons"]

        def unusable(result: str, lines: list[str], **record: Any) -> int:  # the runs' outputs cannot be compared
            print(f"glm52 align: error: {result}:", file=sys.stderr)
            for line in lines:
                print(f"  {line}", file=sys.stderr)
            verdict.update(exit_code=2, result=result, **record)
            write_json_atomic(os.path.join(receipt, "verdict.json"), verdict, indent=1)
            return 2

        ref_loss, pd_loss = os.path.join(ref_out, "loss.json"), os.path.join(pd_out, "loss.json")
        outputs = [ref_loss, pd_loss] + [
            os.path.join(root, f"dump_{tag}", kind, "model.safetensors")
            for root in (ref_out, pd_out)
            for tag in dumps
            for kind in (DUMP_KINDS if tag != "final" else ("weights",))
        ]
        if missing := [f for f in outputs if not os.path.isfile(f)]:  # e.g. --no-run on runs with other dump steps
            return unusable("a run's outputs are missing", missing, missing_outputs=missing)
        for f, dst in ((ref_loss, "reference_loss.json"), (pd_loss, "paddle_loss.json")):
            shutil.copyfile(f, os.path.join(receipt, dst))
        try:
            ref_doc, pd_doc = (read_json(f, "the loss record", unique_keys=True) for f in (ref_loss, pd_loss))
        except ValueError as e:  # not JSON, not an object, a key twice (json would keep its last value)
            return unusable("a run's loss record is unusable", [str(e)])
        # the versions each run recorded of itself (verdict "versions" is this command's environment)
        verdict["run_versions"] = {"reference": ref_doc.get("versions"), "paddle": pd_doc.get("versions")}
        if bad := record_errors(ref_loss, ref_doc, pd_loss, pd_doc, N):
            return unusable("the runs in OUT are not a torch reference run and a Paddle run of --steps", bad)
        if args.no_run:
            if not os.path.isfile(inputs_file):
                why = f"{inputs_file}: missing: OUT was made by a glm52 align that recorded no model or data hashes"
                return unusable("--no-run: OUT does not record its runs' inputs", [why, "rerun without --no-run"])
            try:
                recorded = read_json(inputs_file, "the runs' inputs")
            except ValueError as e:
                return unusable("--no-run: OUT does not record its runs' inputs", [str(e), "rerun without --no-run"])
            other = recorded_settings_mismatch(args, ref_doc, pd_doc) + inputs_mismatch(
                recorded, inputs, ref_doc, pd_doc
            )
            if other:  # the receipt's layout, training settings, model and data come from this command line
                return unusable(
                    "--no-run: the runs in OUT were not made with these settings", other, settings_mismatch=other
                )
        try:  # a loss a run could not compute (null, with the record's "nonfinite" list) makes it a failed run
            for f, doc in ((ref_loss, ref_doc), (pd_loss, pd_doc)):
                for key in ("losses", "mtp_losses", "indexer_losses", "grad_norms", "lrs"):
                    if key in doc or key != "indexer_losses":  # one run without indexer losses: a difference, below
                        read_curve(f, key)
        except ValueError as e:
            return unusable("a run's loss record is not usable", [str(e)])
        margins = ref_doc.get("topk_min_gaps") or []
        verdict["near_ties"] = near_ties(margins)
        kl_rel = args.kl_rel_tol if args.kl_rel_tol is not None else 0.0  # bf16 without a KL to train: unset
        curves = [("losses", "loss.png"), ("mtp_losses", "mtp_loss.png")]
        if "indexer_losses" in ref_doc or "indexer_losses" in pd_doc:
            curves.append(("indexer_losses", "indexer_loss.png"))
        for key, png in curves:
            try:
                a, b = read_curve(ref_loss, key), read_curve(pd_loss, key)
            except ValueError:
                if key != "indexer_losses":
                    raise
                a, b = ref_doc.get(key, []), pd_doc.get(key, [])  # one side lacks it: fails below
            if key == "mtp_losses" and not a and not b:
                continue
            if key == "indexer_losses":  # relative: the KL is as small as --loss-atol
                c = compare_losses(b, a, steps=N, atol=0.0, rtol=kl_rel)
                rel = (_rel_diff(y, x) for x, y in zip(a[:N], b[:N]))
                c.update(kl_rel_tol=kl_rel, kl_max_rel_diff=max(rel, key=_rank, default=0.0))
            else:
                c = compare_losses(b, a, steps=N, atol=args.loss_atol)
            c["jumps"] = [explain_jump(j, margins) for j in detect_jumps(b, a)]
            c["pass"] = c["enough_steps"] and c["length_match"] and c["consistent_steps"] == N
            c["diff_per_step"] = [abs(x - y) for x, y in zip(a, b)]
            try:
                c["plot"] = plot_losses(b, a, os.path.join(receipt, png), labels=("paddle", "torch reference"))
            except ImportError as e:  # the plot extra is optional; the numbers are the verdict
                c["plot"] = f"not drawn: {e}"
            comps[key] = c
        # the rate of every update (a schedule that differs shows here, not only as weights a fraction of
        # lr apart: the weight tolerance is itself 0.1 x the rates) and the pre-clip gradient norm, the
        # whole gradient the dumps compare tensor by tensor, every step (what clips each update)
        for key, rtol in (("lrs", LR_REL_TOL), ("grad_norms", args.later_rel_tol)):
            c = compare_losses(read_curve(pd_loss, key), read_curve(ref_loss, key), N, 0.0, rtol)
            c.update(jumps=[], rel_tol=rtol)
            c["pass"] = c["enough_steps"] and c["length_match"] and c["consistent_steps"] == N
            comps[key] = c
        more = {"indexer_recall": compare_indexer(ref_doc, pd_doc, N, args.loss_atol, kl_rel)}
        more["idle_experts"] = compare_idle_experts(ref_doc, pd_doc)
        comps.update({k: c for k, c in more.items() if c is not None})
        lrs = [float(x) for x in ref_doc["lrs"]]
        weight_atol = {
            k: args.weight_atol if args.weight_atol is not None else WEIGHT_REL_LR * math.fsum(lrs[:k])
            for k in dump_steps
        }
        verdict["tolerances"] = {
            "loss_atol": args.loss_atol,
            "lr_rel_tol": LR_REL_TOL,
            "grad_norm_rel_tol": args.later_rel_tol,
            "rel_tol": args.rel_tol,
            "later_rel_tol": args.later_rel_tol,
            "kl_rel_tol": args.kl_rel_tol,
            **{f"step{k}_weight_atol": v for k, v in weight_atol.items()},
            "final_weight_atol": args.final_weight_atol,
            "indexer_rel_tol": max(args.later_rel_tol, INDEXER_REL_TOL),
            "near_eps_sqrt_v": NEAR_EPS_SQRT_V,
            "near_eps_weight_atol": f"{NEAR_EPS_REL_LR} x the learning rates of steps 1..K",
        }
        hashes: dict[str, Any] = {}
        for tag, step in dumps.items():
            kinds = DUMP_KINDS if tag != "final" else ("weights",)
            for kind in kinds:
                r, p = os.path.join(ref_out, f"dump_{tag}", kind), os.path.join(pd_out, f"dump_{tag}", kind)
                if tag == "final":
                    t: dict[str, Any] = {"atol": args.final_weight_atol}
                    if dump_steps:  # an element whose moment was below eps at the last dump drifts on noise
                        k = max(dump_steps)
                        v_ref = os.path.join(ref_out, f"dump_step{k}", "exp_avg_sq")
                        t["near_eps"] = (v_ref, 1.0 - ADAM_BETA2**k, NEAR_EPS_REL_LR * math.fsum(lrs[:step]))
                elif kind == "weights":
                    v_ref = os.path.join(ref_out, f"dump_{tag}", "exp_avg_sq")
                    loose = NEAR_EPS_REL_LR * math.fsum(lrs[:step])
                    t = {"atol": weight_atol[step], "near_eps": (v_ref, 1.0 - ADAM_BETA2**step, loose)}
                else:
                    rel = args.rel_tol if step == 1 else args.later_rel_tol
                    t = {"rel_tol": rel, "loose_rel": (".indexer.", max(rel, INDEXER_REL_TOL))}
                    t["noise_floor"] = NOISE_FLOOR**2 if kind == "exp_avg_sq" else NOISE_FLOOR
                c = compare_dumps(r, p, **t)
                ck = check_checkpoints(r, p)
                write_json_atomic(os.path.join(receipt, f"check_ckpt_{tag}_{kind}.json"), ck, indent=1)
                rh, ch = ck["ref"].get("native_hash"), ck["cand"].get("native_hash")
                c["check_ckpt"] = {"result": ck["result"], "counts": ck.get("counts"), "ref_hash": rh, "cand_hash": ch}
                if ck.get("counts", {}).get("structural"):
                    c["pass"] = False  # names must match one to one
                hashes[f"{tag}/{kind}"] = {"reference": rh, "paddle": ch}
                comps[f"{tag}_{kind}"] = c
        verdict["checkpoint_hashes"] = hashes
        ok = all(c["pass"] for c in comps.values())
        verdict.update(exit_code=0 if ok else 1, result="aligned" if ok else "not aligned")
        verdict["first_difference"] = first_difference(comps, dump_steps)

        verdict["summary"], lines = {}, []
        for k, c in comps.items():
            if "first_mismatch_step" in c:
                s = {x: c[x] for x in ("steps_with_idle", "max_idle_per_step", "first_mismatch_step")}
                where = "the same every step" if c["pass"] else f"first differ at step {c['first_mismatch_step']}"
                if not c["pass"] and c["first_mismatch_step"] is None:  # equal over their common steps
                    where = "equal over their common steps"
                if not c["pass"] and c.get("reason"):
                    where += f"; {c['reason']}"
                idle, most = c["steps_with_idle"], c["max_idle_per_step"]["reference"]
                detail = f"steps with idle experts: reference {idle['reference']}/{N}, paddle {idle['paddle']}/{N}, "
                detail += f"at most {most} per step; {where}"
            elif "consistent_steps" in c:
                s = {"consistent_steps": c["consistent_steps"], "max_diff": c["max_diff"], "jumps": len(c["jumps"])}
                detail = f"consistent_steps {c['consistent_steps']}/{N} max_diff {c['max_diff']:.3g} jumps {s['jumps']}"
                if "kl_rel_tol" in c:  # the KL's relative measure and tolerance (per layer for indexer_recall)
                    s.update(kl_max_rel_diff=c["kl_max_rel_diff"], kl_rel_tol=c["kl_rel_tol"])
                    detail += (
                        f" kl max |diff| / |reference| {c['kl_max_rel_diff']:.3g} (kl-rel-tol {c['kl_rel_tol']:g})"
                    )
                if not c["pass"] and c.get("reason"):
                    detail += f"; {c['reason']}"
                for j in c["jumps"]:
                    why = f"reference top-k margins {j['reference_min_gaps']}" if "reference_min_gaps" in j else ""
                    if "reference_min_nonzero_gaps" in j:
                        why += f", smallest nonzero {j['reference_min_nonzero_gaps']}"
                    detail += (
                        f"\n    jump at step {j['step']}: |diff| {j['diff']:.3g} ({why or 'no reference margins'})"
                    )
            else:
                s = {"worst": c["worst"], "tolerance": c["tolerance"]}
                tol = c["worst"].get("tolerance", c["tolerance"])
                detail = f"worst {c['worst']['value']:.3g} ({c['worst']['key']}) tolerance {tol:g}"
                near = c.get("near_eps")
                if near and not near.get("pass", True):  # the elements held to the loose near-eps tolerance
                    why = (
                        f"near-eps elements: max |diff| {near['max_abs_diff']:.3g} ({near['key']}) beyond their "
                        f"tolerance {near['tolerance']:g}, {near['beyond_tolerance']} of {near['elements']} elements"
                    )
                    ratio = c["worst"].get("ratio")
                    if ratio is not None and ratio <= 1.0:  # they alone fail it: named first
                        detail = f"{why}; the other elements: {detail}"
                    else:
                        detail = f"{detail}; {why}"
                    s["near_eps"] = near
            if not c["pass"] and c.get("reason"):
                s["reason"] = c["reason"]
            verdict["summary"][k] = {"pass": c["pass"], **s}
            lines.append(f"[glm52 align] {'pass' if c['pass'] else 'FAIL'} {k}: {detail}")
        write_json_atomic(os.path.join(receipt, "verdict.json"), verdict, indent=1)  # strict JSON: inf ratios -> null
        print("\n".join(lines))
        first = verdict["first_difference"]
        if first is not None:
            at = f"after update {first['step']}" if first["step"] is not None else "after the last update"
            what = (
                first["tensor"]
                or f"names on one side only {first.get('only_in_reference')} {first.get('only_in_paddle')}"
            )
            if first.get("shapes"):  # another shape: no value to compare
                size = f" shape reference {first['shapes']['reference']} paddle {first['shapes']['paddle']}"
            else:
                size = f" {first['value']:.3g} (tolerance {first['tolerance']:g})" if first["tensor"] else ""
            if n := first.get("near_eps"):  # its near-eps elements are beyond their loose tolerance
                loose = f" near-eps elements max |diff| {n['max_abs_diff']:.3g} (tolerance {n['tolerance']:g}"
                loose += f", {n['beyond_tolerance']} of {n['elements']} elements beyond it)"
                size = loose if first.get("near_eps_only") else f"{size} and{loose}"
            print(f"[glm52 align] first dump difference {at}: {first['comparison']} {what}{size}")
        print(f"[glm52 align] {verdict['result']}: receipt {receipt}")
        return int(verdict["exit_code"])


def register_align(sub: argparse._SubParsersAction) -> None:
    """Add ``align`` to the glm52 CLI (see cli.COMMANDS)."""
    p = sub.add_parser(
        "align",
        help="train with Paddle and with the torch reference, prove they agree (losses, grads, moments, weights)",
        description="Runs the torch reference (python -m paddleformers_glm.parity.reference.train) and glm52 train on the same checkpoint and data, compares "
        "losses, MTP losses, step-1 gradients / AdamW moments / weights and the final weights, writes OUT/receipt/.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (official HF layout)")
    p.add_argument("--out", required=True, help="output folder (reference/, paddle/, receipt/)")
    g = p.add_argument_group("Paddle layout (default: the headline TP2 x PP2 + SP)")
    for name, default in LAYOUT_FLAGS.items():
        choices = [1, 2] if name == "sharding_stage" else None
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, choices=choices)
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--pp-layout")
    add_expert_update_argument(g)
    g = p.add_argument_group("training (same for both runs)")
    add_step_arguments(g)
    g.add_argument("--data", help=".npy / .bin / .jsonl token data both runs read (default: synthetic)")
    add_dtype_argument(g, "both runs; docs/parity.md says how far they drift apart")
    add_indexer_arguments(g)
    p.set_defaults(steps=100, seq_len=32, lr=1e-4, warmup_steps=10)  # align's own: a longer, gentler run
    g.add_argument(
        "--dump-step",
        type=int,
        nargs="+",
        metavar="K",
        help=f"updates after which both runs dump grads, moments and weights for comparison "
        f"(default {' '.join(map(str, DUMP_STEPS))}; the last update's weights are always compared)",
    )
    g = p.add_argument_group("tolerances (docs/parity.md)")
    g.add_argument(
        "--loss-atol",
        type=float,
        help=f"per-step |loss difference| (losses and MTP; the indexer's recall; default {LOSS_ATOL}{_BF16})",
    )
    g.add_argument(
        "--kl-rel-tol",
        type=float,
        help=f"indexer KL curve and per-layer KLs: per-step |diff| / |reference| (default {KL_REL_TOL}"
        f"{_BF16} and the indexer trained)",
    )
    g.add_argument(
        "--rel-tol", type=float, help=f"step-1 grads / moments: max|diff| / max|ref| (default {REL_TOL}{_BF16})"
    )
    g.add_argument(
        "--later-rel-tol",
        type=float,
        help=f"the same after updates 2, 3, ... (--dump-step), and every step's gradient norm |diff| / |ref| "
        f"(default {LATER_REL_TOL}{_BF16})",
    )
    g.add_argument(
        "--weight-atol",
        type=float,
        help=f"step-K updated weights, absolute (default: 0.1 x the learning rates of steps 1..K summed{_BF16})",
    )
    g.add_argument(
        "--final-weight-atol", type=float, help=f"last-step weights, absolute (default {FINAL_WEIGHT_ATOL}{_BF16})"
    )
    g.add_argument("--timeout", type=float, help="seconds per run (default: none)")
    g.add_argument("--no-run", action="store_true", help="compare the runs already in OUT (e.g. with other tolerances)")
    p.set_defaults(func=run_align)
