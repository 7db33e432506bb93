"""The package's shape (issue 47): no import cycle anywhere, no product module importing test support, no long
function in the layers people read to find where something happens, and an architecture map naming every folder
and build stage."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGE = {"tests", "scripts", "benchmarks", "assets", "build", "docs", ".venv", ".git", ".ci"}
LONG_FUNCTION_FOLDERS = ("compiler", "runtime", "serve", "passes", "quant")
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """``llmc.<dotted name> -> file`` of every module of the installed package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in NOT_PACKAGE or "site-packages" in parts:
            continue
        dotted = ".".join(("llmc", *parts))[: -len(".py")]
        out[dotted.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every llmc module ``name`` imports, anywhere in the file (functions and TYPE_CHECKING blocks included):
    ``from P import m`` counts as ``P.m`` where m is a module, else as ``P``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    modules = _modules()
    assert "llmc.compiler.build.driver" in modules and "llmc.runtime.engine" in modules
    edges = {name: _imports(path, name, modules) for name, path in modules.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles (module-level, in functions or under TYPE_CHECKING):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_product_module_imports_test_support():
    modules = _modules()
    offenders = [f"{name}: {dep}" for name, path in modules.items() if not name.startswith("llmc.testing")
                 for dep in _imports(path, name, modules) if dep == "llmc.testing" or dep.startswith("llmc.testing.")]
    assert not offenders, offenders


def test_no_function_over_80_lines():
    long = []
    for folder in LONG_FUNCTION_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}::{node.name} ({lines} lines)")
    assert not long, long


def test_the_architecture_map_names_every_folder_and_build_stage():
    from llmc.compiler.build.stages import STAGES

    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted(p.name for p in ROOT.iterdir()
                     if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".egg-info")
                     and p.name not in {"build", "engines", "__pycache__"})
    missing = [f for f in folders if not re.search(rf"`{re.escape(f)}/", text)]
    assert not missing, f"docs/architecture.md does not name these top-level folders: {missing}"
    stages = ["load", "check", *(s.name for s in STAGES)]
    missing = [s for s in stages if f"`{s}`" not in text]
    assert not missing, f"docs/architecture.md does not name these build stages: {missing}"
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
