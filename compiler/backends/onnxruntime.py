"""ONNX Runtime (CPU) backend: lower llmc ops to what ORT can run and write the engine files.

``PagedAttention`` becomes a node in onnxruntime-extensions' ``ai.onnx.contrib`` domain, whose
Python-registered kernel (llmc.plugins.paged_attention.ort_op) calls llmc's C++ kernel on the
runtime-owned KV pool. ORT's C/C++ custom-op headers ship in no package reachable here, so a
native custom-op library cannot be built; the bridge costs one Python call per layer per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from llmc.passes.base import replace_value
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE

ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"
MS_DOMAIN = "com.microsoft"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"


@dataclass
class EngineFiles:
    model: str
    weights: str


def _lower_skip_rms_norm(graph: ir.Graph, node: ir.Node) -> None:
    # ORT's SkipSimplifiedLayerNormalization: outputs (y, mean, inv_std_var, input+skip sum).
    eps = node.attributes["epsilon"].value
    fused = ir.node("SkipSimplifiedLayerNormalization", list(node.inputs), attributes={"epsilon": eps},
                    domain=MS_DOMAIN, num_outputs=4)
    graph.insert_before(node, fused)
    replace_value(node.outputs[0], fused.outputs[0])
    replace_value(node.outputs[1], fused.outputs[3])
    graph.remove(node, safe=True)


def _lower_swiglu(graph: ir.Graph, node: ir.Node) -> None:
    # ORT has no SwiGLU kernel; QuickGelu(alpha=1) is its fused x * sigmoid(x).
    gate, up = node.inputs
    silu = ir.node("QuickGelu", [gate], attributes={"alpha": 1.0}, domain=MS_DOMAIN)
    mul = ir.node("Mul", [silu.outputs[0], up])
    graph.insert_before(node, [silu, mul])
    replace_value(node.outputs[0], mul.outputs[0])
    graph.remove(node, safe=True)


def lower(model: ir.Model) -> int:
    """Rewrite llmc-domain ops into ops ONNX Runtime executes. Returns the number of nodes lowered.

    PagedAttention moves to onnxruntime-extensions' domain (llmc's kernel behind it);
    SkipRMSNormalization and SwiGLU become ORT contrib ops.
    """
    count = 0
    graph = model.graph
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        if node.op_type == OP_TYPE:
            node.domain = ORT_CONTRIB_DOMAIN
        elif node.op_type == "SkipRMSNormalization":
            _lower_skip_rms_norm(graph, node)
        elif node.op_type == "SwiGLU":
            _lower_swiglu(graph, node)
        else:
            raise NotImplementedError(f"the ONNX Runtime backend cannot lower llmc.{node.op_type}")
        count += 1
    model.opset_imports.pop(DOMAIN, None)
    model.opset_imports[ORT_CONTRIB_DOMAIN] = 1
    model.opset_imports[MS_DOMAIN] = 1
    return count


def emit(model: ir.Model, out_dir: Path) -> EngineFiles:
    """Lower and write ``model.onnx`` with its weights in ``model.onnx.data`` (streamed, one tensor at a time)."""
    lower(model)
    ir.save(model, out_dir / MODEL_FILE, external_data=WEIGHTS_FILE)
    return EngineFiles(model=MODEL_FILE, weights=WEIGHTS_FILE)
