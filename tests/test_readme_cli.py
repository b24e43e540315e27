"""The README's command table and the docs' `glm52 ...` lines name only flags the CLI has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paddleformers_glm.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _flags_by_command() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


def _uses(text: str) -> list[tuple[str, str]]:
    """(subcommand, the rest of its line) for every `glm52 <subcommand> ...` in inline code or a code block."""
    names = "|".join(re.escape(n) for n, _ in COMMANDS)
    out = []
    for line in text.splitlines():
        for m in re.finditer(rf"glm52 ({names})\b([^`|\n]*(?:\\\|[^`|\n]*)*)", line):
            out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_flags_exist(doc: Path) -> None:
    flags = _flags_by_command()
    unknown = []
    for cmd, rest in _uses(doc.read_text(encoding="utf-8")):
        rest = re.sub(r"'[^']*'|\"[^\"]*\"", "", rest)  # a quoted value (demo's --layout '...') is not a flag
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            if flag not in flags[cmd]:
                unknown.append(f"glm52 {cmd} {flag}")
    assert not unknown, f"{doc.name} names flags the CLI lacks: {sorted(set(unknown))}"


def test_the_check_finds_a_wrong_flag() -> None:
    uses = _uses("run `glm52 convert SRC OUT --layout fleet` here")
    flags = _flags_by_command()
    assert [f for c, r in uses for f in re.findall(r"--[a-z-]+", r) if f not in flags[c]] == ["--layout"]
