// PagedAttention CPU kernel core, shared by the pybind11 module (paged_attention_cpu.cpp, the
// llmc.plugins.paged_attention._cpu extension) and the native ONNX Runtime custom-op library
// (ort_paged_attention.cpp). It works on raw pointers only: no Python, no ONNX Runtime types.
//
// Semantics are those of llmc/plugins/paged_attention/reference.py (normative):
//   1. every new token's K and V row is written into its cache slot, in place, in row order
//      (slot < 0 = padding, no write; a repeated slot keeps the last row, as in the reference);
//   2. every query row of a sequence attends causally (optionally within a sliding window,
//      optionally with a tanh soft-cap on the scores) to the sequence's cached positions,
//      query head h reading KV head h / (num_heads / num_kv_heads); optional attention sinks add
//      exp(sinks[h]) to head h's softmax denominator (once, after any split-K merge) and nothing to
//      its value sum; optional ALiBi adds slope[h] * (key position - query position) to head h's
//      scores (logical positions, after the scale and any soft-cap); optional chunked local attention
//      (llama4) lets a query at position p see only keys in [floor(p / C) * C, p]; optional attend_end
//      (one int64 per query row, Gemma 3's bidirectional image spans) lets row t at position p also see
//      the keys p < k < attend_end[t] (the lower bound of the window / chunk still applies). Those keys
//      are this step's own, which is why every K/V row is written (1) before any row attends (2).
//
// Caches are [num_blocks, num_kv_heads, block_size, head_size], float32 (or float16, converted
// with round-to-nearest-even on write, as numpy does), owned by the caller and never copied.
//
// Compute: work items of (query rows, KV head, block range), distributed over OpenMP threads or a
// caller-provided pool (ONNX Runtime's, see ParallelFor).
// Each item runs an online-softmax (flash-decoding style) loop over the sequence's blocks with
// float32 accumulation. Every index is validated (run() throws llmc_pa::Error, a
// std::invalid_argument, naming the bad value) before the first write, so an error leaves the
// caches untouched and no index is ever read out of bounds.
//
// Each including translation unit gets its own copy (everything is in an unnamed namespace):
// the two libraries share the code, not state.

#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../csrc/exp_nonpos.h"
#include "../../csrc/isa.h"
#include "../../csrc/parallel_for.h"

namespace llmc_pa {

// A caller error (bad shape, index or attribute). The pybind11 module surfaces it as ValueError.
struct Error : std::invalid_argument {
    explicit Error(const std::string& msg) : std::invalid_argument("paged_attention: " + msg) {}
};

namespace {

#define LLMC_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------
// float16 <-> float32, bit-exact with numpy's conversions.

LLMC_INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: mant * 2^-24, exact in float32
            float f = static_cast<float>(mant) * 5.9604644775390625e-08f;
            std::memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

LLMC_INLINE uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // inf / nan (numpy keeps the top mantissa bits, forces a quiet nan)
        if (ax == 0x7f800000u) return sign | 0x7c00u;
        uint16_t ret = static_cast<uint16_t>(0x7c00u + ((ax & 0x007fffffu) >> 13));
        if (ret == 0x7c00u) ++ret;
        return sign | ret;
    }
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {                       // normal half
        const uint32_t exp = (ax >> 23) - 112u;
        const uint32_t mant = ax & 0x7fffffu;
        uint32_t h = (exp << 10) | (mant >> 13);
        const uint32_t rem = mant & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
        return sign | static_cast<uint16_t>(h);
    }
    if (ax <= 0x33000000u) return sign;  // <= 2^-25 rounds (to even) to zero
    const uint32_t exp = ax >> 23;       // 102..112
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
}

// float16 -> float32 for n values: F16C, 8 at a time (exact, like half_to_float). Called once per
// K/V block of a float16 cache; not inlined, so that only this function needs the F16C target.
__attribute__((target("avx,f16c"))) void halves_to_floats_f16c(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h;
        std::memcpy(&h, src + i, sizeof(h));
        const __m256 f = _mm256_cvtph_ps(h);
        std::memcpy(dst + i, &f, sizeof(f));
    }
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void halves_to_floats(const uint16_t* src, float* dst, int64_t n, bool f16c) {
    if (f16c) {
        halves_to_floats_f16c(src, dst, n);
        return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// float32 -> float16 for n values: F16C, 8 at a time, rounding to nearest even as float_to_half does
// (VCVTPS2PH is IEEE's conversion, subnormals and overflow to inf included). NaN is the one input it
// treats differently (it sets the quiet bit; numpy keeps the payload's top bits), so 8 values that hold
// a NaN go through float_to_half. The scalar loop alone took ~5% of a decode step's time at batch 32.
__attribute__((target("avx,f16c"))) void floats_to_halves_f16c(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 f = _mm256_loadu_ps(src + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
            for (int64_t j = i; j < i + 8; ++j) dst[j] = float_to_half(src[j]);
            continue;
        }
        const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        std::memcpy(dst + i, &h, sizeof(h));
    }
    for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

void floats_to_halves(const float* src, uint16_t* dst, int64_t n, bool f16c) {
    if (f16c) {
        floats_to_halves_f16c(src, dst, n);
        return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
}

// ---------------------------------------------------------------------------------------------
// Attention work items.
//
// An item is (query row, KV head, range of the row's blocks): it computes the `group` query
// heads that share that KV head, so each K/V block is read from memory once per group and then
// reused from L1 by every head of the group. A row whose context is long, in a step with few
// rows, is split into several block ranges (flash-decoding's split-K) so that a small decode
// batch still feeds every core; the ranges' partial results (running max, sum, unnormalised
// output) are merged afterwards. The split depends only on the problem's shape, never on the
// thread count, so results are bit-identical whatever the number of threads.

struct Problem {
    const float* query;  // rows of num_heads * head_size
    int64_t q_row;       // row stride, elements
    const void* k_cache;
    const void* v_cache;
    const int64_t* block_tables;
    int64_t bt_row;
    float* out;  // [T, num_heads * head_size], contiguous
    float* partials;  // per split part: m[group], l[group], acc[group * head_size]
    int64_t num_heads, num_kv_heads, group, head_size, block_size;
    float scale, softcap;
    int64_t window;  // <= 0: none
    int64_t chunk;   // chunked local attention: keys from floor(pos / chunk) * chunk on; <= 0: none
    const float* sinks;  // [num_heads] attention-sink logits, or nullptr: none
    const float* alibi;  // [num_heads] ALiBi slopes, or nullptr: none
    const int64_t* attend_end;  // [T]: row t also sees keys up to attend_end[t] - 1; nullptr: causal only
    bool f16c;       // float16 caches convert with F16C (the AVX2 path on a CPU that has it)
};

struct Item {
    int64_t t;             // query row
    int64_t seq;           // its sequence
    int64_t pos;           // its absolute position
    int64_t kvh;           // KV head
    int64_t b_begin, b_end;  // block indices (into the sequence's table) of this item, [begin, end)
    int64_t part;          // -1: write the output; else index of this item's partial result
};

struct Merge {
    int64_t t, kvh, part0, nparts;
};

// Scratch space of one thread: running outputs and scores of the group's heads, and (float16
// caches) the current block's K/V rows converted to float32.
struct Scratch {
    std::vector<float> acc, scores, m, l, ktile, vtile;
    Scratch(int64_t g, int64_t d, int64_t bs, bool half) : acc(g * d), scores(g * bs), m(g), l(g) {
        if (half) {
            ktile.resize(static_cast<size_t>(bs * d));
            vtile.resize(static_cast<size_t>(bs * d));
        }
    }
};

using llmc::exp_nonpos;  // ../../csrc/exp_nonpos.h

// The first key position a query at `pos` sees: 0, raised by a sliding window (the last `window` positions)
// and by chunked local attention (the query's own chunk of `chunk` positions, counted from 0).
LLMC_INLINE int64_t first_visible(int64_t pos, int64_t window, int64_t chunk) {
    int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    if (chunk > 0) lo = std::max<int64_t>(lo, pos - pos % chunk);
    return lo;
}

// The last key position (inclusive) query row `t` at `pos` sees: its own, or with bidirectional spans
// (attend_end != nullptr) up to attend_end[t] - 1 when that lies ahead.
LLMC_INLINE int64_t last_visible(const int64_t* attend_end, int64_t t, int64_t pos) {
    return attend_end != nullptr && attend_end[t] - 1 > pos ? attend_end[t] - 1 : pos;
}

// ALiBi's slopes (Press et al.; transformers' bloom build_alibi_tensor, and mpt's build_mpt_alibi_tensor with
// alibi_bias_max = max_bias): with n the largest power of two <= num_heads, head h < n has slope
// 2^(-max_bias (h + 1) / n); the remaining heads take the odd-indexed slopes of 2n heads, 2^(-max_bias (2j + 1) / 2n).
inline std::vector<float> alibi_slopes(int64_t num_heads, float max_bias) {
    int64_t n = 1;
    while (n * 2 <= num_heads) n *= 2;
    std::vector<float> out(static_cast<size_t>(num_heads));
    for (int64_t h = 0; h < num_heads; ++h) {
        const double e = h < n ? double(h + 1) / double(n) : double(2 * (h - n) + 1) / double(2 * n);
        out[h] = static_cast<float>(std::exp2(-double(max_bias) * e));
    }
    return out;
}

// The factor that turns a head's unnormalised output `acc` (running max `m`, running sum `l`) into its
// attention output: 1 / l, or with an attention sink of logit `sink` (sinks != nullptr) the sink's
// exp(sink - m) joins the denominator: acc / (l + exp(sink - m)), computed against max(m, sink) so that
// neither exponential overflows (as the reference subtracts the max over the scores and the sink).
LLMC_INLINE float normaliser(float m, float l, const float* sinks, int64_t head) {
    if (sinks == nullptr) return 1.0f / l;
    const float sink = sinks[head];
    const float top = std::max(m, sink);
    const float a = std::exp(m - top);
    return a / (l * a + std::exp(sink - top));
}

// One block's step of the online softmax of one query head. `s[j0..j1]` holds the block's visible
// scores (scaled, capped); if their max raises the running max `m`, the running sum `l` and output
// `acc` (D floats) are rescaled to it; then the scores become weights exp(s - m), in place, and are
// added to `l`. The caller accumulates weights x V into `acc`.
LLMC_INLINE void softmax_block(float* __restrict s, int64_t j0, int64_t j1, float& m, float& l,
                               float* __restrict acc, int64_t D) {
    float bmax = -std::numeric_limits<float>::infinity();
    for (int64_t j = j0; j <= j1; ++j) bmax = std::max(bmax, s[j]);
    if (bmax > m) {
        const float alpha = std::exp(m - bmax);  // exp(-inf) = 0 on the head's first block
        l *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
        m = bmax;
    }
    const float mm = m;
    float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
    for (int64_t j = j0; j <= j1; ++j) {
        const float e = exp_nonpos(s[j] - mm);
        s[j] = e;
        lsum += e;
    }
    l += lsum;
}

// Ask for one (block, KV head)'s K and V rows ahead of use. Blocks are scattered in memory and, in a
// real step, cold (the weights evicted every layer's cache since the last step). The per-row loop asks
// one block ahead (2 or 4 measured 5-15% slower there, cold caches, decode b1-b32); the tiled loop,
// whose blocks take less compute, two (see there).
template <typename CacheT>
LLMC_INLINE void prefetch_block(const Problem& p, int64_t block, int64_t kvh, const CacheT* kc, const CacheT* vc) {
    const int64_t at = ((block * p.num_kv_heads + kvh) * p.block_size) * p.head_size;
    const char* kn = reinterpret_cast<const char*>(kc + at);
    const char* vn = reinterpret_cast<const char*>(vc + at);
    const int64_t bytes = p.block_size * p.head_size * static_cast<int64_t>(sizeof(CacheT));
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(vn + off);
    }
}

template <typename CacheT>
LLMC_INLINE void attend(const Problem& p, const Item& it, Scratch& sc) {
    constexpr bool kHalf = std::is_same<CacheT, uint16_t>::value;
    const int64_t D = p.head_size, bs = p.block_size, G = p.group;
    const float* __restrict q = p.query + it.t * p.q_row + it.kvh * G * D;  // the group's heads are adjacent
    const int64_t* bt = p.block_tables + it.seq * p.bt_row;
    const CacheT* kc = static_cast<const CacheT*>(p.k_cache);
    const CacheT* vc = static_cast<const CacheT*>(p.v_cache);

    const int64_t lo = first_visible(it.pos, p.window, p.chunk);
    const int64_t hi = last_visible(p.attend_end, it.t, it.pos);  // inclusive
    const float scale = p.scale, softcap = p.softcap;
    const bool use_cap = softcap > 0.0f;

    float* __restrict acc = sc.acc.data();
    float* __restrict m = sc.m.data();
    float* __restrict l = sc.l.data();
    for (int64_t e = 0; e < G * D; ++e) acc[e] = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.0f;
    }

    for (int64_t bi = it.b_begin; bi < it.b_end; ++bi) {
        const int64_t base = ((bt[bi] * p.num_kv_heads + it.kvh) * bs) * D;
        const int64_t j0 = std::max<int64_t>(lo - bi * bs, 0);
        const int64_t j1 = std::min<int64_t>(hi - bi * bs, bs - 1);  // inclusive

        if (bi + 1 < it.b_end) prefetch_block(p, bt[bi + 1], it.kvh, kc, vc);

        const float* __restrict kb;
        const float* __restrict vb;
        if constexpr (kHalf) {
            float* kt = sc.ktile.data();
            float* vt = sc.vtile.data();
            const uint16_t* ks = kc + base;
            const uint16_t* vs = vc + base;
            for (int64_t e = j0 * D; e < (j1 + 1) * D; ++e) {
                kt[e] = half_to_float(ks[e]);
                vt[e] = half_to_float(vs[e]);
            }
            kb = kt;
            vb = vt;
        } else {
            kb = kc + base;
            vb = vc + base;
        }

        for (int64_t g = 0; g < G; ++g) {
            const float* __restrict qg = q + g * D;
            float* __restrict sg = sc.scores.data() + g * bs;
            float* __restrict ag = acc + g * D;

            // Scores of the block's visible positions, four rows at a time for ILP.
            int64_t j = j0;
            for (; j + 3 <= j1; j += 4) {
                const float* k0 = kb + j * D;
                const float* k1 = k0 + D;
                const float* k2 = k1 + D;
                const float* k3 = k2 + D;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < D; ++d) {
                    const float qd = qg[d];
                    s0 += qd * k0[d];
                    s1 += qd * k1[d];
                    s2 += qd * k2[d];
                    s3 += qd * k3[d];
                }
                sg[j] = s0 * scale;
                sg[j + 1] = s1 * scale;
                sg[j + 2] = s2 * scale;
                sg[j + 3] = s3 * scale;
            }
            for (; j <= j1; ++j) {
                const float* k0 = kb + j * D;
                float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
                for (int64_t d = 0; d < D; ++d) s0 += qg[d] * k0[d];
                sg[j] = s0 * scale;
            }
            if (use_cap) {
                for (j = j0; j <= j1; ++j) sg[j] = softcap * std::tanh(sg[j] / softcap);
            }
            if (p.alibi != nullptr) {  // slope * (key position - query position), on logical positions
                const float slope = p.alibi[it.kvh * G + g];
                for (j = j0; j <= j1; ++j) sg[j] += slope * static_cast<float>(bi * bs + j - it.pos);
            }
            softmax_block(sg, j0, j1, m[g], l[g], ag, D);
            for (j = j0; j + 3 <= j1; j += 4) {
                const float p0 = sg[j], p1 = sg[j + 1], p2 = sg[j + 2], p3 = sg[j + 3];
                const float* __restrict v0 = vb + j * D;
                const float* __restrict v1 = v0 + D;
                const float* __restrict v2 = v1 + D;
                const float* __restrict v3 = v2 + D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] = ag[d] + p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
            for (; j <= j1; ++j) {
                const float pj = sg[j];
                const float* __restrict v0 = vb + j * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += pj * v0[d];
            }
        }
    }

    if (it.part < 0) {
        float* __restrict o = p.out + it.t * (p.num_heads * D) + it.kvh * G * D;
        for (int64_t g = 0; g < G; ++g) {
            // l >= 1: the row always sees its own position
            const float inv = normaliser(m[g], l[g], p.sinks, it.kvh * G + g);
            const float* __restrict ag = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[g * D + d] = ag[d] * inv;
        }
    } else {
        float* __restrict dst = p.partials + it.part * G * (D + 2);
        std::memcpy(dst, m, sizeof(float) * G);
        std::memcpy(dst + G, l, sizeof(float) * G);
        std::memcpy(dst + 2 * G, acc, sizeof(float) * G * D);
    }
}

// ---------------------------------------------------------------------------------------------
// Tiled fast path (head_size and block_size multiples of 8; the loop above serves the rest).
//
// The per-row loop above reads every K/V block once per query row and reduces every dot product
// horizontally, which leaves it at ~1 multiply-add per cycle. Here an item is (sequence, KV head,
// tile of up to kTileQueries / group consecutive query rows, block range): the tile's query
// vectors (rows x heads of the group, pre-scaled) share each K/V block while it sits in L1;
// scores take eight keys at a time with eight independent accumulators and one transposing
// reduction (no per-key horizontal sum); P.V keeps the output row in registers. GCC vector
// extensions rather than intrinsics so that the same source serves the AVX2 and the x86-64-v2
// builds. Prefill tiles make a prompt's attention O(T^2 / tile) reads instead of O(T^2).

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int64_t kTileQueries = 32;

LLMC_INLINE v8f load8(const float* p) { return *reinterpret_cast<const v8fu*>(p); }
LLMC_INLINE void store8(float* p, v8f v) { *reinterpret_cast<v8fu*>(p) = v; }
LLMC_INLINE v8f bcast8(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Lane i of the result = the sum of a[i]'s eight lanes.
LLMC_INLINE v8f hsum8x8(const v8f a[8]) {
    const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8f t01 = __builtin_shuffle(a[0], a[1], even) + __builtin_shuffle(a[0], a[1], odd);
    const v8f t23 = __builtin_shuffle(a[2], a[3], even) + __builtin_shuffle(a[2], a[3], odd);
    const v8f t45 = __builtin_shuffle(a[4], a[5], even) + __builtin_shuffle(a[4], a[5], odd);
    const v8f t67 = __builtin_shuffle(a[6], a[7], even) + __builtin_shuffle(a[6], a[7], odd);
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8f u = __builtin_shuffle(t01, t23, lo2) + __builtin_shuffle(t01, t23, hi2);
    const v8f w = __builtin_shuffle(t45, t67, lo2) + __builtin_shuffle(t45, t67, hi2);
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(u, w, lo4) + __builtin_shuffle(u, w, hi4);
}

typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64)));

// Lane i of the result = the sum of a[i]'s sixteen lanes (hsum8x8's transposing reduction, one level more).
LLMC_INLINE v16f hsum16x16(const v16f a[16]) {
    const v16i lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const v16i lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    v16f t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) + __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1 + 1);
    for (int i = 0; i < 4; ++i) u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo2) + __builtin_shuffle(t[2 * i], t[2 * i + 1], lo2 + 2);
    for (int i = 0; i < 2; ++i) w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], lo4) + __builtin_shuffle(u[2 * i], u[2 * i + 1], lo4 + 4);
    return __builtin_shuffle(w[0], w[1], lo8) + __builtin_shuffle(w[0], w[1], lo8 + 8);
}

// The tiled loop's vector width: 8 floats (AVX2, and the x86-64-v2 build through GCC's lowering) or 16
// (AVX-512, for head and block sizes that are multiples of 16).
struct V8 {
    typedef v8f T;
    typedef v8i I;
    static constexpr int W = 8;
    static LLMC_INLINE I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7}; }
    static LLMC_INLINE T load(const float* p) { return load8(p); }
    static LLMC_INLINE void store(float* p, T v) { store8(p, v); }
    static LLMC_INLINE T bcast(float x) { return bcast8(x); }
    static LLMC_INLINE T hsum(const T a[8]) { return hsum8x8(a); }
};
struct V16 {
    typedef v16f T;
    typedef v16i I;
    static constexpr int W = 16;
    static LLMC_INLINE I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
    static LLMC_INLINE T load(const float* p) { return *reinterpret_cast<const v16fu*>(p); }
    static LLMC_INLINE void store(float* p, T v) { *reinterpret_cast<v16fu*>(p) = v; }
    static LLMC_INLINE T bcast(float x) { return T{} + x; }
    static LLMC_INLINE T hsum(const T a[16]) { return hsum16x16(a); }
    // 16 float16 values -> float32 (VCVTPH2PS, AVX-512F). asm, because this helper has no target attribute of
    // its own: it is only ever inlined into the AVX-512 loop, where the intrinsic's target would be allowed.
    static LLMC_INLINE T load_half(const uint16_t* p) {
        T r;
        asm("vcvtph2ps %1, %0" : "=v"(r) : "m"(*reinterpret_cast<const char(*)[32]>(p)));
        return r;
    }
};

// A row of the cache (or of a float32 copy of it) as vectors: float32 as is, float16 converted on load (only
// at width 16: the AVX2 path converts each block into a float32 scratch first, F16C being optional there).
template <typename V>
LLMC_INLINE typename V::T load_row(const float* p) { return V::load(p); }
template <typename V>
LLMC_INLINE typename V::T load_row(const uint16_t* p) { return V::load_half(p); }

// The block's whole-vector online-softmax step, as softmax_block computes it (same max, same exp_nonpos,
// the sum in another order): lanes outside [j0, j1] weigh exactly 0. bs % W == 0.
template <typename V>
LLMC_INLINE typename V::T exp_nonpos_v(typename V::T x) {
    return llmc::exp_nonpos_t<typename V::T, typename V::I>(x);
}

template <typename V>
LLMC_INLINE void softmax_block_v(float* __restrict s, int64_t bs, int64_t j0, int64_t j1, float& m, float& l,
                                 float* __restrict acc, int64_t D) {
    typedef typename V::T T;
    typedef typename V::I I;
    constexpr int W = V::W;
    const float ninf = -std::numeric_limits<float>::infinity();
    T vmax = T{} + ninf;
    for (int64_t c = 0; c < bs; c += W) {
        const I idx = V::iota() + static_cast<int32_t>(c);
        const T v = V::load(s + c);
        vmax = (idx >= static_cast<int32_t>(j0)) & (idx <= static_cast<int32_t>(j1)) & (v > vmax) ? v : vmax;
    }
    float bmax = ninf;
    for (int i = 0; i < W; ++i) bmax = std::max(bmax, vmax[i]);
    if (bmax > m) {
        const float alpha = std::exp(m - bmax);  // exp(-inf) = 0 on the head's first block
        l *= alpha;
        for (int64_t d = 0; d < D; d += W) V::store(acc + d, V::load(acc + d) * alpha);
        m = bmax;
    }
    const float mm = m;
    T vsum = T{};
    for (int64_t c = 0; c < bs; c += W) {
        const I idx = V::iota() + static_cast<int32_t>(c);
        const T e = exp_nonpos_v<V>(V::load(s + c) - mm);
        const T w = (idx >= static_cast<int32_t>(j0)) & (idx <= static_cast<int32_t>(j1)) ? e : T{};
        V::store(s + c, w);
        vsum += w;
    }
    float lsum = 0.0f;
    for (int i = 0; i < W; ++i) lsum += vsum[i];
    l += lsum;
}

// S[m, j] = Q[m] . K[j] for M query vectors and the block's bs keys (bs % W == 0, D % W == 0). DC: D known
// at compile time (0: use D), so that the K rows' offsets are immediates instead of pointers in registers.
template <typename V, int DC = 0, typename R = float>
LLMC_INLINE void tile_scores(const float* __restrict Q, int64_t M, const R* __restrict kb, int64_t D_, int64_t bs,
                             float* __restrict S) {
    constexpr int W = V::W;
    const int64_t D = DC ? DC : D_;
    for (int64_t j = 0; j < bs; j += W) {
        const R* k = kb + j * D;
        for (int64_t m = 0; m < M; ++m) {
            const float* q = Q + m * D;
            typename V::T a[W] = {};
            for (int64_t d = 0; d < D; d += W) {
                const typename V::T qv = V::load(q + d);
                for (int i = 0; i < W; ++i) a[i] += qv * load_row<V>(k + i * D + d);
            }
            V::store(S + m * bs + j, V::hsum(a));
        }
    }
}

// acc[h, 0, W*K) += sum_j p[h, j] * V[j, 0, W*K) for j in [j0, j1] and NH query heads at once (p rows of
// stride bs, acc rows of stride D), the accumulators in registers. Every V row is loaded once for all the
// heads, and the NH*K accumulators are independent chains: one head at a time left K chains of j1 - j0 + 1
// dependent multiply-adds, bound by their latency (~1 per cycle where 2 could issue; a third of decode's
// attention time). Each accumulator still adds its products in j order, so the sums are the same.
template <typename V, int NH, int K, typename R>
LLMC_INLINE void tile_pv_chunk(float* __restrict acc, int64_t D, const float* __restrict pr, int64_t bs,
                               const R* __restrict vb, int64_t j0, int64_t j1) {
    constexpr int W = V::W;
    typename V::T a[NH][K];
    for (int h = 0; h < NH; ++h) {
        for (int k = 0; k < K; ++k) a[h][k] = V::load(acc + h * D + W * k);
    }
    for (int64_t j = j0; j <= j1; ++j) {
        const R* v = vb + j * D;
        typename V::T vv[K];
        for (int k = 0; k < K; ++k) vv[k] = load_row<V>(v + W * k);
        for (int h = 0; h < NH; ++h) {
            const typename V::T pb = V::bcast(pr[h * bs + j]);
            for (int k = 0; k < K; ++k) a[h][k] += pb * vv[k];
        }
    }
    for (int h = 0; h < NH; ++h) {
        for (int k = 0; k < K; ++k) V::store(acc + h * D + W * k, a[h][k]);
    }
}

// Columns in chunks of up to 4 vectors: NH * 4 accumulators + 4 V vectors fit the register file (NH <= 4 with
// AVX-512's 32, NH <= 2 with AVX2's 16).
template <typename V, int NH, int DC = 0, typename R = float>
LLMC_INLINE void tile_pv_n(float* acc, int64_t D_, const float* pr, int64_t bs, const R* vb, int64_t j0,
                           int64_t j1) {
    constexpr int W = V::W;
    const int64_t D = DC ? DC : D_;
    for (int64_t c = 0; c < D; c += 4 * W) {
        switch (std::min<int64_t>(4, (D - c) / W)) {
            case 1: tile_pv_chunk<V, NH, 1, R>(acc + c, D, pr, bs, vb + c, j0, j1); break;
            case 2: tile_pv_chunk<V, NH, 2, R>(acc + c, D, pr, bs, vb + c, j0, j1); break;
            case 3: tile_pv_chunk<V, NH, 3, R>(acc + c, D, pr, bs, vb + c, j0, j1); break;
            default: tile_pv_chunk<V, NH, 4, R>(acc + c, D, pr, bs, vb + c, j0, j1); break;
        }
    }
}

// P.V for `nh` query heads that see the same keys [j0, j1] of the block (one query row's group).
template <typename V, int DC = 0, typename R = float>
LLMC_INLINE void tile_pv(float* acc, int64_t D, const float* pr, int64_t bs, const R* vb, int64_t nh, int64_t j0,
                         int64_t j1) {
    constexpr int kMaxHeads = V::W == 16 ? 4 : 2;
    int64_t h = 0;
    for (; h + kMaxHeads <= nh; h += kMaxHeads) tile_pv_n<V, kMaxHeads, DC, R>(acc + h * D, D, pr + h * bs, bs, vb, j0, j1);
    switch (nh - h) {
        case 0: break;
        case 1: tile_pv_n<V, 1, DC, R>(acc + h * D, D, pr + h * bs, bs, vb, j0, j1); break;
        case 2: tile_pv_n<V, 2, DC, R>(acc + h * D, D, pr + h * bs, bs, vb, j0, j1); break;
        default: tile_pv_n<V, 3, DC, R>(acc + h * D, D, pr + h * bs, bs, vb, j0, j1); break;
    }
}

struct TileItem {
    int64_t seq, kvh;
    int64_t t0, nrows;       // query rows [t0, t0 + nrows) of the sequence, consecutive positions
    int64_t pos0;            // position of row t0
    int64_t b_begin, b_end;  // block indices (into the sequence's table), [begin, end)
    int64_t part;            // -1: write the output; else float offset of this item's partial result
};

struct TileMerge {
    int64_t t0, nrows, kvh, off0, nparts;  // parts are nrows * group * (D + 2) floats each, adjacent
};

struct TileScratch {  // sized by thread_tile_scratch()
    std::vector<float> q, s, acc, m, l, ktile, vtile;
};

template <typename CacheT, typename V = V8>
LLMC_INLINE void attend(const Problem& p, const TileItem& it, TileScratch& sc) {
    constexpr bool kHalf = std::is_same<CacheT, uint16_t>::value;
    using RowT = typename std::conditional<kHalf && V::W != 16, float, CacheT>::type;
    const int64_t D = p.head_size, bs = p.block_size, G = p.group, M = it.nrows * G;
    const int64_t* bt = p.block_tables + it.seq * p.bt_row;
    const CacheT* kc = static_cast<const CacheT*>(p.k_cache);
    const CacheT* vc = static_cast<const CacheT*>(p.v_cache);
    const float scale = p.scale, softcap = p.softcap;
    const int64_t window = p.window, chunk = p.chunk;

    float* __restrict Q = sc.q.data();
    float* __restrict S = sc.s.data();
    float* __restrict acc = sc.acc.data();
    float* __restrict mrow = sc.m.data();
    float* __restrict lrow = sc.l.data();
    for (int64_t r = 0; r < it.nrows; ++r) {
        const float* qr = p.query + (it.t0 + r) * p.q_row + it.kvh * G * D;  // the group's heads are adjacent
        for (int64_t e = 0; e < G * D; ++e) Q[r * G * D + e] = qr[e] * scale;
    }
    for (int64_t e = 0; e < M * D; ++e) acc[e] = 0.0f;
    for (int64_t m = 0; m < M; ++m) {
        mrow[m] = -std::numeric_limits<float>::infinity();
        lrow[m] = 0.0f;
    }

    // Two blocks ahead (the first two asked for here): with the AVX-512 loop a block's compute is
    // shorter than one block's fetch from DRAM (30 layers' pools cycled, decode b32, 2 threads:
    // 472 -> 432 us per call with a float16 cache, 586 -> 497 with float32).
    if (it.b_begin + 1 < it.b_end) prefetch_block(p, bt[it.b_begin + 1], it.kvh, kc, vc);
    for (int64_t bi = it.b_begin; bi < it.b_end; ++bi) {
        const int64_t start = bi * bs, last = start + bs - 1;
        // Rows that see part of this block: pos >= start, (window) pos - window + 1 <= last and (chunk)
        // floor(pos / chunk) * chunk <= last, i.e. pos < (floor(last / chunk) + 1) * chunk.
        int64_t r_lo = std::max<int64_t>(0, start - it.pos0);
        if (p.attend_end != nullptr) {  // rows before the block that reach into it through their span
            for (int64_t r = 0; r < std::min(r_lo, it.nrows); ++r) {
                if (p.attend_end[it.t0 + r] > start) {
                    r_lo = r;
                    break;
                }
            }
        }
        int64_t r_hi = window > 0 ? std::min<int64_t>(it.nrows, last + window - it.pos0) : it.nrows;
        if (chunk > 0) r_hi = std::min<int64_t>(r_hi, (last / chunk + 1) * chunk - it.pos0);
        if (r_lo >= r_hi) continue;

        const int64_t base = ((bt[bi] * p.num_kv_heads + it.kvh) * bs) * D;
        if (bi + 2 < it.b_end) prefetch_block(p, bt[bi + 2], it.kvh, kc, vc);
        // Rows as the loops read them: the cache itself (float32; float16 at width 16, converted on load), or
        // (float16 at width 8) the block converted into float32 scratch, rows past the context included (masked
        // below).
        const RowT* kb;
        const RowT* vb;
        if constexpr (kHalf && V::W != 16) {
            halves_to_floats(kc + base, sc.ktile.data(), bs * D, p.f16c);
            halves_to_floats(vc + base, sc.vtile.data(), bs * D, p.f16c);
            kb = sc.ktile.data();
            vb = sc.vtile.data();
        } else {
            kb = kc + base;
            vb = vc + base;
        }

        if (D == 64) {
            tile_scores<V, 64>(Q + r_lo * G * D, (r_hi - r_lo) * G, kb, D, bs, S + r_lo * G * bs);
        } else {
            tile_scores<V>(Q + r_lo * G * D, (r_hi - r_lo) * G, kb, D, bs, S + r_lo * G * bs);
        }

        for (int64_t r = r_lo; r < r_hi; ++r) {
            const int64_t pos = it.pos0 + r;
            const int64_t lo = first_visible(pos, window, chunk);
            const int64_t j0 = std::max<int64_t>(lo - start, 0);
            // Inclusive; j0 <= j1 by r_lo/r_hi, except for a row before the block (attend_end only) whose span
            // ends before it.
            const int64_t j1 = std::min<int64_t>(last_visible(p.attend_end, it.t0 + r, pos) - start, bs - 1);
            if (j1 < j0) continue;
            for (int64_t m = r * G; m < (r + 1) * G; ++m) {
                float* __restrict sm = S + m * bs;
                if (softcap > 0.0f) {
                    for (int64_t j = j0; j <= j1; ++j) sm[j] = softcap * std::tanh(sm[j] / softcap);
                }
                if (p.alibi != nullptr) {  // slope * (key position - query position), on logical positions
                    const float slope = p.alibi[it.kvh * G + m % G];
                    for (int64_t j = j0; j <= j1; ++j) sm[j] += slope * static_cast<float>(start + j - pos);
                }
                // 8 lanes at every width: GCC's 16-lane selects and lane reductions measured slower here.
                softmax_block_v<V8>(sm, bs, j0, j1, mrow[m], lrow[m], acc + m * D, D);
            }
            // The row's G heads see the same keys: their P.V runs together.
            if (D == 64) {
                tile_pv<V, 64>(acc + r * G * D, D, S + r * G * bs, bs, vb, G, j0, j1);
            } else {
                tile_pv<V>(acc + r * G * D, D, S + r * G * bs, bs, vb, G, j0, j1);
            }
        }
    }

    if (it.part < 0) {
        for (int64_t m = 0; m < M; ++m) {
            float* o = p.out + (it.t0 + m / G) * (p.num_heads * D) + (it.kvh * G + m % G) * D;
            // l >= 1: the row always sees its own position
            const float inv = normaliser(mrow[m], lrow[m], p.sinks, it.kvh * G + m % G);
            const float* am = acc + m * D;
            for (int64_t d = 0; d < D; d += 8) store8(o + d, load8(am + d) * inv);
        }
    } else {
        float* dst = p.partials + it.part;
        std::memcpy(dst, mrow, sizeof(float) * M);
        std::memcpy(dst + M, lrow, sizeof(float) * M);
        std::memcpy(dst + 2 * M, acc, sizeof(float) * M * D);
    }
}

// Merge the partial results of one (row tile, KV head) split into several block ranges. A part
// that saw none of a row's positions holds m = -inf, l = 0 for it and weighs exp(-inf) = 0.
void merge_tile_parts(const Problem& p, const TileMerge& mg) {
    const int64_t G = p.group, D = p.head_size, M = mg.nrows * G, stride = M * (D + 2);
    for (int64_t m = 0; m < M; ++m) {
        float* og = p.out + (mg.t0 + m / G) * (p.num_heads * D) + (mg.kvh * G + m % G) * D;
        float mmax = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < mg.nparts; ++c) mmax = std::max(mmax, p.partials[mg.off0 + c * stride + m]);
        float lsum = 0.0f;
        for (int64_t d = 0; d < D; ++d) og[d] = 0.0f;
        for (int64_t c = 0; c < mg.nparts; ++c) {
            const float* part = p.partials + mg.off0 + c * stride;
            const float w = std::exp(part[m] - mmax);
            lsum += w * part[M + m];
            const float* ac = part + 2 * M + m * D;
            for (int64_t d = 0; d < D; ++d) og[d] += w * ac[d];
        }
        // The sink joins the merged denominator once (parts hold plain partial sums).
        const float inv = normaliser(mmax, lsum, p.sinks, mg.kvh * G + m % G);
        for (int64_t d = 0; d < D; ++d) og[d] *= inv;
    }
}

// Instruction sets of the attention loops, in order: the x86-64-v2 baseline, AVX2+FMA, and AVX-512
// (the tiled loop at width 16, for head and block sizes that are multiples of 16; other shapes and the
// per-row loop run the AVX2 code there).
enum Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// Each path's attention loop compiled once per instruction set.
template <typename CacheT, typename ItemT, typename ScratchT>
void attend_base(const Problem& p, const ItemT& i, ScratchT& s) { attend<CacheT>(p, i, s); }
template <typename CacheT, typename ItemT, typename ScratchT>
__attribute__((target("avx2,fma"))) void attend_avx2(const Problem& p, const ItemT& i, ScratchT& s) {
    attend<CacheT>(p, i, s);
}
template <typename CacheT>
__attribute__((target("avx512f,avx2,fma"))) void attend_avx512(const Problem& p, const TileItem& i, TileScratch& s) {
    attend<CacheT, V16>(p, i, s);
}

template <typename ItemT, typename ScratchT>
using AttendFn = void (*)(const Problem&, const ItemT&, ScratchT&);

// The loop for this call's cache type (float16 or float32) and instruction set.
template <typename ItemT, typename ScratchT>
AttendFn<ItemT, ScratchT> pick_attend(bool half, Isa isa) {
    if constexpr (std::is_same<ItemT, TileItem>::value) {
        if (isa == kAvx512) return half ? attend_avx512<uint16_t> : attend_avx512<float>;
    }
    if (half) return isa >= kAvx2 ? attend_avx2<uint16_t, ItemT, ScratchT> : attend_base<uint16_t, ItemT, ScratchT>;
    return isa >= kAvx2 ? attend_avx2<float, ItemT, ScratchT> : attend_base<float, ItemT, ScratchT>;
}

// The best instruction set this CPU (and OS) runs.
Isa best_isa() { return static_cast<Isa>(llmc::cpu::vector_level()); }

bool cpu_has_f16c() {
    static const bool has = llmc::cpu::has_f16c();
    return has;
}

// Below this much work (attended positions x query heads x head size, ~50 µs on one core of the
// tiled path here) waking the other threads (passive wait, see cpu.py) costs more than it saves:
// measured by benchmarks/bench_paged_attention_cpu.py, 1 thread vs 2.
constexpr int64_t kParallelMinWork = 1 << 21;
// The same on ONNX Runtime's pool (ParallelFor): its workers cost less to hand work to. Measured on
// the 110M Llama (2 threads, decode b8 at 128-256 context, ~0.9M per layer): 2^19 gave 720 tok/s,
// 2^21 (serial there) 520, 2^17 590-700.
constexpr int64_t kParallelMinWorkPool = int64_t{1} << 19;
// Rows are split into block ranges until a step has about this many items (for any thread count
// up to it), but never into ranges shorter than kMinChunkPositions.
constexpr int64_t kTargetItems = 32;
constexpr int64_t kMinChunkPositions = 128;

[[noreturn]] inline void fail(const std::string& msg) { throw Error(msg); }

// One call's operands. Row strides are in elements; caches are contiguous.
struct Args {
    const float* query;  // [T, num_heads * head_size] rows, q_row apart
    const float* key;    // [T, num_kv_heads * head_size] rows, k_row apart
    const float* value;  // [T, num_kv_heads * head_size] rows, v_row apart
    int64_t q_row, k_row, v_row;
    int64_t T;
    const int64_t* slot_mapping;  // [T]
    const int64_t* block_tables;  // [bt_rows, bt_cols]
    int64_t bt_rows, bt_cols;
    const int64_t* context_lens;     // [S]
    const int64_t* query_start_loc;  // [S + 1]
    int64_t S;
    void* k_cache;  // [num_blocks, num_kv_heads, block_size, head_size]
    void* v_cache;
    bool half;  // caches hold float16 (else float32)
    int64_t num_blocks, block_size, head_size;
    float* out;  // [T, num_heads * head_size], contiguous; rows outside every sequence are zeroed
    int64_t num_heads, num_kv_heads;
    float scale;
    int64_t sliding_window;  // <= 0: none
    float softcap;           // <= 0: none
    const float* sinks = nullptr;  // [num_heads] attention-sink logits (float32), or nullptr: none
    float alibi_max_bias = 0.0f;   // > 0: ALiBi with the standard slopes of this maximum bias (8: the paper's)
    int64_t attention_chunk = 0;   // > 0: chunked local attention in chunks of this many positions
    // [T] int64, or nullptr: row t (at position p) also sees keys p < k < attend_end[t] of its sequence; every
    // value must be <= its sequence's context_lens (checked).
    const int64_t* attend_end = nullptr;
    // Rotary position embedding, rotate-half form (RotaryPagedAttention): row t of query and key is
    // rotated by cos/sin row t, [T, head_size / 2] rows rot_row apart, before anything else; nullptr: none.
    const float* rot_cos = nullptr;
    const float* rot_sin = nullptr;
    int64_t rot_row = 0;
};

// y = x rotated by one row of angles, rotate-half (GPT-NeoX) form, as ONNX's RotaryEmbedding with
// interleaved = 0: y[i] = x[i] cos[i] - x[i + half] sin[i], y[i + half] = x[i + half] cos[i] + x[i] sin[i]
// for i < half. Rounded exactly as ONNX Runtime's kernel rounds on the same CPU, so that fusing rotary
// into attention changes no bit: its AVX2 path (MLAS) computes fma(x[i], cos, -(x[i+half] sin)) and
// fma(x[i], sin, x[i+half] cos); without AVX2 it takes plain products and sums (this unit is built
// for x86-64-v2, where nothing is contracted into an FMA).
void rotate_half(const float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t half,
                 float* __restrict y) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        y[i] = a * c[i] - b * s[i];
        y[i + half] = b * c[i] + a * s[i];
    }
}

__attribute__((target("avx2,fma"))) void rotate_half_fma(const float* __restrict x, const float* __restrict c,
                                                         const float* __restrict s, int64_t half,
                                                         float* __restrict y) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        y[i] = __builtin_fmaf(a, c[i], -(b * s[i]));
        y[i + half] = __builtin_fmaf(a, s[i], b * c[i]);
    }
}

// Check the head counts against each other and the cache's KV heads (before any other check).
inline void check_heads(int64_t num_heads, int64_t num_kv_heads) {
    if (num_heads <= 0 || num_kv_heads <= 0) {
        fail("num_heads and num_kv_heads must be positive, got " + std::to_string(num_heads) + " and " +
             std::to_string(num_kv_heads));
    }
    if (num_heads % num_kv_heads != 0) {
        fail("num_heads (" + std::to_string(num_heads) + ") must be a multiple of num_kv_heads (" +
             std::to_string(num_kv_heads) + ")");
    }
}

using ParallelFor = llmc::ParallelFor;  // ../../csrc/parallel_for.h

// This thread's tile scratch, grown to at least the given sizes (reused across calls, so a step
// allocates nothing on either the OpenMP or the ONNX Runtime pool path).
TileScratch& thread_tile_scratch(int64_t max_q, int64_t d, int64_t bs, bool half) {
    thread_local TileScratch sc;
    auto grow = [](std::vector<float>& v, int64_t n) {
        if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    grow(sc.q, max_q * d);
    grow(sc.s, max_q * bs);
    grow(sc.acc, max_q * d);
    grow(sc.m, max_q);
    grow(sc.l, max_q);
    if (half) {
        grow(sc.ktile, bs * d);
        grow(sc.vtile, bs * d);
    }
    return sc;
}

// Validate every index, then write the new K/V and attend. Throws Error before touching anything.
// `nthreads` threads at most (1: this thread only); with `pf` (and nthreads > 1) the tiled path runs
// on the caller's parallel loop, else on OpenMP. `isa` picks the attention loops' instruction set (the
// caller checks that the CPU has it). Results do not depend on the threads (see "Attention work items").
inline void run(const Args& a, int nthreads, Isa isa, const ParallelFor* pf = nullptr) {
    const bool avx2 = isa >= kAvx2;
    const int64_t T = a.T, S = a.S, D = a.head_size, block_size = a.block_size, num_blocks = a.num_blocks;
    const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, sliding_window = a.sliding_window;
    const int64_t max_blocks = a.bt_cols;
    const int64_t* slot_p = a.slot_mapping;
    const int64_t* bt_p = a.block_tables;
    const int64_t* ctx_p = a.context_lens;
    const int64_t* qsl_p = a.query_start_loc;

    if (a.rot_cos != nullptr && D % 2 != 0) {
        fail("rotary embedding needs an even head_size, got " + std::to_string(D));
    }
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t t = 0; t < T; ++t) {
        if (slot_p[t] >= num_slots) {
            fail("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot_p[t]) +
                 " is out of range for a cache of " + std::to_string(num_blocks) + " blocks of " +
                 std::to_string(block_size) + " slots (must be < " + std::to_string(num_slots) + ", or < 0 to skip)");
        }
    }
    if (qsl_p[0] < 0) fail("query_start_loc[0] must be >= 0, got " + std::to_string(qsl_p[0]));
    if (qsl_p[S] > T) {
        fail("query_start_loc[-1] = " + std::to_string(qsl_p[S]) + " exceeds the number of query rows (" +
             std::to_string(T) + ")");
    }
    struct Row {
        int64_t t, seq, pos;
    };
    std::vector<Row> rows;
    int64_t total_work = 0;  // attended positions, summed over rows
    for (int64_t s = 0; s < S; ++s) {
        const int64_t start = qsl_p[s], end = qsl_p[s + 1];
        const int64_t ctx = ctx_p[s];
        const std::string where = "sequence " + std::to_string(s) + ": ";
        if (end < start) {
            fail(where + "query_start_loc must be non-decreasing, got query_start_loc[" + std::to_string(s) +
                 "] = " + std::to_string(start) + " > query_start_loc[" + std::to_string(s + 1) +
                 "] = " + std::to_string(end));
        }
        if (ctx < 0) fail(where + "context_lens must be >= 0, got " + std::to_string(ctx));
        const int64_t n_new = end - start;
        if (n_new == 0) continue;  // not attended (as in the reference): its table is not read
        if (n_new > ctx) {
            fail(where + std::to_string(n_new) + " new tokens but context_lens = " + std::to_string(ctx) +
                 " (context_lens counts the cached tokens after this step's writes, so it must be >= the new tokens)");
        }
        const int64_t nb = (ctx + block_size - 1) / block_size;
        if (nb > max_blocks) {
            fail(where + "context_lens = " + std::to_string(ctx) + " needs " + std::to_string(nb) +
                 " blocks of " + std::to_string(block_size) + " but block_tables has only " +
                 std::to_string(max_blocks) + " columns");
        }
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t blk = bt_p[s * max_blocks + b];
            if (blk < 0 || blk >= num_blocks) {
                fail(where + "block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                     std::to_string(blk) + " is not a block of the cache (0 <= block < " +
                     std::to_string(num_blocks) + ")");
            }
        }
        for (int64_t i = 0; i < n_new; ++i) {
            const int64_t pos = ctx - n_new + i;
            if (a.attend_end != nullptr && a.attend_end[start + i] > ctx) {
                fail(where + "attend_end[" + std::to_string(start + i) + "] = " + std::to_string(a.attend_end[start + i]) +
                     " exceeds context_lens = " + std::to_string(ctx) +
                     " (a row may only see keys in the cache after this step's writes)");
            }
            rows.push_back({start + i, s, pos});
            total_work += last_visible(a.attend_end, start + i, pos) + 1 -
                          first_visible(pos, sliding_window, a.attention_chunk);
        }
    }

    // --- output: rows outside every sequence stay zero, as in the reference
    float* out_p = a.out;
    {
        std::vector<char> covered(static_cast<size_t>(T), 0);
        for (const Row& r : rows) covered[r.t] = 1;
        for (int64_t t = 0; t < T; ++t) {
            if (!covered[t]) std::memset(out_p + t * num_heads * D, 0, sizeof(float) * num_heads * D);
        }
    }

    // --- work items: (row, KV head, block range); see "Attention work items" above
    const int64_t group = num_heads / num_kv_heads;
    const int64_t base_items = static_cast<int64_t>(rows.size()) * num_kv_heads;
    const int64_t want_splits = base_items > 0 ? std::max<int64_t>(1, (kTargetItems + base_items - 1) / base_items) : 1;
    const int64_t min_chunk_blocks = std::max<int64_t>(1, (kMinChunkPositions + block_size - 1) / block_size);
    std::vector<Item> items;
    std::vector<Merge> merges;
    int64_t n_parts = 0;
    // The tiled path (below) serves head and block sizes that are multiples of 8.
    const bool tiled = D % 8 == 0 && block_size % 8 == 0;
    if (!tiled) {  // per-row items: the path for other head and block sizes
        items.reserve(static_cast<size_t>(base_items));
        for (const Row& r : rows) {
            const int64_t lo = first_visible(r.pos, sliding_window, a.attention_chunk);
            const int64_t b_lo = lo / block_size;
            const int64_t b_hi = last_visible(a.attend_end, r.t, r.pos) / block_size + 1;  // [b_lo, b_hi)
            const int64_t nblk = b_hi - b_lo;
            const int64_t nchunks = std::max<int64_t>(1, std::min(want_splits, nblk / min_chunk_blocks));
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
                if (nchunks == 1) {
                    items.push_back({r.t, r.seq, r.pos, kvh, b_lo, b_hi, -1});
                    continue;
                }
                merges.push_back({r.t, kvh, n_parts, nchunks});
                for (int64_t c = 0; c < nchunks; ++c) {
                    items.push_back({r.t, r.seq, r.pos, kvh, b_lo + nblk * c / nchunks,
                                     b_lo + nblk * (c + 1) / nchunks, n_parts++});
                }
            }
        }
    }
    // The tiled path's items: tiles of consecutive rows of one sequence, split like the rows above.
    const int64_t tile_rows = std::max<int64_t>(1, kTileQueries / group);
    std::vector<TileItem> tiles;
    std::vector<TileMerge> tile_merges;
    int64_t tile_floats = 0;
    if (tiled) {
        std::vector<TileItem> bare;  // (seq, -, t0, nrows, pos0, b_lo, b_hi) per tile, before the KV-head / split fan-out
        for (int64_t s = 0; s < S; ++s) {
            const int64_t start = qsl_p[s], n_new = qsl_p[s + 1] - start;
            for (int64_t r0 = 0; r0 < n_new; r0 += tile_rows) {
                const int64_t nrows = std::min(tile_rows, n_new - r0);
                const int64_t pos0 = ctx_p[s] - n_new + r0;
                int64_t pos_last = pos0 + nrows - 1;  // the last key any row of the tile sees
                for (int64_t r = 0; a.attend_end != nullptr && r < nrows; ++r) {
                    pos_last = std::max(pos_last, last_visible(a.attend_end, start + r0 + r, pos0 + r));
                }
                const int64_t lo = first_visible(pos0, sliding_window, a.attention_chunk);
                bare.push_back({s, 0, start + r0, nrows, pos0, lo / block_size, pos_last / block_size + 1, -1});
            }
        }
        const int64_t n_base = static_cast<int64_t>(bare.size()) * num_kv_heads;
        const int64_t splits = n_base > 0 ? std::max<int64_t>(1, (kTargetItems + n_base - 1) / n_base) : 1;
        for (const TileItem& b : bare) {
            const int64_t nblk = b.b_end - b.b_begin;
            const int64_t nchunks = std::max<int64_t>(1, std::min(splits, nblk / min_chunk_blocks));
            const int64_t part_floats = b.nrows * group * (D + 2);
            for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
                TileItem it = b;
                it.kvh = kvh;
                if (nchunks == 1) {
                    tiles.push_back(it);
                    continue;
                }
                tile_merges.push_back({b.t0, b.nrows, kvh, tile_floats, nchunks});
                for (int64_t c = 0; c < nchunks; ++c) {
                    it.b_begin = b.b_begin + nblk * c / nchunks;
                    it.b_end = b.b_begin + nblk * (c + 1) / nchunks;
                    it.part = tile_floats;
                    tile_floats += part_floats;
                    tiles.push_back(it);
                }
            }
        }
    }
    std::vector<float> partials(static_cast<size_t>(tiled ? tile_floats : n_parts * group * (D + 2)));

    // Rotary: the rotated queries go to this thread's buffer (reused across calls), the keys are
    // rotated on their way into the cache (step 1).
    const bool rotary = a.rot_cos != nullptr;
    const int64_t half_d = D / 2;
    const auto rotate = avx2 ? rotate_half_fma : rotate_half;
    thread_local std::vector<float> q_rotated;
    if (rotary) {
        if (static_cast<int64_t>(q_rotated.size()) < T * num_heads * D) q_rotated.resize(static_cast<size_t>(T * num_heads * D));
        for (int64_t t = 0; t < T; ++t) {
            const float* c = a.rot_cos + t * a.rot_row;
            const float* sn = a.rot_sin + t * a.rot_row;
            for (int64_t h = 0; h < num_heads; ++h) {
                rotate(a.query + t * a.q_row + h * D, c, sn, half_d, q_rotated.data() + (t * num_heads + h) * D);
            }
        }
    }

    Problem p{};
    p.query = rotary ? q_rotated.data() : a.query;
    p.q_row = rotary ? num_heads * D : a.q_row;
    p.k_cache = a.k_cache;
    p.v_cache = a.v_cache;
    p.block_tables = bt_p;
    p.bt_row = max_blocks;
    p.out = out_p;
    p.partials = partials.data();
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.group = group;
    p.head_size = D;
    p.block_size = block_size;
    p.scale = a.scale;
    p.softcap = a.softcap;
    p.window = sliding_window;
    p.chunk = a.attention_chunk;
    p.sinks = a.sinks;
    p.attend_end = a.attend_end;
    const std::vector<float> slopes = a.alibi_max_bias > 0.0f ? alibi_slopes(num_heads, a.alibi_max_bias)
                                                              : std::vector<float>();
    p.alibi = slopes.empty() ? nullptr : slopes.data();
    p.f16c = avx2 && a.half && cpu_has_f16c();

    const bool half = a.half;
    const float* key_p = a.key;
    const float* value_p = a.value;
    const int64_t k_row = a.k_row, v_row = a.v_row;
    void* kc_p = a.k_cache;
    void* vc_p = a.v_cache;
    const auto fn = pick_attend<Item, Scratch>(half, isa);
    const int64_t n_items = static_cast<int64_t>(items.size());
    const int64_t n_merges = static_cast<int64_t>(merges.size());
    const Item* items_p = items.data();
    const Merge* merges_p = merges.data();
    const bool parallel = nthreads > 1 && total_work * num_heads * D >= (pf ? kParallelMinWorkPool : kParallelMinWork);

    // 1. Write K/V. Parallel over KV heads only: each head's rows go in row order, so a
    //    repeated slot ends with the last row's data, as in the reference.
    const bool par_write = nthreads > 1 && T * num_kv_heads * D >= kParallelMinWork;
    const bool write_f16c = half && avx2 && cpu_has_f16c();  // the baseline ISA (a testing hook) keeps the scalar code
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par_write)
    for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
        thread_local std::vector<float> k_rotated;  // one row, reused across calls: no allocation per step
        if (rotary && static_cast<int64_t>(k_rotated.size()) < D) k_rotated.resize(static_cast<size_t>(D));
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = slot_p[t];
            if (slot < 0) continue;
            const int64_t dst = ((slot / block_size * num_kv_heads + kh) * block_size + slot % block_size) * D;
            const float* ks = key_p + t * k_row + kh * D;
            if (rotary) {
                rotate(ks, a.rot_cos + t * a.rot_row, a.rot_sin + t * a.rot_row, half_d, k_rotated.data());
                ks = k_rotated.data();
            }
            const float* vs = value_p + t * v_row + kh * D;
            if (half) {
                uint16_t* kd = static_cast<uint16_t*>(kc_p) + dst;
                uint16_t* vd = static_cast<uint16_t*>(vc_p) + dst;
                floats_to_halves(ks, kd, D, write_f16c);
                floats_to_halves(vs, vd, D, write_f16c);
            } else {
                std::memcpy(static_cast<float*>(kc_p) + dst, ks, sizeof(float) * D);
                std::memcpy(static_cast<float*>(vc_p) + dst, vs, sizeof(float) * D);
            }
        }
    }

    // 2. Attend.
    if (tiled) {
        const Isa tile_isa = isa == kAvx512 && (D % 16 != 0 || block_size % 16 != 0) ? kAvx2 : isa;
        const auto tfn = pick_attend<TileItem, TileScratch>(half, tile_isa);
        const int64_t n_tiles = static_cast<int64_t>(tiles.size());
        const int64_t n_tmerges = static_cast<int64_t>(tile_merges.size());
        const TileItem* tiles_p = tiles.data();
        const TileMerge* tmerges_p = tile_merges.data();
        const int64_t max_q = std::min(tile_rows, std::max<int64_t>(T, 1)) * group;
        if (pf != nullptr && parallel) {
            struct Work {
                const Problem* p;
                const TileItem* tiles;
                const TileMerge* merges;
                AttendFn<TileItem, TileScratch> fn;
                int64_t max_q, D, bs;
                bool half;
            } w{&p, tiles_p, tmerges_p, tfn, max_q, D, block_size, half};
            pf->fn(pf->self, n_tiles, [](void* arg, int64_t i) {
                const Work& x = *static_cast<const Work*>(arg);
                x.fn(*x.p, x.tiles[i], thread_tile_scratch(x.max_q, x.D, x.bs, x.half));
            }, &w);
            if (n_tmerges > 0) {
                pf->fn(pf->self, n_tmerges, [](void* arg, int64_t i) {
                    const Work& x = *static_cast<const Work*>(arg);
                    merge_tile_parts(*x.p, x.merges[i]);
                }, &w);
            }
            return;
        }
#pragma omp parallel num_threads(nthreads) if (parallel)
        {
            TileScratch& sc = thread_tile_scratch(max_q, D, block_size, half);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_tiles; ++i) tfn(p, tiles_p[i], sc);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n_tmerges; ++i) merge_tile_parts(p, tmerges_p[i]);
        }
        return;
    }
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        Scratch sc(group, D, block_size, half);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i) fn(p, items_p[i], sc);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_merges; ++i) {  // a row's parts are a one-row tile's (same layout)
            const Merge& mg = merges_p[i];
            merge_tile_parts(p, {mg.t, 1, mg.kvh, mg.part0 * group * (D + 2), mg.nparts});
        }
    }
}

}  // namespace
}  // namespace llmc_pa
