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
