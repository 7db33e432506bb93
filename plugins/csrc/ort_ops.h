// Every op of llmc's ONNX Runtime custom-op library, each defined next to its kernel in its plugin's folder
// (plugins/<plugin>/csrc/ort_<plugin>.cpp) and registered, in the domain "llmc", by plugins/csrc/ort_ops.cpp.

#pragma once

#include "ort_abi.h"

namespace llmc_ort {

extern const OrtCustomOpV13 kPagedAttentionOp, kRotaryPagedAttentionOp;     // plugins/paged_attention
extern const OrtCustomOpV13 kInt4MatMulOp;                                   // plugins/int4_matmul
extern const OrtCustomOpV13 kCausalConv1dOp, kGatedDeltaRuleOp, kSsdScanOp;  // plugins/recurrent
extern const OrtCustomOpV13 kLoraApplyOp;                                    // plugins/lora
extern const OrtCustomOpV13 kMxfp4MoEMatMulOp, kMxfp4MoEMatMulQ8Op;          // plugins/mxfp4
extern const OrtCustomOpV13 kBf16MatMulOp;                                   // plugins/bf16_matmul

}  // namespace llmc_ort
