// llmc::Int4MatMul for ONNX Runtime: float32 rows times group-wise INT4 weights (int4_matmul_core.h), one node per
// projection (with activation = 1 the gate|up projection and its SwiGLU). A translation unit of llmc's custom-op
// library (registered by plugins/csrc/ort_ops.cpp); Python side: llmc.plugins.int4_matmul.

#include <atomic>
#include <string>
#include <vector>

#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
#include "int4_matmul_core.h"

using namespace llmc_ort;

namespace {

// llmc::Int4MatMul(X float [..., K], W uint8, scales float, mins float) -> float [..., N], attributes
// K, N, group_size; weights in llmc_i4's tiled layout (int4_matmul_core.h). activation = 1: the tiles
// alternate gate and up and the output is SwiGLU(gate, up), [..., N/2].

struct Int4Kernel {
    int64_t K = 0, N = 0, G = 0;
    bool swiglu = false;  // attribute activation = 1: the SwiGLU epilogue, output [..., N/2]
};

std::atomic<int> g_int4_isa{static_cast<int>(llmc_i4::best_isa())};
std::atomic<int64_t> g_int4_calls{0};
std::atomic<int64_t> g_int4_parallel_min{llmc_i4::kParallelMinWork};

void* create_int4_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new Int4Kernel();
    try {
        k->K = int_attr(info, "K", true, 0);
        k->N = int_attr(info, "N", true, 0);
        k->G = int_attr(info, "group_size", true, 0);
        if (k->K <= 0 || k->N <= 0) {
            throw Error("K and N must be positive, got K=" + std::to_string(k->K) + ", N=" + std::to_string(k->N));
        }
        if (k->G <= 0 || k->G % 8) throw Error("group_size must be a positive multiple of 8, got " + std::to_string(k->G));
        const int64_t act = int_attr(info, "activation", false, 0);
        if (act != 0 && act != 1) throw Error("activation must be 0 (none) or 1 (swiglu), got " + std::to_string(act));
        k->swiglu = act == 1;
        if (k->swiglu && k->N % 32) {
            throw Error("activation=1 (swiglu) needs N % 32 == 0 (whole 16-column gate and up tiles), got N=" +
                        std::to_string(k->N));
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_int4_kernel(void* kernel) { delete static_cast<Int4Kernel*>(kernel); }

void compute_int4(void* kernel, OrtKernelContext* ctx) {
    const Int4Kernel& k = *static_cast<const Int4Kernel*>(kernel);
    const Tensor x = input(ctx, 0, "X"), w = input(ctx, 1, "W"), sc = input(ctx, 2, "scales"),
                 mn = input(ctx, 3, "mins");
    if (x.dims.empty() || x.dims.back() != k.K) {
        throw Error("X must have K = " + std::to_string(k.K) + " in its last dimension, got shape " + dims_str(x.dims));
    }
    const int64_t tiles = (k.N + 15) / 16, ng = (k.K + k.G - 1) / k.G;
    require_shape(w, {tiles, ng * k.G / 8, 64}, "W");
    require_shape(sc, {tiles, ng, 16}, "scales");
    require_shape(mn, {tiles, ng, 16}, "mins");
    int64_t M = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
    std::vector<int64_t> out_dims(x.dims);
    out_dims.back() = k.swiglu ? k.N / 2 : k.N;
    llmc_i4::Problem p{static_cast<const float*>(x.data), M, k.K,
                       static_cast<const uint8_t*>(w.data), static_cast<const float*>(sc.data),
                       static_cast<const float*>(mn.data), k.N, k.G, ng,
                       output(ctx, out_dims.data(), out_dims.size())};
    p.swiglu = k.swiglu;
    const auto isa = static_cast<llmc_i4::Isa>(g_int4_isa.load());
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        llmc_i4::run(p, isa, threads, pf, g_int4_parallel_min.load());
    });
    g_int4_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* int4_name(const OrtCustomOpV13*) { return "Int4MatMul"; }
int32_t int4_input_type(const OrtCustomOpV13*, size_t i) { return i == 1 ? kOrtUint8 : kOrtFloat; }
size_t int4_input_count(const OrtCustomOpV13*) { return 4; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kInt4MatMulOp = make_op(int4_name, int4_input_type, int4_input_count,
                                                      create_int4_kernel, compute_int4, destroy_int4_kernel);

// Int4MatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 VNNI (default: the best this CPU has).
// Setting one the CPU lacks returns -1 and changes nothing (tests run every path this way).
LLMC_EXPORT int llmc_int4_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_i4::best_isa())) return -1;
    g_int4_isa = isa;
    return 0;
}

LLMC_EXPORT int llmc_int4_get_isa() { return g_int4_isa.load(); }

// The least work (M x N x K multiply-adds) Int4MatMul spreads over threads (for tuning; returns the old value).
LLMC_EXPORT int64_t llmc_int4_set_parallel_min(int64_t work) {
    return g_int4_parallel_min.exchange(work < 0 ? llmc_i4::kParallelMinWork : work);
}

// Int4MatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_int4_calls() { return g_int4_calls.load(); }
