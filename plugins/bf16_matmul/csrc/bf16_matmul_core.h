// llmc::Bf16MatMul's kernel: Y[M, N] = X[M, K] (float32) @ W[K, N] with W stored as bfloat16, exactly.
//
// A bfloat16 weight is the upper half of a float32, so widening it (a 16-bit shift) gives the very float32 value;
// the products and sums are float32 as in a float32 MatMul. What it saves is memory traffic: a decode step reads
// each weight once, and at 2 bytes instead of 4 (checkpoints ship bfloat16, so nothing is rounded).
//
// W arrives packed by column panels of kNr = 48 outputs (three 16-float vectors): uint16 [P, K, 48], P = ceil(N /
// 48), the last panel zero-padded, so that each panel is one contiguous stream (a [K, N] row-major weight would
// put every k of a panel on another page). Work is split by panel. Each panel runs over X in chunks of up to
// kMr = 8 rows with 8 x 3 float32 accumulators in registers and k the innermost loop: per k, three
// weight vectors and eight broadcasts of X feed 24 FMAs. With more than one chunk the panel is widened to float32
// once (K x 48 floats, in a thread-local buffer) and reused by every chunk. Each output is one FMA chain along k
// in order 0..K-1 whatever M is, so a row's result does not depend on the batch it is in (batch invariance).

#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/isa.h"
#include "../../csrc/parallel_for.h"

namespace llmc_bf {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa best_isa() { return static_cast<Isa>(llmc::cpu::vector_level()); }

constexpr int64_t kMr = 8;
constexpr int64_t kNr = 48;

struct Problem {
    const float* x;     // [M, K]
    const uint16_t* w;  // [P, K, kNr] bfloat16 bits (column panels)
    float* y;           // [M, N]
    int64_t M, K, N;
};

inline float widen(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The scalar path: the same per-output order (one chain along k), for CPUs without AVX2 and as the reference the
// vector paths are tested against bit for bit.
inline void panel_scalar(const Problem& p, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < p.M; ++m) {
        const float* xr = p.x + m * p.K;
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.0f;
            const uint16_t* col = p.w + (n / kNr) * p.K * kNr + n % kNr;
            for (int64_t k = 0; k < p.K; ++k) acc = std::fma(xr[k], widen(col[k * kNr]), acc);
            p.y[m * p.N + n] = acc;
        }
    }
}

__attribute__((target("avx512f"), always_inline)) inline __m512 load_bf16(const uint16_t* src) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
}

// Rows [0, MR) of X (row stride K) times a panel of NV vectors (the last one masked), into Y (row stride N).
// Weights come from `wf` (the panel widened to float32) when not null, else straight from the bfloat16 panel
// `w` (both [K, kNr]; the padding columns are zeros and are never stored).
template <int MR, int NV>
__attribute__((target("avx512f"))) void micro(const float* x, int64_t K, const uint16_t* w, int64_t N,
                                                const float* wf, __mmask16 last, float* y) {
    __m512 acc[MR][NV];
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        __m512 b[NV];
        for (int v = 0; v < NV; ++v) b[v] = wf != nullptr ? _mm512_loadu_ps(wf + k * kNr + 16 * v)
                                                          : load_bf16(w + k * kNr + 16 * v);
        for (int i = 0; i < MR; ++i) {
            const __m512 a = _mm512_set1_ps(x[i * K + k]);
            for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v)
            _mm512_mask_storeu_ps(y + i * N + 16 * v, v == NV - 1 ? last : static_cast<__mmask16>(0xFFFF),
                                  acc[i][v]);
}

template <int NV>
__attribute__((target("avx512f"))) void rows(int mr, const float* x, int64_t K, const uint16_t* w,
                                                        int64_t N, const float* wf, __mmask16 last, float* y) {
    switch (mr) {
        case 8: micro<8, NV>(x, K, w, N, wf, last, y); break;
        case 7: micro<7, NV>(x, K, w, N, wf, last, y); break;
        case 6: micro<6, NV>(x, K, w, N, wf, last, y); break;
        case 5: micro<5, NV>(x, K, w, N, wf, last, y); break;
        case 4: micro<4, NV>(x, K, w, N, wf, last, y); break;
        case 3: micro<3, NV>(x, K, w, N, wf, last, y); break;
        case 2: micro<2, NV>(x, K, w, N, wf, last, y); break;
        default: micro<1, NV>(x, K, w, N, wf, last, y); break;
    }
}

__attribute__((target("avx512f"))) inline void panel_avx512(const Problem& p, int64_t n0) {
    const int64_t width = std::min(kNr, p.N - n0);
    const int nv = static_cast<int>((width + 15) / 16);
    const int tail = static_cast<int>(width - 16 * (nv - 1));
    const auto last = static_cast<__mmask16>((1u << tail) - 1u);
    const uint16_t* w = p.w + (n0 / kNr) * p.K * kNr;
    const float* wf = nullptr;
    thread_local std::vector<float> buf;
    if (p.M > kMr) {  // several row chunks: widen the panel once
        buf.resize(static_cast<size_t>(p.K * kNr));
        for (int64_t i = 0; i < p.K * kNr; i += 16) _mm512_storeu_ps(buf.data() + i, load_bf16(w + i));
        wf = buf.data();
    }
    for (int64_t m0 = 0; m0 < p.M; m0 += kMr) {
        const int mr = static_cast<int>(std::min(kMr, p.M - m0));
        const float* x = p.x + m0 * p.K;
        float* y = p.y + m0 * p.N + n0;
        switch (nv) {
            case 3: rows<3>(mr, x, p.K, w, p.N, wf, last, y); break;
            case 2: rows<2>(mr, x, p.K, w, p.N, wf, last, y); break;
            default: rows<1>(mr, x, p.K, w, p.N, wf, last, y); break;
        }
    }
}

// AVX2: 16 registers, so up to four rows at a time against half a panel (three 8-float vectors: 12 sums), a weight
// vector widened once for all four rows. The same chain per output as the other paths.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load_bf16_avx2(const uint16_t* src) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int MR>
__attribute__((target("avx2,fma"))) void micro_avx2(const float* x, int64_t K, const uint16_t* w, int64_t N,
                                                    int64_t width, float* y) {
    constexpr int kV = 3;  // half a panel: 24 columns
    __m256 acc[MR][kV];
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < kV; ++v) acc[i][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        for (int v = 0; v < kV; ++v) {
            const __m256 b = load_bf16_avx2(w + k * kNr + 8 * v);
            for (int i = 0; i < MR; ++i) acc[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * K + k), b, acc[i][v]);
        }
    }
    alignas(32) float tmp[8 * kV];
    for (int i = 0; i < MR; ++i) {
        for (int v = 0; v < kV; ++v) _mm256_store_ps(tmp + 8 * v, acc[i][v]);
        std::memcpy(y + i * N, tmp, static_cast<size_t>(width) * sizeof(float));
    }
}

inline void panel_avx2(const Problem& p, int64_t n0) {
    const uint16_t* w = p.w + (n0 / kNr) * p.K * kNr;
    for (int64_t half = 0; half < 2; ++half) {
        const int64_t width = std::min<int64_t>(kNr / 2, p.N - n0 - half * (kNr / 2));
        if (width <= 0) break;
        for (int64_t m0 = 0; m0 < p.M; m0 += 4) {
            const float* x = p.x + m0 * p.K;
            float* y = p.y + m0 * p.N + n0 + half * (kNr / 2);
            const uint16_t* wh = w + half * (kNr / 2);
            switch (std::min<int64_t>(4, p.M - m0)) {
                case 4: micro_avx2<4>(x, p.K, wh, p.N, width, y); break;
                case 3: micro_avx2<3>(x, p.K, wh, p.N, width, y); break;
                case 2: micro_avx2<2>(x, p.K, wh, p.N, width, y); break;
                default: micro_avx2<1>(x, p.K, wh, p.N, width, y); break;
            }
        }
    }
}

struct Job {
    const Problem* p;
    Isa isa;
};

inline void run_panel(const Job& job, int64_t i) {
    const int64_t n0 = i * kNr;
    if (job.isa == kAvx512) {
        panel_avx512(*job.p, n0);
    } else if (job.isa == kAvx2) {
        panel_avx2(*job.p, n0);
    } else {
        panel_scalar(*job.p, n0, std::min(job.p->N, n0 + kNr));
    }
}

// `threads` > 1 spreads the column panels over `pf` (the caller's pool) or, without one, OpenMP threads.
inline void run(const Problem& p, Isa isa, int threads, const llmc::ParallelFor* pf) {
    if (p.M == 0 || p.N == 0) return;
    if (p.K == 0) {
        std::fill(p.y, p.y + p.M * p.N, 0.0f);
        return;
    }
    const Job job{&p, isa};
    const int64_t n = (p.N + kNr - 1) / kNr;
    llmc::parallel_items<Job, run_panel>(job, n, threads, pf);
}

}  // namespace llmc_bf
