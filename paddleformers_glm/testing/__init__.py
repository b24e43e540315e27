"""Stand-ins for tests and benchmarks, kept apart from the library proper (nothing in the library
imports this package).

* `checkpoints`: `SpecModel`, a layer holding exactly the checkpoint contract's parameters (zeros),
  and `write_synthetic_checkpoint`, an official-layout checkpoint written with the ``safetensors``
  library itself, so tests read our reader's input from an independent writer.

The tiny checkpoint (`glm52 make-tiny`, the demo's default model) and the toy model of
`glm52 train --model toy` (`train/toy.py`) are user-facing and live in the library.
"""

from .checkpoints import SpecModel, random_array, write_synthetic_checkpoint

__all__ = ["SpecModel", "random_array", "write_synthetic_checkpoint"]
