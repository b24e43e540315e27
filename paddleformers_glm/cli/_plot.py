"""What ``glm52 plot-experts`` and ``glm52 plot-indexer`` share: the ``OUT`` argument (a training
output folder or its loss.json), reading one block of that loss.json, and the two-panel figure
written atomically as a PNG.  matplotlib is imported only when drawing (the ``plot`` extra)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from .._io import WriteError, atomic_path, dumps_json, is_int, read_json
from ._common import output_file_error

PLOT_EXTRA_HINT = "plotting needs matplotlib (the plot extra): pip install 'matplotlib>=3.7', or pip install -e '.[plot]' in a checkout"
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


def read_block(
    loss_json: str, key: str, required: tuple[str, ...], absent: str, reference: str | None = None
) -> dict[str, Any]:
    """``loss_json``'s block ``key``, a JSON object which must hold ``required``; ``absent`` says why a
    run has none, ``reference`` (if given) what to do instead when the record is a ``glm52 align``
    reference run's (top-level ``"reference"``), whose block lacks a required key."""
    doc = read_json(loss_json, "the loss record")
    block = doc.get(key)
    if block is None or block == {}:
        raise ValueError(f"{loss_json}: no {key!r} block ({absent})")
    if not isinstance(block, dict):
        raise shape_error(loss_json, key, "a JSON object", block)
    for k in required:
        if k not in block:
            if reference is not None and "reference" in doc:
                raise ValueError(f"{loss_json}: {key!r} lacks {k!r}: {reference}")
            raise ValueError(f"{loss_json}: {key!r} lacks {k!r}")
    return block


# The readers below check one value of a loss.json block and raise a one-line ValueError naming the
# file, the key path (``expert_load.max_mean_ratio[2]``) and what was expected against what was found.

MAX_INDEX = 2**53  # a step or layer number past this is not exact as a float (the plot's axes)


def describe(value: Any) -> str:
    """``value`` (parsed JSON) in a few words for an error message."""
    if value is None or isinstance(value, bool):
        return dumps_json(value, indent=None)
    if isinstance(value, (int, float)):
        text = repr(value)
        return f"the number {text if len(text) <= 24 else text[:21] + '...'}"
    if isinstance(value, str):
        return f"the string {dumps_json(value[:40] + ('...' if len(value) > 40 else ''), indent=None)}"
    if isinstance(value, list):
        return f"an array of {_count(len(value), 'item')}" if value else "an empty array"
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    return type(value).__name__


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def shape_error(loss_json: str, path: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"{loss_json}: {path!r} must be {expected}, got {describe(got)}")


def index_list(loss_json: str, path: str, value: Any, what: str, *, unique: bool = False) -> list[int]:
    """A non-empty array of non-negative integers (step or layer numbers), ``what`` naming them."""
    if not isinstance(value, list) or not value:
        raise shape_error(loss_json, path, f"a non-empty array of {what} (integers >= 0)", value)
    for i, x in enumerate(value):
        if not is_int(x) or not 0 <= x < MAX_INDEX:
            raise shape_error(loss_json, f"{path}[{i}]", f"one of the {what} (an integer >= 0)", x)
    if unique and len(set(value)) != len(value):
        dup = next(x for i, x in enumerate(value) if x in value[:i])
        raise ValueError(f"{loss_json}: {path!r} must not repeat a number, got {dup} twice")
    return list(value)


def _number(loss_json: str, path: str, x: Any, null: bool, min_value: float | None) -> float:
    if null and x is None:
        return math.nan
    value, ok = math.nan, isinstance(x, (int, float)) and not isinstance(x, bool)
    if ok:
        try:
            value = float(x)
        except OverflowError:  # an integer past float range
            ok = False
        else:
            ok = min_value is None or (math.isfinite(value) and value >= min_value)
    if not ok:
        kind = "a number" if min_value is None else f"a finite number >= {min_value:g}"
        raise shape_error(loss_json, path, kind + (" (or null)" if null else ""), x)
    return value


def number(loss_json: str, path: str, value: Any, *, null: bool = False, min_value: float | None = None) -> float:
    """A JSON number as a float (``null``, where allowed, as NaN: a strict record's non-finite value)."""
    return _number(loss_json, path, value, null, min_value)


def number_rows(
    loss_json: str,
    path: str,
    value: Any,
    rows: tuple[int, str],
    cols: tuple[int | None, str],
    *,
    null: bool = True,
    min_value: float | None = None,
) -> list[list[float]]:
    """A matrix of ``rows[0]`` arrays (one per ``rows[1]``) of ``cols[0]`` numbers (one per ``cols[1]``;
    ``cols[0]`` None: any one count >= 1, the same in every row), as floats (``null``: NaN)."""
    n, row_what = rows
    m, col_what = cols
    inner = _count(m, "number") if m is not None else "numbers (the same count >= 1 in each)"
    if not isinstance(value, list) or len(value) != n:
        expected = f"an array of {_count(n, 'row')} (one per {row_what}), each an array of {inner} (one per {col_what})"
        raise shape_error(loss_json, path, expected, value)
    out: list[list[float]] = []
    for i, row in enumerate(value):
        want = m if m is not None else (len(out[0]) if out else None)
        if not isinstance(row, list) or not row or (want is not None and len(row) != want):
            count = _count(want, "number") if want is not None else "numbers (at least one)"
            raise shape_error(loss_json, f"{path}[{i}]", f"an array of {count} (one per {col_what})", row)
        out.append([_number(loss_json, f"{path}[{i}][{j}]", x, null, min_value) for j, x in enumerate(row)])
    return out


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (raises ImportError without the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, png: str, dpi: int = 110) -> str:
    """Write ``fig`` to ``png`` atomically.  A failed write raises a :class:`WriteError` naming ``png``
    (matplotlib opens the temporary file: its error named that file, and kept a PermissionError's class)."""
    fig.tight_layout()
    try:
        with atomic_path(png) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    except OSError as e:
        if e.errno is None:
            raise
        err = WriteError(e.errno, e.strerror, png)
        err.what = "the plot"
        raise err from e
    finally:
        pyplot().close(fig)
    return png


def plot_error_line(e: Exception, png: str) -> str:
    """A plot command's line for ``e`` raised while drawing into ``png`` (as check-loss says ``--plot``)."""
    if isinstance(e, WriteError) and e.filename == png:
        return f"--png {png}: cannot write the plot: {e.strerror or os.strerror(e.errno or 0)}"
    return str(e)
