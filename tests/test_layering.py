"""Dependencies point one way (DESIGN.md): cli -> compiler -> (passes, quant, plugins); runtime -> plugins.
No module below the compiler imports it (quant once reached into compiler.frontend's privates for the
checkpoint binding; the build now hands it a reader from compiler.binding)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("folder", ["quant", "passes", "plugins", "runtime"])
def test_lower_layers_do_not_import_the_compiler(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    offenders = [f"{f.relative_to(ROOT)}: {name}" for f in files for name in _imports(f)
                 if name == "llmc.compiler" or name.startswith("llmc.compiler.")]
    assert not offenders, offenders


def test_every_package_folder_is_installed():
    """CI installs llmc as a wheel (``pip install .``), which ships only the packages pyproject.toml lists: a new
    folder with an ``__init__.py`` left off the list imports in an editable checkout and fails after install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    outside = {"tests", "scripts", "benchmarks", "assets", "build", ".venv"}
    found = {"llmc." + ".".join(p.parent.relative_to(ROOT).parts) if p.parent != ROOT else "llmc"
             for p in ROOT.rglob("__init__.py")
             if not (set(p.relative_to(ROOT).parts[:1]) & outside) and "site-packages" not in p.parts}
    assert found - listed == set(), f"add to pyproject.toml's packages: {sorted(found - listed)}"


def _module_level_imports(path: Path) -> list[str]:
    """Modules imported when ``path`` is imported: not inside functions, not under ``if TYPE_CHECKING:``;
    ``from P import m`` counts as ``P.m`` too (m may be a module)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def test_the_cuda_executor_is_its_own_package_loaded_only_for_cuda_engines():
    """runtime/workers/cuda/ holds the CUDA engine's executor (torch); the rest of the runtime reaches it only inside
    the functions that load a CUDA engine, so a CPU engine never imports it (nor torch)."""
    cuda = ROOT / "runtime" / "workers" / "cuda"
    assert {p.stem for p in cuda.glob("*.py")} >= {"session", "program", "ops", "kernels", "sampler",
                                                   "tensor_parallel", "step_profile"}
    others = sorted(f for f in (ROOT / "runtime").rglob("*.py") if cuda not in f.parents)
    offenders = [f"{f.relative_to(ROOT)}: {name}" for f in others for name in _module_level_imports(f)
                 if name.startswith("llmc.runtime.workers.cuda") or name.startswith("torch")]
    assert not offenders, offenders


def test_runtime_modules_import_no_cycle_at_import_time():
    """engine -> speculative -> engine was a circle; the runtime's module-level imports form none now."""
    mods = {"llmc." + ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for f in (ROOT / "runtime").rglob("*.py")}
    edges = {m: {n for n in _module_level_imports(f) if n in mods and n != m} for m, f in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            assert state.get(n) != 1, " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [])
