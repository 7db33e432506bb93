// llmc_mxq::run (Mxfp4MoEMatMulQ8's kernel) over gpt-oss-20b's expert shapes with weights far larger than L3, each
// repeat timed right beside a plain read of the same bytes (the memory this machine gives at that moment): the
// ratio says how close to memory-bound the kernel is, whatever a neighbour does to the bandwidth meanwhile.
// Built and run by benchmarks/bench_mxfp4_stream.py; prints one JSON object.
//
//   mxfp4_q8_stream THREADS ROWS REPEATS
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#include "plugins/mxfp4/csrc/mxfp4_q8_core.h"

using namespace llmc_mxq;

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t* p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
    }
    return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}

int main(int argc, char** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const int M = argc > 2 ? atoi(argv[2]) : 32;  // routed rows: decode batch x top-4
    const int reps = argc > 3 ? atoi(argv[3]) : 10;
    if (!has_vnni()) {
        printf("{\"error\": \"this CPU has no AVX-512 VNNI + VBMI\"}\n");
        return 0;
    }
    constexpr int64_t E = 32, K = 2880, G = K / 32, L = 4;  // 4 layers: ~1.1 GB of codes touched at 32 rows
    const int64_t Ns[2] = {5760, 2880};                      // gate_up, down
    std::mt19937 rng(0);
    std::vector<std::vector<uint8_t>> codes(2 * L), scales(2 * L);
    for (int s = 0; s < 2; ++s) {
        for (int l = 0; l < L; ++l) {
            const int64_t T = (Ns[s] + 15) / 16;
            auto& c = codes[s * L + l];
            auto& sc = scales[s * L + l];
            c.resize(E * T * G * 256);
            sc.resize(E * T * G * 16);
            for (size_t i = 0; i < c.size(); i += 4) {
                const uint32_t r = rng();
                memcpy(&c[i], &r, 4);
            }
            for (auto& v : sc) v = static_cast<uint8_t>(119 + rng() % 3);
        }
    }
    std::vector<float> x(M * K), y(M * 5760);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(rng);
    std::vector<std::vector<int64_t>> ids(L, std::vector<int64_t>(M));
    std::vector<std::vector<int64_t>> touched(L);
    double bytes = 0;
    for (int l = 0; l < L; ++l) {
        std::set<int64_t> t;
        for (auto& v : ids[l]) t.insert(v = rng() % E);
        touched[l].assign(t.begin(), t.end());
        for (int s = 0; s < 2; ++s) bytes += t.size() * ((Ns[s] + 15) / 16) * G * 272.0;  // codes + scales
    }
    auto kernel = [&]() {
        for (int l = 0; l < L; ++l) {
            for (int s = 0; s < 2; ++s) {
                Problem p{x.data(), ids[l].data(), codes[s * L + l].data(), scales[s * L + l].data(), y.data(),
                          M, K, Ns[s], E};
                run(p, true, threads, nullptr);
            }
        }
    };
    auto plain_read = [&]() {
        uint64_t h = 0;
        for (int l = 0; l < L; ++l) {
            for (int s = 0; s < 2; ++s) {
                const size_t per = ((Ns[s] + 15) / 16) * G * 256;
                const auto& tv = touched[l];
                const int64_t chunks = static_cast<int64_t>(tv.size()) * 8;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(^ : h)
                for (int64_t i = 0; i < chunks; ++i) {
                    h ^= read_avx512(codes[s * L + l].data() + tv[i / 8] * per + (i % 8) * (per / 8), per / 8);
                }
            }
        }
        return h;
    };
    kernel();
    plain_read();
    std::vector<double> tk, tr, ratio;
    for (int r = 0; r < reps; ++r) {
        double t0 = now();
        kernel();
        tk.push_back(now() - t0);
        t0 = now();
        plain_read();
        tr.push_back(now() - t0);
        ratio.push_back(tk.back() / tr.back());
    }
    std::sort(tk.begin(), tk.end());
    std::sort(tr.begin(), tr.end());
    std::sort(ratio.begin(), ratio.end());
    printf("{\"threads\": %d, \"rows\": %d, \"mb\": %.1f, \"kernel_ms_median\": %.3f, \"read_ms_median\": %.3f, "
           "\"kernel_over_read_median\": %.4f, \"kernel_gb_s_best\": %.2f, \"read_gb_s_best\": %.2f}\n",
           threads, M, bytes / 1e6, tk[reps / 2] * 1e3, tr[reps / 2] * 1e3, ratio[reps / 2], bytes / tk[0] / 1e9,
           bytes / tr[0] / 1e9);
}
