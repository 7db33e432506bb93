"""ONNX Runtime backend fusion: gpt-oss's expert glue into the MXFP4 expert ops' epilogue.

transformers' gpt-oss experts trace, around each routed matmul (passes/mxfp4_experts), to chains of small nodes
over ``[rows, N]`` tensors: the expert bias (``GatherND(bias, ids)`` + ``Add``), after gate_up the clamped SwiGLU
over interleaved columns (two strided ``Slice``s, two ``Clip``s, ``Mul`` by alpha, ``Sigmoid``, ``Mul``, ``Add`` 1,
``Mul``), before it each token's row repeated for its k experts (``Expand`` + ``Reshape``), and after down the
routing-weighted sum of a token's k results (``Mul`` + ``Reshape`` + ``ReduceSum``). At decode batch 8 those ran
~6 ms of a ~57 ms step (a strided Slice alone ~0.25 ms), each writing and reading back a tensor the kernel held in
registers. The ops (``llmc.Mxfp4MoEMatMul`` and ``llmc.Mxfp4MoEMatMulQ8``, plugins/mxfp4/csrc/moe_epilogue.h) do
them instead (``bias`` input, ``activation=1`` with ``alpha`` and ``limit``, ``x_share`` and
``combine`` with a ``weights`` input), with the same formulas (plugins/mxfp4/reference; sigmoid from llmc's exp,
within float rounding of ORT's).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from llmc.passes.base import remove_unused, replace_value
from llmc.passes.lazy import constant_of
from llmc.plugins.mxfp4 import OP_TYPE, Q8_OP_TYPE
from llmc.plugins.paged_attention import DOMAIN

_STD = ("", "ai.onnx")
_AXES = "mxfp4_epilogue.squeeze_axes"
_OPS = (OP_TYPE, Q8_OP_TYPE)


def _n(op: ir.Node) -> int | None:
    """The op's output columns N: the Q8 op's attribute, else the blocks' ``[E, N, K/32, 16]``."""
    if op.op_type == Q8_OP_TYPE:
        return op.attributes.get_int("N")
    shape = op.inputs[2].shape
    return shape[1] if shape is not None and isinstance(shape[1], int) else None


def _std(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in _STD


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    tensor = constant_of(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = constant_of(value)
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def _only_use(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0][0] if len(uses) == 1 and not value.is_graph_output() else None


def _squeezed(op: ir.Node) -> ir.Node | None:
    """The ``Squeeze`` (axis 1) that is the only reader of the op's ``[S, 1, N]`` output, else None."""
    squeeze = _only_use(op.outputs[0])
    if not _std(squeeze, "Squeeze") or len(squeeze.inputs) < 2 or _ints(squeeze.inputs[1]) not in ([1], [-2]):
        return None
    return squeeze


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else (a if b is value else None)


def _replace_op(graph: ir.Graph, old: ir.Node, inputs: list[ir.Value | None], attributes: dict, before: ir.Node,
                result: ir.Value, squeeze: bool = True) -> None:
    """A new op node (``old``'s type) with ``inputs`` and ``attributes`` (plus ``old``'s), squeezed to ``[S, N']``
    unless ``squeeze`` is False, takes the place of ``result``."""
    new = ir.node(old.op_type, inputs, attributes={**{k: a.value for k, a in old.attributes.items()}, **attributes},
                  domain=DOMAIN)
    if not squeeze:
        graph.insert_before(before, [new])
        replace_value(result, new.outputs[0])
        return
    axes = graph.initializers.get(_AXES)
    if axes is None:
        axes = ir.Value(name=_AXES, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        axes.const_value = ir.tensor(np.array([1], dtype=np.int64), name=_AXES)
        graph.register_initializer(axes)
    squeeze = ir.node("Squeeze", [new.outputs[0], axes])
    graph.insert_before(before, [new, squeeze])
    replace_value(result, squeeze.outputs[0])


def _fuse_bias(graph: ir.Graph, op: ir.Node) -> bool:
    """``Squeeze(op) + GatherND(bias, ids)`` -> ``Squeeze(op(..., bias))``."""
    if len(op.inputs) != 4:
        return False
    squeeze = _squeezed(op)
    add = _only_use(squeeze.outputs[0]) if squeeze is not None else None
    if not _std(add, "Add"):
        return False
    gathered = _other(add, squeeze.outputs[0])
    gather = gathered.producer() if gathered is not None else None
    if not _std(gather, "GatherND") or gather.attributes.get_int("batch_dims", 0) != 0:
        return False
    bias, ids = gather.inputs
    tensor = constant_of(bias)
    n = _n(op)
    if (ids is not op.inputs[1] or tensor is None or tensor.dtype != ir.DataType.FLOAT
            or list(tensor.shape) != [op.inputs[2].shape[0], n]):
        return False
    _replace_op(graph, op, [*op.inputs, bias], {}, add, add.outputs[0])
    return True


def _through_reshapes(value: ir.Value) -> ir.Value:
    """Past ``Unsqueeze(1)`` + ``Squeeze(1)`` pairs (the trace's round trips through a unit axis)."""
    while True:
        unsq = _only_use(value)
        if not _std(unsq, "Unsqueeze") or _ints(unsq.inputs[1]) != [1]:
            return value
        sq = _only_use(unsq.outputs[0])
        if not _std(sq, "Squeeze") or _ints(sq.inputs[1]) != [1]:
            return value
        value = sq.outputs[0]


def _strided_half(node: ir.Node, n: int) -> int | None:
    """0 or 1: the start of ``Slice(x, start, end >= n, axes=[-1 or 1], steps=[2])``, else None."""
    if not _std(node, "Slice") or len(node.inputs) != 5:
        return None
    starts, ends, axes, steps = (_ints(v) for v in node.inputs[1:])
    if starts not in ([0], [1]) or ends is None or ends[0] < n or axes not in ([-1], [1]) or steps != [2]:
        return None
    return starts[0]


def _clip(node: ir.Node | None) -> tuple[float | None, float | None] | None:
    """A Clip's (min, max), None for a bound it omits; None if it is no Clip or a bound is not a constant."""
    if not _std(node, "Clip"):
        return None
    bounds = []
    for i in (1, 2):
        given = node.inputs[i] if len(node.inputs) > i else None
        bound = _scalar(given) if given is not None else None
        if given is not None and bound is None:
            return None
        bounds.append(bound)
    return bounds[0], bounds[1]


def _result(op: ir.Node) -> tuple[ir.Value, int] | None:
    """The op's ``[S, N]`` result as the graph goes on to use it (after its Squeeze and any unit-axis round trips),
    with N; None where the op's output is used otherwise."""
    squeeze = _squeezed(op)
    n = _n(op)
    return None if squeeze is None or n is None else (_through_reshapes(squeeze.outputs[0]), n)


def _fuse_swiglu(graph: ir.Graph, op: ir.Node) -> bool:
    """``op(..., bias)`` + the clamped SwiGLU chain -> ``op(..., bias, activation=1, alpha, limit)``."""
    found = _result(op) if op.attributes.get_int("activation", 0) == 0 else None
    if found is None:
        return False
    value, n = found
    uses = list(value.uses())
    if len(uses) != 2 or value.is_graph_output():
        return False
    halves = {_strided_half(u, n): u for u, _ in uses}
    if set(halves) != {0, 1}:
        return False
    gate_clip, up_clip = (_only_use(halves[i].outputs[0]) for i in (0, 1))
    g_bounds, u_bounds = _clip(gate_clip), _clip(up_clip)
    if g_bounds is None or u_bounds is None or g_bounds[0] is not None or g_bounds[1] is None:
        return False
    limit = g_bounds[1]
    if u_bounds != (-limit, limit):
        return False
    gate, up = gate_clip.outputs[0], up_clip.outputs[0]
    # gate: Mul(gate, alpha) -> Sigmoid -> Mul(gate, sigmoid); up: Add(up, 1); then Mul of the two
    g_uses = [u for u, _ in gate.uses()]
    scale = next((u for u in g_uses if _std(u, "Mul") and _scalar(_other(u, gate)) is not None), None)
    sigmoid = _only_use(scale.outputs[0]) if scale is not None else None
    if len(g_uses) != 2 or not _std(sigmoid, "Sigmoid"):
        return False
    glu = _only_use(sigmoid.outputs[0])
    if not _std(glu, "Mul") or _other(glu, sigmoid.outputs[0]) is not gate:
        return False
    plus = _only_use(up)
    if not _std(plus, "Add") or _scalar(_other(plus, up)) != 1.0:
        return False
    out = _only_use(glu.outputs[0])
    if not _std(out, "Mul") or _other(out, glu.outputs[0]) is not plus.outputs[0]:
        return False
    alpha = _scalar(_other(scale, gate))
    _replace_op(graph, op, list(op.inputs), {"activation": 1, "alpha": float(alpha), "limit": float(limit)}, out,
                out.outputs[0])
    return True


def _fuse_x_share(graph: ir.Graph, op: ir.Node) -> bool:
    """X = ``Unsqueeze(Reshape(Expand(Unsqueeze(v, 1), [1, k, 1]), [-1, K]), 1)`` (each token's row repeated for its
    k experts) -> X = ``Unsqueeze(v, 1)`` with ``x_share=k``."""
    if op.attributes.get_int("x_share", 1) != 1:
        return False
    unsq = op.inputs[0].producer()
    if not _std(unsq, "Unsqueeze") or _ints(unsq.inputs[1]) != [1]:
        return False
    width = op.inputs[0].shape[-1] if op.inputs[0].shape is not None else None
    reshape = unsq.inputs[0].producer()
    if width is None or not _std(reshape, "Reshape") or _ints(reshape.inputs[1]) != [-1, width]:
        return False
    expand = reshape.inputs[0].producer()
    shape = _ints(expand.inputs[1]) if _std(expand, "Expand") else None
    if shape is None or len(shape) != 3 or shape[0] != 1 or shape[2] != 1 or shape[1] < 2:
        return False
    token_rows = expand.inputs[0]
    inner = token_rows.producer()
    if not _std(inner, "Unsqueeze") or _ints(inner.inputs[1]) != [1]:
        return False
    rows = token_rows.shape
    if rows is None or len(rows) != 3 or rows[1] != 1 or rows[2] != width:
        return False
    _replace_op(graph, op, [token_rows, *op.inputs[1:]], {"x_share": shape[1]}, op, op.outputs[0], squeeze=False)
    return True


def _fuse_combine(graph: ir.Graph, op: ir.Node) -> bool:
    """``ReduceSum(Reshape(Squeeze(op) * Unsqueeze(w, -1), [-1, k, N]), [1])`` (each token's k expert outputs
    weighted and summed) -> ``Squeeze(op(..., w, combine=k))``."""
    if op.attributes.get_int("combine", 1) != 1 or op.attributes.get_int("activation", 0) != 0:
        return False
    found = _result(op)
    if found is None:
        return False
    value, n = found
    mul = _only_use(value)
    if not _std(mul, "Mul"):
        return False
    weights = _other(mul, value)
    if weights is None or weights.shape is None or len(weights.shape) != 2 or weights.shape[1] != 1:
        return False
    reshape = _only_use(mul.outputs[0])
    shape = _ints(reshape.inputs[1]) if _std(reshape, "Reshape") else None
    if shape is None or len(shape) != 3 or shape[0] != -1 or shape[2] != n or shape[1] < 2:
        return False
    total = _only_use(reshape.outputs[0])
    if (not _std(total, "ReduceSum") or len(total.inputs) < 2 or _ints(total.inputs[1]) != [1]
            or total.attributes.get_int("keepdims", 1) != 0):
        return False
    inputs = list(op.inputs) + [None] * (5 - len(op.inputs)) + [weights]
    _replace_op(graph, op, inputs, {"combine": shape[1]}, total, total.outputs[0])
    return True


def fuse_mxfp4_epilogue(model: ir.Model) -> int:
    """Fold each MXFP4 expert matmul's bias, gate_up's clamped SwiGLU, the top-k repeat of its input rows and the
    down matmul's weighted top-k sum into the op; returns how many of those were folded. Unused nodes and
    initializers are removed."""
    graph = model.graph
    replaced: set[ir.Node] = set()  # ops a fusion took the place of: dead, swept once at the end with their chains
    for fuse in (_fuse_bias, _fuse_swiglu, _fuse_x_share, _fuse_combine):
        for node in list(graph):
            if node.op_type in _OPS and node.domain == DOMAIN and node not in replaced and fuse(graph, node):
                replaced.add(node)
    if replaced:
        remove_unused(model)
    return len(replaced)
