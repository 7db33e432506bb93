// PagedAttention CPU kernel core, shared by the pybind11 module (paged_attention_cpu.cpp, the
// llmc.plugins.paged_attention._cpu extension) and the native ONNX Runtime custom-op library
// (ort_paged_attention.cpp). It works on raw pointers only: no Python, no ONNX Runtime types.
//
// Semantics are those of llmc/plugins/paged_attention/reference.py (normative):
//   1. every new token's K and V row is written into its cache slot, in place, in row order
//      (slot < 0 = padding, no write; a repeated slot keeps the last row, as in the reference);
//   2. every query row of a sequence attends causally (optionally within a sliding window,
//      optionally with a tanh soft-cap on the scores) to the sequence's cached positions,
//      query head h reading KV head h / (num_heads / num_kv_heads).
//
// Caches are [num_blocks, num_kv_heads, block_size, head_size], float32 (or float16, converted
// with round-to-nearest-even on write, as numpy does), owned by the caller and never copied.
//
// Compute: one work item per (query row, KV head, block range), distributed over OpenMP threads.
// Each item runs an online-softmax (flash-decoding style) loop over the sequence's blocks with
// float32 accumulation. Every index is validated (run() throws llmc_pa::Error, a
// std::invalid_argument, naming the bad value) before the first write, so an error leaves the
// caches untouched and no index is ever read out of bounds.
//
// Each including translation unit gets its own copy (everything is in an unnamed namespace):
// the two libraries share the code, not state.

#pragma once

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

// exp(x) for x <= 0, vectorisable (no libm call): Cody-Waite range reduction and the Cephes
// expf polynomial, about 1 ulp. Arguments below -87.3 (results below 1e-38, which cannot
// change a sum that is >= 1) are clamped so that 2^n stays a normal float.
LLMC_INLINE float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    return y * __builtin_bit_cast(float, e);
}

template <typename CacheT>
LLMC_INLINE void attend_item_impl(const Problem& p, const Item& it, Scratch& sc) {
    constexpr bool kHalf = std::is_same<CacheT, uint16_t>::value;
    const int64_t D = p.head_size, bs = p.block_size, G = p.group;
    const float* __restrict q = p.query + it.t * p.q_row + it.kvh * G * D;  // the group's heads are adjacent
    const int64_t* bt = p.block_tables + it.seq * p.bt_row;
    const CacheT* kc = static_cast<const CacheT*>(p.k_cache);
    const CacheT* vc = static_cast<const CacheT*>(p.v_cache);

    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, it.pos - p.window + 1) : 0;
    const int64_t hi = it.pos;  // inclusive
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

        if (bi + 1 < it.b_end) {  // blocks are scattered in memory: fetch the next one ahead
            const int64_t next = ((bt[bi + 1] * p.num_kv_heads + it.kvh) * bs) * D;
            const char* kn = reinterpret_cast<const char*>(kc + next);
            const char* vn = reinterpret_cast<const char*>(vc + next);
            const int64_t bytes = bs * D * static_cast<int64_t>(sizeof(CacheT));
            for (int64_t off = 0; off < bytes; off += 64) {
                __builtin_prefetch(kn + off);
                __builtin_prefetch(vn + off);
            }
        }

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
            float bmax = -std::numeric_limits<float>::infinity();
            for (j = j0; j <= j1; ++j) bmax = std::max(bmax, sg[j]);

            // Online softmax: rescale what we have to the new running max, then accumulate.
            if (bmax > m[g]) {
                const float alpha = std::exp(m[g] - bmax);  // exp(-inf) = 0 on the first block
                l[g] *= alpha;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
                m[g] = bmax;
            }
            const float mg = m[g];
            float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
            for (int64_t jj = j0; jj <= j1; ++jj) {
                const float e = exp_nonpos(sg[jj] - mg);
                sg[jj] = e;
                lsum += e;
            }
            l[g] += lsum;
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
            const float inv = 1.0f / l[g];  // l >= 1: the row always sees its own position
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

// Merge the partial results of one (row, KV head) split into several block ranges.
void merge_parts(const Problem& p, const Merge& mg) {
    const int64_t G = p.group, D = p.head_size, stride = G * (D + 2);
    float* o = p.out + mg.t * (p.num_heads * D) + mg.kvh * G * D;
    for (int64_t g = 0; g < G; ++g) {
        float mmax = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < mg.nparts; ++c) mmax = std::max(mmax, p.partials[(mg.part0 + c) * stride + g]);
        float lsum = 0.0f;
        float* og = o + g * D;
        for (int64_t d = 0; d < D; ++d) og[d] = 0.0f;
        for (int64_t c = 0; c < mg.nparts; ++c) {
            const float* part = p.partials + (mg.part0 + c) * stride;
            const float w = std::exp(part[g] - mmax);
            lsum += w * part[G + g];
            const float* ac = part + 2 * G + g * D;
            for (int64_t d = 0; d < D; ++d) og[d] += w * ac[d];
        }
        const float inv = 1.0f / lsum;
        for (int64_t d = 0; d < D; ++d) og[d] *= inv;
    }
}

using ItemFn = void (*)(const Problem&, const Item&, Scratch&);

void item_f32_base(const Problem& p, const Item& i, Scratch& s) { attend_item_impl<float>(p, i, s); }
void item_f16_base(const Problem& p, const Item& i, Scratch& s) { attend_item_impl<uint16_t>(p, i, s); }
__attribute__((target("avx2,fma"))) void item_f32_avx2(const Problem& p, const Item& i, Scratch& s) {
    attend_item_impl<float>(p, i, s);
}
__attribute__((target("avx2,fma"))) void item_f16_avx2(const Problem& p, const Item& i, Scratch& s) {
    attend_item_impl<uint16_t>(p, i, s);
}


bool cpu_has_avx2_fma() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Below this much work (multiply-adds over K and V, ~60 µs on one core here) waking other threads
// (passive wait, see cpu.py) costs more than it saves.
constexpr int64_t kParallelMinWork = 1 << 17;
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
};

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

// Validate every index, then write the new K/V and attend. Throws Error before touching anything.
// `nthreads` OpenMP threads at most; `avx2` picks the AVX2+FMA attention loop (the caller checks
// that the CPU has it).
inline void run(const Args& a, int nthreads, bool avx2) {
    const int64_t T = a.T, S = a.S, D = a.head_size, block_size = a.block_size, num_blocks = a.num_blocks;
    const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, sliding_window = a.sliding_window;
    const int64_t max_blocks = a.bt_cols;
    const int64_t* slot_p = a.slot_mapping;
    const int64_t* bt_p = a.block_tables;
    const int64_t* ctx_p = a.context_lens;
    const int64_t* qsl_p = a.query_start_loc;

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
            rows.push_back({start + i, s, pos});
            total_work += sliding_window > 0 ? std::min<int64_t>(pos + 1, sliding_window) : pos + 1;
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
    items.reserve(static_cast<size_t>(base_items));
    for (const Row& r : rows) {
        const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, r.pos - sliding_window + 1) : 0;
        const int64_t b_lo = lo / block_size, b_hi = r.pos / block_size + 1;  // [b_lo, b_hi)
        const int64_t nblk = b_hi - b_lo;
        const int64_t nchunks = std::max<int64_t>(1, std::min(want_splits, nblk / min_chunk_blocks));
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            if (nchunks == 1) {
                items.push_back({r.t, r.seq, r.pos, kvh, b_lo, b_hi, -1});
                continue;
            }
            merges.push_back({r.t, kvh, n_parts, nchunks});
            for (int64_t c = 0; c < nchunks; ++c) {
                items.push_back({r.t, r.seq, r.pos, kvh, b_lo + nblk * c / nchunks, b_lo + nblk * (c + 1) / nchunks,
                                 n_parts++});
            }
        }
    }
    std::vector<float> partials(static_cast<size_t>(n_parts * group * (D + 2)));

    Problem p{};
    p.query = a.query;
    p.q_row = a.q_row;
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

    const bool half = a.half;
    const float* key_p = a.key;
    const float* value_p = a.value;
    const int64_t k_row = a.k_row, v_row = a.v_row;
    void* kc_p = a.k_cache;
    void* vc_p = a.v_cache;
    const ItemFn fn = half ? (avx2 ? item_f16_avx2 : item_f16_base) : (avx2 ? item_f32_avx2 : item_f32_base);
    const int64_t n_items = static_cast<int64_t>(items.size());
    const int64_t n_merges = static_cast<int64_t>(merges.size());
    const Item* items_p = items.data();
    const Merge* merges_p = merges.data();
    const bool parallel = nthreads > 1 && total_work * num_heads * D >= kParallelMinWork;

    // 1. Write K/V. Parallel over KV heads only: each head's rows go in row order, so a
    //    repeated slot ends with the last row's data, as in the reference.
    const bool par_write = nthreads > 1 && T * num_kv_heads * D >= kParallelMinWork;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par_write)
    for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = slot_p[t];
            if (slot < 0) continue;
            const int64_t dst = ((slot / block_size * num_kv_heads + kh) * block_size + slot % block_size) * D;
            const float* ks = key_p + t * k_row + kh * D;
            const float* vs = value_p + t * v_row + kh * D;
            if (half) {
                uint16_t* kd = static_cast<uint16_t*>(kc_p) + dst;
                uint16_t* vd = static_cast<uint16_t*>(vc_p) + dst;
                for (int64_t d = 0; d < D; ++d) {
                    kd[d] = float_to_half(ks[d]);
                    vd[d] = float_to_half(vs[d]);
                }
            } else {
                std::memcpy(static_cast<float*>(kc_p) + dst, ks, sizeof(float) * D);
                std::memcpy(static_cast<float*>(vc_p) + dst, vs, sizeof(float) * D);
            }
        }
    }

    // 2. Attend.
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        Scratch sc(group, D, block_size, half);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i) fn(p, items_p[i], sc);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_merges; ++i) merge_parts(p, merges_p[i]);
    }
}

}  // namespace
}  // namespace llmc_pa
