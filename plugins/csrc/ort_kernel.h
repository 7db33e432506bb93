// What every op of llmc's ONNX Runtime custom-op library shares: calls into ONNX Runtime's C API (ort_abi.h),
// node attributes, inputs and the output, the thread setting, and the op schema. Each plugin's op
// (plugins/<plugin>/csrc/ort_<plugin>.cpp) is written with these; plugins/csrc/ort_ops.cpp registers them all.
// Definitions in ort_kernel.cpp; one shared library holds every translation unit, so the state here (the API
// table, the thread setting) is the library's, one copy per process.
//
// Errors (bad shapes or attributes, nothing bound) are thrown as llmc_ort::Error out of KernelCompute or
// CreateKernel; ONNX Runtime catches std::exception around every kernel and fails the run with the message.

#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ort_abi.h"
#include "parallel_for.h"

// The library's C entry points (llmc.plugins.paged_attention.ort_native calls them through ctypes); every other
// symbol stays hidden (-fvisibility=hidden).
#define LLMC_EXPORT extern "C" __attribute__((visibility("default")))

namespace llmc_ort {

// A caller error. Every message of the library carries the prefix it had when the library held PagedAttention
// alone, so that no op's messages changed when the ops moved to their own files.
struct Error : std::invalid_argument {
    explicit Error(const std::string& msg) : std::invalid_argument("paged_attention: " + msg) {}
};

// ---------------------------------------------------------------------------------------------
// The OrtApi table, called by position (see ort_abi.h); set by RegisterCustomOps.

extern const void* const* g_api;

template <typename Fn>
Fn api_fn(size_t index) {
    return reinterpret_cast<Fn>(const_cast<void*>(g_api[index]));
}

// Throw the message of a failed API call (and release its status); nothing for nullptr (success).
void check(OrtStatus* status, const char* what);
OrtStatus* make_status(int code, const std::string& msg);

// ---------------------------------------------------------------------------------------------
// Threads: llmc_set_num_threads's setting and ONNX Runtime's intra-op pool.

// OrtApi::KernelContext_ParallelFor, when the runtime serves API version 17; else nullptr.
using ParallelForFn = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
extern std::atomic<int> g_num_threads;  // 0: the session's intra-op pool (OpenMP's default without it)
extern std::atomic<ParallelForFn> g_parallel_for;

int effective_threads();

// llmc::ParallelFor over ORT's intra-op pool of the session running the node.
struct OrtParallel {
    OrtKernelContext* ctx;
    ParallelForFn fn;
};

void ort_parallel_for(void* self, int64_t n, void (*body)(void*, int64_t), void* arg);

// Run a kernel with the thread setting of llmc_set_num_threads: run(threads, pf) gets ORT's intra-op
// pool as `pf` (setting 0, runtime with ParallelFor; `threads` then only decides whether to go parallel,
// the pool's size is the session's), else pf = nullptr and that many OpenMP threads.
template <typename Run>
void with_threads(OrtKernelContext* ctx, Run run) {
    const ParallelForFn pf_fn = g_parallel_for.load();
    if (g_num_threads.load() == 0 && pf_fn != nullptr) {
        OrtParallel ort{ctx, pf_fn};
        const llmc::ParallelFor pf{ort_parallel_for, &ort};
        run(std::max(2, omp_get_max_threads()), &pf);
    } else {
        run(effective_threads(), static_cast<const llmc::ParallelFor*>(nullptr));
    }
}

// ---------------------------------------------------------------------------------------------
// Attributes, inputs and the output.

// The node's int64 attribute `name`; when absent, `fallback`, or (required) an Error naming it.
int64_t int_attr(const OrtKernelInfo* info, const char* name, bool required, int64_t fallback);
float float_attr(const OrtKernelInfo* info, const char* name, float fallback);

struct Tensor {
    void* data = nullptr;
    std::vector<int64_t> dims;
};

// Input i, or (optional inputs, `optional`) an empty Tensor (data nullptr) when the node omits it.
Tensor input(OrtKernelContext* ctx, size_t i, const char* name, bool optional = false);

// Output 0 with these dims, as float32 data to write.
float* output(OrtKernelContext* ctx, const int64_t* dims, size_t n);

// "(2, 3)", "(4,)": shapes in messages, as numpy prints them.
std::string dims_str(const std::vector<int64_t>& d);
void require_rank(const Tensor& t, size_t rank, const char* name);
void require_shape(const Tensor& t, const std::vector<int64_t>& want, const char* name);

// ---------------------------------------------------------------------------------------------
// The ops' schemas.

// What the ops share: one float output, every input and output required (unless an op says otherwise), on the
// CPU provider.
const char* op_provider(const OrtCustomOpV13*);
int32_t op_output_type(const OrtCustomOpV13*, size_t);
size_t op_output_count(const OrtCustomOpV13*);
int32_t op_required(const OrtCustomOpV13*, size_t);
int32_t op_default_memory(const OrtCustomOpV13*, size_t);

// An op of that shape; the rest of its schema and its kernel as given. constexpr: the ops are constants,
// initialised before any code of the library runs.
constexpr OrtCustomOpV13 make_op(const char* (*name)(const OrtCustomOpV13*),
                                 int32_t (*input_type)(const OrtCustomOpV13*, size_t),
                                 size_t (*input_count)(const OrtCustomOpV13*),
                                 void* (*create)(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo*),
                                 void (*compute_fn)(void*, OrtKernelContext*), void (*destroy)(void*),
                                 int32_t (*input_characteristic)(const OrtCustomOpV13*, size_t) = op_required) {
    OrtCustomOpV13 op{};
    op.version = kOrtApiVersion;
    op.CreateKernel = create;
    op.GetName = name;
    op.GetExecutionProviderType = op_provider;
    op.GetInputType = input_type;
    op.GetInputTypeCount = input_count;
    op.GetOutputType = op_output_type;
    op.GetOutputTypeCount = op_output_count;
    op.KernelCompute = compute_fn;
    op.KernelDestroy = destroy;
    op.GetInputCharacteristic = input_characteristic;
    op.GetOutputCharacteristic = op_required;
    op.GetInputMemoryType = op_default_memory;
    return op;
}

}  // namespace llmc_ort
