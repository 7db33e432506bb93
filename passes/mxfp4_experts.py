"""MoE experts that arrive as MXFP4 (compiler/prequantized_mxfp4.py) run from their codes: ``llmc.Mxfp4MoEMatMul``.

transformers' ``batched_mm`` experts trace to ``GatherND(W, ids)`` (each routed row's expert weight ``[S, K, N]``)
feeding ``MatMul(x [S, 1, K], ·)``. For an expert weight the checkpoint ships as MXFP4, that pair becomes one
``llmc.Mxfp4MoEMatMul(x, ids, blocks, scales)`` over the checkpoint's own blocks and scales (uint8, read lazily when
the backend writes them), and the float weight leaves the graph: the engine holds 4.25 bits per expert weight. A
carried weight used any other way is refused (never a silent float copy of the experts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from llmc.errors import UnsupportedError
from llmc.passes.base import replace_value
from llmc.passes.lazy import constant_of
from llmc.plugins.mxfp4 import OP_TYPE, Q8_OP_TYPE
from llmc.plugins.mxfp4.reference import GROUP, repack_codes_q8, repack_scales_q8
from llmc.plugins.paged_attention import DOMAIN


@dataclass(frozen=True)
class Mxfp4Source:
    """One expert weight's codes as the checkpoint stores them: ``blocks()`` uint8 ``[E, N, K/32, 16]`` and
    ``scales()`` uint8 ``[E, N, K/32]`` (read when called)."""

    experts: int
    n: int
    k: int
    blocks: Callable[[], np.ndarray]
    scales: Callable[[], np.ndarray]


def _lazy(name: str, read: Callable[[], np.ndarray], shape: tuple[int, ...]) -> ir.LazyTensor:
    return ir.LazyTensor(lambda: ir.tensor(np.ascontiguousarray(read()), name=name), dtype=ir.DataType.UINT8,
                         shape=ir.Shape(list(shape)), name=name)


def _selector(node: ir.Node) -> bool:
    """Gather(axis 0) or GatherND(batch_dims 0, ``[..., 1]`` indices): one expert's weight per index."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Gather":
        return node.attributes.get_int("axis", 0) == 0
    idx = node.inputs[1].shape
    return (node.op_type == "GatherND" and node.attributes.get_int("batch_dims", 0) == 0 and idx is not None
            and len(idx) >= 1 and idx[-1] == 1)


def lower_mxfp4_experts(model: ir.Model, sources: dict[str, Mxfp4Source], q8: bool = False) -> int:
    """Rewrite every routed matmul over a weight in ``sources`` (by initializer name); returns how many. Raises
    :class:`UnsupportedError` if a carried weight is left in the graph in float. ``q8``: ``llmc.Mxfp4MoEMatMulQ8``
    (the rows quantized to 8 bits per 32-block; the same codes and scales, repacked for its kernel)."""
    graph = model.graph
    count = 0
    made: dict[str, tuple[ir.Value, ir.Value]] = {}
    for node in list(graph):
        weight = node.inputs[0] if node.inputs else None
        if weight is None or weight.name not in sources or constant_of(weight) is None or not _selector(node):
            continue
        uses = list(node.outputs[0].uses())
        matmuls = [u for u, i in uses if u.op_type == "MatMul" and u.domain in ("", "ai.onnx") and i == 1]
        x_shapes = [m.inputs[0].shape for m in matmuls]
        if len(matmuls) != len(uses) or any(s is None or len(s) != 3 or s[1] != 1 for s in x_shapes):
            continue  # refused below: the weight stays in the graph
        src = sources[weight.name]
        if weight.name not in made and q8:
            g, t = src.k // 32, -(-src.n // GROUP)
            codes = ir.Value(name=f"{weight.name}_codes_q8", shape=ir.Shape([src.experts, t, g, 4, 64]),
                             type=ir.TensorType(ir.DataType.UINT8))
            codes.const_value = _lazy(codes.name, lambda src=src: repack_codes_q8(src.blocks()),
                                      (src.experts, t, g, 4, 64))
            scales = ir.Value(name=f"{weight.name}_scales_q8", shape=ir.Shape([src.experts, t, g, GROUP]),
                              type=ir.TensorType(ir.DataType.UINT8))
            scales.const_value = _lazy(scales.name, lambda src=src: repack_scales_q8(src.scales()),
                                       (src.experts, t, g, GROUP))
            graph.register_initializer(codes)
            graph.register_initializer(scales)
            made[weight.name] = (codes, scales)
        if weight.name not in made:
            g = src.k // 32
            blocks = ir.Value(name=f"{weight.name}_blocks", shape=ir.Shape([src.experts, src.n, g, 16]),
                              type=ir.TensorType(ir.DataType.UINT8))
            blocks.const_value = _lazy(blocks.name, src.blocks, (src.experts, src.n, g, 16))
            scales = ir.Value(name=f"{weight.name}_scales", shape=ir.Shape([src.experts, src.n, g]),
                              type=ir.TensorType(ir.DataType.UINT8))
            scales.const_value = _lazy(scales.name, src.scales, (src.experts, src.n, g))
            graph.register_initializer(blocks)
            graph.register_initializer(scales)
            made[weight.name] = (blocks, scales)
        blocks, scales = made[weight.name]
        for mm in matmuls:
            new = (ir.node(Q8_OP_TYPE, [mm.inputs[0], node.inputs[1], blocks, scales], attributes={"N": src.n},
                           domain=DOMAIN) if q8 else
                   ir.node(OP_TYPE, [mm.inputs[0], node.inputs[1], blocks, scales], domain=DOMAIN))
            graph.insert_before(mm, [new])
            replace_value(mm.outputs[0], new.outputs[0])
            graph.remove(mm, safe=True)
            count += 1
        graph.remove(node, safe=True)
        if not weight.uses() and weight.name in graph.initializers:
            del graph.initializers[weight.name]
    left = sorted(name for name in sources if name in graph.initializers)
    if left:
        raise UnsupportedError(f"{left[0]}: this MXFP4 expert weight is used other than as routed rows' matmul "
                               "(GatherND + MatMul of one row each), so llmc cannot run it from its codes; building "
                               "it would expand the experts to float32. Build from the unquantized original with "
                               "--quant int4")
    if count:
        model.opset_imports[DOMAIN] = model.opset_imports.get(DOMAIN, 1)
    return count
