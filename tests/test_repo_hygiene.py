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


# The floors of docs/model.md's map, from the ground up. A module's floor is given by the longest
# name that is the module itself or a package above it; "=NAME" names a package's __init__ alone.
_FLOORS = (
    ("base", ("_io", "_exit", "cpu_env", "progress", "tokenizer_files", "cli._common", "cli._plot")),
    ("ops", ("ops",)),
    ("config", ("configuration",)),
    ("parallel", ("parallel",)),
    ("layers", ("modeling",)),
    ("checkpoint", ("checkpoint",)),
    ("generation", ("generation", "tokenizer")),
    ("model", ("=", "=modeling", "modeling.pretrained", "modeling.model")),
    ("train", ("train", "generation.launched")),
    ("parity", ("parity",)),
    ("cli", ("cli", "tiny", "demo")),
    ("integrations", ("integrations",)),
)
# a registry entry "module:attribute", the module named in full (a module named alone, as in
# ``python -m paddleformers_glm.cli``, starts a process: no import)
_MODULE_STRING = re.compile(r"^paddleformers_glm(\.\w+)+:\w+$")


def _floor(module: str) -> int | None:
    """The floor of ``module`` (a name inside the package, "" for the package itself), else None."""
    best, length = None, -1
    for i, (_, names) in enumerate(_FLOORS):
        for name in names:
            hit = module == name[1:] if name.startswith("=") else module == name or module.startswith(name + ".")
            if hit and len(name) > length:
                best, length = i, len(name)
    return best


def _is_module(rel: list[str]) -> bool:
    where = ROOT.joinpath("paddleformers_glm", *rel)
    return where.with_suffix(".py").is_file() or where.is_dir()


def _package_imports(path: pathlib.Path, module_level_only: bool = False) -> set[str]:
    """The package's modules that ``path`` imports, by name inside the package ("" for the package
    itself): import statements at any depth (``from X import y`` imports module ``X.y`` when there
    is one, else ``X``), ``importlib.import_module`` of a constant, and registry strings naming a
    module in full (``module:attribute``). ``module_level_only``: the import statements that run when ``path`` is imported."""
    pkg = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(ast.iter_child_nodes(tree)) if module_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ["paddleformers_glm", *pkg[: len(pkg) - node.level + 1], *(node.module or "").split(".")]
            else:
                mod = (node.module or "").split(".")
            mod = [m for m in mod if m]
            names = [mod + [a.name] if _is_module(mod[1:] + [a.name]) else mod for a in node.names]
        elif module_level_only:
            continue
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                continue
            dots = len(arg.value) - len(arg.value.lstrip("."))
            rest = [m for m in arg.value.lstrip(".").split(".") if m]
            here = ["paddleformers_glm", *(pkg[: len(pkg) - dots + 1] if dots else [])]
            names = [here + rest if dots else rest]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            names = [node.value.split(":")[0].split(".")]
        else:
            continue
        out.update(".".join(n[1:]) for n in names if n and n[0] == "paddleformers_glm")
    return out


def _package_modules() -> dict[str, pathlib.Path]:
    """Every module of the library (``testing/``, stand-ins for tests, aside) by name inside the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        if rel[0] != "testing":
            out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def test_each_floor_imports_only_the_floors_below_it():
    """docs/model.md's map and the README promise it: ops < config < parallel < the layers <
    checkpoint < generation < the model (PreTrainedModel's load, save and generate) < train < parity <
    cli; a lower floor never imports a higher one, at any depth. Importing a module runs the
    ``__init__`` of each package above it: what those run at import stays at or below the package's
    lowest floor (the package root aside: it imports the config class, pure Python)."""
    modules = _package_modules()
    unplaced = sorted(m for m in modules if _floor(m) is None)
    assert unplaced == [], "modules the map does not place"
    upward = []
    for me, path in modules.items():
        for target in _package_imports(path):
            if _floor(target) is None or _floor(target) > _floor(me):
                upward.append(f"{me} ({_FLOORS[_floor(me)][0]}) imports {target}")
        if path.name == "__init__.py" and me:
            lowest = min(_floor(m) for m in modules if m.startswith(me + "."))
            for target in _package_imports(path, module_level_only=True):
                if _floor(target) > lowest:
                    upward.append(f"{me}/__init__ (run by {_FLOORS[lowest][0]} imports) imports {target}")
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
