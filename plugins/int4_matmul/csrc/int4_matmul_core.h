// llmc's INT4 matmul on the CPU: Y[M, N] = X[M, K] @ W[N, K]^T with W group-wise 4-bit,
// X quantized on the fly to int8 (one scale per weight group), integer dot products, float32 out.
//
// Why our own and not ONNX Runtime's MatMulNBits (MLAS): profiles put MatMulNBits at about half of
// a decode step, and both MLAS users we measure against (ORT GenAI, llmc before this) read weights
// at well under the machine's bandwidth at batch 1. This kernel is laid out for the integer
// dot-product instructions: a 64-byte weight block holds 16 output columns x 8 inputs, so one
// VPDPBUSD (AVX-512 VNNI) or VPMADDUBSW+VPMADDWD pair (AVX2) gives each column's lane the dot
// product of 4 inputs with no horizontal reduction, and a group's sum stays in int32 until one
// float multiply-add per group. Llama.cpp's Q4 x Q8 dot products work the same way; the layout is ours.
//
// Weight layout (built by llmc.plugins.int4_matmul.pack, which is the reference for it):
//   w      uint8 [Np/16, Kp/8, 64]: tile t holds columns 16t..16t+15; byte 4*c + i of octet o holds
//          code q[16t + c, 8o + i] in its low nibble and q[16t + c, 8o + 4 + i] in its high nibble.
//   scales float [Np/16, ng, 16]: scale of (column, group);
//   mins   float [Np/16, ng, 16]: scale * zero point of (column, group) (zero point 8 if symmetric).
// Np = N rounded up to 16 (padding columns have zero codes and scales), Kp = ng * G (K padded with
// zero weights), G the group size (a multiple of 8).
//
// Per row and group g: xs = max|x| / 127, qx = rint(x / xs) (int8), xsum = xs * sum(qx); then
//   y[n] = sum_g scale[n,g] * xs_g * sum_k q[n,k] qx[k]  -  mins[n,g] * xsum_g.
// Every path (AVX-512 VNNI, AVX2, scalar) computes exactly these integers; the float sums may differ
// in order only. llmc.plugins.int4_matmul.reference emulates it in numpy for the tests.

#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../csrc/exp_nonpos.h"
#include "../../csrc/isa.h"
#include "../../csrc/parallel_for.h"

namespace llmc_i4 {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

using ParallelFor = llmc::ParallelFor;  // ../../csrc/parallel_for.h

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// How far ahead of the octet being read the weight stream is prefetched. The hardware prefetcher alone
// left decode at batch 8 at 11-15 GB/s of a 40-70 GB/s machine (weights beyond the LLC, 2 threads);
// measured with benchmarks/bench_int4_matmul.py's 1B MLP shapes: 0 / 512 / 1K / 2K / 4K / 8K bytes gave
// batch-8 speedups over MatMulNBits of 0.77-0.93 / 0.93-1.07 / 1.19-1.37 / 1.48-1.66 / 1.70-1.88 /
// 1.72-2.00, batch 1 0.93-1.01 -> 1.05-1.09 from 4K on.
constexpr int kPrefetchBytes = 4096;

inline Isa best_isa() {
    if (llmc::cpu::has_avx512_vnni()) return kAvx512Vnni;
    return llmc::cpu::has_avx2_fma() ? kAvx2 : kScalar;
}

struct Problem {
    const float* x;  // [M, K], row stride K
    int64_t M, K;
    const uint8_t* w;  // [Np/16, Kp/8, 64]
    const float* scales;  // [Np/16, ng, 16]
    const float* mins;    // [Np/16, ng, 16]
    int64_t N, G, ng;
    float* y;  // [M, N], or [M, N/2] with swiglu
    // SwiGLU epilogue: the tiles alternate gate and up (tile 2i: gate columns 16i..16i+15, tile 2i+1: the
    // same up columns; pack.interleave_gate_up), and y[r, c] = silu(gate[r, c]) * up[r, c]. N % 32 == 0.
    bool swiglu = false;
};

// y[i, c] = silu(g) * u for g = t[i, c], u = t[i, 16 + c] (t: mr rows of 32, 16 columns). The sigmoid
// takes exp(-|g|), so it never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below. Written with
// vectors: GCC left the plain loop scalar, and a scalar epilogue cost more than the matmul at 8 rows.
typedef float sv8f __attribute__((vector_size(32)));
typedef float sv8fu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t sv8i __attribute__((vector_size(32)));

inline __attribute__((always_inline)) void swiglu_rows_impl(const float* t, int mr, float* y, int64_t ldy) {
    for (int i = 0; i < mr; ++i) {
        for (int c = 0; c < 16; c += 8) {
            const sv8f g = *reinterpret_cast<const sv8fu*>(t + i * 32 + c);
            const sv8f u = *reinterpret_cast<const sv8fu*>(t + i * 32 + 16 + c);
            const sv8f e = llmc::exp_nonpos_t<sv8f, sv8i>(g < 0.0f ? g : -g);
            const sv8f num = g >= 0.0f ? sv8f{} + 1.0f : e;
            *reinterpret_cast<sv8fu*>(y + i * ldy + c) = g * (num / (1.0f + e)) * u;
        }
    }
}
inline void swiglu_rows_base(const float* t, int mr, float* y, int64_t ldy) { swiglu_rows_impl(t, mr, y, ldy); }
__attribute__((target("avx2,fma"))) inline void swiglu_rows_avx2(const float* t, int mr, float* y, int64_t ldy) {
    swiglu_rows_impl(t, mr, y, ldy);
}

// The int8 activations of one call: per row Kp codes, and per (row, group) the scale and the sum.
struct QuantX {
    std::vector<int8_t> q;
    std::vector<float> scale, sum;
};

inline QuantX& thread_quant_x() {
    thread_local QuantX qx;
    return qx;
}

// One row's group of n <= G values (n % 16 == 0) with AVX-512: the same max, the same products and the same
// round-to-nearest-even (VCVTPS2DQ in the default rounding mode, as nearbyint) as the scalar loop below,
// so the same codes. The scalar loop took ~20% of Int4MatMul's time at batch 32 (16 us of 57 for the
// 110M model's QKV projection), on the calling thread while the others waited.
__attribute__((target("avx512f,avx512bw"))) inline void quantize_group_avx512(const float* x, int64_t n, int8_t* q,
                                                                           float& scale, float& sum) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float amax = _mm512_reduce_max_ps(vmax);
    scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < n; k += 16) {
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv));
        c = _mm512_max_epi32(lo, _mm512_min_epi32(hi, c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(c));
        total = _mm512_add_epi32(total, c);
    }
    sum = scale * static_cast<float>(_mm512_reduce_add_epi32(total));
}

// Quantize rows [r0, r1) of x into qx (sized by the caller). Groups whose width is a multiple of 16 take the
// AVX-512 path when `isa` has it (the K tail of a padded last group is zeros either way).
inline void quantize_rows(const Problem& p, QuantX& qx, int64_t r0, int64_t r1, Isa isa = kScalar) {
    const int64_t Kp = p.ng * p.G;
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = p.x + r * p.K;
        int8_t* qr = qx.q.data() + r * Kp;
        for (int64_t g = 0; g < p.ng; ++g) {
            const int64_t k0 = g * p.G, k1 = std::min(p.K, k0 + p.G);
            for (int64_t k = k1; k < k0 + p.G; ++k) qr[k] = 0;
            if (isa == kAvx512Vnni && (k1 - k0) % 16 == 0) {
                quantize_group_avx512(xr + k0, k1 - k0, qr + k0, qx.scale[r * p.ng + g], qx.sum[r * p.ng + g]);
                continue;
            }
            float amax = 0.0f;
            for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
            const float scale = amax / 127.0f;
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t total = 0;
            for (int64_t k = k0; k < k1; ++k) {
                // nearbyint: round half to even in the default rounding mode, as numpy's rint.
                const int32_t v = static_cast<int32_t>(std::nearbyint(xr[k] * inv));
                const int32_t c = std::max(-127, std::min(127, v));
                qr[k] = static_cast<int8_t>(c);
                total += c;
            }
            qx.scale[r * p.ng + g] = scale;
            qx.sum[r * p.ng + g] = scale * static_cast<float>(total);
        }
    }
}

// One column tile (16 columns) x rows [r0, r0 + MR): y[r, cols] for the tile's `ncols` valid columns.
struct TileArgs {
    const uint8_t* w;      // the tile's [Kp/8, 64]
    const float* scales;   // the tile's [ng, 16]
    const float* mins;     // the tile's [ng, 16]
    const int8_t* qx;      // row r0's codes; row stride Kp
    const float* xscale;   // row r0's [ng]; row stride ng
    const float* xsum;     // row r0's [ng]; row stride ng
    int64_t Kp, G, ng;
    float* y;              // row r0, column 16t; row stride ldy
    int64_t ldy;
    int ncols;
};

template <int MR>
void tile_scalar(const TileArgs& a) {
    float acc[MR][16] = {};
    for (int64_t g = 0; g < a.ng; ++g) {
        int32_t dot[MR][16] = {};
        for (int64_t o = g * a.G / 8; o < (g + 1) * a.G / 8; ++o) {
            const uint8_t* blk = a.w + o * 64;
            for (int c = 0; c < 16; ++c) {
                for (int i = 0; i < 4; ++i) {
                    const int32_t lo = blk[4 * c + i] & 0x0F, hi = blk[4 * c + i] >> 4;
                    for (int r = 0; r < MR; ++r) {
                        const int8_t* xr = a.qx + r * a.Kp + o * 8;
                        dot[r][c] += lo * xr[i] + hi * xr[4 + i];
                    }
                }
            }
        }
        for (int r = 0; r < MR; ++r) {
            const float xs = a.xscale[r * a.ng + g], xm = a.xsum[r * a.ng + g];
            for (int c = 0; c < 16; ++c) {
                acc[r][c] = std::fma(static_cast<float>(dot[r][c]), a.scales[g * 16 + c] * xs, acc[r][c]);
                acc[r][c] = std::fma(-a.mins[g * 16 + c], xm, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < MR; ++r) std::memcpy(a.y + r * a.ldy, acc[r], sizeof(float) * a.ncols);
}

// AVX2: the 64-byte block as two halves of 8 columns; VPMADDUBSW (u8 x s8 pairs to s16, which cannot
// saturate: 2 * 15 * 127 < 32767) then VPMADDWD by ones sums 4 products per int32 lane.
template <int MR>
__attribute__((target("avx2,fma"))) void tile_avx2(const TileArgs& a) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
        __m256 acc[MR];
        for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < a.ng; ++g) {
            __m256i dot[MR];
            for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_si256();
            const int64_t o0 = g * a.G / 8, o1 = (g + 1) * a.G / 8;
            for (int64_t o = o0; o < o1; ++o) {
                if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(a.w + o * 64) + kPrefetchBytes, _MM_HINT_T0);
                const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + o * 64 + h * 32));
                const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
                for (int r = 0; r < MR; ++r) {
                    const int8_t* xr = a.qx + r * a.Kp + o * 8;
                    int32_t x0, x1;
                    std::memcpy(&x0, xr, 4);
                    std::memcpy(&x1, xr + 4, 4);
                    const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0));
                    const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1));
                    // |p0 + p1| <= 4 * 15 * 127 = 7620: the int16 sum is exact.
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                }
            }
            const __m256 sc = _mm256_loadu_ps(a.scales + g * 16 + h * 8);
            const __m256 mn = _mm256_loadu_ps(a.mins + g * 16 + h * 8);
            for (int r = 0; r < MR; ++r) {
                const __m256 s = _mm256_mul_ps(sc, _mm256_set1_ps(a.xscale[r * a.ng + g]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), s, acc[r]);
                acc[r] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a.xsum[r * a.ng + g]), acc[r]);
            }
        }
        const int n = std::max(0, std::min(8, a.ncols - 8 * h));
        for (int r = 0; r < MR; ++r) {
            if (n == 8) {
                _mm256_storeu_ps(a.y + r * a.ldy + 8 * h, acc[r]);
            } else if (n > 0) {
                alignas(32) float tmp[8];
                _mm256_store_ps(tmp, acc[r]);
                std::memcpy(a.y + r * a.ldy + 8 * h, tmp, sizeof(float) * n);
            }
        }
    }
}

// VPDPBUSD acc += u8 . s8 (4 products per int32 lane). Written as asm because GCC 12 does not tie the
// intrinsic's accumulator to its output: with 8 rows it copied every accumulator around every dot
// product (62 instructions per octet instead of 42).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}

// One octet's two dot products for MR rows (lo nibbles: inputs 0-3 of the octet, hi nibbles: inputs
// 4-7), into separate accumulators, or both into lo_acc when `Split` is false.
template <int MR, bool Split>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void octet_vnni(
    const uint8_t* blk, const int8_t* x, int64_t Kp, __m512i (&lo_acc)[MR], __m512i (&hi_acc)[MR]) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
    const __m512i b = _mm512_loadu_si512(blk);
    const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
    for (int r = 0; r < MR; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, x + r * Kp, 4);
        std::memcpy(&x1, x + r * Kp + 4, 4);
        lo_acc[r] = dpbusd(lo_acc[r], lo, _mm512_set1_epi32(x0));
        if (Split) {
            hi_acc[r] = dpbusd(hi_acc[r], hi, _mm512_set1_epi32(x1));
        } else {
            lo_acc[r] = dpbusd(lo_acc[r], hi, _mm512_set1_epi32(x1));
        }
    }
}

// A dot product's latency (~4-5 cycles) would bound one accumulator chain per row when rows are few,
// so with up to 4 rows the lo and hi halves accumulate separately, and with up to 2 rows two octets
// at a time go to separate sets as well. With more rows, the rows are the independent chains (and
// more accumulators would spill: 32 zmm registers).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const TileArgs& a) {
    constexpr int U = MR <= 2 ? 2 : 1;  // accumulator sets
    constexpr bool Split = MR <= 4;
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a.ng; ++g) {
        __m512i lo_acc[U][MR], hi_acc[U][MR];
        for (int u = 0; u < U; ++u) {
            for (int r = 0; r < MR; ++r) lo_acc[u][r] = hi_acc[u][r] = _mm512_setzero_si512();
        }
        const int64_t o0 = g * a.G / 8, o1 = (g + 1) * a.G / 8;
        int64_t o = o0;
        for (; o + U <= o1; o += U) {
            for (int u = 0; u < U; ++u) octet_vnni<MR, Split>(a.w + (o + u) * 64, a.qx + (o + u) * 8, a.Kp, lo_acc[u], hi_acc[u]);
        }
        for (; o < o1; ++o) octet_vnni<MR, Split>(a.w + o * 64, a.qx + o * 8, a.Kp, lo_acc[0], hi_acc[0]);
        const __m512 sc = _mm512_loadu_ps(a.scales + g * 16), mn = _mm512_loadu_ps(a.mins + g * 16);
        for (int r = 0; r < MR; ++r) {
            __m512i dot = _mm512_add_epi32(lo_acc[0][r], hi_acc[0][r]);
            for (int u = 1; u < U; ++u) dot = _mm512_add_epi32(dot, _mm512_add_epi32(lo_acc[u][r], hi_acc[u][r]));
            const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(a.xscale[r * a.ng + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
            acc[r] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.xsum[r * a.ng + g]), acc[r]);
        }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << a.ncols) - 1u);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(a.y + r * a.ldy, mask, acc[r]);
}

using TileFn = void (*)(const TileArgs&);

// Rows per register tile: 8 with 32 zmm registers (8 int32 + 8 float accumulators + weights), 4 with
// AVX2's 16 ymm; the scalar path follows AVX2's.
inline int max_rows(Isa isa) { return isa == kAvx512Vnni ? 8 : 4; }

template <template <int> class Pick>
TileFn by_rows(int mr) {
    switch (mr) {
        case 1: return Pick<1>::fn;
        case 2: return Pick<2>::fn;
        case 3: return Pick<3>::fn;
        case 4: return Pick<4>::fn;
        case 5: return Pick<5>::fn;
        case 6: return Pick<6>::fn;
        case 7: return Pick<7>::fn;
        default: return Pick<8>::fn;
    }
}
template <int MR> struct PickScalar { static constexpr TileFn fn = tile_scalar<MR>; };
template <int MR> struct PickAvx2 { static constexpr TileFn fn = tile_avx2<MR>; };
template <int MR> struct PickVnni { static constexpr TileFn fn = tile_vnni<MR>; };

inline TileFn tile_fn(Isa isa, int mr) {
    if (isa == kAvx512Vnni) return by_rows<PickVnni>(mr);
    if (isa == kAvx2) return by_rows<PickAvx2>(mr);
    return by_rows<PickScalar>(mr);
}

// Work items: (block of up to kRowBlock rows, run of column tiles). Within one, each column tile's
// weights (Kp * 8 bytes) are reused from L1/L2 by every register tile of rows, and the row block's
// int8 activations (kRowBlock * Kp bytes) stay in L2 across the run of column tiles.
constexpr int64_t kRowBlock = 64;
// Below this many multiply-adds, waking the other threads costs more than it saves.
constexpr int64_t kParallelMinWork = int64_t{1} << 20;

struct Plan {
    const Problem* p;
    const QuantX* qx;
    Isa isa;
    int64_t tiles, tiles_per_item, row_blocks, col_items;
};

inline void run_item(const Plan& plan, int64_t item) {
    const Problem& p = *plan.p;
    const int64_t rb = item / plan.col_items, ci = item % plan.col_items;
    const int64_t r0 = rb * kRowBlock, r1 = std::min(p.M, r0 + kRowBlock);
    const int64_t t0 = ci * plan.tiles_per_item, t1 = std::min(plan.tiles, t0 + plan.tiles_per_item);
    const int64_t Kp = p.ng * p.G, mr_max = max_rows(plan.isa);
    if (p.swiglu) {  // tile pairs (gate, up) into a [mr, 32] scratch, then the epilogue into y [M, N/2]
        const int64_t ldy = p.N / 2;
        for (int64_t t = t0; t < t1; t += 2) {
            for (int64_t r = r0; r < r1; r += mr_max) {
                const int mr = static_cast<int>(std::min(mr_max, r1 - r));
                alignas(64) float pair[8 * 32];
                for (int64_t h = 0; h < 2; ++h) {
                    const int64_t tt = t + h;
                    TileArgs a{p.w + tt * (Kp / 8) * 64, p.scales + tt * p.ng * 16, p.mins + tt * p.ng * 16,
                               plan.qx->q.data() + r * Kp, plan.qx->scale.data() + r * p.ng,
                               plan.qx->sum.data() + r * p.ng, Kp, p.G, p.ng, pair + h * 16, 32, 16};
                    tile_fn(plan.isa, mr)(a);
                }
                if (plan.isa == kScalar) {
                    swiglu_rows_base(pair, mr, p.y + r * ldy + (t / 2) * 16, ldy);
                } else {
                    swiglu_rows_avx2(pair, mr, p.y + r * ldy + (t / 2) * 16, ldy);
                }
            }
        }
        return;
    }
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t r = r0; r < r1; r += mr_max) {
            const int mr = static_cast<int>(std::min(mr_max, r1 - r));
            TileArgs a{p.w + t * (Kp / 8) * 64,
                       p.scales + t * p.ng * 16,
                       p.mins + t * p.ng * 16,
                       plan.qx->q.data() + r * Kp,
                       plan.qx->scale.data() + r * p.ng,
                       plan.qx->sum.data() + r * p.ng,
                       Kp, p.G, p.ng,
                       p.y + r * p.N + t * 16,
                       p.N,
                       static_cast<int>(std::min<int64_t>(16, p.N - t * 16))};
            tile_fn(plan.isa, mr)(a);
        }
    }
}

inline void check(const Problem& p) {
    if (p.G <= 0 || p.G % 8) throw Error("group_size must be a positive multiple of 8, got " + std::to_string(p.G));
    if (p.swiglu && p.N % 32) throw Error("the SwiGLU epilogue needs N % 32 == 0, got N = " + std::to_string(p.N));
    if (p.ng * p.G < p.K || (p.ng - 1) * p.G >= p.K) {
        throw Error("K = " + std::to_string(p.K) + " needs ceil(K / group_size) = " +
                    std::to_string((p.K + p.G - 1) / p.G) + " groups, the weights have " + std::to_string(p.ng));
    }
}

// Y = X @ W^T. `threads`: OpenMP threads when `pf` is null (1: the calling thread only); with `pf`
// the work goes to that pool when large enough.
inline void run(const Problem& p, Isa isa, int threads, const ParallelFor* pf = nullptr,
                int64_t parallel_min_work = kParallelMinWork) {
    check(p);
    if (p.M == 0 || p.N == 0) return;
    const int64_t Kp = p.ng * p.G;
    QuantX& qx = thread_quant_x();
    if (static_cast<int64_t>(qx.q.size()) < p.M * Kp) qx.q.resize(static_cast<size_t>(p.M * Kp));
    if (static_cast<int64_t>(qx.scale.size()) < p.M * p.ng) {
        qx.scale.resize(static_cast<size_t>(p.M * p.ng));
        qx.sum.resize(static_cast<size_t>(p.M * p.ng));
    }
    const bool parallel = threads > 1 && p.M * p.N * p.K >= parallel_min_work;
    const int64_t row_blocks = (p.M + kRowBlock - 1) / kRowBlock;
    Plan plan{&p, &qx, isa, (p.N + 15) / 16, 1, row_blocks, 1};
    if (parallel) {
        // About 4 items per thread (dynamic hand-out evens out uneven cores), at least 1 tile each.
        const int64_t want = std::max<int64_t>(1, (4 * threads + row_blocks - 1) / row_blocks);
        plan.tiles_per_item = std::max<int64_t>(1, (plan.tiles + want - 1) / want);
        if (p.swiglu) plan.tiles_per_item += plan.tiles_per_item % 2;  // whole (gate, up) pairs per item
    } else {
        plan.tiles_per_item = plan.tiles;
    }
    plan.col_items = (plan.tiles + plan.tiles_per_item - 1) / plan.tiles_per_item;
    const int64_t items = row_blocks * plan.col_items;
    struct Q {
        const Problem* p;
        QuantX* qx;
        Isa isa;
    } q{&p, &qx, isa};
    if (!parallel) {
        quantize_rows(p, qx, 0, p.M, isa);
        for (int64_t i = 0; i < items; ++i) run_item(plan, i);
        return;
    }
    if (pf != nullptr) {
        if (row_blocks > 1) {
            pf->fn(pf->self, row_blocks, [](void* arg, int64_t b) {
                const Q& x = *static_cast<const Q*>(arg);
                quantize_rows(*x.p, *x.qx, b * kRowBlock, std::min(x.p->M, (b + 1) * kRowBlock), x.isa);
            }, &q);
        } else {
            quantize_rows(p, qx, 0, p.M, isa);
        }
        pf->fn(pf->self, items, [](void* arg, int64_t i) { run_item(*static_cast<const Plan*>(arg), i); }, &plan);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < row_blocks; ++b) quantize_rows(p, qx, b * kRowBlock, std::min(p.M, (b + 1) * kRowBlock), isa);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) run_item(plan, i);
    }
}

}  // namespace llmc_i4
