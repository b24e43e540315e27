"""``glm52`` command line: a thin dispatcher over subcommands registered by their owners.

To add a subcommand, append ``("name", "module.path:register_function")`` to ``COMMANDS``; the
function receives argparse's subparsers object, adds its parser and sets ``func`` (returning the
exit code). Modules are imported when the CLI starts, so keep their top level light (import heavy
dependencies such as paddle inside ``func``). The command modules import nothing from this
package but ``cli._common`` (help formatting, the ``--model`` folder message, the ``python -m``
entry) and ``cli._plot`` (the plot commands' frame), so there is no import cycle;
``python -m paddleformers_glm.cli`` runs it too.

Every subcommand's help shows its defaults; an unknown flag is reported with the subcommand's
usage; Ctrl-C ends any command with one line and exit status 130.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import warnings
from collections.abc import Sequence

from .. import progress
from .._io import env_flags_error
from ._common import HelpFormatter, show_defaults

COMMANDS: list[tuple[str, str]] = [
    ("check-ckpt", "paddleformers_glm.parity.commands:register_check_ckpt"),
    ("check-loss", "paddleformers_glm.parity.commands:register_check_loss"),
    ("convert", "paddleformers_glm.checkpoint.commands:register_convert"),
    ("make-tiny", "paddleformers_glm.tiny:register_make_tiny"),
    ("demo", "paddleformers_glm.demo:register_demo"),
    ("train", "paddleformers_glm.train.command:register_train"),
    ("plot-experts", "paddleformers_glm.parity.expert_plot:register_plot_experts"),
    ("plot-indexer", "paddleformers_glm.train.indexer_plot:register_plot_indexer"),
    ("generate", "paddleformers_glm.cli.generate:register_generate"),
    ("align", "paddleformers_glm.parity.align:register_align"),
    ("plan", "paddleformers_glm.train.plan:register_plan"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``glm52`` parser; ``only``: with that subcommand alone, importing no other command's
    module (``glm52 train`` in one process must start its signal listener while the process has one
    thread: another command's import of numpy starts a BLAS thread pool, and Paddle's own SIGTERM
    handler then ended, or deadlocked, the run)."""
    parser = argparse.ArgumentParser(
        prog="glm52", description="GLM-5.2 (glm_moe_dsa) for PaddlePaddle", formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, target in COMMANDS:
        if only is not None and name != only:
            continue
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(sub)
        if name not in sub.choices:  # the list names what each register function adds
            raise RuntimeError(f"glm52: {target} did not register the subcommand {name!r} that COMMANDS lists for it")
        show_defaults(sub.choices[name])
    return parser


class _Interrupts:
    """Ctrl-C as one line: the SIGINT handler remembers that it fired, because an interrupt that
    lands inside Paddle's C++ (its import, an op) comes back as another exception type."""

    fired = False

    @classmethod
    def handler(cls, signum: int, frame: object) -> None:
        cls.fired = True
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    # Paddle's import warns about a compiler cache on every run; it says nothing about the command.
    warnings.filterwarnings("ignore", message="No ccache found")
    _Interrupts.fired = False
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers live
    previous = signal.signal(signal.SIGINT, _Interrupts.handler) if main_thread else None
    command = "command"
    # A subcommand's --quiet lasts as long as the subcommand: main() may be called again in this process.
    quiet = progress.set_quiet(None)
    progress.set_quiet(quiet)
    try:
        argv = list(argv) if argv is not None else sys.argv[1:]
        parser = build_parser(argv[0] if argv and argv[0] in dict(COMMANDS) else None)
        args, extra = parser.parse_known_args(argv)
        command = args.command
        if extra:  # the subcommand's usage, not the top level's
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if bad := env_flags_error():  # an on/off variable the command's code reads: refused before the work
            print(f"glm52 {command}: error: {bad}", file=sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as err:
        if isinstance(err, KeyboardInterrupt) or _Interrupts.fired:
            print(f"\nglm52 {command}: interrupted", file=sys.stderr)
            return 130
        raise
    finally:
        progress.set_quiet(quiet)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
