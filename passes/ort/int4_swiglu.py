"""ONNX Runtime backend fusion: ``Int4MatMul -> Split -> llmc.SwiGLU`` -> one ``Int4MatMul(activation=1)``.

The packed gate/up projection of an INT4 MLP (pack-projections, then the quantize pass's
``llmc.Int4MatMul``) reaches the activation through a Split, and SwiGLU itself lowers to ORT's
QuickGelu and a Mul: three nodes after the matmul, and a ``[tokens, 2H]`` intermediate written and
read back. llmc's kernel can apply SwiGLU in its epilogue when a thread holds a column's gate and up
results together, so the weight tiles are reordered (gate tile i, then up tile i: a permutation of
the packed tensors' first axis, no re-quantization) and the node writes ``[tokens, H]`` directly.
On a small model each node's fixed cost is a visible part of a decode step, which is the point.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.passes.base import remove_unused, replace_value
from llmc.passes.lazy import constant_of, derived
from llmc.plugins.int4_matmul.pack import gate_up_order
from llmc.plugins.paged_attention import DOMAIN

INT4_OP = "Int4MatMul"


def _fuse(graph: ir.Graph, swiglu: ir.Node) -> bool:
    gate, up = swiglu.inputs
    split = gate.producer() if gate is not None else None
    if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.outputs) != 2:
        return False
    if list(split.outputs) != [gate, up] or len(gate.uses()) != 1 or len(up.uses()) != 1:
        return False
    mm = split.inputs[0].producer()
    if mm is None or mm.op_type != INT4_OP or mm.domain != DOMAIN or mm.attributes.get_int("activation", 0) != 0:
        return False
    n = mm.attributes.get_int("N")
    sizes = constant_of(split.inputs[1]) if len(split.inputs) > 1 else None
    if n is None or n % 32 or sizes is None or sizes.numpy().tolist() != [n // 2, n // 2]:
        return False
    if split.attributes.get_int("axis", 0) != -1 or len(mm.outputs[0].uses()) != 1:
        return False
    order = gate_up_order(n)
    tensors = [constant_of(v) for v in mm.inputs[1:4]]
    if any(t is None for t in tensors):
        return False
    new_inputs = [mm.inputs[0]]
    for value, tensor in zip(mm.inputs[1:4], tensors, strict=True):
        reordered = ir.Value(name=f"{value.name}.gate_up", shape=ir.Shape(list(tensor.shape)), type=value.type)
        reordered.const_value = derived([tensor], lambda a: a[order], tensor.dtype, list(tensor.shape), reordered.name)
        graph.register_initializer(reordered)
        new_inputs.append(reordered)
    fused = ir.node(INT4_OP, new_inputs, attributes={**{k: a.value for k, a in mm.attributes.items()}, "activation": 1},
                    domain=DOMAIN)
    graph.insert_before(swiglu, fused)
    replace_value(swiglu.outputs[0], fused.outputs[0])
    graph.remove(swiglu, safe=True)
    return True


def fuse_int4_swiglu(model: ir.Model) -> int:
    """Fuse every matching ``llmc.SwiGLU`` into its INT4 gate/up matmul; returns how many. Unused nodes and
    initializers (the original tile order) are removed."""
    graph = model.graph
    count = sum(_fuse(graph, n) for n in list(graph) if n.domain == DOMAIN and n.op_type == "SwiGLU")
    if count:
        remove_unused(model)
    return count

