// llmc::Bf16MatMul for ONNX Runtime: float32 rows times a bfloat16 weight, exactly (bf16_matmul_core.h). A translation
// unit of llmc's custom-op library (registered by plugins/csrc/ort_ops.cpp).
//
// Bf16MatMul(X float [..., K], W uint16 [P, K, 48] (bfloat16 bits in column panels, P = ceil(N / 48)))
//     -> float [..., N], attribute N (the output width).

#include <atomic>
#include <string>
#include <vector>

#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
#include "bf16_matmul_core.h"

using namespace llmc_ort;

namespace {

std::atomic<int> g_bf16_isa{static_cast<int>(llmc_bf::best_isa())};
std::atomic<int64_t> g_bf16_calls{0};

void* create_bf16_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    const int64_t n = int_attr(info, "N", true, 0);
    if (n <= 0) throw Error("attribute N must be positive, got " + std::to_string(n));
    return new int64_t(n);
}

void destroy_bf16_kernel(void* kernel) { delete static_cast<int64_t*>(kernel); }

void compute_bf16(void* kernel, OrtKernelContext* ctx) {
    const int64_t N = *static_cast<const int64_t*>(kernel);
    const Tensor x = input(ctx, 0, "X"), w = input(ctx, 1, "W");
    require_rank(w, 3, "W");
    const int64_t K = w.dims[1];
    require_shape(w, {(N + llmc_bf::kNr - 1) / llmc_bf::kNr, K, llmc_bf::kNr}, "W");
    if (x.dims.empty() || x.dims.back() != K) {
        throw Error("X must have K = " + std::to_string(K) + " (W's dimension 1) in its last dimension, got shape " +
                    dims_str(x.dims));
    }
    int64_t M = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
    std::vector<int64_t> out_dims(x.dims);
    out_dims.back() = N;
    llmc_bf::Problem p{static_cast<const float*>(x.data), static_cast<const uint16_t*>(w.data),
                       output(ctx, out_dims.data(), out_dims.size()), M, K, N};
    const auto isa = static_cast<llmc_bf::Isa>(g_bf16_isa.load());
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) { llmc_bf::run(p, isa, threads, pf); });
    g_bf16_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* bf16_name(const OrtCustomOpV13*) { return "Bf16MatMul"; }
int32_t bf16_input_type(const OrtCustomOpV13*, size_t i) { return i == 0 ? kOrtFloat : kOrtUint16; }
size_t bf16_input_count(const OrtCustomOpV13*) { return 2; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kBf16MatMulOp = make_op(bf16_name, bf16_input_type, bf16_input_count,
                                                      create_bf16_kernel, compute_bf16, destroy_bf16_kernel);

// Bf16MatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 (default: the best this CPU has); -1 if absent.
LLMC_EXPORT int llmc_bf16_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_bf::best_isa())) return -1;
    g_bf16_isa = isa;
    return 0;
}

// Bf16MatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_bf16_calls() { return g_bf16_calls.load(); }
