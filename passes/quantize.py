"""The quantization graph pass: rewrite linear layers (and the KV cache's inputs) of an ``onnx_ir.Model``.

CPU forms, by format:

- ``int4*``: ``MatMul(x, W)`` → ``llmc.Int4MatMul(x, W, scales, mins)``, llmc's own 4-bit kernel in its
  native custom-op library (:mod:`llmc.plugins.int4_matmul`; the default, ``--int4-kernel llmc``), or
  ``com.microsoft.MatMulNBits(x, B, scales[, zero_points])``, ONNX Runtime's (``--int4-kernel mlas``).
  AWQ input scales fold into the RMSNorm weight in front, into the
  previous linear layer (already in its weights), or become an explicit ``Mul``.
- ``fp8``: weights stored E4M3 with per-output-channel scales behind ``DequantizeLinear``; the
  activation goes through ``QuantizeLinear``/``DequantizeLinear`` with its static calibrated scale.
  This is also the explicit Q/DQ form that TensorRT's strongly typed networks fuse into FP8 GEMMs.
- ``nvfp4``: weights stored as 4-bit E2M1 codes, E4M3 block scales and an FP32 global scale, decoded
  by a small constant subgraph (ONNX Runtime's CPU kernels do not read FLOAT4E2M1); activations are
  quantized dynamically per block of 16 by ordinary ops (:func:`nvfp4_qdq`).
- ``--kv-cache-dtype fp8``: K and V pass through FP8 Q/DQ with per-layer scales before
  ``PagedAttention`` writes them, so attention sees exactly what an FP8 cache would hold.

Weights are produced lazily (:mod:`llmc.quant.streaming`) unless calibration already computed
them (AWQ, GPTQ), so the build keeps streaming.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir

from llmc.passes.base import replace_value
from llmc.passes.lazy import constant_of, derivation_of, derived, transpose_array
from llmc.plugins.int4_matmul import pack as int4_pack
from llmc.plugins.paged_attention import DOMAIN as LLMC_DOMAIN
from llmc.plugins.paged_attention import OPSET_VERSION as LLMC_OPSET
from llmc.quant import fp8, int4, int8, nvfp4
from llmc.quant.collect import CalibrationResult
from llmc.quant.minifloat import E2M1
from llmc.quant.recipe import QuantRecipe
from llmc.quant.streaming import Spec, shared_derived

MS_DOMAIN = "com.microsoft"
_PACKED = re.compile(r"^packed\[(.*)\]$")
_F8 = ir.DataType.FLOAT8E4M3FN


@dataclass
class LinearSite:
    """A ``MatMul(x, W)`` with a constant 2-D weight. ``weight`` is the constant as stored: ``[K, N]``,
    or ``[N, K]`` behind a ``Transpose`` (``transpose`` is that node). ``members`` are the parameter
    names the weight packs, in order along N."""

    node: ir.Node
    x: ir.Value
    weight_value: ir.Value
    transpose: ir.Node | None
    k: int
    n: int
    members: list[str]

    @property
    def tensor(self) -> ir.TensorProtocol:
        return self.weight_value.const_value

    def nk(self) -> tuple[list[ir.TensorProtocol], Callable[..., np.ndarray]]:
        """Tensors to read and a function of their arrays that gives the weight as ``[N, K]`` float32 (a
        fresh, writable array). A weight that the layout passes made lazily from ``nn.Linear``'s
        ``[N, K]`` parameters (transposed, then maybe packed along N) is read from those parameters:
        no transpose at all, instead of one there and one back."""
        tensor = self.tensor
        if self.transpose is not None:
            return [tensor], _float32_copy
        made = derivation_of(tensor)
        if made is not None and made.op == "transpose" and made.arg == (1, 0):
            return [made.sources[0]], _float32_copy
        if made is not None and made.op == "concat" and made.arg in (1, -1):
            parts = [derivation_of(s) for s in made.sources]
            if all(p is not None and p.op == "transpose" and p.arg == (1, 0) for p in parts):
                return [p.sources[0] for p in parts], lambda *a: np.concatenate(a, axis=0, dtype=np.float32)
        return [tensor], lambda a: transpose_array(np.asarray(a, np.float32), (1, 0))

    def read_nk(self) -> np.ndarray:
        """The weight as ``[N, K]`` float32, read now."""
        sources, to_nk = self.nk()
        return to_nk(*[t.numpy() for t in sources])


def _float32_copy(a: np.ndarray) -> np.ndarray:
    return np.array(a, np.float32)  # a copy: a checkpoint's float32 array is a read-only memory map


def members_of(name: str) -> list[str]:
    """Parameter names behind a weight value's name: ``W.T`` → ``[W]``; ``packed[A.T+B.T]`` → ``[A, B]``."""
    m = _PACKED.match(name)
    parts = m.group(1).split("+") if m else [name]
    return [p[:-2] if p.endswith(".T") else p for p in parts]


def find_linears(model: ir.Model) -> list[LinearSite]:
    """Every MatMul whose second input is a 2-D constant (directly, or through a 2-D Transpose)."""
    sites = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        transpose = None
        producer = w.producer() if w is not None else None
        if producer is not None and producer.op_type == "Transpose" and producer.domain == "":
            perm = producer.attributes.get("perm")
            if perm is not None and list(perm.value) != [1, 0]:
                continue
            transpose, w = producer, producer.inputs[0]
        tensor = constant_of(w)
        if tensor is None or len(tensor.shape) != 2 or tensor.dtype != ir.DataType.FLOAT:
            continue
        rows, cols = (int(d) for d in tensor.shape)
        k, n = (cols, rows) if transpose is not None else (rows, cols)
        sites.append(LinearSite(node, node.inputs[0], w, transpose, k, n, members_of(w.name)))
    return sites


# Ops that read a router's scores: a linear feeding one of them (through shape-only ops) picks experts.
_ROUTING_OPS = {"Softmax", "TopK", "Sigmoid"}
_SHAPE_OPS = {"Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def feeds_router(value: ir.Value) -> bool:
    """Whether ``value`` (a linear's output) reaches a Softmax / TopK / Sigmoid through shape-only ops:
    a mixture-of-experts router, kept in full precision (its scores choose the experts, and it is a
    negligible share of the weights), as AutoAWQ, llm-compressor and vLLM do."""
    for user, _ in value.uses():
        if user.op_type in _ROUTING_OPS:
            return True
        if user.op_type in _SHAPE_OPS and user.outputs and feeds_router(user.outputs[0]):
            return True
    return False


def gemms_to_matmuls(model: ir.Model) -> int:
    """Rewrite every ``Gemm(x, W[, c])`` with a constant 2-D float ``W`` (``transA=0``, ``alpha=beta=1``)
    into ``MatMul(x, W)`` (``MatMul(x, Transpose(W))`` for ``transB=1``) + ``Add(c)``, the form
    :func:`find_linears` reads. GPT-2's ``Conv1D`` layers and bias-carrying linears on 2-D inputs trace to
    ``Gemm``. Routers (:func:`feeds_router`) are left alone. Returns how many were rewritten."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "Gemm" or node.domain != "" or len(node.inputs) < 2:
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        tensor = constant_of(node.inputs[1])
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if (attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0 or (c is not None and attrs.get("beta", 1.0)
                != 1.0) or tensor is None or len(tensor.shape) != 2 or tensor.dtype != ir.DataType.FLOAT
                or feeds_router(node.outputs[0])):
            continue
        w = node.inputs[1]
        nodes = []
        if attrs.get("transB", 0):
            t = ir.node("Transpose", [w], attributes={"perm": [1, 0]})
            nodes.append(t)
            w = t.outputs[0]
        mm = ir.node("MatMul", [node.inputs[0], w])
        nodes.append(mm)
        out = mm.outputs[0]
        if c is not None:
            add = ir.node("Add", [out, c])
            nodes.append(add)
            out = add.outputs[0]
        model.graph.insert_before(node, nodes)
        replace_value(node.outputs[0], out)
        model.graph.remove(node, safe=True)
        count += 1
    return count


def _expert_weights(model: ir.Model) -> int:
    """Constant 3-D float weights that a Gather / GatherND indexes (a mixture-of-experts layer's batched
    ``[E, N, K]`` expert weights)."""
    return len({node.inputs[0].name for node in model.graph if _expert_gather(node) is not None})


@dataclass
class _Builder:
    graph: ir.Graph
    stats: dict = field(default_factory=lambda: {"matches": 0})

    def const(self, name: str, array: np.ndarray | ir.TensorProtocol, dtype=None, shape=None) -> ir.Value:
        tensor = array if isinstance(array, ir.TensorProtocol) else ir.tensor(np.ascontiguousarray(array), name=name)
        value = ir.Value(name=name, shape=ir.Shape(list(tensor.shape)), type=ir.TensorType(tensor.dtype))
        value.const_value = tensor
        self.graph.register_initializer(value)
        return value

    def lazy(self, sources, fn, specs: list[Spec]) -> list[ir.Value]:
        return [self.const(s.name, t) for s, t in zip(specs, shared_derived(sources, fn, specs), strict=True)]


def _replace_matmul(b: _Builder, site: LinearSite, new_nodes: list[ir.Node], output: ir.Value) -> None:
    b.graph.insert_before(site.node, new_nodes)
    replace_value(site.node.outputs[0], output)
    b.graph.remove(site.node, safe=True)
    if site.transpose is not None and not site.transpose.outputs[0].uses():
        b.graph.remove(site.transpose, safe=True)
    w = site.weight_value
    if not w.uses() and w.name in b.graph.initializers:
        del b.graph.initializers[w.name]


# -- INT4 ---------------------------------------------------------------------------------------------

def _int4_specs(base: str, site: LinearSite, recipe: QuantRecipe, form: str) -> list[Spec]:
    gs, ng, n, k = recipe.group_size, -(-site.k // recipe.group_size), site.n, site.k
    if form == "llmc":  # Int4MatMul's tiles (llmc.plugins.int4_matmul.pack)
        tiles = -(-n // int4_pack.TILE)
        return [Spec(f"{base}.int4_tiles", ir.DataType.UINT8, (tiles, ng * gs // int4_pack.OCTET, 64)),
                Spec(f"{base}.int4_tile_scales", ir.DataType.FLOAT, (tiles, ng, int4_pack.TILE)),
                Spec(f"{base}.int4_tile_mins", ir.DataType.FLOAT, (tiles, ng, int4_pack.TILE))]
    if form == "qdq":  # [K, N] codes, [K / g, N] scales and zero points: DequantizeLinear(axis=0, block_size=g)
        specs = [Spec(f"{base}.int4", ir.DataType.INT4 if recipe.symmetric else ir.DataType.UINT4, (k, n)),
                 Spec(f"{base}.int4_scales", ir.DataType.FLOAT, (ng, n))]
        return specs if recipe.symmetric else [*specs, Spec(f"{base}.int4_zero_points", ir.DataType.UINT4, (ng, n))]
    specs = [Spec(f"{base}.int4", ir.DataType.UINT8, (n, ng, gs // 2)),
             Spec(f"{base}.int4_scales", ir.DataType.FLOAT, (n, ng))]
    zp = Spec(f"{base}.int4_zero_points", ir.DataType.UINT8, (n, -(-ng // 2)))
    return specs if recipe.symmetric else [*specs, zp]


def _int4_arrays(q: int4.Int4Weights, form: str) -> list[np.ndarray]:
    """The initializers of one INT4 linear: ``Int4MatMul`` tiles (``llmc``), ``MatMulNBits`` packing
    (``cpu``) or block-wise Q/DQ (``qdq``)."""
    if form == "llmc":
        t = int4_pack.pack(q.q, q.scales, q.zero_points, q.group_size, q.k)
        return [t.w, t.scales, t.mins]
    if form == "qdq":
        if q.zero_points is None:
            out = [np.ascontiguousarray(q.signed_codes()[:, : q.k].T).astype(ml_dtypes.int4)]
        else:
            out = [np.ascontiguousarray(q.q[:, : q.k].T).astype(ml_dtypes.uint4)]
        out.append(np.ascontiguousarray(q.scales.T))
        return out if q.zero_points is None else [*out, np.ascontiguousarray(q.zero_points.T).astype(ml_dtypes.uint4)]
    out = [q.matmulnbits_b(), q.scales]
    return out if q.zero_points is None else [*out, q.matmulnbits_zero_points()]


def _int4_site(b: _Builder, site: LinearSite, recipe: QuantRecipe, calib: CalibrationResult | None,
               accuracy_level: int, form: str = "cpu") -> None:
    found = [calib.linears.get(m) for m in site.members] if calib is not None else []
    if form == "cpu" and recipe.int4_kernel == "llmc":
        form = "llmc"
    x = site.x
    nodes: list[ir.Node] = []
    specs = _int4_specs(site.weight_value.name, site, recipe, form)
    if found and all(f is not None and f.weights is not None for f in found):
        n, k = sum(f.weights.n for f in found), found[0].weights.k
        if n != site.n or k != site.k or any(f.weights.k != k for f in found):
            raise RuntimeError(f"calibrated INT4 weights of {site.members} are [{n}, {k}], the graph's "
                               f"weight {site.weight_value.name} is [{site.n}, {site.k}]")
        # Packed when the backend writes them (calibrated weights may be spilled to disk: quant.int4.spill).
        parts = [f.weights for f in found]
        inputs = b.lazy([], lambda: _int4_arrays(int4.concat([int4.materialize(p) for p in parts]), form), specs)
        b.stats["calibrated"] = b.stats.get("calibrated", 0) + 1
        scale, fold = found[0].input_scale, found[0].fold
        if scale is not None and not (fold == "previous-linear" or (fold and _fold_into_norm(b, fold, scale))):
            inv = b.const(f"{site.weight_value.name}.awq_input_scale", (1.0 / scale).astype(np.float32))
            mul = ir.node("Mul", [x, inv])
            nodes.append(mul)
            x = mul.outputs[0]
            b.stats["awq_mul"] = b.stats.get("awq_mul", 0) + 1
    else:
        (sources, to_nk), gs, sym = site.nk(), recipe.group_size, recipe.symmetric
        inputs = b.lazy(sources, lambda *a: _int4_arrays(int4.quantize_rtn(to_nk(*a), gs, sym), form), specs)
        b.stats["rtn"] = b.stats.get("rtn", 0) + 1
    if form == "qdq":
        dq = ir.node("DequantizeLinear", inputs, attributes={"axis": 0, "block_size": recipe.group_size})
        node = ir.node("MatMul", [x, dq.outputs[0]])
        nodes += [dq, node]
    elif form == "llmc":
        node = ir.node("Int4MatMul", [x, *inputs], domain=LLMC_DOMAIN,
                       attributes={"K": site.k, "N": site.n, "group_size": recipe.group_size})
        nodes.append(node)
        b.stats["int4_llmc_kernel"] = b.stats.get("int4_llmc_kernel", 0) + 1
    else:
        node = ir.node("MatMulNBits", [x, *inputs], domain=MS_DOMAIN,
                       attributes={"K": site.k, "N": site.n, "bits": 4, "block_size": recipe.group_size,
                                   "accuracy_level": accuracy_level})
        nodes.append(node)
    _replace_matmul(b, site, nodes, node.outputs[0])


def lm_head_site(model: ir.Model, sites: list[LinearSite]) -> LinearSite | None:
    """The output projection: the last linear (graph order) whose N is the logits' width. Matching on
    the last one matters where an MLP's intermediate size equals the vocabulary size."""
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    width = logits.shape[-1] if logits is not None and logits.shape is not None and len(logits.shape) else None
    if not isinstance(width, int):
        return None
    return next((s for s in reversed(sites) if s.n == width), None)


def _int8_site(b: _Builder, site: LinearSite, group_size: int, accuracy_level: int) -> None:
    """``MatMul`` → ``MatMulNBits(bits=8)``: uint8 codes with a zero point per group of ``group_size`` inputs
    (:mod:`llmc.quant.int8`), round to nearest."""
    (sources, to_nk), base, n, k = site.nk(), site.weight_value.name, site.n, site.k
    ng = -(-k // group_size)

    def compute(*a):
        w = to_nk(*a)
        if k % group_size:  # MatMulNBits reads whole blocks; the padding columns meet no input
            w = np.pad(w, ((0, 0), (0, ng * group_size - k)))
        codes, scales, zps = int8.quantize(w, group_size)
        return [codes.reshape(n, ng, group_size), scales.reshape(-1), zps.reshape(-1)]

    inputs = b.lazy(sources, compute, [Spec(f"{base}.int8", ir.DataType.UINT8, (n, ng, group_size)),
                                       Spec(f"{base}.int8_scales", ir.DataType.FLOAT, (n * ng,)),
                                       Spec(f"{base}.int8_zero_points", ir.DataType.UINT8, (n * ng,))])
    node = ir.node("MatMulNBits", [site.x, *inputs], domain=MS_DOMAIN,
                   attributes={"K": k, "N": n, "bits": 8, "block_size": group_size, "accuracy_level": accuracy_level})
    _replace_matmul(b, site, [node], node.outputs[0])


def _fold_into_norm(b: _Builder, norm_name: str, scale: np.ndarray) -> bool:
    """Divide the norm weight ``norm_name`` by ``scale`` (once); False if the graph has no such lone weight."""
    folded = b.stats.setdefault("_folded", {})
    if norm_name in folded:
        return np.array_equal(folded[norm_name], scale)
    value = b.graph.initializers.get(norm_name)
    tensor = constant_of(value)
    if tensor is None or len(tensor.shape) != 1 or int(tensor.shape[0]) != scale.shape[0]:
        return False
    if not all(user.op_type in ("RMSNormalization", "SkipRMSNormalization", "SimplifiedLayerNormalization",
                                "SkipSimplifiedLayerNormalization") for user, _ in value.uses()):
        return False
    value.const_value = derived([tensor], lambda w, s=scale: (np.asarray(w, np.float32) / s).astype(np.float32),
                                tensor.dtype, list(tensor.shape), f"{norm_name}.awq")
    folded[norm_name] = scale
    b.stats["awq_folded_norms"] = b.stats.get("awq_folded_norms", 0) + 1
    return True


def _quantize_embedding(b: _Builder, node: ir.Node, recipe: QuantRecipe) -> bool:
    """``Gather(table, ids)`` of a 2-D constant table → ``com.microsoft.GatherBlockQuantized`` with the
    table in ``recipe.embeddings`` (8 or 4 bits, groups along the hidden dimension), dequantized row
    by row as it is gathered."""
    table = constant_of(node.inputs[0])
    axis = node.attributes.get("axis")
    gs = recipe.group_size
    if (table is None or len(table.shape) != 2 or table.dtype != ir.DataType.FLOAT
            or (axis is not None and axis.value != 0) or int(table.shape[1]) % gs):
        return False
    rows, k = (int(d) for d in table.shape)
    sym = recipe.symmetric
    base = node.inputs[0].name
    bits = 8 if recipe.embeddings == "int8" else 4
    if bits == 8:
        def compute8(a):
            return int8.quantize(a, gs)

        inputs = b.lazy([table], compute8, [Spec(f"{base}.int8", ir.DataType.UINT8, (rows, k)),
                                           Spec(f"{base}.int8_scales", ir.DataType.FLOAT, (rows, k // gs)),
                                           Spec(f"{base}.int8_zero_points", ir.DataType.UINT8, (rows, k // gs))])
        return _replace_gather(b, node, inputs, gs, bits)

    def compute(a):
        q = int4.quantize_rtn(np.asarray(a, np.float32), gs, sym)
        if sym:
            return [q.signed_codes().astype(ml_dtypes.int4), q.scales]
        return [q.q.astype(ml_dtypes.uint4), q.scales, q.zero_points.astype(ml_dtypes.uint4)]

    specs = [Spec(f"{base}.int4", ir.DataType.INT4 if sym else ir.DataType.UINT4, (rows, k)),
             Spec(f"{base}.int4_scales", ir.DataType.FLOAT, (rows, k // gs))]
    if not sym:
        specs.append(Spec(f"{base}.int4_zero_points", ir.DataType.UINT4, (rows, k // gs)))
    return _replace_gather(b, node, b.lazy([table], compute, specs), gs, bits)


def _expert_gather(node: ir.Node) -> tuple[ir.TensorProtocol, bool] | None:
    """``(weights [E, N, K], indices need squeezing)`` when ``node`` selects experts' batched weights: a
    ``Gather(axis=0)`` or a ``GatherND(batch_dims=0)`` with ``[..., 1]`` indices of a constant 3-D float
    tensor (transformers' ``batched_mm`` experts: ``gate_up_proj[expert_ids]``)."""
    if node.domain != "" or node.op_type not in ("Gather", "GatherND"):
        return None
    t = constant_of(node.inputs[0])
    if t is None or len(t.shape) != 3 or t.dtype != ir.DataType.FLOAT:
        return None
    attrs = {k: a.value for k, a in node.attributes.items()}
    if node.op_type == "Gather":
        return (t, False) if attrs.get("axis", 0) == 0 else None
    idx = node.inputs[1].shape
    if attrs.get("batch_dims", 0) != 0 or idx is None or len(idx) < 1 or idx[-1] != 1:
        return None
    return t, True


def _int4_experts(b: _Builder, node: ir.Node, weights: ir.TensorProtocol, squeeze: bool, recipe: QuantRecipe) -> None:
    """Expert weights ``[E, N, K]`` selected per token → ``com.microsoft.GatherBlockQuantized`` over INT4
    codes (groups of ``group_size`` along K, round to nearest: no per-expert calibration statistics), which
    dequantizes only the selected experts' weights. K is zero-padded to whole groups and sliced back."""
    e, n, k = (int(d) for d in weights.shape)
    gs, sym = recipe.group_size, recipe.symmetric
    ng = -(-k // gs)
    kp = ng * gs
    base = node.inputs[0].name

    def compute(a):
        w = np.asarray(a, np.float32).reshape(e * n, k)
        if kp != k:
            w = np.pad(w, ((0, 0), (0, kp - k)))
        q = int4.quantize_rtn(w, gs, sym)
        if sym:
            return [q.signed_codes()[:, :kp].reshape(e, n, kp).astype(ml_dtypes.int4), q.scales.reshape(e, n, ng)]
        return [q.q[:, :kp].reshape(e, n, kp).astype(ml_dtypes.uint4), q.scales.reshape(e, n, ng),
                q.zero_points.reshape(e, n, ng).astype(ml_dtypes.uint4)]

    specs = [Spec(f"{base}.int4", ir.DataType.INT4 if sym else ir.DataType.UINT4, (e, n, kp)),
             Spec(f"{base}.int4_scales", ir.DataType.FLOAT, (e, n, ng))]
    if not sym:
        specs.append(Spec(f"{base}.int4_zero_points", ir.DataType.UINT4, (e, n, ng)))
    inputs = b.lazy([weights], compute, specs)
    nodes: list[ir.Node] = []
    idx = node.inputs[1]
    if squeeze:
        sq = ir.node("Squeeze", [idx, b.const(f"{base}.expert_axes", np.asarray([-1], np.int64))])
        nodes.append(sq)
        idx = sq.outputs[0]
    gather = ir.node("GatherBlockQuantized", [inputs[0], idx, *inputs[1:]], domain=MS_DOMAIN,
                     attributes={"gather_axis": 0, "quantize_axis": 2, "block_size": gs, "bits": 4})
    nodes.append(gather)
    out = gather.outputs[0]
    if kp != k:
        sl = ir.node("Slice", [out, b.const(f"{base}.k_start", np.asarray([0], np.int64)),
                               b.const(f"{base}.k_end", np.asarray([k], np.int64)),
                               b.const(f"{base}.k_axis", np.asarray([-1], np.int64))])
        nodes.append(sl)
        out = sl.outputs[0]
    old = node.inputs[0]
    b.graph.insert_before(node, nodes)
    replace_value(node.outputs[0], out)
    b.graph.remove(node, safe=True)
    if not old.uses() and old.name in b.graph.initializers:
        del b.graph.initializers[old.name]


def _replace_gather(b: _Builder, node: ir.Node, inputs: list[ir.Value], gs: int, bits: int) -> bool:
    new = ir.node("GatherBlockQuantized", [inputs[0], node.inputs[1], *inputs[1:]], domain=MS_DOMAIN,
                  attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": gs, "bits": bits})
    old_table = node.inputs[0]
    b.graph.insert_before(node, [new])
    replace_value(node.outputs[0], new.outputs[0])
    b.graph.remove(node, safe=True)
    if not old_table.uses() and old_table.name in b.graph.initializers:
        del b.graph.initializers[old_table.name]
    return True


# -- FP8 ----------------------------------------------------------------------------------------------

def _fp8_zero(b: _Builder, name: str) -> ir.Value:
    return b.const(name, np.zeros((), ml_dtypes.float8_e4m3fn))


def fp8_qdq(b: _Builder, x: ir.Value, scale: float, name: str) -> tuple[list[ir.Node], ir.Value]:
    """``DequantizeLinear(QuantizeLinear(x))`` to E4M3 with a static per-tensor ``scale`` (saturating)."""
    s = b.const(f"{name}.fp8_scale", np.asarray(scale, np.float32))
    zp = _fp8_zero(b, f"{name}.fp8_zero")
    q = ir.node("QuantizeLinear", [x, s, zp], attributes={"saturate": 1})
    dq = ir.node("DequantizeLinear", [q.outputs[0], s, zp])
    return [q, dq], dq.outputs[0]


def _fp8_site(b: _Builder, site: LinearSite, calib: CalibrationResult | None) -> None:
    base = site.weight_value.name
    sources, to_nk = site.nk()

    def compute(*a):
        q = fp8.quantize(to_nk(*a).T, axis=1)  # [K, N], one scale per output channel
        return [q.codes.view(ml_dtypes.float8_e4m3fn), q.scale]

    w8, ws = b.lazy(sources, compute, [Spec(f"{base}.fp8", _F8, (site.k, site.n)),
                                              Spec(f"{base}.fp8_scales", ir.DataType.FLOAT, (site.n,))])
    nodes: list[ir.Node] = []
    x = site.x
    amax = calib.input_amax.get(site.members[0]) if calib is not None else None
    if amax is not None:
        nodes, x = fp8_qdq(b, x, float(fp8.scale_for(amax)), f"{base}.input")
        b.stats["fp8_activations"] = b.stats.get("fp8_activations", 0) + 1
    dq = ir.node("DequantizeLinear", [w8, ws], attributes={"axis": 1})
    mm = ir.node("MatMul", [x, dq.outputs[0]])
    _replace_matmul(b, site, [*nodes, dq, mm], mm.outputs[0])


# -- NVFP4 --------------------------------------------------------------------------------------------

def nvfp4_qdq(b: _Builder, x: ir.Value, k: int, global_scale: float, name: str) -> tuple[list[ir.Node], ir.Value]:
    """Dynamic NVFP4 quantize-dequantize of ``x [..., K]`` in plain ONNX ops: per block of 16, scale =
    E4M3(amax / 6 / g) * g with the static global scale ``g``; values rounded to E2M1 (nearest even,
    saturating at 6) by steps of 0.5 below 2, 1 below 4, 2 above, which is exactly E2M1's grid."""
    c = {key: b.const(f"{name}.nvfp4_{key}", np.asarray(v, dt)) for key, v, dt in [
        ("blocks", [-1, k // nvfp4.BLOCK, nvfp4.BLOCK], np.int64), ("six", 6.0, np.float32),
        ("g", global_scale, np.float32), ("one", 1.0, np.float32), ("zero", 0.0, np.float32),
        ("two", 2.0, np.float32), ("four", 4.0, np.float32), ("half", 0.5, np.float32), ("axes", [-1], np.int64)]}
    zp = _fp8_zero(b, f"{name}.nvfp4_fp8_zero")
    nodes: list[ir.Node] = []

    def op(op_type, *inputs, **attrs):
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    shape = op("Shape", x)
    xb = op("Reshape", x, c["blocks"])
    amax = op("ReduceMax", op("Abs", xb), c["axes"], keepdims=1)
    raw = op("Div", op("Div", amax, c["six"]), c["g"])
    scale8 = op("DequantizeLinear", op("QuantizeLinear", raw, c["one"], zp, saturate=1), c["one"], zp)
    scale = op("Mul", scale8, c["g"])
    safe = op("Where", op("Greater", scale, c["zero"]), scale, c["one"])
    y = op("Div", xb, safe)
    a = op("Min", op("Abs", y), c["six"])
    step = op("Where", op("Less", a, c["two"]), c["half"], op("Where", op("Less", a, c["four"]), c["one"], c["two"]))
    r = op("Mul", op("Round", op("Div", a, step)), step)
    out = op("Reshape", op("Mul", op("Mul", op("Sign", y), r), safe), shape)
    return nodes, out


def _nvfp4_site(b: _Builder, site: LinearSite, calib: CalibrationResult | None) -> bool:
    if site.k % nvfp4.BLOCK:
        return False
    base = site.weight_value.name
    sources, to_nk = site.nk()
    nb = site.k // nvfp4.BLOCK

    def compute(*a):
        t = nvfp4.quantize(to_nk(*a))
        return [t.codes.astype(ml_dtypes.uint4), t.block_scales.view(ml_dtypes.float8_e4m3fn),
                np.asarray(t.global_scale, np.float32)]

    codes, bscales, gscale = b.lazy(sources, compute, [
        Spec(f"{base}.nvfp4", ir.DataType.UINT4, (site.n, site.k)),
        Spec(f"{base}.nvfp4_block_scales", _F8, (site.n, nb)),
        Spec(f"{base}.nvfp4_global_scale", ir.DataType.FLOAT, ())])
    lut = b.const(f"{base}.e2m1_values", E2M1.table)
    shape3 = b.const(f"{base}.nvfp4_shape3", np.asarray([site.n, nb, nvfp4.BLOCK], np.int64))
    shape2 = b.const(f"{base}.nvfp4_shape2", np.asarray([site.n, site.k], np.int64))
    axes = b.const(f"{base}.nvfp4_axes", np.asarray([-1], np.int64))
    # Weight decode: every input is constant, so ONNX Runtime folds it once at session start.
    idx = ir.node("Cast", [codes], attributes={"to": ir.DataType.INT32})
    vals = ir.node("Gather", [lut, idx.outputs[0]])
    bs = ir.node("DequantizeLinear", [bscales, gscale])
    bs3 = ir.node("Unsqueeze", [bs.outputs[0], axes])
    v3 = ir.node("Reshape", [vals.outputs[0], shape3])
    w3 = ir.node("Mul", [v3.outputs[0], bs3.outputs[0]])
    w2 = ir.node("Reshape", [w3.outputs[0], shape2])
    wt = ir.node("Transpose", [w2.outputs[0]], attributes={"perm": [1, 0]})
    nodes = [idx, vals, bs, bs3, v3, w3, w2, wt]
    x = site.x
    amax = calib.input_amax.get(site.members[0]) if calib is not None else None
    if amax is not None:
        act_nodes, x = nvfp4_qdq(b, x, site.k, float(nvfp4.global_scale_for(amax)), f"{base}.input")
        nodes = act_nodes + nodes
        b.stats["nvfp4_activations"] = b.stats.get("nvfp4_activations", 0) + 1
    mm = ir.node("MatMul", [x, wt.outputs[0]])
    _replace_matmul(b, site, [*nodes, mm], mm.outputs[0])
    return True


# -- KV cache -----------------------------------------------------------------------------------------

def _kv_fp8(b: _Builder, calib: CalibrationResult) -> None:
    for node in list(b.graph):
        if node.op_type != "PagedAttention":
            continue
        layer = node.attributes["layer_idx"].value
        amax = calib.kv_amax.get(layer)
        if amax is None:
            raise RuntimeError(f"no calibrated K/V range for attention layer {layer}")
        for slot, which, a in ((1, "key", amax[0]), (2, "value", amax[1])):
            nodes, out = fp8_qdq(b, node.inputs[slot], float(fp8.scale_for(a)), f"layers.{layer}.kv_{which}")
            b.graph.insert_before(node, nodes)
            node.replace_input_with(slot, out)
        b.stats["kv_fp8_layers"] = b.stats.get("kv_fp8_layers", 0) + 1


def quantize_model(model: ir.Model, recipe: QuantRecipe, calib: CalibrationResult | None,
                   accuracy_level: int = 0, form: str = "cpu") -> dict:
    """Rewrite ``model`` in place for ``recipe``. Returns statistics (``matches`` = linears rewritten).

    ``form="cpu"`` emits what ONNX Runtime's CPU kernels run (INT4 on ``MatMulNBits``);
    ``form="qdq"`` emits INT4 weights as block-wise ``DequantizeLinear`` (axis 0, ``block_size`` =
    group) + ``MatMul``, the explicit form TensorRT's strongly typed networks fuse into INT4 GEMMs
    (FP8 and the KV cache are Q/DQ in both forms). The TensorRT backend is not built yet; ONNX
    Runtime runs both forms, and the tests check they compute the same values.
    """
    if form not in ("cpu", "qdq"):
        raise ValueError(f"form {form!r}: 'cpu' or 'qdq'")
    b = _Builder(model.graph)
    fmt = recipe.format
    if fmt is not None:
        gemms = gemms_to_matmuls(model)
        if gemms:
            b.stats["gemm_rewritten"] = gemms
        sites = find_linears(model)
        routers = sum(1 for n in model.graph if n.op_type == "Gemm" and feeds_router(n.outputs[0]))
        if routers:
            b.stats["routers_kept"] = routers
        if fmt.family == "int4" and form == "cpu":
            for node in list(model.graph):
                found = _expert_gather(node)
                if found is not None:
                    _int4_experts(b, node, *found, recipe)
                    b.stats["expert_weights_int4"] = b.stats.get("expert_weights_int4", 0) + 1
        experts = _expert_weights(model)
        if experts:  # batched [E, N, K] expert weights this format does not rewrite stay in full precision
            b.stats["expert_weights_kept"] = experts
        # The LM head's own format (--lm-head): on the CPU any of them; in the GPU (qdq) form INT4 unless "none"
        # (kept in the compute dtype; a pre-quantized checkpoint's float head stays as stored).
        head = (lm_head_site(model, sites) if fmt.family == "int4" and (form == "cpu" or recipe.lm_head == "none")
                else None)
        for site in sites:
            if feeds_router(site.node.outputs[0]):
                b.stats["routers_kept"] = b.stats.get("routers_kept", 0) + 1
                continue
            if site is head and recipe.lm_head != "int4":
                if recipe.lm_head == "int8":
                    _int8_site(b, site, recipe.group_size, accuracy_level)
                    b.stats["lm_head_int8"] = 1
                continue
            if fmt.family == "int4":
                _int4_site(b, site, recipe, calib, accuracy_level, form)
            elif fmt.family == "fp8":
                _fp8_site(b, site, calib)
            elif fmt.family == "nvfp4":
                if not _nvfp4_site(b, site, calib):
                    b.stats["skipped"] = b.stats.get("skipped", 0) + 1
                    continue
            b.stats["matches"] += 1
        if fmt.family == "int4":
            if recipe.embeddings != "none":
                for node in list(model.graph):
                    if node.op_type == "Gather" and node.domain == "" and _quantize_embedding(b, node, recipe):
                        b.stats["embeddings"] = b.stats.get("embeddings", 0) + 1
            model.opset_imports[MS_DOMAIN] = 1
            if b.stats.get("int4_llmc_kernel"):
                model.opset_imports[LLMC_DOMAIN] = LLMC_OPSET
    if recipe.kv_cache_dtype == "fp8":
        _kv_fp8(b, calib)
    b.stats.pop("_folded", None)
    return b.stats
