"""``python -m paddleformers_glm.train ...`` = ``glm52 train ...``."""

from ..cli._common import run_main
from .command import main

run_main(main)
