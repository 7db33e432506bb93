// llmc::Mxfp4MoEMatMul's kernel: each token row times its expert's MXFP4 weight, straight from the codes.
//
// Weights as gpt-oss ships them (OpenAI's layout): blocks uint8 [E, N, K/32, 16] (E2M1 codes, two per byte, the
// low nibble first, 32 codes of one output row n along K per block) and scales uint8 [E, N, K/32] (E8M0, bias
// 127). W[e, n, k] = FP4[code] * 2^(scale - 127). Rows are grouped by expert (a counting sort of the ids), and the
// work is (expert, tile of output rows n): each weight row is decoded once into a float32 buffer -- a 16-entry
// table of E2M1 values times the block's power of two, exact -- and dotted with every token row routed to that
// expert, accumulating in float32. Nothing is dequantized ahead of time: the experts stay 4.25 bits per weight.
// On AVX-512 the table lookup is one vpermps per 16 codes and a decoded block stays in registers (dots_avx512);
// scalar and AVX2 decode a weight row into a float32 buffer first.

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

namespace llmc_mx {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa best_isa() { return static_cast<Isa>(llmc::cpu::vector_level()); }

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 32;  // output rows per work item
// Codes are read this many bytes ahead (software prefetch): the hardware prefetcher stops at each 4 KB page (~3
// weight rows), and at decode batch 8 the kernel waited on memory there. Measured on gpt-oss-20b's expert shapes,
// 2 threads: 17.3 -> 11.0 ms a gate_up call at 32 rows (1024 to 16384 bytes all within noise of each other).
constexpr int64_t kPrefetchBytes = 4096;
// Twice the E2M1 values, as int8 (so that a byte shuffle decodes 16 codes at once); the block scale is halved.
constexpr int8_t kFp4x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct Problem {
    const float* x;          // [M / x_share, K]
    const int64_t* ids;      // [M], each in [0, E)
    const uint8_t* blocks;   // [E, N, K/32, 16]
    const uint8_t* scales;   // [E, N, K/32]
    float* y;                // [M / combine, N] (activation 1: [.., N / 2])
    int64_t M, K, N, E;
    llmc_moe::Epilogue epi{};  // bias, SwiGLU, top-k repeat and sum (moe_epilogue.h)
};

// 2^(s - 128): half the E8M0 scale, exact for every s (2^-128 is a float32 subnormal; s = 255 gives 2^127).
inline float half_scale(uint8_t s) { return std::ldexp(1.0f, static_cast<int>(s) - 128); }

inline void decode_row_scalar(const uint8_t* blk, const uint8_t* sc, int64_t groups, float* w) {
    for (int64_t g = 0; g < groups; ++g) {
        const float s = half_scale(sc[g]);
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = blk[g * 16 + j];
            w[g * kBlock + 2 * j] = static_cast<float>(kFp4x2[b & 15]) * s;
            w[g * kBlock + 2 * j + 1] = static_cast<float>(kFp4x2[b >> 4]) * s;
        }
    }
}

inline float dot_scalar(const float* a, const float* b, int64_t k) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < k; i += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

__attribute__((target("avx2,fma"))) inline void decode_row_avx2(const uint8_t* blk, const uint8_t* sc,
                                                                 int64_t groups, float* w) {
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4x2));
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; ++g) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + g * 16));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        // Codes in K order: lo0 hi0 lo1 hi1 ...
        const __m128i c0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
        const __m128i c1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
        const __m256 s = _mm256_set1_ps(half_scale(sc[g]));
        float* o = w + g * kBlock;
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), s));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8))), s));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), s));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8))), s));
    }
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Rows r[0..m) of X (each K floats) dotted with w, four rows at a time (w's loads shared).
__attribute__((target("avx2,fma"))) inline void dots_avx2(const float* w, const float* x, const int64_t* rows,
                                                           int64_t m, int64_t K, float* out) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        const float *x0 = x + rows[i] * K, *x1 = x + rows[i + 1] * K, *x2 = x + rows[i + 2] * K,
                    *x3 = x + rows[i + 3] * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 wv = _mm256_loadu_ps(w + k);
            a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + k), a0);
            a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + k), a1);
            a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2 + k), a2);
            a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3 + k), a3);
        }
        out[i] = hsum_avx2(a0);
        out[i + 1] = hsum_avx2(a1);
        out[i + 2] = hsum_avx2(a2);
        out[i + 3] = hsum_avx2(a3);
    }
    for (; i < m; ++i) {
        const float* xr = x + rows[i] * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xr + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xr + k + 8), a1);
        }
        for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xr + k), a0);
        out[i] = hsum_avx2(_mm256_add_ps(a0, a1));
    }
}

// AVX-512: a 16-entry float table is one vpermps, so the codes never become bytes in memory. X is read
// de-interleaved per block (xd: the 16 even then the 16 odd elements of each 32, made once per call), so that a
// block's 16 low nibbles meet the even elements and its 16 high nibbles the odd ones. Up to four rows share each
// decoded block.
constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The E2M1 table times each E8M0 power of two (2^-127 is subnormal), 256 x 16 floats (16 KB, L1-resident): a
// block's table is one load instead of a broadcast and a multiply on the vector ports, which bound the kernel at
// decode batch sizes (the very same products, so the same bits).
struct ScaledTables {
    alignas(64) float v[256][16];
    ScaledTables() {
        for (int e = 0; e < 256; ++e) {
            const float s = std::ldexp(1.0f, e - 127);
            for (int j = 0; j < 16; ++j) v[e][j] = kFp4[j] * s;
        }
    }
};
inline const ScaledTables& scaled_tables() {
    static const ScaledTables t;
    return t;
}

// One block of 32 weights against R rows, into the sums acc[i][2h] (low nibbles) and acc[i][2h + 1] (high).
template <int R>
__attribute__((target("avx512f"), always_inline)) inline void block_avx512(const uint8_t* blk, const uint8_t* sc,
                                                                            const ScaledTables& st, int64_t g,
                                                                            int h, const float* const* xr,
                                                                            __m512 (*acc)[4]) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + g * 16)));
    const __m512 table = _mm512_load_ps(st.v[sc[g]]);
    // vpermps reads only the low 4 bits of each index: the low nibble needs no mask.
    const __m512 wl = _mm512_permutexvar_ps(codes, table);
    const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    for (int i = 0; i < R; ++i) {
        acc[i][2 * h] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr[i] + g * kBlock), acc[i][2 * h]);
        acc[i][2 * h + 1] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr[i] + g * kBlock + 16), acc[i][2 * h + 1]);
    }
}

template <int R>
__attribute__((target("avx512f"))) inline void dots_avx512(const uint8_t* blk, const uint8_t* sc, int64_t groups,
                                                            const float* const* xr, float* out) {
    const ScaledTables& st = scaled_tables();
    // Up to four sums per row (low and high nibbles of even and odd blocks): independent FMA chains, so that one
    // row (the common case: a token per expert at batch 8 with top-4 of 32) is not held to one FMA's latency.
    __m512 acc[R][4];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
    // Four rows already give eight chains; more sums would only take registers (prefill measured slower).
    constexpr int kOdd = R < 4 ? 1 : 0;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + g * 16 + kPrefetchBytes), _MM_HINT_T0);
        block_avx512<R>(blk, sc, st, g, 0, xr, acc);
        block_avx512<R>(blk, sc, st, g + 1, kOdd, xr, acc);
    }
    if (g < groups) block_avx512<R>(blk, sc, st, g, 0, xr, acc);
    for (int i = 0; i < R; ++i) {
        out[i] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3])));
    }
}

__attribute__((target("avx512f"))) inline void row_avx512(const uint8_t* blk, const uint8_t* sc, int64_t groups,
                                                           const float* xd, const int64_t* rows, int64_t m,
                                                           int64_t K, float* out) {
    int64_t i = 0;
    const float* xr[4];
    for (; i + 4 <= m; i += 4) {
        for (int j = 0; j < 4; ++j) xr[j] = xd + rows[i + j] * K;
        dots_avx512<4>(blk, sc, groups, xr, out + i);
    }
    // The rest in one pass (a block decoded once for every row): two or three rows per expert are the common case
    // at decode batch 8, where one pass per row decoded each block again and halved the rate per byte.
    for (int j = 0; j < m - i; ++j) xr[j] = xd + rows[i + j] * K;
    switch (m - i) {
        case 3: dots_avx512<3>(blk, sc, groups, xr, out + i); break;
        case 2: dots_avx512<2>(blk, sc, groups, xr, out + i); break;
        case 1: dots_avx512<1>(blk, sc, groups, xr, out + i); break;
        default: break;
    }
}

// Rows grouped by expert: order[start[e] .. start[e + 1]) are the rows routed to expert e.
struct Routing {
    std::vector<int64_t> order, start;
    // Work items: (expert, first output row) for every expert with rows, `step` output rows apart.
    std::vector<std::pair<int64_t, int64_t>> items;
};

inline Routing group_rows(const int64_t* ids, int64_t M, int64_t E, int64_t N, int64_t step) {
    Routing r;
    r.start.assign(E + 1, 0);
    for (int64_t m = 0; m < M; ++m) ++r.start[ids[m] + 1];
    for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
    r.order.resize(M);
    std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
    for (int64_t m = 0; m < M; ++m) r.order[fill[ids[m]]++] = m;
    for (int64_t e = 0; e < E; ++e) {
        if (r.start[e + 1] == r.start[e]) continue;
        for (int64_t n0 = 0; n0 < N; n0 += step) r.items.emplace_back(e, n0);
    }
    return r;
}

inline Routing route(const Problem& p) { return group_rows(p.ids, p.M, p.E, p.N, kTile); }

struct Job {
    const Problem* p;
    const Routing* r;
    Isa isa;
    const float* xd;  // AVX-512: X de-interleaved per block (else nullptr)
};

inline void run_item(const Job& job, int64_t item) {
    const Problem& p = *job.p;
    const llmc_moe::Epilogue& epi = p.epi;
    const auto [e, n0] = job.r->items[item];
    const int64_t* routed = job.r->order.data() + job.r->start[e];
    const int64_t m = job.r->start[e + 1] - job.r->start[e];
    const int64_t groups = p.K / kBlock, n1 = std::min(p.N, n0 + kTile), W = llmc_moe::out_width(epi, p.N);
    thread_local std::vector<float> w, out, gate;
    thread_local std::vector<int64_t> xrows;
    w.resize(p.K);
    out.resize(m);
    gate.resize(m);
    xrows.resize(m);
    for (int64_t i = 0; i < m; ++i) xrows[i] = routed[i] / epi.x_share;  // the X row each routed row reads
    const int64_t* rows = xrows.data();
    for (int64_t n = n0; n < n1; ++n) {
        const int64_t row = e * p.N + n;
        const uint8_t* blk = p.blocks + row * groups * 16;
        const uint8_t* sc = p.scales + row * groups;
        if (job.isa == kAvx512) {
            row_avx512(blk, sc, groups, job.xd, rows, m, p.K, out.data());
        } else if (job.isa == kAvx2) {
            decode_row_avx2(blk, sc, groups, w.data());
            dots_avx2(w.data(), p.x, rows, m, p.K, out.data());
        } else {
            decode_row_scalar(blk, sc, groups, w.data());
            for (int64_t i = 0; i < m; ++i) out[i] = dot_scalar(w.data(), p.x + rows[i] * p.K, p.K);
        }
        if (epi.bias != nullptr) {
            for (int64_t i = 0; i < m; ++i) out[i] += epi.bias[e * p.N + n];
        }
        if (!epi.activation) {
            for (int64_t i = 0; i < m; ++i) p.y[routed[i] * W + n] = out[i];
        } else if (n % 2 == 0) {  // a gate column: its up column n + 1 comes next, in the same item (kTile even)
            for (int64_t i = 0; i < m; ++i) gate[i] = out[i];
        } else {
            for (int64_t i = 0; i < m; ++i) {
                p.y[routed[i] * W + n / 2] = llmc_moe::swiglu_oai<float, int32_t>(gate[i], out[i], epi.alpha, epi.limit);
            }
        }
    }
}

// `threads` > 1 spreads the (expert, tile) items over `pf` (the caller's pool) or, without one, OpenMP threads.
inline void run(const Problem& p, Isa isa, int threads, const llmc::ParallelFor* pf) {
    const Routing r = route(p);
    std::vector<float> xd;
    const int64_t x_rows = p.M / p.epi.x_share;
    if (isa == kAvx512) {
        xd.resize(static_cast<size_t>(x_rows * p.K));
        for (int64_t m = 0; m < x_rows; ++m) {
            for (int64_t g = 0; g < p.K / kBlock; ++g) {
                const float* src = p.x + m * p.K + g * kBlock;
                float* dst = xd.data() + m * p.K + g * kBlock;
                for (int j = 0; j < 16; ++j) {
                    dst[j] = src[2 * j];
                    dst[16 + j] = src[2 * j + 1];
                }
            }
        }
    }
    const int64_t W = llmc_moe::out_width(p.epi, p.N);
    const llmc_moe::RoutedOut routed(p.epi, p.M, W, p.y);
    Problem q = p;
    q.y = routed.rows;
    const Job job{&q, &r, isa, xd.data()};
    const auto n = static_cast<int64_t>(r.items.size());
    llmc::parallel_items<Job, run_item>(job, n, threads, pf);
    llmc_moe::combine_rows(p.epi, routed, p.M, W, p.y);
}

}  // namespace llmc_mx
