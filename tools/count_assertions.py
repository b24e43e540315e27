"""Count the checks of the test suite, statically, so a change to the suite can be compared
before/after: per file, the test functions, their ``assert`` statements, ``pytest.raises`` /
``pytest.warns`` blocks and ``np.testing.assert_*`` / ``assert_*`` helper calls, plus the same
counts in the helpers, fixtures and the multi-process scripts of ``tests/_dist`` they call.

A merge of two launches moves no check out of a test body (each test still asserts its own part),
so the totals must not drop.  ``--items`` also collects the suite (``pytest --collect-only``) for
the number of test items (parametrized cases counted one by one) and of those marked slow.

    python tools/count_assertions.py              # table + totals
    python tools/count_assertions.py --items      # + collected items (a few seconds: imports the tests)
    python tools/count_assertions.py --json       # machine-readable
    python tools/count_assertions.py --root DIR   # another checkout (e.g. the commit before a change)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _call_name(node: ast.Call) -> str:
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def count_checks(node: ast.AST) -> dict[str, int]:
    """assert statements, pytest.raises/warns (call or with), and assert_* calls under ``node``
    (nested functions included: a closure's asserts run when the test calls it)."""
    c = {"assert": 0, "raises": 0, "assert_calls": 0}
    for n in ast.walk(node):
        if isinstance(n, ast.Assert):
            c["assert"] += 1
        elif isinstance(n, ast.Call):
            name = _call_name(n)
            last = name.rsplit(".", 1)[-1]
            if name.startswith("pytest.") and last in ("raises", "warns", "deprecated_call"):
                c["raises"] += 1
            elif last.startswith("assert_") or last.startswith("_assert") or last.startswith("_check"):
                c["assert_calls"] += 1
    return c


def scan_file(path: Path) -> dict:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    tests, helpers = {}, {"assert": 0, "raises": 0, "assert_calls": 0}
    module_level = {"assert": 0, "raises": 0, "assert_calls": 0}
    for node in tree.body:
        nodes = [node]
        if isinstance(node, ast.ClassDef):
            nodes = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                c = count_checks(n)
                if n.name.startswith("test"):
                    tests[n.name] = c
                else:
                    for k in helpers:
                        helpers[k] += c[k]
            else:
                c = count_checks(n)
                for k in module_level:
                    module_level[k] += c[k]
    for k in helpers:
        helpers[k] += module_level[k]
    return {"tests": tests, "helpers": helpers}


def collect_items(root: Path) -> dict[str, dict[str, int]]:
    """Per file: collected items, and those selected by ``-m slow`` (from pytest itself)."""

    def run(*extra: str) -> dict[str, int]:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
        )
        per: dict[str, int] = {}
        for line in p.stdout.splitlines():
            if "::" in line:
                f = line.split("::", 1)[0]
                per[f] = per.get(f, 0) + 1
        return per

    all_items, slow = run(), run("-m", "slow")
    return {f: {"items": n, "slow": slow.get(f, 0)} for f, n in all_items.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", action="store_true", help="also collect the suite for the test item counts")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to count (default: this one)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    files = sorted((root / "tests").glob("test_*.py"))
    support = [root / "tests" / "conftest.py", *sorted((root / "tests").glob("_*.py"))]
    support += sorted((root / "tests" / "_dist").glob("*.py"))
    rows = {}
    for f in files:
        s = scan_file(f)
        t = s["tests"].values()
        rows[str(f.relative_to(root))] = {
            "tests": len(s["tests"]),
            "assert": sum(c["assert"] for c in t),
            "raises": sum(c["raises"] for c in t),
            "assert_calls": sum(c["assert_calls"] for c in t),
            "helper_assert": s["helpers"]["assert"] + s["helpers"]["raises"],
        }
    sup = {"assert": 0, "raises": 0}
    for f in support:
        if f.is_file():
            c = count_checks(ast.parse(f.read_text(encoding="utf-8")))
            sup["assert"] += c["assert"]
            sup["raises"] += c["raises"]
    items = collect_items(root) if args.items else {}
    for f, r in rows.items():
        if items:
            r.update(items.get(f, {"items": 0, "slow": 0}))
    keys = ["tests", "assert", "raises", "assert_calls", "helper_assert"] + (["items", "slow"] if items else [])
    total = {k: sum(r.get(k, 0) for r in rows.values()) for k in keys}
    total["support_assert"] = sup["assert"] + sup["raises"]
    if args.json:
        print(json.dumps({"files": rows, "total": total}, indent=1))
        return 0
    w = max(len(f) for f in rows)
    print(f"{'file':<{w}} " + " ".join(f"{k:>13}" for k in keys))
    for f, r in rows.items():
        print(f"{f:<{w}} " + " ".join(f"{r.get(k, 0):>13}" for k in keys))
    print(f"{'TOTAL':<{w}} " + " ".join(f"{total[k]:>13}" for k in keys))
    checks = total["assert"] + total["raises"] + total["assert_calls"] + total["helper_assert"]
    print(
        f"checks in test bodies {total['assert'] + total['raises'] + total['assert_calls']}, "
        f"in helpers/fixtures {total['helper_assert']}, in conftest/_tiny/_dist {total['support_assert']}; "
        f"all {checks + total['support_assert']}"
    )
    if items:
        print(f"test items {total['items']} ({total['slow']} slow, {total['items'] - total['slow']} fast)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
