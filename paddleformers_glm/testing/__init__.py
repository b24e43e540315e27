"""Stand-ins for tests and benchmarks (`checkpoints`), kept apart from the library proper (nothing in
the library imports this package). The tiny checkpoint (`glm52 make-tiny`, the demo's default model) and the toy model of
`glm52 train --model toy` (`train/toy.py`) are user-facing and live in the library.
"""

from .checkpoints import SpecModel, random_array, write_synthetic_checkpoint

__all__ = ["SpecModel", "random_array", "write_synthetic_checkpoint"]
