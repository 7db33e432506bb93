"""Head layout: drop the per-head reshapes and transposes between the projections and attention.

transformers computes attention on ``[batch, heads, seq, head_size]``, and llmc's packed-token
attention op takes ``[tokens, heads * head_size]``; the traced graph moves each of Q, K and V from
the projection's ``[1, T, H*D]`` to the op's ``[T, H*D]`` through six layout nodes (rotary in
between for Q and K)::

    s [1, T, H*D] -> Reshape [1, T, H, D] -> Transpose(0,2,1,3) [1, H, T, D] -> (RotaryEmbedding)
      -> Gather(axis 0, index 0) [H, T, D] -> Transpose(1,0,2) [T, H, D] -> Reshape [T, H*D]

Element ``(t, h, d)`` of the result is element ``(0, t, h*D + d)`` of ``s`` throughout, so the chain
is one ``Reshape(s, [-1, H*D])``; ``RotaryEmbedding`` takes the packed 3-D form ``[B, S, H*D]`` with
``num_heads`` (ONNX opset 23) and rotates the same rows with the same cos/sin. Per layer this removes
about 15 nodes, whose fixed cost per node dominates a decode step of a small model. Transposes copy;
ONNX Runtime runs Reshape as a view.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from llmc.passes.lazy import constant_of


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain != "":
        return None
    return node


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return list(attr.value) if attr is not None else None


def _dims(value: ir.Value) -> list | None:
    return list(value.shape) if value.shape is not None else None


def _is_first_row(gather: ir.Node) -> bool:
    """``Gather(x, 0, axis=0)`` with a scalar index on an ``x`` whose first dimension is 1."""
    axis = gather.attributes.get("axis")
    if axis is not None and axis.value != 0:
        return False
    index = constant_of(gather.inputs[1])
    if index is None or len(index.shape) != 0 or int(index.numpy()) not in (0, -1):
        return False
    dims = _dims(gather.inputs[0])
    return dims is not None and len(dims) == 4 and dims[0] == 1


def _match(final: ir.Node) -> tuple[ir.Value, ir.Node | None, int, int] | None:
    """For a ``Reshape`` ending the head-layout chain: (source ``[1, T, H*D]``, its rotary or None, H, D)."""
    out = _dims(final.outputs[0])
    if out is None or len(out) != 2 or not isinstance(out[1], int):
        return None
    t2 = _producer(final.inputs[0], "Transpose")
    if t2 is None or _perm(t2) != [1, 0, 2]:
        return None
    gather = _producer(t2.inputs[0], "Gather")
    if gather is None or not _is_first_row(gather):
        return None
    rotary = _producer(gather.inputs[0], "RotaryEmbedding")
    if rotary is not None:
        # cos/sin given per [batch, seq] position; position_ids would index a cache instead (keep it simple).
        if len(rotary.inputs) != 3 or any(v is None for v in rotary.inputs):
            return None
        heads_in = rotary.inputs[0]
    else:
        heads_in = gather.inputs[0]
    t1 = _producer(heads_in, "Transpose")
    if t1 is None or _perm(t1) != [0, 2, 1, 3]:
        return None
    r1 = _producer(t1.inputs[0], "Reshape")
    if r1 is None:
        return None
    split = _dims(r1.outputs[0])
    source = r1.inputs[0]
    src = _dims(source)
    if split is None or src is None or len(split) != 4 or len(src) != 3 or split[0] != 1 or src[0] != 1:
        return None
    heads, head_size = split[2], split[3]
    if not (isinstance(heads, int) and isinstance(head_size, int) and src[2] == heads * head_size == out[1]):
        return None
    if rotary is not None:
        attr = rotary.attributes.get("num_heads")
        if attr is not None and attr.value != heads:
            return None
    return source, rotary, heads, head_size


def fold_head_layout(model: ir.Model) -> dict[str, int]:
    """Replace every head-layout chain (see the module docstring) by one Reshape (and a packed rotary)."""
    graph = model.graph
    shapes: dict[int, ir.Value] = {}
    matches = rotaries = 0
    for node in list(graph):
        if node.op_type != "Reshape" or node.domain != "":
            continue
        found = _match(node)
        if found is None:
            continue
        source, rotary, heads, head_size = found
        width = heads * head_size
        new_nodes: list[ir.Node] = []
        x = source
        if rotary is not None:
            attrs = {k: a.value for k, a in rotary.attributes.items()}
            attrs["num_heads"] = heads
            packed = ir.node("RotaryEmbedding", [source, rotary.inputs[1], rotary.inputs[2]], attributes=attrs)
            packed.outputs[0].shape = ir.Shape(list(source.shape))
            packed.outputs[0].type = source.type
            new_nodes.append(packed)
            x = packed.outputs[0]
            rotaries += 1
        if width not in shapes:
            shape = ir.Value(name=f"head_layout.shape_{width}", shape=ir.Shape([2]),
                             type=ir.TensorType(ir.DataType.INT64))
            shape.const_value = ir.tensor(np.asarray([-1, width], np.int64), name=shape.name)
            graph.register_initializer(shape)
            shapes[width] = shape
        reshape = ir.node("Reshape", [x, shapes[width]])
        new_nodes.append(reshape)
        graph.insert_before(node, new_nodes)
        old = node.outputs[0]
        reshape.outputs[0].shape, reshape.outputs[0].type = old.shape, old.type
        # The old chain's last value keeps its name (graph outputs and readable names survive).
        name = old.name
        old.name = f"{name}.replaced"
        reshape.outputs[0].name = name
        ir.convenience.replace_all_uses_with(old, reshape.outputs[0], replace_graph_outputs=True)
        matches += 1
    if matches:
        RemoveUnusedNodesPass()(model)  # the old chains (unless something else still reads them)
    return {"matches": matches, "packed_rotaries": rotaries}
