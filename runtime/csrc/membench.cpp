// llmc.runtime._membench: this machine's read bandwidth, measured the way benchmarks/peers/bw_read.c
// measures it (OpenMP threads stream disjoint static slices of one float array through independent
// SIMD accumulators), so that `llmc bench`'s roofline fraction is taken against the same yardstick
// as an independent C probe. A numpy reduction run from Python threads read 0.53-0.99x (median
// 0.85x) of that C loop at the same moment on this machine, which alone put llmc bench's fractions
// ~18% above the independent estimate.

#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));

// Sum of n floats (n a multiple of 32) with four independent accumulators. Cloned for AVX-512 and AVX2
// (picked at load time): the x86-64-v2 build alone read ~45 GB/s where bw_read's AVX-512 loop read 60-74.
__attribute__((target_clones("avx512f", "avx2", "default"))) float stream_sum(const float* a, int64_t n) {
    v8f s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int64_t i = 0; i < n; i += 32) {
        s0 += *reinterpret_cast<const v8fu*>(a + i);
        s1 += *reinterpret_cast<const v8fu*>(a + i + 8);
        s2 += *reinterpret_cast<const v8fu*>(a + i + 16);
        s3 += *reinterpret_cast<const v8fu*>(a + i + 24);
    }
    const v8f s = (s0 + s1) + (s2 + s3);
    float t = 0.0f;
    for (int k = 0; k < 8; ++k) t += s[k];
    return t;
}

// GB/s (1e9 bytes/s) of `repeats` timed passes over `buffer` (after one untimed pass) by `threads` threads.
std::vector<double> read_bandwidth(py::array_t<float, py::array::c_style> buffer, int repeats, int threads) {
    if (repeats < 1 || threads < 1) throw py::value_error("read_bandwidth: repeats and threads must be >= 1");
    const float* a = buffer.data();
    const int64_t n = (static_cast<int64_t>(buffer.size()) / (32 * threads)) * 32 * threads;
    if (n == 0) throw py::value_error("read_bandwidth: buffer too small");
    const int64_t per = n / threads;
    std::vector<double> out;
    volatile float sink = 0.0f;
    py::gil_scoped_release nogil;
    for (int r = -1; r < repeats; ++r) {
        float total = 0.0f;
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        total += stream_sum(a + per * omp_get_thread_num(), per);
        const double dt = omp_get_wtime() - t0;
        sink = sink + total;
        if (r >= 0) out.push_back(static_cast<double>(n) * 4.0 / dt / 1e9);
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_membench, m) {
    m.doc() = "Read-bandwidth probe (C++/OpenMP) for llmc bench's roofline report.";
    m.def("read_bandwidth", &read_bandwidth, py::arg("buffer"), py::arg("repeats"), py::arg("threads"),
          "GB/s of `repeats` timed passes over a float32 buffer by `threads` OpenMP threads, each streaming "
          "its own contiguous slice (one untimed pass first).");
}
