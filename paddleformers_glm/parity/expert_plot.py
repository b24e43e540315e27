"""``glm52 plot-experts OUT``: the expert load of a training run, drawn from ``OUT/loss.json``: a layer x
expert heatmap and the max/mean balance curve (docs/model.md, "MoE balancing").
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli._plot import (
    PLOT_EXTRA_HINT,
    TWO_PANELS,
    loss_json_of,
    png_error,
    pyplot,
    read_block,
    register_plot,
    save_png,
)

__all__ = ["plot_expert_load", "register_plot_experts"]


def plot_expert_load(loss_json: str, png: str) -> str:
    """Draw the heatmap and balance curve of ``loss_json`` into ``png`` (written atomically)."""
    plt = pyplot()
    import numpy as np

    required = ("layers", "steps", "max_mean_ratio", "load_total")
    el = read_block(loss_json, "expert_load", required, "a run of a model without MoE routers?")
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
    rate = el.get("bias_update_rate", 0.0)
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
        print(f"plot-experts: {PLOT_EXTRA_HINT if isinstance(e, ImportError) else e}", file=sys.stderr)
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
