"""What every ``glm52`` subcommand shares: help pages that show defaults, the one message for
a ``--model`` that is not a checkpoint folder (missing, a file, or a Hugging Face Hub id), and the
check of an output file path before any work (a folder there, a file where its folder should be, or
one of the command's own inputs, which the write would replace)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Callable, Sequence
from typing import NoReturn

__all__ = [
    "HelpFormatter",
    "checkpoint_files",
    "model_folder_error",
    "output_file_error",
    "output_folder_error",
    "outputs_clash",
    "run_main",
    "show_defaults",
]

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


def checkpoint_files(path: str) -> list[str]:
    """The files of the checkpoint at ``path`` that a reader of it reads: the file itself, or a
    folder's ``config.json``, index and ``.safetensors`` files (what an output must never replace)."""
    if not os.path.isdir(path):
        return [path]
    try:
        names = os.listdir(path)
    except OSError:
        return []
    keep = [n for n in names if n == "config.json" or n.endswith((".safetensors", ".safetensors.index.json"))]
    return [os.path.join(path, n) for n in sorted(keep)]


def _file_above(path: str, what: str) -> str | None:
    """The message for a file standing where one of ``path``'s folders must be, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else f"{what} {path}: {parent} is a file, not a folder"


def output_folder_error(path: str, what: str) -> str | None:
    """Why the output folder ``path`` (named by ``what``) cannot be made or written into, or None:
    a file is there, or stands where one of its parent folders must be."""
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"{what} {path}: a file, not a folder"
    return _file_above(path, what)


def output_file_error(path: str, what: str, inputs: Sequence[str] = ()) -> str | None:
    """Why the file ``path`` that a command writes (``what``: the flag naming it, e.g. ``--json``)
    cannot be written, or None: a folder is there, a file stands where one of its folders must be,
    or it is one of ``inputs`` (files the command reads: the write would replace an input). Checked
    before the command works, so an hour of hashing does not end in a traceback at the last write."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{what} {path}: a folder, not a file"
    if bad := _file_above(path, what):
        return bad
    if os.path.exists(full):
        for f in inputs:
            with contextlib.suppress(OSError):
                if os.path.samefile(full, f):
                    return f"{what} {path}: this is an input of the command ({f}); writing there would replace it"
    return None


def outputs_clash(*named: tuple[str, str | None]) -> str | None:
    """Why two outputs of one command (``(what, path)`` pairs; None: not asked for) cannot both be
    written: they name the same file (the same path, relative or absolute, or through a symlink),
    so the second write would replace the first; else None."""
    seen: dict[str, tuple[str, str]] = {}
    for what, path in named:
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            first, first_path = seen[real]
            return f"{first} {first_path} and {what} {path} are the same file; the second write would replace the first"
        seen[real] = (what, path)
    return None


def run_main(main: Callable[[], int]) -> NoReturn:
    """A ``python -m`` entry point: run ``main`` and end the process with its exit code (argparse's
    usage errors and ``--help`` too) without the interpreter's teardown (``_exit.py``)."""
    from .._exit import exit_code, exit_now

    try:
        code = main()
    except SystemExit as e:
        code = exit_code(e)
    exit_now(code)
