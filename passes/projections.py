"""Pack sibling projections: ``MatMul(x, W1)``, ``MatMul(x, W2)``, … → ``Split(MatMul(x, [W1|W2|…]))``.

This turns the Q, K, V projections into one matmul and gate + up into another: fewer, larger
GEMMs that read ``x`` once. A projection is packed only when its weight is a constant used by
nothing else (packing a shared or tied weight would duplicate it).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from llmc.passes.base import replace_value
from llmc.passes.lazy import constant_of, derived


def _packable(node: ir.Node, graph: ir.Graph) -> bool:
    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
        return False
    w = node.inputs[1]
    tensor = constant_of(w)
    return (
        tensor is not None
        and len(tensor.shape) == 2
        and len(w.uses()) == 1
        and w not in graph.outputs
    )


def pack_projections(model: ir.Model) -> dict[str, int]:
    """Pack every group of two or more packable MatMuls that share their activation input."""
    graph = model.graph
    groups: dict[tuple[int, int], list[ir.Node]] = defaultdict(list)
    for node in graph:
        if _packable(node, graph):
            w = node.inputs[1].const_value
            groups[(id(node.inputs[0]), int(w.dtype))].append(node)
    packed = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        x = nodes[0].inputs[0]
        weights = [n.inputs[1] for n in nodes]
        tensors = [w.const_value for w in weights]
        k = tensors[0].shape[0]
        if any(t.shape[0] != k for t in tensors):
            continue
        widths = [int(t.shape[1]) for t in tensors]
        name = "+".join(w.name for w in weights)
        packed_w = ir.Value(name=f"packed[{name}]", shape=ir.Shape([k, sum(widths)]),
                            type=ir.TensorType(tensors[0].dtype))
        packed_w.const_value = derived(tensors, lambda *a: np.concatenate(a, axis=1), tensors[0].dtype,
                                       [k, sum(widths)], packed_w.name)
        graph.register_initializer(packed_w)
        split_sizes = ir.Value(name=f"split_sizes[{name}]", shape=ir.Shape([len(widths)]),
                               type=ir.TensorType(ir.DataType.INT64))
        split_sizes.const_value = ir.tensor(np.asarray(widths, np.int64), name=split_sizes.name)
        graph.register_initializer(split_sizes)
        # Insert the packed matmul where the first projection was, so x is already defined.
        matmul = ir.node("MatMul", [x, packed_w])
        split = ir.node("Split", [matmul.outputs[0], split_sizes], attributes={"axis": -1},
                        num_outputs=len(nodes))
        graph.insert_before(nodes[0], [matmul, split])
        for old, new in zip(nodes, split.outputs, strict=True):
            replace_value(old.outputs[0], new)
        for old, w in zip(nodes, weights, strict=True):
            graph.remove(old, safe=True)
            del graph.initializers[w.name]
        packed += 1
    return {"matches": packed}
