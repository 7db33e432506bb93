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
