"""The ONNX Runtime backend's lowering passes, in the order it runs them (:func:`lowering_passes`).

On the native route (llmc's custom-op library) the backend fusions run first (rotary-attention, int4-swiglu,
mxfp4-epilogue), then every llmc-domain op is lowered for the route (contrib-ops), LoRA slot updates become one
``llmc.LoraApply`` each (lora-apply), bfloat16 weights stay bfloat16 (bf16-weights: last, after lora-apply has
matched its base MatMuls), and the opset imports are set (ort-opsets). The Python-op route runs contrib-ops and
ort-opsets only. Fusion names are those of llmc.passes.registry.BACKEND_FUSIONS (``--disable-pass`` takes them).
"""

from __future__ import annotations

from llmc.passes.base import GraphPass
from llmc.passes.ort.bf16_weights import lower_bf16_weights
from llmc.passes.ort.contrib_ops import lower_llmc_ops, set_opsets
from llmc.passes.ort.int4_swiglu import fuse_int4_swiglu
from llmc.passes.ort.lora_apply import lower_lora
from llmc.passes.ort.mxfp4_epilogue import fuse_mxfp4_epilogue
from llmc.passes.ort.rotary_attention import fuse_rotary_attention
from llmc.passes.registry import BACKEND_FUSIONS

# The backend fusions of the native route, before the ops are lowered.
FUSIONS = {"rotary-attention": fuse_rotary_attention, "int4-swiglu": fuse_int4_swiglu,
           "mxfp4-epilogue": fuse_mxfp4_epilogue}
# Native-route lowerings that run last, after the LoRA lowering has matched its base MatMuls.
LATE_FUSIONS = {"bf16-weights": lower_bf16_weights}


def _counted(run):
    return lambda model: {"matches": run(model)}


def lowering_passes(attention: str = "native", fusions: frozenset[str] | None = None) -> list[GraphPass]:
    """The lowering of ``attention``'s route, as passes; ``fusions`` the backend fusions left on (None: all)."""
    native = attention == "native"

    def fusion(name: str, run) -> list[GraphPass]:
        if not native or (fusions is not None and name not in fusions):
            return []
        return [GraphPass(name, _counted(run), BACKEND_FUSIONS[name])]

    passes = [p for name, run in FUSIONS.items() for p in fusion(name, run)]
    passes.append(GraphPass("contrib-ops", _counted(lambda m: lower_llmc_ops(m, attention)),
                            "llmc ops -> ONNX Runtime ops for the attention route (SkipRMSNormalization -> "
                            "SkipSimplifiedLayerNormalization, SwiGLU -> QuickGelu + Mul; pyop: PagedAttention -> "
                            "onnxruntime-extensions' Python op)", fusion=False))
    if native:
        passes.append(GraphPass("lora-apply", _counted(lower_lora),
                                "LoRA slot updates -> one llmc.LoraApply each (native route)", fusion=False))
    passes += [p for name, run in LATE_FUSIONS.items() for p in fusion(name, run)]
    passes.append(GraphPass("ort-opsets", lambda m: (set_opsets(m, attention), {"matches": 0})[1],
                            "opset imports of the lowered graph (llmc or onnxruntime-extensions, com.microsoft)",
                            fusion=False))
    return passes
