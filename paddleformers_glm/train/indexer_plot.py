"""``glm52 plot-indexer OUT``: how well the DSA indexer selects, drawn from ``OUT/loss.json``.

Left: a layer x step heatmap of the top-k recall (the share of a layer's dense attention mass on
the keys its indexer selected; 1 = the selection misses nothing).  Right: the indexer KL per layer
per step (log scale), each stage's first step marked.  A warm-up should show recall rising and KL
falling.  ``OUT/indexer.json`` gets the same numbers by layer (written first, so that a machine
without matplotlib still gets them).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._io import is_int
from ..cli._plot import (
    MAX_INDEX,
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

__all__ = ["indexer_curves", "plot_indexer", "register_plot_indexer"]


def indexer_curves(loss_json: str) -> dict[str, Any]:
    """The run's indexer numbers by layer: ``recall_by_layer`` / ``kl_by_layer`` (layer id as a
    string -> per step), ``mean_recall`` per step and its first and last value."""
    absent = "a run with --indexer-stage none, or of a model without a DSA indexer?"
    block = read_block(loss_json, "indexer", ("layers", "steps", "kl", "recall"), absent)
    layers = index_list(loss_json, "indexer.layers", block["layers"], "layer numbers", unique=True)
    if block["steps"] == []:
        raise ValueError(f"{loss_json}: 'indexer' has no steps (the run trained no indexer step)")
    steps = index_list(loss_json, "indexer.steps", block["steps"], "step numbers")
    n, m = len(steps), len(layers)
    kl, recall = (
        number_rows(loss_json, f"indexer.{key}", block[key], (n, "step in 'steps'"), (m, "layer in 'layers'"))
        for key in ("kl", "recall")
    )
    mean = block.get("mean_recall")
    if mean is None:
        mean = [sum(r) / len(r) for r in recall]
    elif not isinstance(mean, list) or len(mean) != n:
        raise shape_error(loss_json, "indexer.mean_recall", f"an array of {n} numbers (one per step in 'steps')", mean)
    else:
        mean = [number(loss_json, f"indexer.mean_recall[{i}]", x, null=True) for i, x in enumerate(mean)]
    stages = block.get("stages", [])
    if not isinstance(stages, list):
        raise shape_error(
            loss_json, "indexer.stages", "an array of {'stage': name, 'first_step': step} objects", stages
        )
    for i, st in enumerate(stages):
        where = f"indexer.stages[{i}]"
        if not isinstance(st, dict):
            raise shape_error(loss_json, where, "an object with 'stage' and 'first_step'", st)
        for k in ("stage", "first_step"):
            if k not in st:
                raise ValueError(f"{loss_json}: {where!r} lacks {k!r}")
        if not isinstance(st["stage"], str):
            raise shape_error(loss_json, f"{where}.stage", "a stage name (a string)", st["stage"])
        if not is_int(st["first_step"]) or not 0 <= st["first_step"] < MAX_INDEX:
            raise shape_error(loss_json, f"{where}.first_step", "a step number (an integer >= 0)", st["first_step"])
    return {
        "source": os.path.abspath(loss_json),
        "stage": block.get("stage"),
        "stages": stages,
        "layers": layers,
        "steps": steps,
        "recall_by_layer": {str(i): [row[j] for row in recall] for j, i in enumerate(layers)},
        "kl_by_layer": {str(i): [row[j] for row in kl] for j, i in enumerate(layers)},
        "mean_recall": list(mean),
        "recall_first_last": {"first": mean[0], "last": mean[-1]},
    }


def plot_indexer(curves: dict[str, Any], png: str) -> str:
    """Draw the recall heatmap and KL curves of :func:`indexer_curves` into ``png`` (atomically)."""
    plt = pyplot()
    import numpy as np

    layers, steps = curves["layers"], curves["steps"]
    recall = np.asarray([curves["recall_by_layer"][str(i)] for i in layers], dtype=np.float64)  # [layers, steps]
    fig, (ax_h, ax_c) = plt.subplots(1, 2, **TWO_PANELS)
    im = ax_h.imshow(recall, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax_h.set_yticks(range(len(layers)), [str(i) for i in layers])
    tick = max(1, len(steps) // 10)
    ax_h.set_xticks(range(0, len(steps), tick), [str(s) for s in steps[::tick]])
    first, last = curves["recall_first_last"]["first"], curves["recall_first_last"]["last"]
    ax_h.set(xlabel="step", ylabel="layer", title=f"top-k recall (mean {first:.3f} -> {last:.3f})")
    fig.colorbar(im, ax=ax_h, label="attention mass on the selected keys")
    for i in layers:
        kl = np.asarray(curves["kl_by_layer"][str(i)], dtype=np.float64)
        ax_c.plot(steps, np.maximum(kl, 1e-12), lw=1.2, label=f"layer {i}")
    for st in curves["stages"][1:]:
        ax_c.axvline(st["first_step"], ls="--", color="gray", lw=1)
    names = " -> ".join(st["stage"] for st in curves["stages"]) or str(curves.get("stage"))
    ax_c.set(yscale="log", xlabel="step", ylabel="indexer KL", title=f"indexer KL per layer ({names})")
    ax_c.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"indexer of run {curves['source']}", fontsize=10)
    return save_png(fig, png)


def _run(args: argparse.Namespace) -> int:
    from .._io import write_json_atomic
    from ..cli._common import output_file_error, outputs_clash

    loss_json = loss_json_of(args.out)
    folder = os.path.dirname(os.path.abspath(loss_json))
    png = args.png or os.path.join(folder, "indexer.png")
    json_file = os.path.join(folder, "indexer.json")
    bad = png_error(png, loss_json) or output_file_error(json_file, "OUT", [loss_json])
    if bad := bad or outputs_clash(("OUT/indexer.json", json_file), ("--png", png)):
        print(f"plot-indexer: {bad}", file=sys.stderr)
        return 2
    try:
        curves = indexer_curves(loss_json)
        write_json_atomic(json_file, curves)  # first: a machine without matplotlib still gets the numbers
        plot_indexer(curves, png)
    except (ImportError, OSError, ValueError) as e:
        why = f"wrote {json_file}; {PLOT_EXTRA_HINT}" if isinstance(e, ImportError) else plot_error_line(e, png)
        print(f"plot-indexer: {why}", file=sys.stderr)
        return 2
    first, last = curves["recall_first_last"]["first"], curves["recall_first_last"]["last"]
    print(f"plot-indexer: wrote {png} (mean recall {first:.4f} -> {last:.4f})")
    return 0


def register_plot_indexer(sub: argparse._SubParsersAction) -> None:
    register_plot(
        sub,
        "plot-indexer",
        _run,
        "indexer.png",
        help="draw a training run's DSA indexer curves (layer x step recall heatmap, KL per layer) as a PNG",
        description="Read OUT/loss.json of `glm52 train --indexer-stage ...`; write OUT/indexer.json and OUT/indexer.png.",
    )
