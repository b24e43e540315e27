"""Rules about the repository itself, so they hold after every change."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "paddleformers_glm"


def test_the_library_does_not_import_its_test_stand_ins():
    """`paddleformers_glm/testing/` serves tests and benchmarks only: no library module imports it."""
    pattern = re.compile(r"^\s*(from|import)\s+(paddleformers_glm\.testing|\.+testing)\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if "testing" not in p.relative_to(PACKAGE).parts and pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []
