"""ONNX Runtime (CPU) backend: lower llmc ops to what ORT can run and write the engine files.

``PagedAttention`` has two routes into llmc's C++ kernel on the runtime-owned KV pool:

- ``"native"`` (the default): the node stays in the ``llmc`` domain, which llmc's own custom-op
  library registers (llmc.plugins.paged_attention.ort_native; a shared object built with llmc,
  written against ORT's C ABI). No Python runs per call.
- ``"pyop"``: the node moves to onnxruntime-extensions' ``ai.onnx.contrib`` domain, whose
  Python-registered kernel (llmc.plugins.paged_attention.ort_op) is called once per layer per
  step (about 40 µs each). Kept for debugging (it can run the numpy reference) and as a
  differential reference for the native library.

The engine's manifest names the library its graph needs (``engine.custom_ops``, see
:data:`CUSTOM_OPS`), and the runtime loads exactly that one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from llmc.compiler.backends.ort_bf16_weights import lower_bf16_weights
from llmc.compiler.backends.ort_int4_swiglu import fuse_int4_swiglu
from llmc.compiler.backends.ort_lora import lower_lora
from llmc.compiler.backends.ort_mxfp4_epilogue import fuse_mxfp4_epilogue
from llmc.compiler.backends.ort_rotary_attention import fuse_rotary_attention
from llmc.errors import LlmcError
from llmc.passes.base import replace_value
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, OPSET_VERSION, ROTARY_OP_TYPE
from llmc.plugins.recurrent import CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE

ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"
MS_DOMAIN = "com.microsoft"
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
ATTENTION_ROUTES = ("native", "pyop")
# What engine.custom_ops in the manifest says for each route (the runtime's names for the libraries).
CUSTOM_OPS = {"native": "llmc_ort_ops", "pyop": "onnxruntime_extensions"}
# The backend fusions of the native route (names as in llmc.passes.registry.BACKEND_FUSIONS).
FUSIONS = {"rotary-attention": fuse_rotary_attention, "int4-swiglu": fuse_int4_swiglu,
           "mxfp4-epilogue": fuse_mxfp4_epilogue}
# Native-route lowerings that run last, after the LoRA lowering has matched its base MatMuls (same names).
LATE_FUSIONS = {"bf16-weights": lower_bf16_weights}


@dataclass
class EngineFiles:
    model: str
    weights: str
    custom_ops: str  # the custom-op library the graph needs (a value of CUSTOM_OPS)
    fusions: dict[str, int] = field(default_factory=dict)  # matches per backend fusion (for report.json)


PROGRESS_S = 15.0


def _progress(say):
    """An ``ir.save`` callback that reports every ``PROGRESS_S`` seconds (None without ``say``)."""
    if say is None:
        return None
    import time

    from llmc.memory import rss_gb

    start = last = time.perf_counter()
    done = 0

    def callback(tensor, info) -> None:
        nonlocal last, done
        done += 1
        now = time.perf_counter()
        if now - last >= PROGRESS_S:
            last = now
            say(f"      wrote {done}/{info.total} tensors, {now - start:.0f}s, {rss_gb():.1f} GB resident")

    return callback


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


def _check_route(attention: str) -> None:
    if attention not in ATTENTION_ROUTES:
        raise ValueError(f"attention route {attention!r}: expected one of {', '.join(ATTENTION_ROUTES)}")


def lower(model: ir.Model, attention: str = "native", fusions: frozenset[str] | None = None) -> dict[str, int]:
    """Rewrite llmc-domain ops into ops ONNX Runtime executes. Returns how many nodes each step rewrote
    (``lowered``, and per backend fusion).

    PagedAttention stays in the ``llmc`` domain (``attention="native"``: llmc's custom-op library) or
    moves to onnxruntime-extensions' domain (``"pyop"``: a Python op); SkipRMSNormalization and SwiGLU
    become ORT contrib ops. On the native route the backend fusions named in ``fusions`` (default: all
    of :data:`FUSIONS`) run first: each layer's Split + rotary + reshapes + PagedAttention becomes one
    ``llmc.RotaryPagedAttention`` (ort_rotary_attention), an INT4 gate/up matmul + Split + SwiGLU one
    ``llmc.Int4MatMul`` with the SwiGLU epilogue (ort_int4_swiglu), gpt-oss's expert glue (bias, clamped SwiGLU,
    top-k repeat and weighted sum) into the MXFP4 expert ops' epilogue (ort_mxfp4_epilogue). Last, each float32
    MatMul whose weight holds bfloat16 values becomes ``llmc.Bf16MatMul`` over the weight kept in bfloat16
    (ort_bf16_weights; exact).
    """
    _check_route(attention)
    graph = model.graph
    stats = {name: 0 for name in (*FUSIONS, *LATE_FUSIONS)}
    if attention == "native":
        for name, fuse in FUSIONS.items():
            if fusions is None or name in fusions:
                stats[name] = fuse(model)
    count = 0
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        if node.op_type == OP_TYPE:
            if attention == "pyop":
                node.domain = ORT_CONTRIB_DOMAIN
                if len(node.inputs) > 7 and node.inputs[7] is not None:  # attention sinks: the 8-input Python op
                    node.op_type = OP_TYPE + "Sinks"
                from llmc.plugins.paged_attention import OPTIONAL_ATTRS, PYOP_EXTENDED

                if any(name in node.attributes for name in OPTIONAL_ATTRS):
                    # ALiBi / chunked local attention: the Python op that declares them, which needs them all set.
                    node.op_type += PYOP_EXTENDED
                    for name, off in OPTIONAL_ATTRS.items():
                        if name not in node.attributes:
                            make = ir.AttrFloat32 if isinstance(off, float) else ir.AttrInt64
                            node.attributes[name] = make(name, off)
        elif node.op_type == ROTARY_OP_TYPE:  # made just above, on the native route only
            continue
        elif node.op_type == "Int4MatMul":
            # Only llmc's native library has this kernel; the Python-op route hosts attention only.
            if attention == "pyop":
                raise LlmcError("llmc.Int4MatMul runs only in llmc's native custom-op library; build with the "
                                "native attention route, or with --int4-kernel mlas (ONNX Runtime's MatMulNBits)")
            continue
        elif node.op_type in ("Mxfp4MoEMatMul", "Mxfp4MoEMatMulQ8"):  # MXFP4 experts (passes/mxfp4_experts)
            if attention == "pyop":
                raise LlmcError("llmc.Mxfp4MoEMatMul runs only in llmc's native custom-op library; build with the "
                                "native attention route")
            continue
        elif node.op_type in (CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE):  # recurrent-state ops: native library only
            if attention == "pyop":
                raise LlmcError(f"llmc.{node.op_type} runs only in llmc's native custom-op library; build with the "
                                "native attention route")
            continue
        elif node.op_type == "SkipRMSNormalization":
            _lower_skip_rms_norm(graph, node)
        elif node.op_type == "SwiGLU":
            _lower_swiglu(graph, node)
        else:
            raise NotImplementedError(f"the ONNX Runtime backend cannot lower llmc.{node.op_type}")
        count += 1
    # LoRA slot updates (llmc.passes.lora): one llmc.LoraApply each on the native route (ort_lora); the Python-op
    # route keeps their standard-op form.
    lora = lower_lora(model) if attention == "native" else 0
    if attention == "native":
        for name, fuse in LATE_FUSIONS.items():
            if fusions is None or name in fusions:
                stats[name] = fuse(model)
    if attention == "pyop":
        model.opset_imports.pop(DOMAIN, None)
        model.opset_imports[ORT_CONTRIB_DOMAIN] = 1
    elif any(node.domain == DOMAIN for node in graph):
        model.opset_imports[DOMAIN] = OPSET_VERSION
    model.opset_imports[MS_DOMAIN] = 1
    return {"lowered": count, **stats, **({"lora": lora} if lora else {})}


def emit(model: ir.Model, out_dir: Path, attention: str = "native",
         fusions: frozenset[str] | None = None, say=None) -> EngineFiles:
    """Lower and write ``model.onnx`` with its weights in ``model.onnx.data`` (streamed, one tensor at a time).

    ``attention`` picks PagedAttention's route (see the module docstring), ``fusions`` the native
    route's backend fusions (see :func:`lower`); the returned :class:`EngineFiles` names the custom-op
    library the engine needs and what each backend fusion matched. ``say`` gets a progress line (tensors
    written, resident memory) every ``PROGRESS_S`` seconds: an 8B model's weights take minutes to quantize and
    write.
    """
    stats = lower(model, attention, fusions)
    ir.save(model, out_dir / MODEL_FILE, external_data=WEIGHTS_FILE, callback=_progress(say))
    return EngineFiles(model=MODEL_FILE, weights=WEIGHTS_FILE, custom_ops=CUSTOM_OPS[attention],
                       fusions={name: stats[name] for name in (*FUSIONS, *LATE_FUSIONS)})
