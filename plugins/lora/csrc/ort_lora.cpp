// llmc::LoraApply for ONNX Runtime: LoRA slot updates chosen per token (llmc.passes.lora), in one node. A translation
// unit of llmc's custom-op library (registered by plugins/csrc/ort_ops.cpp).
//
// LoraApply(Y float [..., W], X float [..., K], A0 float [K, S*R], B0 float [S*R, N0], slots int64 [T],
//           [A1, B1, [A2, B2]])
//   -> float [..., W] (activation 0) or [..., W/2] (activation 1), attributes rank = R, offset, offset1, offset2
//   (default 0; offset_i + N_i <= W), activation (default 0):
// out = Y, then for every token t (T = the rows of X and Y) whose slot s = slots[t] is in 1..S and every part i:
//   out[t, offset_i : offset_i + N_i] += (X[t] @ A_i[:, (s-1)R : sR]) @ B_i[(s-1)R : sR]
// in float32; with activation 1 (SwiGLU, Y = [gate | up]) the output is then silu(out[:, :W/2]) * out[:, W/2:].
// Only the token's own slot is computed (the graph's standard-op form computes all S and masks the others away).
// A packed projection (Q|K|V, gate|up) takes its parts' updates in one node, and gate|up its SwiGLU too, so that
// a LoRA engine runs about as many nodes per layer as the engine without slots.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/exp_nonpos.h"
#include "../../csrc/isa.h"
#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
// The SwiGLU is Int4MatMul's fused epilogue (its 8-float vector types and the same exp).
#include "../../int4_matmul/csrc/int4_matmul_core.h"

using namespace llmc_ort;

namespace {

struct LoraKernel {
    int64_t rank = 0, activation = 0;
    int64_t offsets[3] = {0, 0, 0};
};

void* create_lora_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new LoraKernel();
    try {
        k->rank = int_attr(info, "rank", true, 0);
        k->offsets[0] = int_attr(info, "offset", false, 0);
        k->offsets[1] = int_attr(info, "offset1", false, 0);
        k->offsets[2] = int_attr(info, "offset2", false, 0);
        k->activation = int_attr(info, "activation", false, 0);
        if (k->rank <= 0 || k->offsets[0] < 0 || k->offsets[1] < 0 || k->offsets[2] < 0 || k->activation < 0 ||
            k->activation > 1) {
            throw Error("rank must be positive, offsets >= 0 and activation 0 or 1, got rank=" +
                        std::to_string(k->rank) + ", offset=" + std::to_string(k->offsets[0]) +
                        ", activation=" + std::to_string(k->activation));
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_lora_kernel(void* kernel) { delete static_cast<LoraKernel*>(kernel); }

struct LoraPart {
    const float *a, *b;
    int64_t N, offset;
};

struct LoraProblem {
    const float *y, *x;
    const int64_t* slots;
    float* acc;  // [T, width]: Y plus the updates (the output itself when there is no activation)
    float* out;  // the output: acc, or [T, width / 2] after the SwiGLU
    LoraPart parts[3];
    int64_t n_parts, K, W, R, S, width, activation;
};

// The update of one part for the tokens `rows[0..m)` of slot s together (u: m * R floats of scratch). Each
// row of the slot's A and B is read once per block of 4 tokens, whose sums stay in registers: the shrink keeps
// 4 tokens' R-column chunk across all of K, the expand 4 tokens' 4 vectors of outputs across the R rows.
// Written with GCC vectors of L floats (R % L == 0); inlined into one copy per instruction set (below).
// Loads and stores go through memcpy (unaligned moves): an under-aligned typedef would lose its alignment as a
// template argument.
typedef float lora_v16 __attribute__((vector_size(64)));
typedef float lora_v8 __attribute__((vector_size(32)));
constexpr int64_t kLoraTokens = 4;

template <typename V>
__attribute__((always_inline)) inline V lora_load(const float* p) {
    V v;
    __builtin_memcpy(&v, p, sizeof(V));
    return v;
}
template <typename V>
__attribute__((always_inline)) inline void lora_store(float* p, const V& v) {
    __builtin_memcpy(p, &v, sizeof(V));
}

template <typename V, int64_t L>
__attribute__((always_inline)) inline void lora_group_vec(const LoraProblem& p, const LoraPart& part, int64_t c0,
                                                          const int64_t* rows, int64_t m, float* __restrict u) {
    const int64_t R = p.R, K = p.K, W = p.W, N = part.N;
    for (int64_t i0 = 0; i0 < m; i0 += kLoraTokens) {
        const int64_t mb = std::min(kLoraTokens, m - i0);
        const float* xr[kLoraTokens];
        for (int64_t j = 0; j < kLoraTokens; ++j) xr[j] = p.x + rows[i0 + std::min(j, mb - 1)] * K;
        float* ub = u + i0 * R;
        for (int64_t c = 0; c < R; c += L) {  // shrink: ub[j, c : c + L] = x_j @ A[:, c0 + c : c0 + c + L]
            V acc[kLoraTokens] = {};
            const float* a = part.a + c0 + c;
            for (int64_t k = 0; k < K; ++k) {
                const V av = lora_load<V>(a + k * W);
                for (int64_t j = 0; j < kLoraTokens; ++j) acc[j] += xr[j][k] * av;
            }
            for (int64_t j = 0; j < mb; ++j) lora_store(ub + j * R + c, acc[j]);
        }
        int64_t n0 = 0;
        for (; n0 + 4 * L <= N; n0 += 4 * L) {  // expand: 4 * L columns of 4 tokens at a time
            V acc[kLoraTokens][4] = {};
            for (int64_t r = 0; r < R; ++r) {
                const float* br = part.b + (c0 + r) * N + n0;
                V bv[4];
                for (int64_t q = 0; q < 4; ++q) bv[q] = lora_load<V>(br + q * L);
                for (int64_t j = 0; j < kLoraTokens; ++j) {
                    const float uv = ub[std::min(j, mb - 1) * R + r];
                    for (int64_t q = 0; q < 4; ++q) acc[j][q] += uv * bv[q];
                }
            }
            for (int64_t j = 0; j < mb; ++j) {
                float* od = p.acc + rows[i0 + j] * p.width + part.offset + n0;
                for (int64_t q = 0; q < 4; ++q) lora_store(od + q * L, lora_load<V>(od + q * L) + acc[j][q]);
            }
        }
        for (; n0 < N; ++n0) {  // the last columns
            for (int64_t j = 0; j < mb; ++j) {
                float sum = 0.0f;
                for (int64_t r = 0; r < R; ++r) sum += ub[j * R + r] * part.b[(c0 + r) * N + n0];
                p.acc[rows[i0 + j] * p.width + part.offset + n0] += sum;
            }
        }
    }
}

// Any rank (R not a multiple of 8): plain loops.
__attribute__((always_inline)) inline void lora_group_scalar(const LoraProblem& p, const LoraPart& part, int64_t c0,
                                                             const int64_t* rows, int64_t m, float* __restrict u) {
    const int64_t R = p.R, K = p.K, W = p.W, N = part.N;
    for (int64_t i = 0; i < m * R; ++i) u[i] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
        const float* __restrict ar = part.a + k * W + c0;
        for (int64_t i = 0; i < m; ++i) {
            const float xv = p.x[rows[i] * K + k];
            for (int64_t r = 0; r < R; ++r) u[i * R + r] += xv * ar[r];
        }
    }
    for (int64_t i = 0; i < m; ++i) {
        float* __restrict od = p.acc + rows[i] * p.width + part.offset;
        for (int64_t r = 0; r < R; ++r) {
            const float uv = u[i * R + r];
            const float* __restrict br = part.b + (c0 + r) * N;
            for (int64_t n = 0; n < N; ++n) od[n] += uv * br[n];
        }
    }
}

// wide: 16-float vectors (AVX-512's 32 registers hold the expand's 16 sums); else 8 (AVX2's 16 would spill them).
__attribute__((always_inline)) inline void lora_group_body(const LoraProblem& p, const LoraPart& part, int64_t s,
                                                           const int64_t* rows, int64_t m, float* u, bool wide) {
    const int64_t c0 = (s - 1) * p.R;
    if (wide && p.R % 16 == 0) {
        lora_group_vec<lora_v16, 16>(p, part, c0, rows, m, u);
    } else if (p.R % 8 == 0) {
        lora_group_vec<lora_v8, 8>(p, part, c0, rows, m, u);
    } else {
        lora_group_scalar(p, part, c0, rows, m, u);
    }
}

// SwiGLU of rows t0..t1: out = silu(gate) * up, the sigmoid from exp(-|g|) (never overflows) as the INT4 kernel's
// fused epilogue computes it (llmc_i4::swiglu_rows_impl); in 8-float vectors: GCC leaves the plain loop scalar.
__attribute__((always_inline)) inline void lora_swiglu_body(const LoraProblem& p, int64_t t0, int64_t t1) {
    using llmc_i4::sv8f;
    using llmc_i4::sv8fu;
    using llmc_i4::sv8i;
    const int64_t h = p.width / 2;
    for (int64_t t = t0; t < t1; ++t) {
        const float* g = p.acc + t * p.width;
        const float* up = g + h;
        float* o = p.out + t * h;
        int64_t j = 0;
        for (; j + 8 <= h; j += 8) {
            const sv8f gv = *reinterpret_cast<const sv8fu*>(g + j);
            const sv8f uv = *reinterpret_cast<const sv8fu*>(up + j);
            const sv8f e = llmc::exp_nonpos_t<sv8f, sv8i>(gv < 0.0f ? gv : -gv);
            const sv8f num = gv >= 0.0f ? sv8f{} + 1.0f : e;
            *reinterpret_cast<sv8fu*>(o + j) = gv * (num / (1.0f + e)) * uv;
        }
        for (; j < h; ++j) {
            const float e = std::exp(-std::fabs(g[j]));
            o[j] = g[j] * ((g[j] >= 0.0f ? 1.0f : e) / (1.0f + e)) * up[j];
        }
    }
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void lora_group_avx512(
    const LoraProblem& p, const LoraPart& part, int64_t s, const int64_t* rows, int64_t m, float* u) {
    lora_group_body(p, part, s, rows, m, u, true);
}
__attribute__((target("avx2,fma"))) void lora_group_avx2(const LoraProblem& p, const LoraPart& part, int64_t s,
                                                         const int64_t* rows, int64_t m, float* u) {
    lora_group_body(p, part, s, rows, m, u, false);
}
void lora_group_base(const LoraProblem& p, const LoraPart& part, int64_t s, const int64_t* rows, int64_t m,
                     float* u) {
    lora_group_body(p, part, s, rows, m, u, false);
}
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void lora_swiglu_avx512(
    const LoraProblem& p, int64_t t0, int64_t t1) {
    lora_swiglu_body(p, t0, t1);
}
__attribute__((target("avx2,fma"))) void lora_swiglu_avx2(const LoraProblem& p, int64_t t0, int64_t t1) {
    lora_swiglu_body(p, t0, t1);
}
void lora_swiglu_base(const LoraProblem& p, int64_t t0, int64_t t1) { lora_swiglu_body(p, t0, t1); }

// 2: AVX-512, 1: AVX2 + FMA, 0: the build's baseline (x86-64-v2). LLMC_LORA_ISA=0/1/2 caps it (tests).
int lora_isa() {
    static const int isa = [] {
        int best = llmc::cpu::has_avx512_fvlbwdq() ? 2 : llmc::cpu::has_avx2_fma() ? 1 : 0;
        if (const char* cap = std::getenv("LLMC_LORA_ISA")) best = std::min(best, std::atoi(cap));
        return best;
    }();
    return isa;
}

void lora_group(const LoraProblem& p, const LoraPart& part, int64_t s, const int64_t* rows, int64_t m, float* u) {
    switch (lora_isa()) {
        case 2: lora_group_avx512(p, part, s, rows, m, u); break;
        case 1: lora_group_avx2(p, part, s, rows, m, u); break;
        default: lora_group_base(p, part, s, rows, m, u);
    }
}

void lora_swiglu(const LoraProblem& p, int64_t t0, int64_t t1) {
    switch (lora_isa()) {
        case 2: lora_swiglu_avx512(p, t0, t1); break;
        case 1: lora_swiglu_avx2(p, t0, t1); break;
        default: lora_swiglu_base(p, t0, t1);
    }
}

void lora_copy_rows(const LoraProblem& p, int64_t t0, int64_t t1) {
    if (p.acc != p.y) std::memcpy(p.acc + t0 * p.width, p.y + t0 * p.width, sizeof(float) * (t1 - t0) * p.width);
}

// One token on its own (long prefills, spread over the pool).
void lora_row(const LoraProblem& p, int64_t t) {
    lora_copy_rows(p, t, t + 1);
    const int64_t s = p.slots[t];
    if (s >= 1 && s <= p.S) {
        float u[256];  // R <= 256 (llmc.passes.lora.MAX_RANK)
        for (int64_t i = 0; i < p.n_parts; ++i) lora_group(p, p.parts[i], s, &t, 1, u);
    }
    if (p.activation == 1) lora_swiglu(p, t, t + 1);
}

void compute_lora(void* kernel, OrtKernelContext* ctx) {
    const LoraKernel& k = *static_cast<const LoraKernel*>(kernel);
    const Tensor y = input(ctx, 0, "Y"), x = input(ctx, 1, "X"), s = input(ctx, 4, "slots");
    Tensor a[3], b[3];
    a[0] = input(ctx, 2, "A");
    b[0] = input(ctx, 3, "B");
    a[1] = input(ctx, 5, "A1", true);
    b[1] = input(ctx, 6, "B1", true);
    a[2] = input(ctx, 7, "A2", true);
    b[2] = input(ctx, 8, "B2", true);
    require_rank(s, 1, "slots");
    if (x.dims.empty() || y.dims.empty()) throw Error("X and Y must have a last dimension");
    const int64_t K = x.dims.back(), width = y.dims.back();
    int64_t n_parts = 0, W = 0;
    LoraPart parts[3];
    for (int i = 0; i < 3; ++i) {
        if (a[i].data == nullptr || b[i].data == nullptr) break;
        require_rank(a[i], 2, "A");
        require_rank(b[i], 2, "B");
        if (i == 0) W = a[i].dims[1];
        const int64_t N = b[i].dims[1];
        if (k.rank > 256 || a[i].dims[1] != W || W % k.rank || b[i].dims[0] != W || a[i].dims[0] != K) {
            throw Error("A " + dims_str(a[i].dims) + " and B " + dims_str(b[i].dims) + " must stack whole slots of "
                        "rank " + std::to_string(k.rank) + " (at most 256) over K = " + std::to_string(K) +
                        ", the same slots for every part");
        }
        if (k.offsets[i] + N > width) {
            throw Error("part " + std::to_string(i) + ": offset " + std::to_string(k.offsets[i]) + " + N " +
                        std::to_string(N) + " exceeds Y's width " + std::to_string(width));
        }
        parts[i] = LoraPart{static_cast<const float*>(a[i].data), static_cast<const float*>(b[i].data), N,
                            k.offsets[i]};
        ++n_parts;
    }
    if (k.activation == 1 && width % 2) throw Error("activation 1 (SwiGLU) needs an even width, got " +
                                                    std::to_string(width));
    int64_t T = 1, TY = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) T *= x.dims[i];
    for (size_t i = 0; i + 1 < y.dims.size(); ++i) TY *= y.dims[i];
    if (TY != T || s.dims[0] != T) {
        throw Error("X, Y and slots must have the same number of tokens, got X " + dims_str(x.dims) + ", Y " +
                    dims_str(y.dims) + ", slots " + dims_str(s.dims));
    }
    std::vector<int64_t> out_dims = y.dims;
    if (k.activation == 1) out_dims.back() = width / 2;
    float* out = output(ctx, out_dims.data(), out_dims.size());
    // With the SwiGLU the sums go to a scratch buffer first (kept per thread: no allocation per step).
    thread_local std::vector<float> scratch;
    float* acc = out;
    if (k.activation == 1) {
        scratch.resize(static_cast<size_t>(T * width));
        acc = scratch.data();
    }
    LoraProblem p{static_cast<const float*>(y.data), static_cast<const float*>(x.data),
                  static_cast<const int64_t*>(s.data), acc, out, {parts[0], parts[1], parts[2]}, n_parts, K, W,
                  k.rank, W / k.rank, width, k.activation};
    int64_t cols = 0;
    for (int64_t i = 0; i < n_parts; ++i) cols += parts[i].N;
    // A decode step's few rows are cheaper on one thread than the pool's hand-off; long prefills spread.
    if (T * k.rank * (K + cols) < (int64_t{1} << 20)) {
        lora_copy_rows(p, 0, T);
        thread_local std::vector<int64_t> rows;
        thread_local std::vector<float> u;
        for (int64_t slot = 1; slot <= p.S; ++slot) {
            rows.clear();
            for (int64_t t = 0; t < T; ++t) {
                if (p.slots[t] == slot) rows.push_back(t);
            }
            if (rows.empty()) continue;
            u.resize(rows.size() * static_cast<size_t>(k.rank));
            for (int64_t i = 0; i < n_parts; ++i) {
                lora_group(p, parts[i], slot, rows.data(), static_cast<int64_t>(rows.size()), u.data());
            }
        }
        if (p.activation == 1) lora_swiglu(p, 0, T);
        return;
    }
    if (k.activation == 1) {
        // the pool's threads each write their own rows of one buffer (not this thread's scratch)
        std::vector<float> shared(static_cast<size_t>(T * width));
        p.acc = shared.data();
        with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
            if (pf != nullptr && threads > 1) {
                pf->fn(pf->self, T, [](void* arg, int64_t t) { lora_row(*static_cast<const LoraProblem*>(arg), t); },
                       &p);
            } else {
                for (int64_t t = 0; t < T; ++t) lora_row(p, t);
            }
        });
        return;
    }
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        if (pf != nullptr && threads > 1) {
            pf->fn(pf->self, T, [](void* arg, int64_t t) { lora_row(*static_cast<const LoraProblem*>(arg), t); },
                   &p);
        } else {
            for (int64_t t = 0; t < T; ++t) lora_row(p, t);
        }
    });
}

const char* lora_name(const OrtCustomOpV13*) { return "LoraApply"; }
int32_t lora_input_type(const OrtCustomOpV13*, size_t i) { return i == 4 ? kOrtInt64 : kOrtFloat; }
size_t lora_input_count(const OrtCustomOpV13*) { return 9; }
// Inputs 0-4 required (one part), 5-8 optional (the second and third parts of a packed projection).
int32_t lora_input_characteristic(const OrtCustomOpV13*, size_t i) { return i >= 5 ? 1 : 0; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kLoraApplyOp = make_op(lora_name, lora_input_type, lora_input_count,
                                                     create_lora_kernel, compute_lora, destroy_lora_kernel,
                                                     lora_input_characteristic);
