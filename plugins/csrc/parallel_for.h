// The parallel loop llmc's C++ kernels accept from their caller (shared by PagedAttention and
// Int4MatMul, which run in the same ONNX Runtime op library).

#pragma once

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

}  // namespace llmc
