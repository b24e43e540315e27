"""``glm52 plot-experts OUT``: the expert load of a training run, drawn from ``OUT/loss.json``: a layer x
expert heatmap and the max/mean balance curve (docs/model.md, "MoE balancing").
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._io import is_int
from ..cli._plot import (
    PLOT_EXTRA_HINT,
    TWO_PANELS,
    index_list,
    loss_json_of,
    number,
    number_rows,
    plot_error_line,
    png_error,
    pyplot,
    read_block,
    register_plot,
    save_png,
    shape_error,
)

__all__ = ["plot_expert_load", "read_expert_load", "register_plot_experts"]


def reference_hint(loss_json: str) -> str:
    """What to plot instead of a ``glm52 align`` reference run's loss.json."""
    folder = os.path.dirname(os.path.abspath(loss_json))
    paddle = os.path.join(os.path.dirname(folder), "paddle") if os.path.basename(folder) == "reference" else None
    instead = f"glm52 plot-experts {paddle or 'ALIGN_OUT/paddle'}"
    return (
        "this is a reference run's record (glm52 align's torch side records only 'idle_experts' and "
        f"'bias_update_rate', no load counts); plot the Paddle run's loss.json instead: {instead}"
    )


def read_expert_load(loss_json: str) -> dict[str, Any]:
    """``loss_json``'s ``expert_load`` block, every value the plot reads checked (one-line ValueError
    naming the file, the key and expected vs found): ``layers`` [L] and ``steps`` [S] (integers),
    ``max_mean_ratio`` [S][L] and ``load_total`` [L][E] (numbers), ``bias_update_rate`` (a number)."""
    required = ("layers", "steps", "max_mean_ratio", "load_total")
    absent = "a run of a model without MoE routers?"
    el = read_block(loss_json, "expert_load", required, absent, reference_hint(loss_json))
    layers = index_list(loss_json, "expert_load.layers", el["layers"], "MoE layer numbers", unique=True)
    steps = index_list(loss_json, "expert_load.steps", el["steps"], "step numbers")
    num_experts = el.get("num_experts")
    experts = num_experts if is_int(num_experts) and num_experts > 0 else None
    if "num_experts" in el and experts is None:
        raise shape_error(loss_json, "expert_load.num_experts", "an integer >= 1", num_experts)
    load = number_rows(
        loss_json, "expert_load.load_total", el["load_total"], (len(layers), "MoE layer in 'layers'"),
        (experts, "expert"), null=False, min_value=0.0,
    )  # fmt: skip
    ratio = number_rows(
        loss_json, "expert_load.max_mean_ratio", el["max_mean_ratio"], (len(steps), "step in 'steps'"),
        (len(layers), "MoE layer in 'layers'"),
    )  # fmt: skip
    rate = number(loss_json, "expert_load.bias_update_rate", el.get("bias_update_rate", 0.0))
    return {"layers": layers, "steps": steps, "load_total": load, "max_mean_ratio": ratio, "bias_update_rate": rate}


def plot_expert_load(loss_json: str, png: str) -> str:
    """Draw the heatmap and balance curve of ``loss_json`` into ``png`` (written atomically)."""
    el = read_expert_load(loss_json)  # before matplotlib: a malformed record is named without the extra
    plt = pyplot()
    import numpy as np

    run = os.path.basename(os.path.dirname(os.path.abspath(loss_json)))
    load = np.asarray(el["load_total"], dtype=np.float64)  # [layers, experts]
    mean = load.mean(axis=1, keepdims=True)
    rel = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)
    ratio = np.asarray(el["max_mean_ratio"], dtype=np.float64)  # [steps, layers]
    steps = el["steps"]
    fig, (ax_h, ax_c) = plt.subplots(1, 2, **TWO_PANELS)
    im = ax_h.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest")
    ax_h.set_yticks(range(len(el["layers"])), [str(i) for i in el["layers"]])
    ax_h.set(xlabel="expert", ylabel="layer", title=f"tokens per expert / layer mean, steps {steps[0]}-{steps[-1]}")
    fig.colorbar(im, ax=ax_h, label="load / mean")
    for j in range(ratio.shape[1]):
        ax_c.plot(steps, ratio[:, j], lw=0.7, alpha=0.5)
    ax_c.plot(steps, ratio.mean(axis=1), lw=2.2, color="black", label="mean over MoE layers")
    ax_c.axhline(1.0, ls="--", color="gray", lw=1)
    rate = el["bias_update_rate"]
    ax_c.set(xlabel="step", ylabel="max / mean expert load", title=f"balance (bias update rate {rate:g})")
    ax_c.legend(loc="upper right")
    fig.suptitle(f"expert load of run {run!r} ({loss_json})", fontsize=10)
    return save_png(fig, png)


def _run(args: argparse.Namespace) -> int:
    loss_json = loss_json_of(args.out)
    png = args.png or os.path.join(os.path.dirname(os.path.abspath(loss_json)), "expert_load.png")
    if bad := png_error(png, loss_json):
        print(f"plot-experts: {bad}", file=sys.stderr)
        return 2
    try:
        plot_expert_load(loss_json, png)
    except (ImportError, OSError, ValueError) as e:
        print(
            f"plot-experts: {PLOT_EXTRA_HINT if isinstance(e, ImportError) else plot_error_line(e, png)}",
            file=sys.stderr,
        )
        return 2
    print(f"plot-experts: wrote {png}")
    return 0


def register_plot_experts(sub: argparse._SubParsersAction) -> None:
    register_plot(
        sub,
        "plot-experts",
        _run,
        "expert_load.png",
        help="draw a training run's expert load (layer x expert heatmap, balance curve) as a PNG",
        description="Read OUT/loss.json of `glm52 train` and write OUT/expert_load.png.",
    )
