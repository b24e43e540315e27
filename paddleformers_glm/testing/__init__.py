"""Stand-ins for tests and benchmarks, kept apart from the library proper (nothing in the library
imports this package).

* `checkpoints`: `SpecModel`, a layer holding exactly the checkpoint contract's parameters (zeros),
  and `write_synthetic_checkpoint`, an official-layout checkpoint written with the ``safetensors``
  library itself, so tests read our reader's input from an independent writer.
* `toy`: a small stand-in transformer and its `ToyAdapter` (`glm52 train --model toy`, resolved
  by name in `train/adapter.py` only when asked for) exercising every parallel feature quickly.

The tiny checkpoint (`glm52 make-tiny`, the demo's default model) is user-facing and stays in
`paddleformers_glm/tiny.py`.
"""

from .checkpoints import SpecModel, random_array, write_synthetic_checkpoint

__all__ = ["SpecModel", "random_array", "write_synthetic_checkpoint"]
