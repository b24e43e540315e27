"""Rules about the repository itself, so they hold after every change."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "paddleformers_glm"


def test_the_library_does_not_import_its_test_stand_ins():
    """`paddleformers_glm/testing/` serves tests and benchmarks only: no library module imports it,
    by an import statement or by name (an adapter registry entry, importlib)."""
    pattern = re.compile(
        r"^\s*(from|import)\s+(paddleformers_glm\.testing|\.+testing)\b|paddleformers_glm\.testing", re.M
    )
    offenders = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if "testing" not in p.relative_to(PACKAGE).parts and pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


# Pointers to documents a reader of the repository does not have: the project's private model
# notes (by section sign), tracker entries by number, and working diaries. Written with escapes so
# this file does not match itself.
_DANGLING = re.compile(r"REFERENCE\s*\u00a7|\b[Ii]ssue\s+#?\d+|\b[Ss]essions?\b")
_TEXT_SUFFIXES = {".py", ".md", ".txt", ".json", ".toml", ".cfg", ".ini", ".sh", ".cc", ".h", ".yaml", ".yml"}
_SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def _repo_text_files() -> list[pathlib.Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if any(part.startswith(".") or part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue  # .git, .venv, caches
        if p.is_file() and p.suffix in _TEXT_SUFFIXES:
            out.append(p)
    return out


def test_no_references_to_documents_outside_the_repository():
    """Code, tests, docs and the changelog state facts themselves, not documents a reader lacks."""
    hits = []
    for p in _repo_text_files():
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _DANGLING.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert hits == [], "\n".join(hits)
    assert len(_repo_text_files()) > 50  # the walk saw the repository


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an ``import`` statement in ``path`` names (relative ones resolved), at any depth."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_model_adapters_register_one_way():
    """train/adapter.py names its built-in adapters as data and imports them only when asked; the
    adapters import adapter.py, never the other way round (no import cycle)."""
    adapter = PACKAGE / "train" / "adapter.py"
    adapters = ["paddleformers_glm.train.glm_adapter", "paddleformers_glm.train.toy"]
    assert not set(adapters) & _imported_modules(adapter)
    for mod in adapters:
        path = ROOT.joinpath(*mod.split(".")).with_suffix(".py")
        assert "paddleformers_glm.train.adapter" in _imported_modules(path), mod
        assert "register_adapter" not in path.read_text(encoding="utf-8"), mod
    # in a fresh interpreter: importing the contract loads no adapter; asking for a kind loads only it
    code = (
        "import sys; import paddleformers_glm.train.adapter as a; "
        f"before = [m for m in {adapters!r} if m in sys.modules]; "
        "f = a.get_adapter_factory('toy'); "
        f"after = [m for m in {adapters!r} if m in sys.modules]; "
        "print(before, after, f.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "['paddleformers_glm.train.toy']", "paddleformers_glm.train.toy"]


def test_the_library_never_runs_a_tools_script():
    """tools/ holds fixture generators and developer scripts, which an installed package does not
    have: no string in the library's code (docstrings aside) names a path under tools/."""
    offenders = []
    for p in PACKAGE.rglob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                if re.search(r"(^|[/\\])tools[/\\]|[/\\]tools$", n.value):  # a path, not the word
                    offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}: {n.value!r}")
    assert offenders == []
