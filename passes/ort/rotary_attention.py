"""ONNX Runtime backend fusion: a layer's attention front end -> one ``llmc.RotaryPagedAttention``.

After the passes, every layer of a rotary model reaches attention through seven nodes::

    qkv [1, T, (H+2Hkv)*D] -> Split -> q -> RotaryEmbedding(cos, sin) -> Reshape [T, H*D]   -> PagedAttention
                                    -> k -> RotaryEmbedding(cos, sin) -> Reshape [T, Hkv*D] ->
                                    -> v -----------------------------> Reshape [T, Hkv*D] ->

On a small model each node's fixed cost in ONNX Runtime is a visible part of a decode step, and the
rotations are copies of Q and K. llmc's native library reads Q, K and V straight out of ``qkv`` by row
stride, rotates Q into a per-thread buffer and K on its way into the cache (same arithmetic as ORT's
RotaryEmbedding), so the seven nodes become one. Only the native route has this op, which is why this is a
backend lowering and not a graph pass: the TensorRT lowering and the Python-op route keep the unfused form,
and so does any layer whose pattern differs (partial or interleaved rotary, position ids, an fp8-emulated
KV cache between the rotation and attention).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from llmc.passes.base import replace_value
from llmc.passes.lazy import constant_of
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, ROTARY_OP_TYPE


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _rotary(value: ir.Value | None, heads: int, head_size: int) -> ir.Node | None:
    """The rotate-half, full-width RotaryEmbedding (cos/sin per row, no position ids) behind a Reshape."""
    reshape = _producer(value, "Reshape")
    rot = _producer(reshape.inputs[0], "RotaryEmbedding") if reshape is not None else None
    if rot is None or len(rot.inputs) < 3 or any(i is not None for i in rot.inputs[3:]):  # no position_ids
        return None
    if rot.attributes.get_int("interleaved", 0) != 0 or rot.attributes.get_int("num_heads", 0) != heads:
        return None
    if rot.attributes.get_int("rotary_embedding_dim", 0) not in (0, head_size):
        return None
    return rot


def _split_sizes(split: ir.Node) -> list[int] | None:
    if len(split.inputs) < 2:
        return None
    tensor = constant_of(split.inputs[1])
    return [int(x) for x in tensor.numpy().tolist()] if tensor is not None else None


def _fuse(graph: ir.Graph, node: ir.Node) -> bool:
    h, hkv, d = (node.attributes.get_int(n) for n in ("num_heads", "num_kv_heads", "head_size"))
    # 8: with attention sinks, 9: with attend_end (input 7 then possibly empty); both carried as they are.
    if not (h and hkv and d) or d % 2 or len(node.inputs) not in (7, 8, 9):
        return False
    rq, rk = _rotary(node.inputs[0], h, d), _rotary(node.inputs[1], hkv, d)
    v_reshape = _producer(node.inputs[2], "Reshape")
    if rq is None or rk is None or v_reshape is None:
        return False
    if rq.inputs[1] is not rk.inputs[1] or rq.inputs[2] is not rk.inputs[2]:
        return False
    xq, xk, xv = rq.inputs[0], rk.inputs[0], v_reshape.inputs[0]
    split = _producer(xq, "Split")
    if split is None or len(split.outputs) != 3 or list(split.outputs) != [xq, xk, xv]:
        return False
    qkv = split.inputs[0]
    known = qkv if qkv.shape is not None else xq  # a Split output has its input's rank and type
    axis = split.attributes.get_int("axis", 0)
    if axis != -1 and (known.shape is None or axis != len(known.shape) - 1):
        return False
    if _split_sizes(split) != [h * d, hkv * d, hkv * d] or known.dtype not in (None, ir.DataType.FLOAT):
        return False
    # Sinks and attend_end stay inputs 7 and 8.
    fused = ir.node(ROTARY_OP_TYPE, [qkv, rq.inputs[1], rq.inputs[2], *node.inputs[3:]],
                    attributes={**{k: a.value for k, a in node.attributes.items()}, "rotary_interleaved": 0},
                    domain=DOMAIN, name=f"{node.name}.rotary" if node.name else None)
    graph.insert_before(node, fused)
    replace_value(node.outputs[0], fused.outputs[0])
    graph.remove(node, safe=True)
    return True


def fuse_rotary_attention(model: ir.Model) -> int:
    """Fuse every matching layer (see the module docstring); returns how many. Unused nodes are removed."""
    graph = model.graph
    count = sum(_fuse(graph, n) for n in list(graph) if n.domain == DOMAIN and n.op_type == OP_TYPE)
    if count:
        RemoveUnusedNodesPass()(model)
    return count
