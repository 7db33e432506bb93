// llmc.quant._gram: G += XᵀX on and above the diagonal, for bfloat16 X, in float32, with AVX-512 BF16.
//
// Why not torch: its bfloat16 GEMM (oneDNN) rounds its output to bfloat16, 2^-9 relative per entry per batch,
// which GPTQ's Cholesky of H (damped by 1 % of its mean diagonal) should not see; a float32 GEMM is exact on
// bfloat16 inputs but runs at a quarter of the rate. VDPBF16PS multiplies bfloat16 pairs exactly and adds them in
// float32: the float32 GEMM's result (up to the order of the sums) at near the bfloat16 rate. MKL's
// cblas_gemm_bf16bf16f32 is exported by libtorch but runs at the float32 rate on this (AMD) CPU; numpy's
// OpenBLAS is built without sbgemm.
//
// Layout: the caller hands X as P [T2, Kp] uint32, P[t][k] = (X[2t, k], X[2t+1, k]) (tokens in pairs, Kp a
// multiple of 32, zero padded), the operand layout of VDPBF16PS. GotoBLAS-style blocking: a block of NC columns
// of P over TC token pairs is packed once (in L2) and read by every row tile; each thread packs its row tile's
// MR columns (in L1); an MR x NR microkernel keeps its sums in registers over the TC pairs.

#include <immintrin.h>
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t MR = 8;    // rows of G per microkernel (broadcast operands)
constexpr int64_t NR = 32;   // columns of G per microkernel (two 16-lane vectors)
constexpr int64_t NC = 512;  // columns per packed block of P
// Token pairs per packed block: NC x TC x 4 B = 1 MB. Measured on a 1B down projection (K 8192, 2048 tokens):
// 512 x 512 ran ~13 % faster than 256 x 512 (half the passes over G's tiles), 128 x 1024 and 1024 x 512 alike.
constexpr int64_t TC = 512;

bool cpu_has_avx512_bf16() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

// acc[MR x NR] over tc pairs: a [tc][MR] (broadcast pairs), b [tc][NR]; added into G's tile (rows/cols past
// the matrix masked off).
__attribute__((target("avx512f,avx512bf16"))) void micro(const uint32_t* a, const uint32_t* b, int64_t tc,
                                                          float* g, int64_t ldg, int64_t rows, int64_t cols) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < tc; ++t) {
        const __m512i b0 = _mm512_loadu_si512(b + t * NR);
        const __m512i b1 = _mm512_loadu_si512(b + t * NR + 16);
        const uint32_t* at = a + t * MR;
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
            const __m512i av = _mm512_set1_epi32(static_cast<int>(at[m]));
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)av, (__m512bh)b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)av, (__m512bh)b1);
        }
    }
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
    for (int64_t m = 0; m < std::min(rows, MR); ++m) {
        float* row = g + m * ldg;
        _mm512_mask_storeu_ps(row, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, row), acc[m][0]));
        _mm512_mask_storeu_ps(row + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, row + 16), acc[m][1]));
    }
}

// Both arrays are taken as they are (no conversion: G is written in place, and a converted copy would be
// written and dropped), so their dtype and layout are checked here.
void add_upper(py::array gram, py::array pairs, int threads) {
    if (!cpu_has_avx512_bf16()) throw std::runtime_error("gram_bf16: this CPU lacks AVX-512 BF16");
    if (gram.dtype().kind() != 'f' || gram.itemsize() != 4 || !(gram.flags() & py::array::c_style) || !gram.writeable() ||
        gram.ndim() != 2 || gram.shape(0) != gram.shape(1))
        throw py::value_error("gram_bf16: G must be a writeable C-contiguous float32 K x K array");
    if (pairs.dtype().kind() != 'u' || pairs.itemsize() != 4 || !(pairs.flags() & py::array::c_style) || pairs.ndim() != 2)
        throw py::value_error("gram_bf16: pairs must be a C-contiguous uint32 [T/2, Kp] array");
    const int64_t k = gram.shape(0), t2 = pairs.shape(0), kp = pairs.shape(1);
    if (kp % NR || kp < k || kp - k >= NR) throw py::value_error("gram_bf16: Kp must be K rounded up to 32");
    float* g = static_cast<float*>(gram.mutable_data());
    const uint32_t* p = static_cast<const uint32_t*>(pairs.data());
    if (threads < 1) threads = 1;
    std::vector<uint32_t> bpack(static_cast<size_t>(NC * TC));
    py::gil_scoped_release nogil;
    for (int64_t jc = 0; jc < kp; jc += NC) {
        const int64_t nc = std::min(NC, kp - jc);
        for (int64_t tc0 = 0; tc0 < t2; tc0 += TC) {
            const int64_t tc = std::min(TC, t2 - tc0);
            // B block: [nc / NR][tc][NR], each microkernel's columns contiguous over the pairs.
            for (int64_t jt = 0; jt < nc / NR; ++jt)
                for (int64_t t = 0; t < tc; ++t)
                    std::memcpy(&bpack[(jt * tc + t) * NR], p + (tc0 + t) * kp + jc + jt * NR, NR * 4);
            const int64_t row_tiles = (std::min(jc + nc, k) + MR - 1) / MR;  // rows that meet the upper triangle
#pragma omp parallel num_threads(threads)
            {
                std::vector<uint32_t> apack(static_cast<size_t>(TC * MR));
#pragma omp for schedule(dynamic, 4)
                for (int64_t it = 0; it < row_tiles; ++it) {
                    const int64_t i0 = it * MR;
                    for (int64_t t = 0; t < tc; ++t)
                        std::memcpy(&apack[t * MR], p + (tc0 + t) * kp + i0, MR * 4);
                    for (int64_t jt = 0; jt < nc / NR; ++jt) {
                        const int64_t j0 = jc + jt * NR;
                        if (j0 + NR <= i0 || j0 >= k) continue;  // below the diagonal, or padding
                        micro(apack.data(), &bpack[jt * tc * NR], tc, g + i0 * k + j0, k, k - i0,
                              std::min(NR, k - j0));
                    }
                }
            }
        }
    }
}

}  // namespace

PYBIND11_MODULE(_gram, m) {
    m.doc() = "G += X^T X (upper triangle) for bfloat16 X in float32, with AVX-512 BF16";
    m.def("available", &cpu_has_avx512_bf16, "Whether this CPU runs add_upper (AVX-512 BF16).");
    m.def("add_upper", &add_upper, py::arg("gram"), py::arg("pairs"), py::arg("threads"),
          "gram [K, K] float32 += XᵀX on and above the diagonal (tiles that straddle it also below), for "
          "pairs [T/2, Kp] uint32: X's token pairs interleaved per column, Kp = K rounded up to 32.");
}
