"""The ordered list of graph passes for a recipe and target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from llmc.passes import cleanup


@dataclass(frozen=True)
class PassSpec:
    name: str
    run: Callable[[ir.Model], dict]


def passes_for(target: str) -> list[PassSpec]:
    """The passes applied, in order, for ``target``."""
    return [PassSpec("dead-code-elimination", cleanup.dead_code_elimination)]


def run_pipeline(model: ir.Model, target: str) -> list[dict]:
    """Run every pass in place; returns per-pass statistics for report.json."""
    stats = []
    for spec in passes_for(target):
        stats.append({"pass": spec.name, **spec.run(model)})
    return stats
