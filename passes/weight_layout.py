"""Weight layout: replace ``Transpose(W)`` of a weight by the transposed weight itself.

torch exports ``nn.Linear`` as ``MatMul(x, Transpose(W))``; without this pass the transpose
would run at every step or be folded by the runtime at load. The transposed weight is lazy
(computed when the engine is written), so the build still streams weights.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.passes.lazy import constant_of, transposed


def transpose_weights(model: ir.Model) -> dict[str, int]:
    """Fold ``Transpose`` nodes whose only input is an initializer used by nothing else."""
    graph = model.graph
    matches = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "":
            continue
        src = node.inputs[0]
        tensor = constant_of(src)
        if tensor is None or len(src.uses()) != 1 or src in graph.outputs:
            continue
        rank = len(tensor.shape)
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.value) if perm_attr is not None else list(range(rank))[::-1]
        shape = [tensor.shape[p] for p in perm]
        name = f"{src.name}.T" if perm == [1, 0] else f"{src.name}.perm{''.join(map(str, perm))}"
        new = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype))
        new.const_value = transposed(tensor, perm, name)
        graph.register_initializer(new)
        ir.convenience.replace_all_uses_with(node.outputs[0], new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        del graph.initializers[src.name]
        matches += 1
    return {"matches": matches}
