"""What ``glm52 train`` relays from its workers to the console: the run's own lines, not Paddle's
set-up chatter (its INFO records, among them every pipeline chunk's printed model, hundreds of lines,
and the modified-flags banner), which stays in ``OUT/logs/workerlog.*`` and reaches the console with
``--verbose`` (docs/parallel.md, "Logging").
"""

from __future__ import annotations

import re

__all__ = ["PaddleChatter"]

# Paddle's logging format: "[2026-01-01 12:00:00,000] [    INFO] file.py:123 - message"
_RECORD = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[\s*([A-Z]+)\] ")
_BANNER = "======================= Modified FLAGS detected ======================="
_BANNER_END = "=" * 71


class PaddleChatter:
    """A line filter for one worker stream: ``keep(line)`` is False for Paddle's INFO records
    (with their continuation lines, such as a printed model) and for the modified-flags banner."""

    def __init__(self) -> None:
        self._in_record = self._in_banner = False

    def keep(self, line: str) -> bool:
        text = line.rstrip("\n")
        if self._in_banner or text.strip() == _BANNER:  # the banner, up to its closing line
            self._in_banner = text.strip() != _BANNER_END
            return False
        m = _RECORD.match(text)
        if m:
            self._in_record = m.group(1) in ("INFO", "DEBUG")
            return not self._in_record
        if self._in_record and (text[:1].isspace() or text.startswith(")") or not text.strip()):
            return False  # a continuation of the INFO record (the printed model's lines)
        self._in_record = False
        return True
