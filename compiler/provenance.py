"""Debug metadata the exporter writes into a traced graph, made reproducible.

torch.onnx records, on every node, the Python stack that produced it (``pkg.torch.onnx.stack_trace``): absolute
paths of the installed llmc, transformers and torch, and line numbers. Two builds of the same inputs by the same
versions installed in different places (a venv, a container, a CI runner's checkout) then gave different
model.onnx bytes, and so different manifests. The stack is dropped; the module path of each node
(``namespace``, ``pkg.torch.onnx.name_scopes``, ``class_hierarchy``) stays, which is what reading a graph needs.
"""

from __future__ import annotations

import onnx_ir as ir

SOURCE_LOCATION_KEYS = ("pkg.torch.onnx.stack_trace",)


def strip_source_locations(model: ir.Model) -> int:
    """Remove the source-location entries of every node's metadata (subgraphs included); returns how many."""
    removed = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key in SOURCE_LOCATION_KEYS:
            if node.metadata_props.pop(key, None) is not None:
                removed += 1
    return removed
