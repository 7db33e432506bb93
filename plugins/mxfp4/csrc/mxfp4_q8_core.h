// llmc::Mxfp4MoEMatMulQ8's kernel: each token row times its expert's MXFP4 weight with the row quantized to 8 bits
// per 32-element block (llama.cpp's Q8_0 trade, opt-in: `llmc build --mxfp4-activations int8`).
//
// The exact kernel (mxfp4_core.h) spends most of a decode step decoding codes into float32 tables for one or two
// rows per expert. Here the products are 8-bit integer dot products (AVX-512 VNNI vpdpbusd: 64 multiply-adds an
// instruction; the codes decoded by AVX-512 VBMI vpermb), with the 16 lanes of a vector being 16 output rows n, so a decoded weight vector serves every
// token row of the expert and the per-block scaling is one float FMA per 16 outputs.
//
// Weights (repacked at build time from OpenAI's layout, the same codes and scales, never re-quantized):
//   codes  uint8 [E, T, G, 4, 64], T = ceil(N / 16), G = K / 32: for output group t (rows n = 16t .. 16t+15),
//          block g and pair r, byte p = 4 nn + jj holds code(n = 16t + nn, j = 8r + jj) in its low nibble and
//          code(n, j = 8r + 4 + jj) in its high nibble (j: the position in the block along K);
//   scales uint8 [E, T, G, 16]: the E8M0 exponent of (n = 16t + nn, block g).
// Rows past N (padding of the last group) hold code 0 and are never stored.
// Activations: per row and block, d = max|x| / 127, q = round(x / d) in [-127, 127] (int8), kept with d as float32.
// y[m, n] = 1/2 sum_g (2^(s - 127) d_g) * (sum_j (2 E2M1[code] + 12) q_j - 12 sum_j q_j), the inner sum exact in int32.

#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../csrc/isa.h"
#include "../../csrc/parallel_for.h"
#include "moe_epilogue.h"
#include "mxfp4_core.h"

namespace llmc_mxq {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;    // output rows per vector
constexpr int kMaxRows = 8;       // token rows per pass over an output group's codes
// Output groups per work item (256 outputs, ~370 KB of codes at K = 2880): items of one group left each thread
// reading 23 KB pieces scattered over an expert, and batch-1 calls ran slower than the exact kernel's; 16 groups
// came 2-3% closer than 8 to a plain read of the same bytes (kernel / read 1.17 vs 1.20 at batch 8, two threads).
constexpr int64_t kItemGroups = 16;
// Software prefetch distance along an item's codes (32 blocks ahead), into L2 (_MM_HINT_T1). The hardware prefetcher
// alone left the loads and the arithmetic one after the other (single-thread time = memory + compute); 8 KB ahead
// cut one thread's time over 1 GB of codes from 63 to 55 ms, 2 KB (4x fewer blocks of lead) helped less.
constexpr int64_t kPrefetchBytes = 8192;
// And from L2 into L1 8 blocks ahead: kernel / plain read of the same bytes 1.17-1.19 -> 1.13-1.14 (two threads,
// memory shared with a busy neighbour; benchmarks measured side by side with the read, same seconds).
constexpr int64_t kPrefetchL1Bytes = 2048;
// Twice the E2M1 value plus 12, as uint8 (vpdpbusd multiplies unsigned by signed bytes): 0 .. 24. The 12 is taken
// back out with 12 x (the block's sum of q), computed when the row is quantized.
constexpr uint8_t kFp4x2Plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr int32_t kOffset = 12;

inline bool has_vnni() { return llmc::cpu::has_avx512_vnni_vbmi(); }

struct Problem {
    const float* x;         // [M / x_share, K]
    const int64_t* ids;     // [M], each in [0, E)
    const uint8_t* codes;   // [E, T, G, 4, 64]
    const uint8_t* scales;  // [E, T, G, 16]
    float* y;               // [M / combine, N] (activation 1: [.., N / 2])
    int64_t M, K, N, E;
    llmc_moe::Epilogue epi{};  // bias, SwiGLU, top-k repeat and sum (moe_epilogue.h)
};

inline int64_t out_width(const Problem& p) { return llmc_moe::out_width(p.epi, p.N); }
using llmc_moe::swiglu_oai;

// One row's 16 (or `width`) finished sums v of output group n0 of expert e, through the epilogue into the row's
// output (scalar; the vector path's twin is finish_vnni).
inline void finish_scalar(const Problem& p, const float* v, int64_t width, int64_t e, int64_t n0, float* row_out) {
    float t[kGroup];
    for (int64_t i = 0; i < width; ++i) t[i] = v[i] + (p.epi.bias ? p.epi.bias[e * p.N + n0 + i] : 0.0f);
    if (!p.epi.activation) {
        for (int64_t i = 0; i < width; ++i) row_out[n0 + i] = t[i];
        return;
    }
    for (int64_t i = 0; i < width / 2; ++i) {
        row_out[n0 / 2 + i] = swiglu_oai<float, int32_t>(t[2 * i], t[2 * i + 1], p.epi.alpha, p.epi.limit);
    }
}

// The rows quantized per 32-block: q [M, K] int8, d [M, G] float32, corr [M, G] = -12 x sum(q) over the block (each
// block's integer sum starts from it).
struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> corr;
};

inline void quantize_rows(const float* x, int64_t M, int64_t K, QuantRows& out) {
    const int64_t G = K / kBlock;
    out.q.resize(static_cast<size_t>(M * K));
    out.d.resize(static_cast<size_t>(M * G));
    out.corr.resize(static_cast<size_t>(M * G));
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t g = 0; g < G; ++g) {
            const float* src = x + m * K + g * kBlock;
            float amax = 0.0f;
            for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
            const float d = amax / 127.0f;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            int8_t* q = out.q.data() + m * K + g * kBlock;
            for (int j = 0; j < kBlock; ++j) {
                const int v = std::clamp(static_cast<int>(std::nearbyint(src[j] * inv)), -127, 127);
                q[j] = static_cast<int8_t>(v);
                sum += v;
            }
            out.d[m * G + g] = d;
            out.corr[m * G + g] = -kOffset * sum;
        }
    }
}

// 2^(s - 127): the E8M0 scale (s = 0: the subnormal 2^-127). The codes hold twice the E2M1 value, so the sums
// below come out twice the output and are halved once at the end (exact: a factor of two commutes with rounding).
inline float scale_of(uint8_t s) { return std::ldexp(1.0f, static_cast<int>(s) - 127); }

inline int code_at(const uint8_t* group_codes, int64_t g, int nn, int j) {
    const int r = j / 8, half = (j % 8) / 4, jj = j % 4;
    const uint8_t b = group_codes[(g * 4 + r) * 64 + 4 * nn + jj];
    return half ? b >> 4 : b & 15;
}

// Scalar path (CPUs without AVX-512 VNNI, and the vector path's reference): the same integer sums and the same
// float order (one FMA per block per output, then the halving).
inline void group_scalar(const Problem& p, const uint8_t* codes, const uint8_t* sc, const QuantRows& xq,
                         const int64_t* rows, int64_t m, int64_t e, int64_t n0) {
    const int64_t K = p.K, G = K / kBlock, width = std::min(kGroup, p.N - n0);
    for (int64_t i = 0; i < m; ++i) {
        const int64_t row = rows[i], xr = row / p.epi.x_share;
        float v[kGroup];
        for (int nn = 0; nn < width; ++nn) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; ++g) {
                int32_t dot = xq.corr[xr * G + g];
                for (int j = 0; j < kBlock; ++j) {
                    dot += static_cast<int32_t>(kFp4x2Plus12[code_at(codes, g, nn, j)]) * xq.q[xr * K + g * kBlock + j];
                }
                const float c = scale_of(sc[g * kGroup + nn]) * xq.d[xr * G + g];
                acc = std::fma(static_cast<float>(dot), c, acc);
            }
            v[nn] = 0.5f * acc;
        }
        finish_scalar(p, v, width, e, n0, p.y + row * out_width(p));
    }
}

// E8M0 exponents s of 16 outputs -> 2^(s - 127) as floats: exponent bits s << 23, and for s = 0 the subnormal
// 2^-127 (bits 1 << 22), which is also the smallest of the two, so one unsigned max makes both, with no branch.
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"), always_inline)) inline __m512 scales_of(const uint8_t* s8) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s8)));
    return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_slli_epi32(s, 23), _mm512_set1_epi32(1 << 22)));
}

// acc += w (unsigned bytes) . the signed bytes at x, broadcast to every lane: vpdpbusd with an embedded
// broadcast memory operand (GCC emits a separate vpbroadcastd for the intrinsic with _mm512_set1_epi32).
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dpbusd_bcast(__m512i acc, __m512i w,
                                                                                       const int32_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"))) void group_vnni(const uint8_t* codes, const uint8_t* sc,
                                                                         int64_t G, const int8_t* const* q_in,
                                                                         const float* const* d_in,
                                                                         const int32_t* const* corr_in,
                                                                         float* const* out, __mmask16 store) {
    // vpermb reads the low 6 bits of each index byte: a 64-entry table of the 16 values four times over decodes a
    // byte's low nibble without masking it, and its high nibble after one 16-bit shift (whatever lands in bits 4-5).
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4x2Plus12)));
    // The loop holds only registers and loads: no call, no store (a spilled accumulator put a store-to-load
    // round trip on every block's chain).
    const int8_t* q[R];
    const float* d[R];
    const int32_t* corr[R];
    __m512 facc[R];
    for (int i = 0; i < R; ++i) {
        q[i] = q_in[i], d[i] = d_in[i], corr[i] = corr_in[i];
        facc[i] = _mm512_setzero_ps();
    }
    // Integer chains per row: blocks are independent (each starts from its correction), so out-of-order execution
    // overlaps them; measured at gpt-oss shapes, one chain per row beat 2 and 4 at one row and tied at more.
    for (int64_t g = 0; g < G; ++g) {
        for (int line = 0; line < 4; ++line) {
            _mm_prefetch(reinterpret_cast<const char*>(codes + g * 256 + kPrefetchBytes + 64 * line), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(codes + g * 256 + kPrefetchL1Bytes + 64 * line), _MM_HINT_T0);
        }
        __m512i acc[R];
        for (int i = 0; i < R; ++i) acc[i] = _mm512_set1_epi32(corr[i][g]);
        for (int r = 0; r < 4; ++r) {
            const __m512i v = _mm512_loadu_si512(codes + (g * 4 + r) * 64);
            const __m512i wl = _mm512_permutexvar_epi8(v, lut);
            const __m512i wh = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
            for (int i = 0; i < R; ++i) {
                // four activation bytes broadcast from memory inside vpdpbusd ({1to16}): no separate broadcast op
                const int32_t* xr = reinterpret_cast<const int32_t*>(q[i] + g * kBlock + 8 * r);
                acc[i] = dpbusd_bcast(acc[i], wl, xr);
                acc[i] = dpbusd_bcast(acc[i], wh, xr + 1);
            }
        }
        const __m512 ws = scales_of(sc + g * kGroup);
        for (int i = 0; i < R; ++i) {
            const __m512 c = _mm512_mul_ps(ws, _mm512_set1_ps(d[i][g]));
            facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), c, facc[i]);
        }
    }
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out[i], store, _mm512_mul_ps(facc[i], _mm512_set1_ps(0.5f)));
}

// finish_scalar's vector twin: the 16 sums of one row through the epilogue, stored with a mask.
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"))) inline void finish_vnni(
        const Problem& p, const float* v16, int64_t width, int64_t e, int64_t n0, float* row_out) {
    const auto mask = static_cast<__mmask16>((1u << width) - 1u);
    __m512 v = _mm512_maskz_loadu_ps(mask, v16);
    if (p.epi.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p.epi.bias + e * p.N + n0));
    if (!p.epi.activation) {
        _mm512_mask_storeu_ps(row_out + n0, mask, v);
        return;
    }
    typedef int32_t v16si __attribute__((vector_size(64)));
    const __m512 gate = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14), v);
    const __m512 up = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15), v);
    const __m512 r = swiglu_oai<__m512, v16si>(gate, up, p.epi.alpha, p.epi.limit);
    _mm512_mask_storeu_ps(row_out + n0 / 2, static_cast<__mmask16>((1u << (width / 2)) - 1u), r);
}

struct Job {
    const Problem* p;
    const llmc_mx::Routing* r;  // items (expert, first output row), kItemGroups groups of 16 apart
    const QuantRows* xq;
    bool vnni;
};

inline void run_group(const Job& job, int64_t e, int64_t t) {
    const Problem& p = *job.p;
    const int64_t* rows = job.r->order.data() + job.r->start[e];
    const int64_t m = job.r->start[e + 1] - job.r->start[e];
    const int64_t G = p.K / kBlock, T = (p.N + kGroup - 1) / kGroup, n0 = t * kGroup;
    const uint8_t* codes = p.codes + (e * T + t) * G * 256;
    const uint8_t* sc = p.scales + (e * T + t) * G * kGroup;
    if (!job.vnni) {
        group_scalar(p, codes, sc, *job.xq, rows, m, e, n0);
        return;
    }
    const int64_t width = std::min(kGroup, p.N - n0);
    const auto store = static_cast<__mmask16>((1u << width) - 1u);
    for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
        const int rr = static_cast<int>(std::min<int64_t>(kMaxRows, m - i0));
        const int8_t* q[kMaxRows];
        const float* d[kMaxRows];
        const int32_t* corr[kMaxRows];
        alignas(64) float sums[kMaxRows][kGroup];
        float* out[kMaxRows];
        for (int i = 0; i < rr; ++i) {
            const int64_t xr = rows[i0 + i] / p.epi.x_share;
            q[i] = job.xq->q.data() + xr * p.K;
            d[i] = job.xq->d.data() + xr * G;
            corr[i] = job.xq->corr.data() + xr * G;
            out[i] = sums[i];
        }
        switch (rr) {
            case 8: group_vnni<8>(codes, sc, G, q, d, corr, out, store); break;
            case 7: group_vnni<7>(codes, sc, G, q, d, corr, out, store); break;
            case 6: group_vnni<6>(codes, sc, G, q, d, corr, out, store); break;
            case 5: group_vnni<5>(codes, sc, G, q, d, corr, out, store); break;
            case 4: group_vnni<4>(codes, sc, G, q, d, corr, out, store); break;
            case 3: group_vnni<3>(codes, sc, G, q, d, corr, out, store); break;
            case 2: group_vnni<2>(codes, sc, G, q, d, corr, out, store); break;
            default: group_vnni<1>(codes, sc, G, q, d, corr, out, store); break;
        }
        for (int i = 0; i < rr; ++i) finish_vnni(p, sums[i], width, e, n0, p.y + rows[i0 + i] * out_width(p));
    }
}

inline void run_item(const Job& job, int64_t item) {
    const auto [e, n0] = job.r->items[item];
    const int64_t t0 = n0 / kGroup, T = (job.p->N + kGroup - 1) / kGroup;
    for (int64_t t = t0; t < std::min(T, t0 + kItemGroups); ++t) run_group(job, e, t);
}

// `threads` > 1 spreads the (expert, output groups) items over `pf` (the caller's pool) or OpenMP threads.
inline void run(const Problem& p, bool vnni, int threads, const llmc::ParallelFor* pf) {
    const llmc_mx::Routing r = llmc_mx::group_rows(p.ids, p.M, p.E, p.N, kGroup * kItemGroups);
    QuantRows xq;
    quantize_rows(p.x, p.M / p.epi.x_share, p.K, xq);
    const llmc_moe::RoutedOut routed(p.epi, p.M, out_width(p), p.y);
    Problem q = p;
    q.y = routed.rows;
    const Job job{&q, &r, &xq, vnni};
    const auto n = static_cast<int64_t>(r.items.size());
    llmc::parallel_items<Job, run_item>(job, n, threads, pf);
    llmc_moe::combine_rows(p.epi, routed, p.M, out_width(p), p.y);
}

}  // namespace llmc_mxq
