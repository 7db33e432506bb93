"""llmc's MXFP4 expert matmul for the CPU: ``llmc.Mxfp4MoEMatMul`` in the native ONNX Runtime custom-op library
(csrc/mxfp4_core.h, registered by plugins/paged_attention/csrc/ort_paged_attention.cpp), and its numpy reference.

gpt-oss ships its MoE experts as MXFP4 (OpenAI's layout: E2M1 codes two per byte, low nibble first, 32 along the
input dimension per block, one E8M0 exponent per block); the op multiplies each token row by its expert's weight
straight from those codes, so the engine keeps the experts at 4.25 bits per weight."""

OP_TYPE = "Mxfp4MoEMatMul"
