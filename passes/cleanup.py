"""Cleanup passes: constant folding with shape simplification, CSE, dead-code elimination.

Folding and the shape/cast simplifications are onnxscript's optimizer (a well-kept
implementation of exactly this); the size limits keep it from materialising weights, which the
weight-layout pass handles lazily instead.
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    RemoveUnusedNodesPass,
    RemoveUnusedOpsetsPass,
)

from llmc.passes.base import count_nodes

# Tensors above this many elements are never folded (they are weights, or derived from them).
FOLD_SIZE_LIMIT = 4096


def fold_constants(model: ir.Model) -> dict[str, int]:
    """Fold constant subgraphs, simplify shapes/casts/reshapes, remove dead nodes."""
    before = count_nodes(model)
    onnxscript.optimizer.optimize(
        model, input_size_limit=FOLD_SIZE_LIMIT, output_size_limit=FOLD_SIZE_LIMIT, num_iterations=2
    )
    return {"matches": max(0, before - count_nodes(model))}


def common_subexpressions(model: ir.Model) -> dict[str, int]:
    """Merge nodes that compute the same thing from the same inputs (e.g. per-layer Cos/Sin)."""
    before = count_nodes(model)
    CommonSubexpressionEliminationPass()(model)
    return {"matches": max(0, before - count_nodes(model))}


def dead_code_elimination(model: ir.Model) -> dict[str, int]:
    """Remove nodes whose outputs nothing uses, and unused opset imports."""
    before = count_nodes(model)
    RemoveUnusedNodesPass()(model)
    RemoveUnusedOpsetsPass()(model)
    return {"matches": before - count_nodes(model)}
