"""Training: data, AdamW + schedule, the step loop, checkpoints, and the multi-process launcher.

``glm52 train`` lives in :mod:`.command`; the model contract in :mod:`.adapter`.
"""

from .adapter import LossSpec, ModelAdapter, make_adapter, register_adapter
from .loop import TrainConfig, run_training

__all__ = ["LossSpec", "ModelAdapter", "TrainConfig", "make_adapter", "register_adapter", "run_training"]
