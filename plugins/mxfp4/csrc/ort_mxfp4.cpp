// llmc::Mxfp4MoEMatMul and llmc::Mxfp4MoEMatMulQ8 for ONNX Runtime: a token row times its expert's MXFP4 weight
// (mxfp4_core.h, mxfp4_q8_core.h). A translation unit of llmc's custom-op library (registered by
// plugins/csrc/ort_ops.cpp).
//
// Mxfp4MoEMatMul(X float [..., K], expert_ids int64 (M values: M = the rows of X), blocks uint8 [E, N, K/32, 16],
//                scales uint8 [E, N, K/32], optional bias float [E, N], optional weights float [M]) -> float [..., N]
// Both ops take the same optional epilogue (moe_epilogue.h): inputs bias and weights, attributes activation, alpha,
// limit, x_share and combine (then X is [rows, 1, K] and the output [M / combine, 1, N or N / 2]).

#include <atomic>
#include <string>
#include <vector>

#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
#include "moe_epilogue.h"
#include "mxfp4_core.h"
#include "mxfp4_q8_core.h"

using namespace llmc_ort;

namespace {

std::atomic<int> g_mxfp4_isa{static_cast<int>(llmc_mx::best_isa())};
std::atomic<int64_t> g_mxfp4_calls{0};

// The epilogue's attributes (moe_epilogue.h); N is checked against them where the op knows it.
llmc_moe::Epilogue epilogue_attrs(const OrtKernelInfo* info) {
    llmc_moe::Epilogue epi;
    const int64_t act = int_attr(info, "activation", false, 0);
    if (act != 0 && act != 1) throw Error("attribute activation must be 0 or 1, got " + std::to_string(act));
    epi.activation = static_cast<int>(act);
    epi.alpha = float_attr(info, "alpha", 1.702f);
    epi.limit = float_attr(info, "limit", 7.0f);
    epi.x_share = int_attr(info, "x_share", false, 1);
    epi.combine = int_attr(info, "combine", false, 1);
    if (epi.x_share < 1 || epi.combine < 1) {
        throw Error("attributes x_share and combine must be >= 1, got " + std::to_string(epi.x_share) + " and " +
                    std::to_string(epi.combine));
    }
    return epi;
}

void* create_mxfp4_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    return new llmc_moe::Epilogue(epilogue_attrs(info));
}

void destroy_mxfp4_kernel(void* kernel) { delete static_cast<llmc_moe::Epilogue*>(kernel); }

// X's rows against K (named after the weight input it comes from) and expert_ids against E: the routed row count M
// (X's rows times `share`, the routed rows that read each X row), and each id checked to be in [0, E).
int64_t routed_rows(const Tensor& x, const Tensor& ids, int64_t K, int64_t E, const char* weight, int64_t share = 1) {
    if (x.dims.empty() || x.dims.back() != K) {
        throw Error("X must have K = " + std::to_string(K) + " (" + weight +
                    "' K/32 x 32) in its last dimension, got shape " + dims_str(x.dims));
    }
    int64_t M = 1, I = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
    for (int64_t d : ids.dims) I *= d;
    M *= share;
    if (I != M) {
        throw Error(std::string("expert_ids must hold one expert per row of X") + (share > 1 ? " times x_share (" : " (") +
                    std::to_string(M) + "), got shape " + dims_str(ids.dims));
    }
    const auto* id = static_cast<const int64_t*>(ids.data);
    for (int64_t m = 0; m < M; ++m) {
        if (id[m] < 0 || id[m] >= E) {
            throw Error("expert_ids[" + std::to_string(m) + "] = " + std::to_string(id[m]) + " is outside [0, " +
                        std::to_string(E) + ")");
        }
    }
    return M;
}

// The epilogue's inputs (4: bias [E, N], 5: weights [M]) checked, and the output's dims: X's with N (or N / 2)
// last, and with x_share / combine [M / combine, 1, ...]. `epi` comes back with the input pointers set.
std::vector<int64_t> epilogue_io(OrtKernelContext* ctx, const Tensor& x, int64_t M, int64_t E, int64_t N,
                                 llmc_moe::Epilogue& epi) {
    if (epi.activation && N % 2) throw Error("activation 1 needs an even N (gate/up pairs), got " + std::to_string(N));
    const Tensor bias = input(ctx, 4, "bias", true), weights = input(ctx, 5, "weights", true);
    if (bias.data != nullptr) require_shape(bias, {E, N}, "bias");
    epi.bias = static_cast<const float*>(bias.data);
    epi.weights = static_cast<const float*>(weights.data);
    std::vector<int64_t> out_dims(x.dims);
    out_dims.back() = llmc_moe::out_width(epi, N);
    if (epi.x_share > 1 || epi.combine > 1) {
        // rows are counted on the first axis: X [rows, 1, K] (the routed matmul's layout)
        if (x.dims.size() != 3 || x.dims[1] != 1) {
            throw Error("with x_share or combine, X must be [rows, 1, K], got shape " + dims_str(x.dims));
        }
        if (M % epi.combine) {
            throw Error("combine = " + std::to_string(epi.combine) + " must divide the routed rows (" +
                        std::to_string(M) + ")");
        }
        out_dims[0] = M / epi.combine;
    }
    if (epi.combine > 1) {
        int64_t W = 1;
        for (int64_t d : weights.dims) W *= d;
        if (weights.data == nullptr || W != M) {
            throw Error("combine needs weights holding one float per routed row (" + std::to_string(M) + ")" +
                        (weights.data == nullptr ? std::string(", got none") : ", got shape " + dims_str(weights.dims)));
        }
    }
    return out_dims;
}

void compute_mxfp4(void* kernel, OrtKernelContext* ctx) {
    llmc_moe::Epilogue epi = *static_cast<const llmc_moe::Epilogue*>(kernel);
    const Tensor x = input(ctx, 0, "X"), ids = input(ctx, 1, "expert_ids"), blocks = input(ctx, 2, "blocks"),
                 scales = input(ctx, 3, "scales");
    require_rank(blocks, 4, "blocks");
    const int64_t E = blocks.dims[0], N = blocks.dims[1], G = blocks.dims[2];
    if (blocks.dims[3] != 16 || E <= 0 || N <= 0 || G <= 0) {
        throw Error("blocks must be [E, N, K/32, 16] uint8 (E2M1 pairs), got shape " + dims_str(blocks.dims));
    }
    require_shape(scales, {E, N, G}, "scales");
    const int64_t K = G * llmc_mx::kBlock;
    const int64_t M = routed_rows(x, ids, K, E, "blocks", epi.x_share);
    const auto* id = static_cast<const int64_t*>(ids.data);
    const std::vector<int64_t> out_dims = epilogue_io(ctx, x, M, E, N, epi);
    llmc_mx::Problem p{static_cast<const float*>(x.data), id, static_cast<const uint8_t*>(blocks.data),
                       static_cast<const uint8_t*>(scales.data), output(ctx, out_dims.data(), out_dims.size()),
                       M, K, N, E, epi};
    const auto isa = static_cast<llmc_mx::Isa>(g_mxfp4_isa.load());
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) { llmc_mx::run(p, isa, threads, pf); });
    g_mxfp4_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* mxfp4_name(const OrtCustomOpV13*) { return "Mxfp4MoEMatMul"; }
// X, expert_ids, the two weight inputs, then the epilogue's optional float bias and weights.
int32_t mxfp4_input_type(const OrtCustomOpV13*, size_t i) {
    return i == 0 || i >= 4 ? kOrtFloat : (i == 1 ? kOrtInt64 : kOrtUint8);
}
size_t mxfp4_input_count(const OrtCustomOpV13*) { return 6; }
int32_t mxfp4_input_characteristic(const OrtCustomOpV13*, size_t i) { return i >= 4 ? 1 : 0; }

// Mxfp4MoEMatMulQ8(X float [..., K], expert_ids int64 (M values), codes uint8 [E, T, K/32, 4, 64],
//                  scales uint8 [E, T, K/32, 16], optional bias float [E, N], optional weights float [M])
//   -> float [..., N] (activation 1: [..., N / 2]; combine k: [M / k, 1, ...]),
// attributes N (T = ceil(N / 16)), activation (0 none, 1 gpt-oss's clamped SwiGLU over interleaved gate/up
// columns), alpha, limit, x_share and combine (the top-k repeat and weighted sum, moe_epilogue.h): the rows quantized
// to 8 bits per 32-block (mxfp4_q8_core.h; opt-in, not exact).

std::atomic<int> g_mxfp4_q8_vnni{llmc_mxq::has_vnni() ? 1 : 0};
std::atomic<int64_t> g_mxfp4_q8_calls{0};

struct Mxfp4Q8Kernel {
    int64_t N = 0;
    llmc_moe::Epilogue epi{};
};

void* create_mxfp4_q8_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    Mxfp4Q8Kernel k;
    k.N = int_attr(info, "N", true, 0);
    if (k.N <= 0) throw Error("attribute N must be positive, got " + std::to_string(k.N));
    k.epi = epilogue_attrs(info);
    return new Mxfp4Q8Kernel(k);
}

void destroy_mxfp4_q8_kernel(void* kernel) { delete static_cast<Mxfp4Q8Kernel*>(kernel); }

void compute_mxfp4_q8(void* kernel, OrtKernelContext* ctx) {
    const Mxfp4Q8Kernel& k = *static_cast<const Mxfp4Q8Kernel*>(kernel);
    const int64_t N = k.N;
    const Tensor x = input(ctx, 0, "X"), ids = input(ctx, 1, "expert_ids"), codes = input(ctx, 2, "codes"),
                 scales = input(ctx, 3, "scales");
    require_rank(codes, 5, "codes");
    const int64_t E = codes.dims[0], T = codes.dims[1], G = codes.dims[2];
    if (E <= 0 || G <= 0 || T != (N + llmc_mxq::kGroup - 1) / llmc_mxq::kGroup || codes.dims[3] != 4 ||
        codes.dims[4] != 64) {
        throw Error("codes must be [E, ceil(N / 16), K/32, 4, 64] uint8 with N = " + std::to_string(N) + ", got shape " +
                    dims_str(codes.dims));
    }
    require_shape(scales, {E, T, G, llmc_mxq::kGroup}, "scales");
    const int64_t K = G * llmc_mxq::kBlock;
    llmc_moe::Epilogue epi = k.epi;
    const int64_t M = routed_rows(x, ids, K, E, "codes", epi.x_share);
    const auto* id = static_cast<const int64_t*>(ids.data);
    const std::vector<int64_t> out_dims = epilogue_io(ctx, x, M, E, N, epi);
    llmc_mxq::Problem p{static_cast<const float*>(x.data), id, static_cast<const uint8_t*>(codes.data),
                        static_cast<const uint8_t*>(scales.data), output(ctx, out_dims.data(), out_dims.size()),
                        M, K, N, E, epi};
    const bool vnni = g_mxfp4_q8_vnni.load() != 0;
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) { llmc_mxq::run(p, vnni, threads, pf); });
    g_mxfp4_q8_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* mxfp4_q8_name(const OrtCustomOpV13*) { return "Mxfp4MoEMatMulQ8"; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kMxfp4MoEMatMulOp = make_op(mxfp4_name, mxfp4_input_type, mxfp4_input_count,
                                                          create_mxfp4_kernel, compute_mxfp4, destroy_mxfp4_kernel,
                                                          mxfp4_input_characteristic);
// The same schema; the codes in the Q8 layout.
const OrtCustomOpV13 llmc_ort::kMxfp4MoEMatMulQ8Op = make_op(mxfp4_q8_name, mxfp4_input_type, mxfp4_input_count,
                                                            create_mxfp4_q8_kernel, compute_mxfp4_q8,
                                                            destroy_mxfp4_q8_kernel, mxfp4_input_characteristic);

// Mxfp4MoEMatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 (default: the best this CPU has); -1 if absent.
LLMC_EXPORT int llmc_mxfp4_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_mx::best_isa())) return -1;
    g_mxfp4_isa = isa;
    return 0;
}

LLMC_EXPORT int llmc_mxfp4_get_isa() { return g_mxfp4_isa.load(); }

// Mxfp4MoEMatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_mxfp4_calls() { return g_mxfp4_calls.load(); }

// Mxfp4MoEMatMulQ8's path: 1 AVX-512 VNNI (the default where the CPU has it), 0 scalar; -1 if absent.
LLMC_EXPORT int llmc_mxfp4_q8_set_vnni(int on) {
    if (on != 0 && on != 1) return -1;
    if (on && !llmc_mxq::has_vnni()) return -1;
    g_mxfp4_q8_vnni = on;
    return 0;
}

// Mxfp4MoEMatMulQ8 kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_mxfp4_q8_calls() { return g_mxfp4_q8_calls.load(); }
