"""Cleanup: remove nodes whose outputs nothing uses, and opset imports nothing needs."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, RemoveUnusedOpsetsPass


def dead_code_elimination(model: ir.Model) -> dict:
    """Remove unused nodes in place; returns statistics ``{"nodes_removed": n}``."""
    before = sum(1 for _ in model.graph)
    RemoveUnusedNodesPass()(model)
    RemoveUnusedOpsetsPass()(model)
    return {"nodes_removed": before - sum(1 for _ in model.graph)}
