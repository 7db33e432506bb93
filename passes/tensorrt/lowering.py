"""ONNX-level lowering of llmc's graph to what TensorRT's ONNX parser turns into native layers.

Everything here is a rewrite of the ``onnx_ir.Model`` into standard ONNX (opset 24) plus the
``trt`` domain's FP4 dynamic quantizer, so that the exact graph a TensorRT engine is built from
also runs in ONNX Runtime on a CPU (the tests check it against the PagedAttention reference):

- ``llmc.PagedAttention`` → ``TensorScatter`` (parsed into ``IKVCacheUpdateLayer``) + ``Attention``
  (parsed into ``IAttention``) over a per-sequence **slot** KV cache. TensorRT for RTX has no
  plugin API and its KV-cache update layer writes contiguous per-sequence caches only
  (``KVCacheMode.LINEAR``), so the engine's KV layout is :data:`KV_LAYOUT` (see there), not
  the CPU engine's block pool.
- ``llmc.SkipRMSNormalization`` → ``Add`` + ``RMSNormalization``; ``llmc.SwiGLU`` → ``x·σ(x)·up``.
- Precision (strongly typed networks take every type from the graph): matrix multiplies, the
  embedding table, attention and the KV cache run in float16; norms, rotary embedding and the
  residual stream stay float32 (casts at the edges, which TensorRT fuses into the kernels).
- NVFP4 sites (the CPU pass's decode-by-lookup form) become FLOAT4E2M1 weights behind two
  ``DequantizeLinear`` and a ``trt::TRT_FP4DynamicQuantize`` on the activation, the form
  TensorRT's FP4 GEMMs fuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir

from llmc.passes.base import GraphPass, replace_value
from llmc.passes.lazy import constant_of, derived
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE

OPSET = 24  # TensorScatter
TRT_DOMAIN = "trt"
# One cache slot per sequence of a step: K and V of layer i are two tensors
# [slots, num_kv_heads, max_seq_len, head_size]; the step's sequence s lives in slot s (row s of the
# tensors bound for this step), its token p at [s, :, p, :]. A slot is free for reuse as soon as its
# sequence finishes; the runtime moves a sequence's slot when it reorders sequences.
KV_LAYOUT = "slots_bhsd"
KV_INPUT = "past_{kind}.{layer}"
KV_OUTPUT = "present_{kind}.{layer}"
# Graph inputs the slot layout does not read (block tables and slots belong to the block layout).
DROPPED_INPUTS = ("slot_mapping", "block_tables")
# Named tensors the TensorRT backend looks up after parsing: each layer's packed [T, heads, D] K/V
# (the KV-cache update layers are switched to read these, see tensorrt.py).
PACKED_NAME = "llmc_attention/packed_{kind}.{layer}"
COMPUTE = ir.DataType.FLOAT16
_F32 = ir.DataType.FLOAT
_F8 = ir.DataType.FLOAT8E4M3FN


@dataclass
class Lowered:
    """What lowering did: ``kv`` the cache geometry, ``inputs``/``outputs`` the engine's I/O in order."""

    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    num_heads: int = 0
    kv_dtype: str = "float16"
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


class _Ops:
    """Appends nodes to a graph (sorted topologically at the end of lowering)."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self.n = 0

    def __call__(self, op_type: str, *inputs: ir.Value | None, domain: str = "", num_outputs: int = 1,
                 **attrs) -> ir.Value | tuple[ir.Value, ...]:
        self.n += 1
        node = ir.node(op_type, list(inputs), attributes=attrs or None, domain=domain, num_outputs=num_outputs,
                       name=f"{self.prefix}/{op_type}_{self.n}")
        for i, out in enumerate(node.outputs):
            out.name = f"{self.prefix}/{op_type}_{self.n}.out{i}"
        self.graph.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def const(self, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
        tensor = array if isinstance(array, ir.TensorProtocol) else ir.tensor(np.ascontiguousarray(array), name=name)
        value = ir.Value(name=name, shape=ir.Shape(list(tensor.shape)), type=ir.TensorType(tensor.dtype))
        value.const_value = tensor
        self.graph.register_initializer(value)
        return value

    def i64(self, name: str, values) -> ir.Value:
        """An int64 constant, shared by name (callers use one name per value)."""
        full = f"{self.prefix}/{name}"
        existing = self.graph.initializers.get(full)
        return existing if existing is not None else self.const(full, np.asarray(values, np.int64))


def _typed(value: ir.Value, dtype: ir.DataType, shape: list | None = None) -> ir.Value:
    value.type = ir.TensorType(dtype)
    if shape is not None:
        value.shape = ir.Shape(shape)
    return value


# -- PagedAttention -------------------------------------------------------------------------------

@dataclass
class _StepIndex:
    """Per-step index tensors shared by every layer (computed once from the attention metadata).

    ``pad`` [S, n_max] packed row of each padded query row (clamped); ``write`` [S] first new
    position of each sequence; ``positions`` [S, n_max] the position of each padded row;
    ``key_pos`` [L] 0..max(context_lens)-1; ``unpad`` [T] padded row of each packed token.
    """

    pad: ir.Value
    write: ir.Value
    positions: ir.Value
    key_pos: ir.Value
    ctx: ir.Value
    max_ctx: ir.Value
    unpad: ir.Value
    n_max: ir.Value


def _step_index(op: _Ops, query: ir.Value, context_lens: ir.Value, query_start_loc: ir.Value) -> _StepIndex:
    zero, one, minus_one = op.i64("zero", [0]), op.i64("one", [1]), op.i64("minus_one", [-1])
    big = op.i64("big", [2**62])
    axis0, axis1 = op.i64("axis0", [0]), op.i64("axis1", [1])
    starts = op("Slice", query_start_loc, zero, minus_one, axis0)  # [S]
    ends = op("Slice", query_start_loc, one, big, axis0)  # [S]
    n_new = op("Sub", ends, starts)  # [S]
    write = op("Sub", context_lens, n_new)  # [S] first new position = cached tokens before this step
    n_max = op("ReduceMax", n_new, axis0, keepdims=1)  # [1]
    scalar = op.i64("scalar", [])
    rows = op("Range", op("Reshape", zero, scalar), op("Reshape", n_max, scalar), op("Reshape", one, scalar))
    tokens = op("Shape", query, start=0, end=1)  # [1] = T
    last = op("Sub", tokens, one)
    pad = op("Min", op("Add", op("Unsqueeze", starts, axis1), op("Unsqueeze", rows, axis0)), last)  # [S, n_max]
    positions = op("Add", op("Unsqueeze", write, axis1), op("Unsqueeze", rows, axis0))  # [S, n_max]
    max_ctx = op("ReduceMax", context_lens, axis0, keepdims=1)  # [1]
    key_pos = op("Range", op("Reshape", zero, scalar), op("Reshape", max_ctx, scalar), op("Reshape", one, scalar))
    # Packed token t belongs to sequence seq(t) = #{s : ends[s] <= t}; its padded row is
    # seq(t) * n_max + (t - starts[seq(t)]).
    t = op("Range", op("Reshape", zero, scalar), op("Reshape", tokens, scalar), op("Reshape", one, scalar))
    done = op("Cast", op("LessOrEqual", op("Unsqueeze", ends, axis0), op("Unsqueeze", t, axis1)), to=ir.DataType.INT64)
    seq = op("ReduceSum", done, axis1, keepdims=0)  # [T]
    unpad = op("Add", op("Mul", seq, n_max), op("Sub", t, op("Gather", starts, seq, axis=0)))
    return _StepIndex(pad, write, positions, key_pos, context_lens, max_ctx, unpad, n_max)


def _mask(op: _StepIndex, ops: _Ops, sliding_window: int) -> ir.Value:
    """Boolean [S, 1, n_max, L]: key j is visible to the padded row of position p iff j <= p and j < ctx
    (and j > p - window). Padded rows (p >= ctx) see the whole sequence, so no row is empty."""
    axes12 = ops.i64("axes12", [1, 2])
    pos = ops("Unsqueeze", op.positions, ops.i64("axis_last", [2]))  # [S, n_max, 1]
    keys = ops("Unsqueeze", op.key_pos, ops.i64("axes01", [0, 1]))  # [1, 1, L]
    causal = ops("LessOrEqual", keys, pos)
    inside = ops("Less", keys, ops("Unsqueeze", op.ctx, axes12))  # [S, 1, L]
    mask = ops("And", causal, inside)
    if sliding_window > 0:
        lo = ops("Sub", pos, ops.i64(f"window{sliding_window}", [sliding_window]))
        mask = ops("And", mask, ops("Greater", keys, lo))
    return ops("Unsqueeze", mask, ops.i64("axis1_mask", [1]))  # [S, 1, n_max, L]


def _lower_attention(graph: ir.Graph, node: ir.Node, idx: _StepIndex, masks: dict[int, ir.Value], ops: _Ops,
                     max_seq_len: int, kv_dtype: ir.DataType, info: Lowered) -> None:
    attrs = {k: a.value for k, a in node.attributes.items()}
    layer, h, hkv, d = attrs["layer_idx"], attrs["num_heads"], attrs["num_kv_heads"], attrs["head_size"]
    if attrs.get("softcap", 0.0):
        raise NotImplementedError("attention logit soft-capping")
    if attrs.get("alibi_max_bias", 0.0) or attrs.get("attention_chunk", 0):
        from llmc.errors import UnsupportedError

        raise UnsupportedError("the TensorRT export has no ALiBi or chunked local attention (its Attention layer "
                               "takes a causal or windowed mask only); build the CUDA engine instead (--engine cuda)")
    if len(node.inputs) > 7 and node.inputs[7] is not None:
        from llmc.errors import UnsupportedError

        raise UnsupportedError("the TensorRT export has no attention sinks (its Attention layer has no sink term); "
                               "build the CUDA engine instead (--engine cuda)")
    if len(node.inputs) > 8 and node.inputs[8] is not None:
        from llmc.errors import UnsupportedError

        # Its masks are built once per window for the whole step; bidirectional spans would need one per token.
        raise UnsupportedError("the TensorRT export has no bidirectional attention spans (attend_end: Gemma 3's "
                               "image tokens); build the CUDA engine instead (--engine cuda)")
    window = int(attrs.get("sliding_window", 0) or 0)
    if window not in masks:
        masks[window] = _mask(idx, ops, window)
    query, key, value = node.inputs[:3]

    def packed(x: ir.Value, heads: int, kind: str) -> ir.Value:  # [T, heads*D] -> [T, heads, D] in the KV dtype
        r = ops("Reshape", x, ops.i64(f"packed_{heads}x{d}", [-1, heads, d]))
        out = ops("Cast", r, to=kv_dtype)
        out.name = PACKED_NAME.format(kind=kind, layer=layer)
        return out

    def padded(x: ir.Value) -> ir.Value:  # [T, heads, D] -> [S, heads, n_max, D]
        return ops("Transpose", ops("Gather", x, idx.pad, axis=0), perm=[0, 2, 1, 3])

    q = padded(packed(query, h, "query"))
    k, v = padded(packed(key, hkv, "key")), padded(packed(value, hkv, "value"))
    present = []
    for kind, update in (("key", k), ("value", v)):
        past = _typed(ir.Value(name=KV_INPUT.format(kind=kind, layer=layer)), kv_dtype,
                      ["slots", hkv, max_seq_len, d])
        graph.inputs.append(past)
        out = ops("TensorScatter", past, update, idx.write, axis=2)
        out.name = KV_OUTPUT.format(kind=kind, layer=layer)
        _typed(out, kv_dtype, ["slots", hkv, max_seq_len, d])
        graph.outputs.append(out)
        # Attend over the step's longest context only, not the whole max_seq_len.
        present.append(ops("Slice", out, ops.i64("zero", [0]), idx.max_ctx, ops.i64("axis2", [2])))
    y = ops("Attention", q, present[0], present[1], masks[window], q_num_heads=h, kv_num_heads=hkv,
            scale=float(attrs["scale"]))  # [S, H, n_max, D]
    y = ops("Reshape", ops("Transpose", y, perm=[0, 2, 1, 3]), ops.i64(f"rows_{h * d}", [-1, h * d]))
    y = ops("Cast", ops("Gather", y, idx.unpad, axis=0), to=query.dtype or _F32)  # [T, H*D] packed again
    replace_value(node.outputs[0], y)
    graph.remove(node, safe=True)
    info.num_layers = max(info.num_layers, layer + 1)
    info.num_heads, info.num_kv_heads, info.head_size = h, hkv, d


def lower_paged_attention(model: ir.Model, max_seq_len: int, kv_dtype: ir.DataType = COMPUTE,
                          info: Lowered | None = None) -> Lowered:
    """Replace every ``llmc.PagedAttention`` by a slot-cache ``TensorScatter`` + ``Attention`` (see module doc).

    Adds graph inputs ``past_key.<layer>`` / ``past_value.<layer>`` and outputs ``present_key.<layer>`` /
    ``present_value.<layer>`` ``[slots, num_kv_heads, max_seq_len, head_size]`` (in place on TensorRT:
    the update layer aliases each output to its input), and drops the block-layout inputs.
    """
    info = info or Lowered()
    graph = model.graph
    nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == OP_TYPE]
    if not nodes:
        return info
    ops = _Ops(graph, "llmc_attention")
    first = nodes[0]
    names = [v.name if v is not None else None for v in first.inputs]
    inputs = {v.name: v for v in graph.inputs}
    idx = _step_index(ops, first.inputs[0], inputs[names[5]], inputs[names[6]])
    masks: dict[int, ir.Value] = {}
    for node in nodes:
        _lower_attention(graph, node, idx, masks, ops, max_seq_len, kv_dtype, info)
    for name in DROPPED_INPUTS:
        v = inputs.get(name)
        if v is not None and not v.uses():
            graph.inputs.remove(v)
    info.kv_dtype = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16", _F32: "float32"}[kv_dtype]
    info.stats["paged_attention"] = len(nodes)
    return info


# -- llmc fused ops -------------------------------------------------------------------------------

def lower_llmc_ops(model: ir.Model) -> int:
    """``llmc.SkipRMSNormalization`` → ``Add`` + ``RMSNormalization``; ``llmc.SwiGLU`` → ``gate·σ(gate)·up``.

    TensorRT fuses these back into its own kernels; the parser knows only standard ops.
    """
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.domain != DOMAIN or node.op_type == OP_TYPE:
            continue
        if node.op_type == "SkipRMSNormalization":
            a, b, weight = node.inputs
            add = ir.node("Add", [a, b])
            norm = ir.node("RMSNormalization", [add.outputs[0], weight],
                           attributes={"epsilon": node.attributes["epsilon"].value, "axis": -1})
            graph.insert_before(node, [add, norm])
            replace_value(node.outputs[0], norm.outputs[0])
            replace_value(node.outputs[1], add.outputs[0])
        elif node.op_type == "SwiGLU":
            gate, up = node.inputs
            sig = ir.node("Sigmoid", [gate])
            silu = ir.node("Mul", [gate, sig.outputs[0]])
            mul = ir.node("Mul", [silu.outputs[0], up])
            graph.insert_before(node, [sig, silu, mul])
            replace_value(node.outputs[0], mul.outputs[0])
        else:
            raise NotImplementedError(f"the TensorRT backend cannot lower llmc.{node.op_type}")
        graph.remove(node, safe=True)
        count += 1
    return count


# -- precision ------------------------------------------------------------------------------------

class _Half:
    """float16 copies of float32 initializers, made lazily (weights stream at save time) and shared."""

    def __init__(self, graph: ir.Graph, dtype: ir.DataType) -> None:
        self.graph = graph
        self.dtype = dtype
        self.np_dtype = np.float16 if dtype == ir.DataType.FLOAT16 else ml_dtypes.bfloat16
        self.done: dict[str, ir.Value] = {}

    def __call__(self, value: ir.Value) -> ir.Value:
        if value.name in self.done:
            return self.done[value.name]
        src = value.const_value
        name = f"{value.name}.{'fp16' if self.dtype == ir.DataType.FLOAT16 else 'bf16'}"
        np_dtype = self.np_dtype
        tensor = derived([src], lambda a: np.asarray(a, np.float32).astype(np_dtype), self.dtype, list(src.shape),
                         name)
        new = ir.Value(name=name, shape=ir.Shape(list(src.shape)), type=ir.TensorType(self.dtype))
        new.const_value = tensor
        self.graph.register_initializer(new)
        self.done[value.name] = new
        return new


def _float_const(v: ir.Value | None) -> bool:
    t = constant_of(v)
    return t is not None and t.dtype == _F32


def _cast_scale(half: _Half, node: ir.Node, index: int) -> bool:
    """Make a Q/DQ node's float32 constant scale half precision (the Q/DQ then computes in it)."""
    if index < len(node.inputs) and _float_const(node.inputs[index]):
        node.replace_input_with(index, half(node.inputs[index]))
        return True
    return False


def _half_operand(graph: ir.Graph, half: _Half, ops: _Ops, mm: ir.Node, index: int) -> None:
    x = mm.inputs[index]
    if _float_const(x):  # a float32 weight
        mm.replace_input_with(index, half(x))
        return
    producer = x.producer()
    if (producer is not None and producer.op_type == "Transpose" and _float_const(producer.inputs[0])
            and len(x.uses()) == 1):
        producer.replace_input_with(0, half(producer.inputs[0]))
        _typed(x, half.dtype)
        return
    if producer is not None and producer.op_type == "DequantizeLinear" and producer.domain == "" \
            and len(x.uses()) == 1 and _cast_scale(half, producer, 1):
        # Quantized operand: the DQ's output follows its scale's type. An activation Q/DQ pair
        # quantizes a half-precision input with the same (now half) scale.
        _typed(x, half.dtype)
        q = producer.inputs[0].producer()
        if q is not None and q.op_type == "QuantizeLinear" and q.domain == "" and _cast_scale(half, q, 1):
            src = q.inputs[0]
            q.replace_input_with(0, ops("Cast", src, to=half.dtype))
        return
    cast = ops("Cast", x, to=half.dtype)
    mm.replace_input_with(index, cast)


def autocast(model: ir.Model, dtype: ir.DataType = COMPUTE) -> dict[str, int]:
    """Run matrix multiplies and the embedding lookup in ``dtype`` (float16 or bfloat16), the rest in float32.

    A MatMul gets half-precision operands (weights converted, quantized weights' scales converted,
    activations cast) and a cast of its result back to float32; ``Gather`` from a float32 table
    reads a half-precision copy of it. Norms, rotary embedding and residual adds stay float32.
    """
    graph = model.graph
    half = _Half(graph, dtype)
    ops = _Ops(graph, "llmc_autocast")
    stats = {"matmuls": 0, "gathers": 0}
    for node in list(graph):
        if node.domain != "":
            continue
        if node.op_type == "MatMul":
            out = node.outputs[0]
            if out.dtype not in (None, _F32):
                continue
            for i in (0, 1):
                _half_operand(graph, half, ops, node, i)
            y = ir.Value(name=f"{out.name}.half", type=ir.TensorType(dtype), shape=out.shape)
            cast = ir.node("Cast", [y], attributes={"to": _F32}, name=f"{out.name}/to_float")
            replace_value(out, cast.outputs[0])
            # the MatMul now writes the half-precision value
            mm = ir.node("MatMul", list(node.inputs), outputs=[y], name=node.name)
            graph.insert_after(node, [mm, cast])
            graph.remove(node, safe=True)
            stats["matmuls"] += 1
        elif node.op_type == "Gather" and _float_const(node.inputs[0]) and len(node.inputs[0].shape or ()) == 2:
            out = node.outputs[0]
            node.replace_input_with(0, half(node.inputs[0]))
            y = ir.Value(name=f"{out.name}.half", type=ir.TensorType(dtype), shape=out.shape)
            cast = ir.node("Cast", [y], attributes={"to": _F32}, name=f"{out.name}/to_float")
            replace_value(out, cast.outputs[0])
            g = ir.node("Gather", list(node.inputs), attributes={"axis": node.attributes.get("axis", ir.AttrInt64(
                "axis", 0)).value}, outputs=[y], name=node.name)
            graph.insert_after(node, [g, cast])
            graph.remove(node, safe=True)
            stats["gathers"] += 1
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del graph.initializers[name]
    return stats


# -- NVFP4 ----------------------------------------------------------------------------------------

def nvfp4_to_trt(model: ir.Model, dtype: ir.DataType = COMPUTE) -> int:
    """Rewrite the CPU pass's NVFP4 linears into TensorRT's FP4 form. Returns the number rewritten.

    Weight: FLOAT4E2M1 ``[N, K]`` codes → ``DequantizeLinear(axis=1, block_size=16)`` with the
    block scales ``DequantizeLinear(E4M3 scales, global scale)``, transposed to ``[K, N]``.
    Activation (when calibrated): ``trt::TRT_FP4DynamicQuantize`` (block 16, E4M3 scales, the
    calibrated global scale) → the same two ``DequantizeLinear``. Both in ``dtype``.
    """
    graph = model.graph
    inits = graph.initializers
    count = 0
    for name in [n for n in inits if n.endswith(".nvfp4")]:
        base = name[: -len(".nvfp4")]
        codes, bscales, gscale = inits[name], inits[f"{base}.nvfp4_block_scales"], inits[f"{base}.nvfp4_global_scale"]
        shape2 = inits.get(f"{base}.nvfp4_shape2")
        (transpose,) = [u.node for u in shape2.uses()][0].outputs[0].uses()
        wt_node = transpose.node
        (mm_use,) = wt_node.outputs[0].uses()
        mm = mm_use.node
        n, k = codes.shape[0], codes.shape[1]
        ops = _Ops(graph, f"{base}/fp4")
        src = codes.const_value
        fp4 = ops.const(f"{base}.fp4", derived([src], _e2m1_from_codes, ir.DataType.FLOAT4E2M1, [n, k],
                                               f"{base}.fp4"))
        g_half = ops.const(f"{base}.fp4_global_scale", np.asarray(gscale.const_value.numpy(), np.float32))
        bs = ops("DequantizeLinear", bscales, g_half)  # [N, K/16] float32
        bs = ops("Cast", bs, to=dtype)
        w = ops("DequantizeLinear", fp4, bs, axis=1, block_size=16)  # [N, K]
        wt = ops("Transpose", w, perm=[1, 0])
        x = mm.inputs[0]
        act = x.producer()
        g_name = f"{base}.input.nvfp4_g"
        if act is not None and act.op_type == "Reshape" and g_name in inits:
            shape_node = act.inputs[1].producer()
            raw = shape_node.inputs[0]
            xh = ops("Cast", raw, to=dtype)
            ga = ops.const(f"{base}.input.fp4_global_scale", np.asarray(inits[g_name].const_value.numpy(), np.float32))
            xq, sq = ops("TRT_FP4DynamicQuantize", xh, ga, domain=TRT_DOMAIN, num_outputs=2, axis=-1, block_size=16,
                         scale_type=int(_F8))
            _typed(xq, ir.DataType.FLOAT4E2M1)
            _typed(sq, _F8)
            sdq = ops("Cast", ops("DequantizeLinear", sq, ga), to=dtype)
            x = ops("DequantizeLinear", xq, sdq, axis=-1, block_size=16)
        else:
            x = ops("Cast", x, to=dtype)
        y = _typed(ops("MatMul", x, wt), dtype)  # typed: autocast leaves this MatMul alone
        replace_value(mm.outputs[0], ops("Cast", y, to=_F32))
        graph.remove(mm, safe=True)
        count += 1
    if count:
        _prune(graph)
        model.opset_imports[TRT_DOMAIN] = 1
    return count


def _e2m1_from_codes(a: np.ndarray) -> np.ndarray:
    # The CPU pass stores E2M1 bit patterns as uint4; FLOAT4E2M1 holds the same bits.
    return np.asarray(a).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)


def _prune(graph: ir.Graph) -> None:
    """Drop nodes whose outputs nothing reads, then unused initializers."""
    outputs = set(id(v) for v in graph.outputs)
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if all(not o.uses() and id(o) not in outputs for o in node.outputs):
                graph.remove(node, safe=True)
                changed = True
    for name in [n for n, v in graph.initializers.items() if not v.uses()]:
        del graph.initializers[name]


def whole_blocks(model: ir.Model) -> int:
    """Pad block-quantized constant weights to whole blocks (TensorRT's DequantizeLinear needs the
    blocked axis to be a multiple of ``block_size``; ONNX allows a short last block): zero codes are
    appended along the axis and the dequantized tensor is sliced back. Returns the weights padded."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "DequantizeLinear" or node.domain != "" or "block_size" not in node.attributes:
            continue
        block = node.attributes["block_size"].value
        t = constant_of(node.inputs[0])
        if not block or t is None:
            continue
        axis = node.attributes["axis"].value if "axis" in node.attributes else 1
        axis %= len(t.shape)
        size = t.shape[axis]
        if size % block == 0:
            continue
        padded = -(-size // block) * block
        shape = list(t.shape)
        shape[axis] = padded
        widths = [(0, 0)] * len(shape)
        widths[axis] = (0, padded - size)

        def pad(a, widths=widths):
            return np.pad(np.asarray(a), widths)  # zero codes in the padding

        ops = _Ops(graph, f"{node.name}/whole_blocks")
        name = f"{node.inputs[0].name}.padded"
        node.replace_input_with(0, ops.const(name, derived([t], pad, t.dtype, shape, name)))
        out = node.outputs[0]
        y = ir.node("Slice", [out, ops.i64("start", [0]), ops.i64(f"end{size}", [size]),
                              ops.i64(f"axis{axis}", [axis])])
        graph.insert_after(node, y)
        for use in list(out.uses()):
            if use.node is not y:
                use.node.replace_input_with(use.idx, y.outputs[0])
        count += 1
    return count


def _finish(model: ir.Model, info: Lowered) -> None:
    model.opset_imports.pop(DOMAIN, None)
    model.opset_imports[""] = OPSET
    model.graph.sort()
    _prune(model.graph)
    info.inputs = [v.name for v in model.graph.inputs]
    info.outputs = [v.name for v in model.graph.outputs]


def lowering_passes(max_seq_len: int, dtype: ir.DataType = COMPUTE, info: Lowered | None = None) -> list[GraphPass]:
    """Everything above as passes, in order; each records its counts in ``info.stats``."""
    info = info if info is not None else Lowered()

    def step(name: str, run, description: str) -> GraphPass:
        def counted(model: ir.Model) -> dict[str, int]:
            got = run(model)
            if isinstance(got, dict):
                info.stats.update({f"autocast_{k}": v for k, v in got.items()})
            elif got is not None:
                info.stats[name] = got
            return {"matches": got if isinstance(got, int) else 0}

        return GraphPass(f"trt-{name.replace('_', '-')}", counted, description, fusion=False)

    return [
        step("llmc_ops", lower_llmc_ops, "SkipRMSNormalization -> Add + RMSNormalization, SwiGLU -> x*sigmoid(x)*up"),
        step("nvfp4", lambda m: nvfp4_to_trt(m, dtype), "NVFP4 sites -> FLOAT4E2M1 weights + TRT_FP4DynamicQuantize"),
        step("padded_blocks", whole_blocks, "INT4 block-quantized weights padded to whole blocks"),
        step("autocast", lambda m: autocast(m, dtype), "matmuls, embeddings, attention and KV in float16"),
        step("paged_attention", lambda m: (lower_paged_attention(m, max_seq_len, dtype, info), None)[1],
             "PagedAttention -> TensorScatter + Attention over per-sequence slot caches"),
        step("finish", lambda m: _finish(m, info), "standard opset 24, topological order, unused values pruned"),
    ]


def lower(model: ir.Model, max_seq_len: int, dtype: ir.DataType = COMPUTE) -> Lowered:
    """Everything above, in order (:func:`lowering_passes`); the model then holds only ops TensorRT's parser maps
    to native layers."""
    info = Lowered()
    for graph_pass in lowering_passes(max_seq_len, dtype, info):
        graph_pass.run(model)
    return info
