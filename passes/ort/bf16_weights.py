"""ONNX Runtime backend lowering: ``MatMul(x, W)`` over a float32 weight whose values are all bfloat16 ->
``llmc.Bf16MatMul(x, packed W)``.

Checkpoints ship bfloat16 (gpt-oss's attention, router and LM head; most Llama-family checkpoints whole), and the
CPU engine computes in float32. Widening a bfloat16 to float32 is exact, so keeping such a weight in bfloat16 and
widening it in the kernel computes the same products as a float32 MatMul while a decode step, which reads every
weight once, reads half the bytes. Nothing is rounded: a weight is lowered only when it is known to hold bfloat16
values -- every tensor it was made from (through the weight-layout transposes and the pack-projections concats) was
stored as bfloat16 in the checkpoint -- or, where its provenance is not known, when its values are checked to be.
A weight another node also reads (a tied embedding) stays float32, so the engine never holds two copies.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.passes.base import replace_value
from llmc.passes.lazy import SOURCE_DTYPE, constant_of, derivation_of, derived
from llmc.plugins.bf16_matmul import OP_TYPE, PANEL, bf16_exact, pack
from llmc.plugins.paged_attention import DOMAIN


def _stored_bf16(tensor: ir.TensorProtocol) -> bool | None:
    """True if every tensor ``tensor`` was derived from (by transposes and concats) was stored as bfloat16, False if
    one was stored otherwise, None if that is not known (a tensor made some other way)."""
    derivation = derivation_of(tensor)
    if derivation is not None:
        verdicts = [_stored_bf16(source) for source in derivation.sources]
        return False if False in verdicts else (None if None in verdicts else True)
    meta = getattr(tensor, "meta", None)
    dtype = meta.get(SOURCE_DTYPE) if meta is not None else None
    return None if dtype is None else dtype == "bfloat16"


def _exact(tensor: ir.TensorProtocol) -> bool:
    stored = _stored_bf16(tensor)
    if stored is not None:
        return stored
    return bf16_exact(tensor.numpy())  # provenance unknown: read it (one weight, bounded)


def lower_bf16_weights(model: ir.Model) -> int:
    """Rewrite every float32 ``MatMul(x, W)`` with a 2-D bfloat16-valued initializer ``W`` read by that node only;
    returns how many."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        weight = node.inputs[1]
        tensor = constant_of(weight)
        if (tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2 or len(weight.uses()) != 1
                or weight.is_graph_output()):
            continue
        k, n = (int(d) for d in tensor.shape)
        if k == 0 or n == 0 or not _exact(tensor):
            continue
        panels = -(-n // PANEL)
        packed = ir.Value(name=f"{weight.name}.bf16", shape=ir.Shape([panels, k, PANEL]),
                          type=ir.TensorType(ir.DataType.UINT16))
        packed.const_value = derived([tensor], pack, ir.DataType.UINT16, [panels, k, PANEL], packed.name)
        graph.register_initializer(packed)
        new = ir.node(OP_TYPE, [node.inputs[0], packed], attributes={"N": n}, domain=DOMAIN)
        graph.insert_before(node, [new])
        replace_value(node.outputs[0], new.outputs[0])
        graph.remove(node, safe=True)
        if not weight.uses() and weight.name in graph.initializers:
            del graph.initializers[weight.name]
        count += 1
    if count:
        model.opset_imports[DOMAIN] = model.opset_imports.get(DOMAIN, 1)
    return count
