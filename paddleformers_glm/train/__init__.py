"""Training: data, AdamW + schedule, the step loop, checkpoints, and the multi-process launcher.

``glm52 train`` lives in :mod:`.command`; the model contract in :mod:`.adapter`.  Names are
imported lazily so ``glm52 --help`` does not load Paddle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LossSpec": ".adapter",
    "ModelAdapter": ".adapter",
    "make_adapter": ".adapter",
    "register_adapter": ".adapter",
    "TrainConfig": ".settings",
    "run_training": ".loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
