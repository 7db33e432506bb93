"""Cleanup passes: constant folding with shape simplification, CSE, dead-code elimination.

Folding and the shape/cast simplifications are onnxscript's optimizer (a well-kept
implementation of exactly this); the size limits keep it from materialising weights, which the
weight-layout pass handles lazily instead.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    RemoveUnusedNodesPass,
    RemoveUnusedOpsetsPass,
)
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding

from llmc.passes.base import count_nodes

# Tensors above this many elements are never folded (they are weights, or derived from them).
FOLD_SIZE_LIMIT = 1024


def _never_fold_weights(node: ir.Node) -> bool | None:
    # onnxscript always folds Transpose of an initializer, whatever its size: that would read the
    # weight into RAM now. Weights are repacked lazily by the weight-layout pass instead.
    for value in node.inputs:
        tensor = value.const_value if value is not None else None
        if tensor is not None and tensor.size > FOLD_SIZE_LIMIT:
            return False
    return None


def fold_constants(model: ir.Model) -> dict[str, int]:
    """Fold constant subgraphs, simplify shapes/casts/reshapes, remove dead nodes.

    This is onnxscript's optimizer pipeline minus initializer deduplication (which would read
    every weight to compare them), with weights excluded from folding.
    """
    before = count_nodes(model)
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=FOLD_SIZE_LIMIT,
                    output_size_limit=FOLD_SIZE_LIMIT,
                    should_fold=_never_fold_weights,
                ),
                rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),
                common.RemoveUnusedNodesPass(),
                common.RemoveUnusedFunctionsPass(),
                common.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
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
