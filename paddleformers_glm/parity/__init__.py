"""Parity checkers: `glm52 check-ckpt` (checkpoint vs checkpoint) and `glm52 check-loss` (loss curves).

See docs/parity.md.
"""

from .ckpt_check import check_checkpoints, checkpoint_hash, file_safety_problems, tensor_hash
from .loss_check import LossFileError, check_losses, compare_losses, plot_losses, read_losses

__all__ = [
    "check_checkpoints",
    "checkpoint_hash",
    "file_safety_problems",
    "tensor_hash",
    "check_losses",
    "compare_losses",
    "plot_losses",
    "read_losses",
    "LossFileError",
]
