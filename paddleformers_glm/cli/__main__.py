"""``python -m paddleformers_glm.cli``: the ``glm52`` command."""

from .._exit import exit_code, exit_now
from . import main

try:
    code = main()
except SystemExit as e:  # argparse's usage errors and --help
    code = exit_code(e)
exit_now(code)
