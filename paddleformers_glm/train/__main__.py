"""``python -m paddleformers_glm.train ...`` = ``glm52 train ...``."""

import sys

from .command import main

sys.exit(main())
