// The parallel loop llmc's C++ kernels accept from their caller (every kernel of the ONNX Runtime op
// library, and the pybind11 PagedAttention module, which passes none).

#pragma once

#include <omp.h>

#include <cstdint>

namespace llmc {

// A caller's parallel loop: fn(self, n, body, arg) runs body(arg, i) for every i in [0, n), on any
// threads, and returns when all have run. The ONNX Runtime op library passes the session's
// intra-op pool, so that a kernel shares ORT's threads instead of starting an OpenMP team that
// competes with them for the same cores. Bodies never throw.
struct ParallelFor {
    void (*fn)(void* self, int64_t n, void (*body)(void*, int64_t), void* arg);
    void* self;
};

// Work items [0, n) of `job` (run_item(job, i) each): on `pf` when the caller gives one, else on `threads` OpenMP
// threads handed items one at a time (items differ in cost), else in order on this thread.
template <typename Job, void (*run_item)(const Job&, int64_t)>
inline void parallel_items(const Job& job, int64_t n, int threads, const ParallelFor* pf) {
    if (threads > 1 && n > 1 && pf != nullptr) {
        pf->fn(pf->self, n, [](void* arg, int64_t i) { run_item(*static_cast<const Job*>(arg), i); },
               const_cast<Job*>(&job));
    } else if (threads > 1 && n > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) run_item(job, i);
    } else {
        for (int64_t i = 0; i < n; ++i) run_item(job, i);
    }
}

}  // namespace llmc
