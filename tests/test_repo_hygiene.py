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


# The floors of docs/model.md's map, from the ground up, by module-name prefix (the longest prefix
# decides): a module imports modules of its own floor or below, function-level imports included.
_FLOORS = (
    ("base", ("_io", "_exit", "cpu_env", "progress", "tokenizer_files", "cli._common", "cli._plot")),
    ("ops", ("ops",)),
    ("config", ("configuration",)),
    ("parallel", ("parallel",)),
    ("layers", ("modeling",)),
    ("checkpoint", ("checkpoint",)),
    ("generation", ("generation", "tokenizer")),
    ("model", ("", "modeling.pretrained", "modeling.model")),
    ("train", ("train", "generation.launched")),
    ("parity", ("parity",)),
    ("cli", ("cli",)),
    ("top", ("integrations", "tiny", "demo", "__main__")),
)


def _floor(module: str) -> int:
    """The floor of ``module`` (a name inside the package, "" for the package itself)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(_FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") or p == "") and len(p) > length:
                best, length = i, len(p)
    return best


def _package_imports(path: pathlib.Path) -> set[str]:
    """The package's modules that ``path`` imports, at any depth, by name inside the package ("" for
    the package itself): ``from X import y`` imports module ``X.y`` when there is one, else ``X``."""

    def module(rel: list[str]) -> bool:
        where = ROOT.joinpath("paddleformers_glm", *rel)
        return where.with_suffix(".py").is_file() or where.is_dir()

    pkg = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            names = [
                mod + [a.name] if module(mod[1 if not node.level else 0 :] + [a.name]) else mod for a in node.names
            ]
            names = [(["paddleformers_glm"] + n) if node.level else n for n in names]
        else:
            continue
        out.update(".".join(n[1:]) for n in names if n and n[0] == "paddleformers_glm")
    return out


def test_each_floor_imports_only_the_floors_below_it():
    """docs/model.md's map and the README promise it: ops < config < parallel < the layers <
    checkpoint < generation < the model (PreTrainedModel's load, save and generate) < train < parity <
    cli; a lower floor never imports a higher one, at any depth."""
    upward = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        if rel[0] == "testing":
            continue  # stand-ins for tests, never imported by the library (test above)
        me = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        for target in _package_imports(path):
            if _floor(target) > _floor(me):
                upward.append(f"{me} ({_FLOORS[_floor(me)][0]}) imports {target} ({_FLOORS[_floor(target)][0]})")
    assert sorted(upward) == []


def test_model_adapters_register_one_way():
    """train/adapter.py names its built-in adapters as data and imports them only when asked; the
    adapters import adapter.py, never the other way round (no import cycle)."""
    adapter = PACKAGE / "train" / "adapter.py"
    adapters = ["paddleformers_glm.train.glm_adapter", "paddleformers_glm.train.toy_adapter"]
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
    assert out.stdout.split() == [
        "[]",
        "['paddleformers_glm.train.toy_adapter']",
        "paddleformers_glm.train.toy_adapter",
    ]


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


def test_glm52_train_checks_a_run_without_loading_paddle(tmp_path):
    """``glm52 train`` checks a job (settings, layout against the model, pipeline split, indexer stage,
    data, resume state) in the command's own process before it starts the launcher and the workers,
    which each load Paddle; the check itself must not (one Paddle import fewer per launched run).
    Run in a fresh interpreter whose ``import paddle`` raises: every line below is checked to the end
    (and a bad one refused with the trainer's own error), and Paddle never loads."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")  # with its tokenizer
    data = tmp_path / "chat.jsonl"
    data.write_text('{"text": "hello world, hello paddle"}\n' * 8, encoding="utf-8")
    lines = [
        ["--model", "toy", "--tp", "2", "--pp", "2", "--sp", "--seq-len", "32"],
        ["--model", "toy", "--ep", "2", "--dp", "2", "--recompute", "core", "--expert-update", "routed-only"],
        ["--model", str(ckpt), "--cp", "2", "--ep", "2", "--seq-len", "32", "--recompute", "full"],
        ["--model", str(ckpt), "--tp", "2", "--pp", "2", "--sp", "--seq-len", "32", "--indexer-stage", "warmup"],
        ["--model", str(ckpt), "--data", str(data), "--tokenizer", str(ckpt), "--seq-len", "16"],
        ["--model", str(ckpt), "--tp", "3"],  # refused: 3 does not divide the heads
    ]
    code = f"""
import importlib.abc, sys
class NoPaddle(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "paddle":
            raise ImportError("the pre-launch check imported " + name)
sys.meta_path.insert(0, NoPaddle())
import argparse
from paddleformers_glm.train.command import add_train_arguments, check_args, check_inputs_before_launch
for i, line in enumerate({lines!r}):
    args = add_train_arguments(argparse.ArgumentParser()).parse_args([*line, "--out", {str(tmp_path)!r} + f"/out{{i}}"])
    try:
        cfg, adapter, world = check_args(args)
        check_inputs_before_launch(cfg, args, adapter.vocab_size)
        print("ok", world)
    except ValueError as e:
        print("refused", str(e).split(":")[0])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [x for x in out.stdout.split("\n") if x and not x.startswith("[glm52 train] data")] == [
        "ok 4",
        "ok 2",
        "ok 2",
        "ok 4",
        "ok 1",
        "refused tp 3 does not divide num_attention_heads 4",
    ], out.stdout
