"""llmc-domain ops -> what ONNX Runtime executes (the ONNX Runtime backend's route-dependent lowering).

``PagedAttention`` stays in the ``llmc`` domain (``attention="native"``: llmc's custom-op library) or moves to
onnxruntime-extensions' domain (``"pyop"``: a Python op); SkipRMSNormalization and SwiGLU become ONNX Runtime contrib
ops. Ops only llmc's native library runs (INT4, MXFP4, recurrent) are refused on the Python-op route.
"""

from __future__ import annotations

import onnx_ir as ir

from llmc.errors import LlmcError
from llmc.passes.base import replace_value
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, OPSET_VERSION, ROTARY_OP_TYPE
from llmc.plugins.recurrent import CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE

ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"
MS_DOMAIN = "com.microsoft"
ATTENTION_ROUTES = ("native", "pyop")
_NATIVE_ONLY = {"Int4MatMul": "llmc.Int4MatMul runs only in llmc's native custom-op library; build with the native "
                              "attention route, or with --int4-kernel mlas (ONNX Runtime's MatMulNBits)"}


def _lower_skip_rms_norm(graph: ir.Graph, node: ir.Node) -> None:
    # ORT's SkipSimplifiedLayerNormalization: outputs (y, mean, inv_std_var, input+skip sum).
    eps = node.attributes["epsilon"].value
    shape = node.inputs[0].shape
    if shape is None or shape.rank() not in (2, 3):
        # ORT's kernel takes 2-D or 3-D input only; a norm over per-head 4-D tensors (HunYuan normalizes
        # rotated queries and keys, and rotary ends in an Add) runs as the two standard ops.
        a, b, weight = node.inputs
        add = ir.node("Add", [a, b])
        norm = ir.node("RMSNormalization", [add.outputs[0], weight], attributes={"epsilon": eps, "axis": -1})
        graph.insert_before(node, [add, norm])
        replace_value(node.outputs[0], norm.outputs[0])
        replace_value(node.outputs[1], add.outputs[0])
        graph.remove(node, safe=True)
        return
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


def _to_python_op(node: ir.Node) -> None:
    """PagedAttention -> onnxruntime-extensions' Python op of the same semantics."""
    from llmc.plugins.paged_attention import ATTEND_END_INDEX, OPTIONAL_ATTRS, PYOP_ATTEND_END, PYOP_EXTENDED

    node.domain = ORT_CONTRIB_DOMAIN
    sinks = len(node.inputs) > 7 and node.inputs[7] is not None
    attend_end = node.inputs[ATTEND_END_INDEX] if len(node.inputs) > ATTEND_END_INDEX else None
    if sinks:  # attention sinks: the 8-input Python op
        node.op_type = OP_TYPE + "Sinks"
    if attend_end is not None:
        # Python ops have no optional inputs: attend_end becomes the last of exactly the inputs the op declares
        # (an empty sinks slot dropped), on the op that declares every optional attribute.
        node.op_type += PYOP_ATTEND_END
        if not sinks:
            node.replace_input_with(7, attend_end)
            node.resize_inputs(8)
    if attend_end is not None or any(name in node.attributes for name in OPTIONAL_ATTRS):
        # ALiBi / chunked local attention: the Python op that declares them, which needs them all set.
        node.op_type += PYOP_EXTENDED
        for name, off in OPTIONAL_ATTRS.items():
            if name not in node.attributes:
                make = ir.AttrFloat32 if isinstance(off, float) else ir.AttrInt64
                node.attributes[name] = make(name, off)


def _native_only(node: ir.Node) -> str | None:
    if node.op_type in _NATIVE_ONLY:
        return _NATIVE_ONLY[node.op_type]
    if node.op_type in ("Mxfp4MoEMatMul", "Mxfp4MoEMatMulQ8"):  # MXFP4 experts (passes/mxfp4_experts)
        return "llmc.Mxfp4MoEMatMul runs only in llmc's native custom-op library; build with the native attention route"
    if node.op_type in (CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE):  # recurrent-state ops: native library only
        return (f"llmc.{node.op_type} runs only in llmc's native custom-op library; build with the native attention "
                "route")
    return None


def lower_llmc_ops(model: ir.Model, attention: str) -> int:
    """Rewrite each llmc-domain op for ``attention``'s route; returns how many nodes it rewrote."""
    if attention not in ATTENTION_ROUTES:
        raise ValueError(f"attention route {attention!r}: expected one of {', '.join(ATTENTION_ROUTES)}")
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        if node.op_type == OP_TYPE:
            if attention == "pyop":
                _to_python_op(node)
        elif node.op_type == ROTARY_OP_TYPE:  # made by the rotary-attention fusion, on the native route only
            continue
        elif (refusal := _native_only(node)) is not None:
            if attention == "pyop":
                raise LlmcError(refusal)
            continue
        elif node.op_type == "SkipRMSNormalization":
            _lower_skip_rms_norm(graph, node)
        elif node.op_type == "SwiGLU":
            _lower_swiglu(graph, node)
        else:
            raise NotImplementedError(f"the ONNX Runtime backend cannot lower llmc.{node.op_type}")
        count += 1
    return count


def set_opsets(model: ir.Model, attention: str) -> None:
    """The opset imports the lowered graph needs: llmc's domain (native) or onnxruntime-extensions' (pyop), and
    ONNX Runtime's contrib domain."""
    if attention == "pyop":
        model.opset_imports.pop(DOMAIN, None)
        model.opset_imports[ORT_CONTRIB_DOMAIN] = 1
    elif any(node.domain == DOMAIN for node in model.graph):
        model.opset_imports[DOMAIN] = OPSET_VERSION
    model.opset_imports[MS_DOMAIN] = 1
