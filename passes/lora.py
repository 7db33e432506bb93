"""Multi-LoRA slots: ``y = x W + B_slot(A_slot x)`` for every targeted linear, the slot chosen per token.

An engine built with ``--lora-slots S --max-lora-rank R`` takes, besides its usual inputs, ``lora_slots``
(``[tokens]`` int64: 0 or -1 = no adapter, ``1..S`` = that slot) and, per targeted linear, the stacked
adapters of all slots as two graph inputs (bound by the runtime at every step, never baked into the
artifact): ``<module>.lora_A`` ``[in, S*R]`` (column block ``s-1`` holds slot ``s``'s ``A^T``) and
``<module>.lora_B`` ``[S*R, out]`` (row block ``s-1`` holds its ``(scaling * B)^T``), ranks below ``R``
zero-padded. ``<module>`` is the Hugging Face module path (``model.layers.0.self_attn.q_proj``), which is
what PEFT's tensor names carry.

The graph states the update in standard ONNX ops: every token's ``x A`` for all slots at once (one ``[in, S*R]``
GEMM), the columns of other slots zeroed by a ``[tokens, S*R]`` mask, one ``[S*R, out]`` GEMM adding the chosen
slot's update (``S*R*(in + out)`` multiply-adds per token and linear). That form is the semantics every pass and
the pass verifier run; the backends lower it to kernels that compute each token's own slot only
(``R*(in + out)``): ``llmc.LoraApply`` in llmc's ONNX Runtime library (passes/ort/lora_apply.py) and the
CUDA engine's ``LoraApply`` node with its shrink/expand Triton kernels (compiler/backends/cuda.py, plugins/lora).

This runs right after tracing, before any fusion, while each linear is still ``MatMul(x, Transpose(W))``
with ``W`` named by its checkpoint key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx_ir as ir

from llmc.errors import LlmcError, UnsupportedError

# --lora-targets names -> the Hugging Face module names (Llama/Mistral/Qwen/Gemma families).
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
DEFAULT_TARGETS = tuple(TARGETS)
SLOT_INPUT = "lora_slots"
MAX_SLOTS = 64
MAX_RANK = 256


@dataclass(frozen=True)
class LoraSite:
    """One linear with LoRA slots: its module path, its width in and out, and its two graph inputs."""

    module: str
    in_features: int
    out_features: int
    a_input: str
    b_input: str


@dataclass(frozen=True)
class LoraGeometry:
    """What the manifest's ``lora`` section records (the runtime reads it back: llmc.runtime.lora)."""

    slots: int
    max_rank: int
    targets: tuple[str, ...]
    sites: tuple[LoraSite, ...]

    def to_json(self) -> dict:
        return {"slots": self.slots, "max_rank": self.max_rank, "targets": list(self.targets),
                "slot_input": SLOT_INPUT, "modules": [asdict(s) for s in self.sites]}


def check_options(slots: int, max_rank: int, targets: tuple[str, ...]) -> None:
    """Refuse bad --lora-* flags before any work (exit 2)."""
    if not 1 <= slots <= MAX_SLOTS:
        raise LlmcError(f"--lora-slots {slots}: must be from 1 to {MAX_SLOTS} (adapters resident at once; more "
                        "adapters than slots take turns)")
    if not 1 <= max_rank <= MAX_RANK:
        raise LlmcError(f"--max-lora-rank {max_rank}: must be from 1 to {MAX_RANK} (the largest adapter rank the "
                        "engine accepts; smaller ranks are zero-padded)")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise LlmcError(f"--lora-targets {','.join(targets) or '(empty)'}: {unknown[0] if unknown else 'no target'} is "
                        f"not one of {','.join(TARGETS)}; give a comma-separated subset")


def _weight_of(node: ir.Node) -> ir.Value | None:
    """The checkpoint weight ``W`` of a traced linear ``MatMul(x, Transpose(W))``, else None."""
    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
        return None
    producer = node.inputs[1].producer() if node.inputs[1] is not None else None
    if producer is None or producer.op_type != "Transpose":
        return None
    perm = producer.attributes.get("perm")
    w = producer.inputs[0]
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    if perm is not None and list(perm.value) != [1, 0]:
        return None
    return w


def add_lora(model: ir.Model, slots: int, max_rank: int, targets: tuple[str, ...]) -> LoraGeometry:
    """Add the slots to every linear of ``targets`` in place; returns the geometry for the manifest.

    Refuses (exit 3) a model in which no linear of the targets is found (its modules have other names)."""
    check_options(slots, max_rank, targets)
    graph = model.graph
    suffixes = {f".{TARGETS[t]}.weight" for t in targets}
    width = slots * max_rank
    slot_in = ir.Value(name=SLOT_INPUT, shape=ir.Shape(["tokens"]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(slot_in)
    # Column j of every slot stack belongs to slot j // R + 1: a token's mask keeps its own slot's columns.
    owner = ir.Value(name="lora_column_slot", shape=ir.Shape([width]), type=ir.TensorType(ir.DataType.INT64))
    owner.const_value = ir.tensor(np.repeat(np.arange(1, slots + 1, dtype=np.int64), max_rank), name=owner.name)
    graph.register_initializer(owner)
    axis = ir.Value(name="lora_unsqueeze_axis", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    axis.const_value = ir.tensor(np.asarray([1], np.int64), name=axis.name)
    graph.register_initializer(axis)
    masks: dict[int, ir.Value] = {}  # per float dtype
    sites: list[LoraSite] = []
    for node in list(graph):
        w = _weight_of(node)
        if w is None or not any(w.name.endswith(s) for s in suffixes):
            continue
        module = w.name[: -len(".weight")]
        out_features, in_features = (int(d) for d in w.const_value.shape)
        dtype = w.const_value.dtype
        if int(dtype) not in masks:
            unsq = ir.node("Unsqueeze", [slot_in, axis])
            eq = ir.node("Equal", [unsq.outputs[0], owner])
            cast = ir.node("Cast", [eq.outputs[0]], attributes={"to": dtype})
            graph.insert_before(next(iter(graph)), [unsq, eq, cast])
            masks[int(dtype)] = cast.outputs[0]
        a = ir.Value(name=f"{module}.lora_A", shape=ir.Shape([in_features, width]), type=ir.TensorType(dtype))
        b = ir.Value(name=f"{module}.lora_B", shape=ir.Shape([width, out_features]), type=ir.TensorType(dtype))
        graph.inputs.extend([a, b])
        y = node.outputs[0]
        shrink = ir.node("MatMul", [node.inputs[0], a])
        keep = ir.node("Mul", [shrink.outputs[0], masks[int(dtype)]])
        expand = ir.node("MatMul", [keep.outputs[0], b])
        add = ir.node("Add", [y, expand.outputs[0]])
        graph.insert_after(node, [shrink, keep, expand, add])
        for use in list(y.uses()):
            if use.node is not add:
                use.node.replace_input_with(use.idx, add.outputs[0])
        sites.append(LoraSite(module, in_features, out_features, a.name, b.name))
    if not sites:
        raise UnsupportedError(f"--lora-targets {','.join(targets)}: no linear layer of this model is named "
                               f"{' / '.join(sorted(TARGETS[t] for t in targets))}; LoRA slots are built for "
                               "Llama-style module names only")
    return LoraGeometry(slots, max_rank, tuple(targets), tuple(sites))


def _is_delta(value: ir.Value | None) -> bool:
    """Whether ``value`` is a slot update's expand GEMM (``MatMul(..., <module>.lora_B)``)."""
    node = value.producer() if value is not None else None
    return (node is not None and node.op_type == "MatMul" and node.inputs[1] is not None
            and node.inputs[1].name.endswith(".lora_B") and node.inputs[1].producer() is None)


def fold_into_packed(model: ir.Model) -> int:
    """After pack-projections, move the slot updates of packed projections in front of their Split:
    ``Split(P) -> o_i``, ``o_i + d_i`` becomes ``Split(P + Concat(d_i))``. The Split's outputs then feed attention
    directly again, which the CPU backend's rotary-attention fusion needs (without it a decode step of the default
    model took 2.5 ms more). Only where every output of the Split has an update. Returns how many Splits."""
    graph = model.graph
    count = 0
    for split in [n for n in graph if n.op_type == "Split" and n.domain == ""]:
        if split.attributes.get_int("axis", 0) != -1:
            continue
        adds = []
        for out in split.outputs:
            uses = list(out.uses())
            if len(uses) != 1 or out.is_graph_output():
                break
            add = uses[0].node
            if add.op_type != "Add" or add.inputs[0] is not out or not _is_delta(add.inputs[1]):
                break
            adds.append(add)
        if len(adds) != len(split.outputs):
            continue
        concat = ir.node("Concat", [a.inputs[1] for a in adds], attributes={"axis": -1})
        total = ir.node("Add", [split.inputs[0], concat.outputs[0]])
        graph.insert_before(split, [concat, total])
        split.replace_input_with(0, total.outputs[0])
        for out, add in zip(split.outputs, adds, strict=True):
            ir.convenience.replace_all_uses_with(add.outputs[0], out, replace_graph_outputs=True)
            graph.remove(add, safe=True)
        count += 1
    if count:
        graph.sort()  # the updates were computed after the Split they now feed
    return count
