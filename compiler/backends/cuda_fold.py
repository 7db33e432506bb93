"""Shape arithmetic the CUDA lowering evaluates at build time: integer values that depend only on constants and on
the static dimensions of activations (``Gather(Shape(x), i)`` where ``x``'s dimension ``i`` is a number).

Why: a program's ``Shape`` is host metadata (a CPU tensor), so a chain such as Qwen3.5's interleaved M-RoPE
(``Range(0, Shape(sin)[-1])`` sliced into the indices of a ``ScatterND``) would mix host tensors with device constants
inside a step: an error on a GPU (a CPU tensor indexed by a device index), and host-to-device copies that a CUDA graph
cannot capture. Evaluated here, the chain becomes one small int64 weight on the device. Only integer results of at
most ``MAX_ELEMENTS`` elements are folded; each op is evaluated by ONNX's reference evaluator, so folding keeps the
graph's own semantics.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

MAX_ELEMENTS = 1024
FOLDABLE = frozenset({"Shape", "Gather", "Range", "Slice", "Unsqueeze", "Squeeze", "Concat", "Add", "Sub", "Mul",
                      "Div", "Cast", "Reshape", "Identity"})
_INTS = (ir.DataType.INT64, ir.DataType.INT32)


class ShapeFolder:
    """Walk the graph's nodes in order through :meth:`fold`; it returns the values a node folds to, or None."""

    def __init__(self) -> None:
        self.known: dict[int, np.ndarray] = {}  # id(value) -> its folded value

    def value(self, v: ir.Value | None) -> np.ndarray | None:
        if v is None:
            return None
        if id(v) in self.known:
            return self.known[id(v)]
        if v.producer() is None and v.const_value is not None and v.dtype in _INTS:
            a = v.const_value.numpy()
            return a if a.size <= 64 else None
        return None

    def _static_dims(self, shape_node: ir.Node) -> list[int | None] | None:
        x = shape_node.inputs[0]
        if x is None or x.shape is None:
            return None
        dims = [d if isinstance(d, int) else None for d in x.shape]
        start = shape_node.attributes.get_int("start", 0)
        end = shape_node.attributes.get_int("end", len(dims))
        return dims[start:end]

    def fold(self, node: ir.Node) -> dict[str, np.ndarray] | None:
        if node.domain not in ("", "ai.onnx") or node.op_type not in FOLDABLE or len(node.outputs) != 1:
            return None
        out = node.outputs[0]
        if node.op_type == "Shape":
            dims = self._static_dims(node)
            if dims is None or any(d is None for d in dims):
                return None
            result = np.asarray(dims, np.int64)
        else:
            data = node.inputs[0] if node.inputs else None
            shape_of = data.producer() if data is not None and data.producer() is not None else None
            if node.op_type == "Gather" and self.value(data) is None and shape_of is not None \
                    and shape_of.op_type == "Shape":  # some dimensions of an activation: the static ones fold
                dims, idx = self._static_dims(shape_of), self.value(node.inputs[1])
                if dims is None or idx is None:
                    return None
                picked = [dims[int(i)] for i in np.asarray(idx).reshape(-1)]
                if any(d is None for d in picked):
                    return None
                result = np.asarray(picked, np.int64).reshape(np.asarray(idx).shape)
            else:
                values = [self.value(v) if v is not None else None for v in node.inputs]
                if any(v is not None and a is None for v, a in zip(node.inputs, values, strict=True)):
                    return None
                result = _evaluate(node, values)
                if result is None:
                    return None
        if result.dtype != np.int64 or result.size > MAX_ELEMENTS:
            return None
        self.known[id(out)] = result
        return {out.name: result}


def _evaluate(node: ir.Node, values: list[np.ndarray | None]) -> np.ndarray | None:
    """``node`` on constant inputs with ONNX's reference evaluator (None where it cannot run it)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if v is not None else "" for i, v in enumerate(values)]
    attrs = {}
    for name, a in node.attributes.items():
        v = a.value
        if isinstance(v, ir.TensorProtocol) or hasattr(v, "numpy"):
            return None
        attrs[name] = list(v) if isinstance(v, tuple) else v
    proto = onnx.helper.make_node(node.op_type, names, ["out"], **attrs)
    inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for n, v in zip(names, values, strict=True) if v is not None]
    graph = onnx.helper.make_graph([proto], "fold", inputs, [onnx.helper.make_tensor_value_info(
        "out", onnx.TensorProto.UNDEFINED, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    try:
        return np.asarray(ReferenceEvaluator(model).run(None, {n: v for n, v in zip(names, values, strict=True)
                                                                if v is not None})[0])
    except Exception:  # noqa: BLE001 - an op the evaluator cannot run here stays in the program
        return None
