"""``python -m paddleformers_glm.cli``: the ``glm52`` command."""

import sys

from . import main

sys.exit(main())
