"""ONNX Runtime backend lowering (native route): LoRA slot updates -> ``llmc.LoraApply`` nodes.

llmc.passes.lora writes each update in standard ops, ``Add(y, MatMul(Mul(MatMul(x, A), mask), B))``, which
computes every slot's ``x A`` and masks all but the token's own; for a packed projection (Q|K|V, gate|up) the
updates of its parts arrive as one ``Add(P, Concat(d_1, ..., d_n))`` (passes/lora.fold_into_packed). llmc's
native library computes each token's own slot only, in one node (plugins/lora/csrc/ort_lora.cpp): one
``LoraApply`` per update, a chain of them with column offsets for a packed projection. On the default model
at batch 8 the standard-op form's LoRA GEMMs took about as long as the whole base model's step.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from llmc.passes.base import replace_value
from llmc.plugins.paged_attention import DOMAIN

OP_TYPE = "LoraApply"


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _slot_input(value: ir.Value | None) -> bool:
    return value is not None and value.producer() is None and value.const_value is None


def _delta(value: ir.Value | None) -> tuple | None:
    """``MatMul(Mul(MatMul(x, A), mask), B)`` with A/B graph inputs -> (x, A, B, rank, slots)."""
    expand = _producer(value, "MatMul")
    keep = _producer(expand.inputs[0], "Mul") if expand is not None else None
    shrink = _producer(keep.inputs[0], "MatMul") if keep is not None else None
    if shrink is None or not (expand.inputs[1].name.endswith(".lora_B") and _slot_input(expand.inputs[1])
                              and shrink.inputs[1].name.endswith(".lora_A") and _slot_input(shrink.inputs[1])):
        return None
    cast = _producer(keep.inputs[1], "Cast")
    equal = _producer(cast.inputs[0], "Equal") if cast is not None else None
    unsq = _producer(equal.inputs[0], "Unsqueeze") if equal is not None else None
    owner = equal.inputs[1].const_value if equal is not None else None
    if unsq is None or owner is None or not _slot_input(unsq.inputs[0]):
        return None
    rank = int((owner.numpy() == 1).sum())
    return shrink.inputs[0], shrink.inputs[1], expand.inputs[1], rank, unsq.inputs[0]


def _parts(delta: ir.Value) -> list[tuple[tuple, int]] | None:
    """The updates ``delta`` adds, each with its column offset."""
    one = _delta(delta)
    if one is not None:
        return [(one, 0)]
    concat = _producer(delta, "Concat")
    if concat is None or concat.attributes.get_int("axis", 0) != -1:
        return None
    parts, offset = [], 0
    for v in concat.inputs:
        m = _delta(v)
        if m is None or m[2].shape is None:
            return None
        parts.append((m, offset))
        offset += int(m[2].shape[1])
    return parts


MAX_PARTS = 3  # LoraApply's optional inputs: a packed Q|K|V's three parts in one node


def _swiglu_after(value: ir.Value) -> tuple[ir.Node, ir.Node, ir.Node] | None:
    """``Split(value) -> QuickGelu(gate, alpha=1) * up`` (llmc.SwiGLU as lowered for ONNX Runtime, on a packed
    gate|up projection) -> (split, quick_gelu, mul), when nothing else reads those values."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    split = uses[0].node
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.outputs) != 2 \
            or split.attributes.get_int("axis", 0) != -1 or len(split.inputs) < 2:
        return None
    sizes = split.inputs[1].const_value if split.inputs[1] is not None else None
    if sizes is None or len(set(sizes.numpy().tolist())) != 1:  # two equal halves: [gate | up]
        return None
    gate, up = split.outputs
    if len(gate.uses()) != 1 or len(up.uses()) != 1 or gate.is_graph_output() or up.is_graph_output():
        return None
    gelu = next(iter(gate.uses())).node
    if gelu.op_type != "QuickGelu" or gelu.domain != "com.microsoft" or gelu.attributes.get_float("alpha", 1.0) != 1.0:
        return None
    silu = gelu.outputs[0]
    uses = list(silu.uses())
    if len(uses) != 1 or silu.is_graph_output():
        return None
    mul = uses[0].node
    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or set(mul.inputs) != {silu, up}:
        return None
    return split, gelu, mul


def lower_lora(model: ir.Model) -> int:
    """Replace every LoRA update by a ``LoraApply`` node (one per packed projection, with its parts' column offsets;
    a gate|up projection's SwiGLU taken in too); returns how many updates (Adds) were lowered."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        parts = _parts(node.inputs[1])
        if parts is None:
            continue
        prev, new = node.inputs[0], []
        for start in range(0, len(parts), MAX_PARTS):
            group = parts[start: start + MAX_PARTS]
            (x, a, b, rank, slots), offset = group[0]
            inputs = [prev, x, a, b, slots]
            attrs = {"rank": rank, "offset": offset}
            for i, ((x_i, a_i, b_i, rank_i, slots_i), offset_i) in enumerate(group[1:], start=1):
                if x_i is not x or rank_i != rank or slots_i is not slots:
                    break  # parts of another input or rank: a node of their own
                inputs += [a_i, b_i]
                attrs[f"offset{i}"] = offset_i
            else:
                n = ir.node(OP_TYPE, inputs, attributes=attrs, domain=DOMAIN)
                new.append(n)
                prev = n.outputs[0]
                continue
            for (x_i, a_i, b_i, rank_i, slots_i), offset_i in group:
                n = ir.node(OP_TYPE, [prev, x_i, a_i, b_i, slots_i], attributes={"rank": rank_i, "offset": offset_i},
                            domain=DOMAIN)
                new.append(n)
                prev = n.outputs[0]
        graph.insert_before(node, new)
        replace_value(node.outputs[0], prev)
        graph.remove(node, safe=True)
        last = new[-1]
        swiglu = _swiglu_after(last.outputs[0]) if len(new) == 1 else None
        if swiglu is not None:
            split, gelu, mul = swiglu
            last.attributes["activation"] = ir.AttrInt64("activation", 1)
            replace_value(mul.outputs[0], last.outputs[0])
            for dead in (mul, gelu, split):
                graph.remove(dead, safe=True)
        count += 1
    if count:
        RemoveUnusedNodesPass()(model)  # the standard-op updates and the slot masks
    return count
