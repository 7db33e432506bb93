"""Pack sibling projections: ``MatMul(x, W1)``, ``MatMul(x, W2)``, … → ``Split(MatMul(x, [W1|W2|…]))``.

This turns the Q, K, V projections into one matmul and gate + up into another: fewer, larger
GEMMs that read ``x`` once. Biases added to every projection (Qwen2's Q/K/V) become one Add before
the Split, so the Split's outputs are the projections themselves (what the backends' attention
fusions look for). A projection is packed only when its weight is a constant used by
nothing else (packing a shared or tied weight would duplicate it).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from llmc.passes.base import replace_value
from llmc.passes.lazy import concatenated, constant_of, derived


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


def _biases(nodes: list[ir.Node], widths: list[int]) -> tuple[list[ir.Node], list[ir.TensorProtocol]] | None:
    """When every projection's only consumer is ``Add(out, bias)`` with a constant 1-D bias of its width,
    those Adds and biases (in order), else None."""
    adds, values = [], []
    for node, width in zip(nodes, widths, strict=True):
        uses = node.outputs[0].uses()
        if len(uses) != 1 or node.outputs[0].is_graph_output():
            return None
        add = uses[0].node
        if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
            return None
        other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
        tensor = constant_of(other)
        if tensor is None or list(tensor.shape) != [width] or len(other.uses()) != 1:
            return None
        adds.append(add)
        values.append(tensor)
    if len({int(v.dtype) for v in values}) != 1:
        return None
    return adds, values


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
        packed_w.const_value = concatenated(tensors, 1, packed_w.name)
        graph.register_initializer(packed_w)
        split_sizes = ir.Value(name=f"split_sizes[{name}]", shape=ir.Shape([len(widths)]),
                               type=ir.TensorType(ir.DataType.INT64))
        split_sizes.const_value = ir.tensor(np.asarray(widths, np.int64), name=split_sizes.name)
        graph.register_initializer(split_sizes)
        # Insert the packed matmul where the first projection was, so x is already defined.
        matmul = ir.node("MatMul", [x, packed_w])
        biases = _biases(nodes, widths)
        packed_out, new_nodes = matmul.outputs[0], [matmul]
        if biases is not None:  # one Add of the concatenated biases before the Split (Qwen2's Q/K/V biases)
            adds, bias_values = biases
            packed_b = ir.Value(name=f"packed_bias[{name}]", shape=ir.Shape([sum(widths)]),
                                type=ir.TensorType(bias_values[0].dtype))
            packed_b.const_value = derived(bias_values, lambda *a: np.concatenate(a), bias_values[0].dtype,
                                           [sum(widths)], packed_b.name)
            graph.register_initializer(packed_b)
            add = ir.node("Add", [matmul.outputs[0], packed_b])
            packed_out, new_nodes = add.outputs[0], [matmul, add]
        split = ir.node("Split", [packed_out, split_sizes], attributes={"axis": -1}, num_outputs=len(nodes))
        graph.insert_before(nodes[0], [*new_nodes, split])
        olds = [a.outputs[0] for a in biases[0]] if biases is not None else [n.outputs[0] for n in nodes]
        for old, new in zip(olds, split.outputs, strict=True):
            replace_value(old, new)
        if biases is not None:
            for a in biases[0]:
                graph.remove(a, safe=True)
        for old, w in zip(nodes, weights, strict=True):
            graph.remove(old, safe=True)
            del graph.initializers[w.name]
        packed += 1
    return {"matches": packed}
