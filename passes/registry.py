"""Every pass llmc has, in the order the default pipeline runs them."""

from __future__ import annotations

from llmc.passes import activation, attention_layout, cleanup, normalization, projections, rotary, weight_layout
from llmc.passes.base import GraphPass

ALL_PASSES: tuple[GraphPass, ...] = (
    GraphPass("fold-constants", cleanup.fold_constants,
              "constant folding, shape/cast/reshape simplification, dead-code elimination",
              guarantees=("folded",), fusion=False),
    GraphPass("weight-layout", weight_layout.transpose_weights,
              "store transposed weights instead of transposing them at run time (lazy)",
              requires=("fold-constants",), guarantees=("no-weight-transposes",)),
    GraphPass("rms-norm", normalization.rms_norm, "RMSNorm subgraph -> RMSNormalization (opset 23)",
              requires=("fold-constants",), guarantees=("rms-normalization",)),
    GraphPass("skip-rms-norm", normalization.skip_rms_norm,
              "residual Add + RMSNormalization -> llmc.SkipRMSNormalization", requires=("rms-norm",)),
    GraphPass("rotary-embedding", rotary.rotary_embedding, "rotate-half rotary subgraph -> RotaryEmbedding",
              requires=("fold-constants",)),
    GraphPass("head-layout", attention_layout.fold_head_layout,
              "per-head Reshape/Transpose/Gather chains into attention (and rotary) -> one Reshape, packed rotary",
              requires=("fold-constants",)),
    GraphPass("pack-projections", projections.pack_projections,
              "Q/K/V and gate/up projections sharing an input -> one MatMul + Split",
              requires=("weight-layout",)),
    GraphPass("swiglu", activation.swiglu, "SiLU(gate) * up -> llmc.SwiGLU"),
    GraphPass("cse", cleanup.common_subexpressions, "merge identical computations (per-layer rotary cos/sin)",
              fusion=False),
    GraphPass("dead-code-elimination", cleanup.dead_code_elimination, "remove unused nodes and opsets",
              fusion=False),
)

BY_NAME = {p.name: p for p in ALL_PASSES}

# Fusions that a backend applies while lowering (they need that backend's kernels), not graph passes:
# --disable-pass accepts their names too, and 'all-fusions' includes them.
BACKEND_FUSIONS: dict[str, str] = {
    "rotary-attention": "CPU, native attention route: Split + RotaryEmbedding x2 + Reshape x3 + PagedAttention "
                        "-> llmc.RotaryPagedAttention (ONNX Runtime backend lowering)",
    "int4-swiglu": "CPU, native route: llmc.Int4MatMul (packed gate/up) + Split + SwiGLU -> llmc.Int4MatMul with the "
                   "SwiGLU epilogue (ONNX Runtime backend lowering)",
    "mxfp4-epilogue": "CPU, native route: gpt-oss's expert bias (GatherND + Add), clamped SwiGLU (Slice x2, Clip "
                      "x2, Sigmoid, Mul x3, Add), top-k row repeat (Expand) and weighted top-k sum (Mul + ReduceSum) "
                      "-> the epilogue of llmc.Mxfp4MoEMatMul / Mxfp4MoEMatMulQ8 (ONNX Runtime backend lowering)",
    "bf16-weights": "CPU, native route: MatMul over a weight the checkpoint stores in bfloat16 -> llmc.Bf16MatMul with "
                    "the weight kept in bfloat16 (exact: half the bytes a decode step reads; ONNX Runtime backend "
                    "lowering)",
}
