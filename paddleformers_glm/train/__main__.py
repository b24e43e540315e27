"""``python -m paddleformers_glm.train ...`` = ``glm52 train ...``."""

from .._exit import exit_code, exit_now
from .command import main

try:
    code = main()
except SystemExit as e:  # argparse's usage errors and --help
    code = exit_code(e)
exit_now(code)
