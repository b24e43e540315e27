"""What every ``glm52`` subcommand shares: help pages that show defaults, and the one message for
a ``--model`` that is not a checkpoint folder (missing, a file, or a Hugging Face Hub id)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import NoReturn

__all__ = ["HelpFormatter", "model_folder_error", "run_main", "show_defaults"]

# owner/name, as the Hub spells repository ids
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _no_default(value: object) -> bool:
    """None, False, [] or SUPPRESS: nothing worth printing. By identity, so that a default of 0 or
    0.0 (which equal False) is still shown."""
    return value is None or value is False or value is argparse.SUPPRESS or (isinstance(value, list) and not value)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, minus the noise: no "(default: None)" or "(default: False)",
    nothing added to a help text that already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""  # "%(default)s" counts as stating it
        quiet = _no_default(action.default) or isinstance(action, argparse._HelpAction)
        return text if quiet or "default" in text.lower() else super()._get_help_string(action)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the :class:`HelpFormatter` and a help line to every option that has a
    default but no help text (argparse prints nothing for those)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and not _no_default(action.default):
            action.help = "default: %(default)s"


def model_folder_error(model: str, what: str = "--model") -> str | None:
    """Why ``model`` is not a checkpoint folder this package can read, or None when it is one."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            return f"{what} {model}: no config.json in this folder (not a checkpoint folder)"
        return None
    if os.path.exists(model):
        return f"{what} {model}: a file, not a checkpoint folder"
    if _HUB_ID.match(model) and not model.startswith((".", "/")):
        return (
            f"{what} {model}: no such folder; it looks like a Hugging Face Hub id, and glm52 reads local folders "
            f"only (download it first, e.g. `huggingface-cli download {model} --local-dir DIR`, then {what} DIR)"
        )
    return f"{what} {model}: no such folder"


def run_main(main: Callable[[], int]) -> NoReturn:
    """A ``python -m`` entry point: run ``main`` and end the process with its exit code (argparse's
    usage errors and ``--help`` too) without the interpreter's teardown (``_exit.py``)."""
    from .._exit import exit_code, exit_now

    try:
        code = main()
    except SystemExit as e:
        code = exit_code(e)
    exit_now(code)
