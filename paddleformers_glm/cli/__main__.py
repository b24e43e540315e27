"""``python -m paddleformers_glm.cli``: the ``glm52`` command."""

from . import main
from ._common import run_main

run_main(main)
