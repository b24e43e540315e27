"""The one error type the checkpoint code raises for bad input.

It subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working, and it
carries the file, the key and expected/actual values so a message can be checked field by field
(tests do) instead of by grepping prose.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint (or a state dict) that cannot be used as asked; says where and why."""

    def __init__(
        self, message: str, *, file: str | None = None, key: str | None = None, expected: Any = None, actual: Any = None
    ) -> None:
        self.file = file
        self.key = key
        self.expected = expected
        self.actual = actual
        parts = [message]
        if key is not None:
            parts.append(f"key={key!r}")
        if file is not None and str(file) not in message:  # named once
            parts.append(f"file={file}")
        if expected is not None or actual is not None:
            parts.append(f"expected={expected!r}, actual={actual!r}")
        super().__init__("; ".join(parts))
