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

from llmc.passes.ort import FUSIONS, LATE_FUSIONS, lowering_passes
from llmc.passes.ort.contrib_ops import ATTENTION_ROUTES, MS_DOMAIN, ORT_CONTRIB_DOMAIN

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
# What engine.custom_ops in the manifest says for each route (the runtime's names for the libraries).
CUSTOM_OPS = {"native": "llmc_ort_ops", "pyop": "onnxruntime_extensions"}
__all__ = ["ATTENTION_ROUTES", "CUSTOM_OPS", "MS_DOMAIN", "ORT_CONTRIB_DOMAIN", "emit", "lower", "lowering_passes"]


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


def lower(model: ir.Model, attention: str = "native", fusions: frozenset[str] | None = None) -> dict[str, int]:
    """Run the route's lowering passes (llmc.passes.ort) on ``model`` in place. Returns how many nodes each step
    rewrote: ``lowered`` (llmc ops lowered for the route), one entry per backend fusion, and ``lora`` when any
    LoRA update was lowered.

    PagedAttention stays in the ``llmc`` domain (``attention="native"``: llmc's custom-op library) or
    moves to onnxruntime-extensions' domain (``"pyop"``: a Python op). On the native route the backend fusions
    named in ``fusions`` (default: all) run first: each layer's Split + rotary + reshapes + PagedAttention becomes
    one ``llmc.RotaryPagedAttention``, an INT4 gate/up matmul + Split + SwiGLU one ``llmc.Int4MatMul`` with the
    SwiGLU epilogue, gpt-oss's expert glue into the MXFP4 expert ops' epilogue; last, each float32 MatMul whose
    weight holds bfloat16 values becomes ``llmc.Bf16MatMul`` over the weight kept in bfloat16 (exact).
    """
    if attention not in ATTENTION_ROUTES:
        raise ValueError(f"attention route {attention!r}: expected one of {', '.join(ATTENTION_ROUTES)}")
    stats = {name: 0 for name in (*FUSIONS, *LATE_FUSIONS)}
    for graph_pass in lowering_passes(attention, fusions):
        stats[graph_pass.name] = graph_pass.run(model)["matches"]
    lora = stats.pop("lora-apply", 0)
    stats.pop("ort-opsets")
    return {"lowered": stats.pop("contrib-ops"), **stats, **({"lora": lora} if lora else {})}


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


def emit_graph(name: str, model: ir.Model, out_dir: Path) -> dict:
    """Write a further graph of the artifact (standard ONNX ops: an encoder, a projector) as ``{name}.onnx`` with
    its weights in ``{name}.onnx.data``; returns its manifest entry."""
    model_file, weights_file = f"{name}.onnx", f"{name}.onnx.data"
    ir.save(model, out_dir / model_file, external_data=weights_file)
    if not (out_dir / weights_file).exists():  # no initializer large enough to leave the graph
        weights_file = None
    return {"backend": "onnxruntime", "model_file": model_file, "weights_file": weights_file,
            "inputs": [v.name for v in model.graph.inputs], "outputs": [v.name for v in model.graph.outputs]}
