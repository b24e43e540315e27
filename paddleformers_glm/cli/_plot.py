"""What ``glm52 plot-experts`` and ``glm52 plot-indexer`` share: the ``OUT`` argument (a training
output folder or its loss.json), reading one block of that loss.json, and the two-panel figure
written atomically as a PNG.  matplotlib is imported only when drawing (the ``plot`` extra)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .._io import atomic_path, read_json
from ._common import output_file_error

PLOT_EXTRA_HINT = "plotting needs matplotlib: pip install 'paddleformers_glm[plot]'"
# left a heatmap, right curves
TWO_PANELS = {"figsize": (13, 4.8), "gridspec_kw": {"width_ratios": [1.3, 1]}}


def register_plot(sub: argparse._SubParsersAction, name: str, run: Any, png_name: str, **text: str) -> None:
    """Add the plot subcommand ``name`` (see cli.COMMANDS): ``OUT`` and ``--png`` (default ``OUT/png_name``)."""
    p = sub.add_parser(name, **text)
    p.add_argument("out", help="training output folder (or its loss.json)")
    p.add_argument("--png", help=f"where to write the PNG (default: OUT/{png_name})")
    p.set_defaults(func=run)


def loss_json_of(out: str) -> str:
    return os.path.join(out, "loss.json") if os.path.isdir(out) else out


def png_error(png: str, loss_json: str) -> str | None:
    """Why ``png`` cannot take the figure (checked before drawing: not over the loss record it reads)."""
    return output_file_error(png, "--png", [loss_json])


def read_block(loss_json: str, key: str, required: tuple[str, ...], absent: str) -> dict[str, Any]:
    """``loss_json``'s block ``key``, which must hold ``required``; ``absent`` says why a run has none."""
    block = read_json(loss_json, "the loss record").get(key)
    if not block:
        raise ValueError(f"{loss_json}: no {key!r} block ({absent})")
    for k in required:
        if k not in block:
            raise ValueError(f"{loss_json}: {key!r} lacks {k!r}")
    return block


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (raises ImportError without the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, png: str, dpi: int = 110) -> str:
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    pyplot().close(fig)
    return png
