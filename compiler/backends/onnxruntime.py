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

from llmc.plugins.paged_attention import DOMAIN, OP_TYPE

ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"


@dataclass
class EngineFiles:
    model: str
    weights: str


def lower(model: ir.Model) -> int:
    """Move PagedAttention into the domain ORT executes it from. Returns the number of nodes lowered."""
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            node.domain = ORT_CONTRIB_DOMAIN
            count += 1
    model.opset_imports.pop(DOMAIN, None)
    model.opset_imports[ORT_CONTRIB_DOMAIN] = 1
    return count


def emit(model: ir.Model, out_dir: Path) -> EngineFiles:
    """Lower and write ``model.onnx`` with its weights in ``model.onnx.data`` (streamed, one tensor at a time)."""
    lower(model)
    ir.save(model, out_dir / MODEL_FILE, external_data=WEIGHTS_FILE)
    return EngineFiles(model=MODEL_FILE, weights=WEIGHTS_FILE)
