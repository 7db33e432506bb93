// What both MXFP4 expert ops (mxfp4_core.h, mxfp4_q8_core.h) may apply around their matmul: gpt-oss's MoE glue,
// fused so that no [rows, N] intermediate is written and read back by a chain of small ONNX nodes
// (compiler/backends/ort_mxfp4_epilogue.py folds the traced nodes into the ops' attributes and inputs).
//
//   bias       [E, N] or nullptr: y += bias[expert];
//   activation 1: gpt-oss's clamped SwiGLU over interleaved columns (gate = y[2i], up = y[2i + 1]):
//              out[i] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit); N/2 outputs;
//   x_share k: routed row m reads X row m / k (each token's row serves its k experts, read once);
//   combine k: with `weights` [M], the output holds M / k rows, y[t] = sum_j weights[t k + j] * row (t k + j).

#pragma once

#include <cstdint>
#include <vector>

#include "../../csrc/exp_nonpos.h"

namespace llmc_moe {

struct Epilogue {
    const float* bias = nullptr;
    int activation = 0;
    float alpha = 1.702f, limit = 7.0f;
    int64_t x_share = 1, combine = 1;
    const float* weights = nullptr;  // [M] when combine > 1
};

// Output columns per row: N, or N / 2 after the SwiGLU.
inline int64_t out_width(const Epilogue& epi, int64_t N) { return epi.activation ? N / 2 : N; }

// gpt-oss's clamped SwiGLU on a float or a GCC vector of floats (the same bits per lane either way, up to FMA
// contraction): sigmoid from exp of a non-positive argument, so it never overflows.
template <typename F, typename I>
inline __attribute__((always_inline)) F swiglu_oai(F gate, F up, float alpha, float limit) {
    gate = gate > limit ? F{} + limit : gate;
    up = up > limit ? F{} + limit : (up < -limit ? F{} - limit : up);
    const F z = gate * alpha;
    const F e = llmc::exp_nonpos_t<F, I>(z < 0.0f ? z : F{} - z);
    const F sig = z < 0.0f ? e / (e + 1.0f) : F{} + 1.0f / (e + 1.0f);
    return (up + 1.0f) * (gate * sig);
}

// Where a kernel writes its routed rows: straight into y, or (combine > 1) into a scratch of M rows that
// combine_rows then sums -- items of different experts write the same token's outputs, so summing in place
// would race.
struct RoutedOut {
    std::vector<float> scratch;
    float* rows;  // [M, W]
    RoutedOut(const Epilogue& epi, int64_t M, int64_t W, float* y) {
        if (epi.combine > 1) scratch.resize(static_cast<size_t>(M * W));
        rows = epi.combine > 1 ? scratch.data() : y;
    }
};

// y[t] = sum_j weights[t k + j] * rows[t k + j] (j in order), for the M / k tokens.
inline void combine_rows(const Epilogue& epi, const RoutedOut& routed, int64_t M, int64_t W, float* y) {
    if (epi.combine <= 1) return;
    for (int64_t t = 0; t < M / epi.combine; ++t) {
        float* dst = y + t * W;
        for (int64_t c = 0; c < W; ++c) dst[c] = 0.0f;
        for (int64_t j = 0; j < epi.combine; ++j) {
            const float w = epi.weights[t * epi.combine + j];
            const float* src = routed.rows + (t * epi.combine + j) * W;
            for (int64_t c = 0; c < W; ++c) dst[c] += w * src[c];
        }
    }
}

}  // namespace llmc_moe
