// llmc's native ONNX Runtime custom-op library (llmc.plugins._ort_ops; Python side:
// llmc.plugins.paged_attention.ort_native): its registration unit and library-wide settings.
//
// A session loads it with SessionOptions.register_custom_ops_library(path); ONNX Runtime then calls
// RegisterCustomOps, which adds the domain "llmc" with every plugin's ops (ort_ops.h). Each op's ONNX Runtime code
// lives in its plugin's folder, a translation unit of this same library, written with the shared helpers of
// ort_kernel.h; the kernels it calls are the plugins' *_core.h headers.
//
// Runtime state (the KV pool, recurrent state, per-op instruction sets and call counters) is bound and read
// through each op's own C entry points, called through ctypes on the same file: dlopen of one path returns one
// handle, so ONNX Runtime's copy of this library and the runtime's are the same and share what is bound.
//
// Only the C ABI of ONNX Runtime is used, through llmc's own declarations in ort_abi.h.

#include <mutex>

#include "ort_kernel.h"
#include "ort_ops.h"

using namespace llmc_ort;

namespace {

// Every op, in the order the domain lists them.
const OrtCustomOpV13* const kOps[] = {
    &kPagedAttentionOp, &kRotaryPagedAttentionOp, &kInt4MatMulOp,    &kCausalConv1dOp,     &kGatedDeltaRuleOp,
    &kSsdScanOp,        &kLoraApplyOp,            &kMxfp4MoEMatMulOp, &kBf16MatMulOp,      &kMxfp4MoEMatMulQ8Op,
};

std::mutex g_domain_mutex;
OrtCustomOpDomain* g_domain = nullptr;  // one domain object for every session; lives as long as the process

}  // namespace

// Called by ONNX Runtime when a session registers this library.
LLMC_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    const OrtApi* api = base->GetApi(kOrtApiVersion);
    if (api == nullptr) return nullptr;  // cannot happen on ONNX Runtime >= 1.13; nothing to report it with
    g_api = reinterpret_cast<const void* const*>(api);
    if (const OrtApi* v17 = base->GetApi(kOrtApiVersionParallelFor)) {
        g_parallel_for = reinterpret_cast<ParallelForFn>(
            const_cast<void*>(reinterpret_cast<const void* const*>(v17)[kKernelContext_ParallelFor]));
    }
    try {
        std::lock_guard<std::mutex> lock(g_domain_mutex);
        if (g_domain == nullptr) {
            OrtCustomOpDomain* domain = nullptr;
            check(api_fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("llmc", &domain),
                  "CreateCustomOpDomain");
            for (const OrtCustomOpV13* op : kOps) {
                check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain, op),
                      "CustomOpDomain_Add");
            }
            g_domain = domain;
        }
        check(api_fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, g_domain),
              "AddCustomOpDomain");
    } catch (const std::exception& e) {
        return make_status(kOrtFail, e.what());
    }
    return nullptr;
}

// Threads the kernels use: 0 (the default) = the intra-op thread pool of the ONNX Runtime session
// running the node (ONNX Runtime >= 1.17; older runtimes: the OpenMP default, OMP_NUM_THREADS or
// every core); n >= 1 = n OpenMP threads (1: the calling thread only). Returns -1 for n < 0.
LLMC_EXPORT int llmc_set_num_threads(int n) {
    if (n < 0) return -1;
    g_num_threads = n;
    return 0;
}

// The setting (0: the session's pool, or the OpenMP default without one).
LLMC_EXPORT int llmc_get_num_threads() { return g_num_threads.load(); }

// 1: with llmc_set_num_threads(0) the kernels run on ONNX Runtime's intra-op pool; 0: on OpenMP.
LLMC_EXPORT int llmc_uses_ort_pool() { return g_num_threads.load() == 0 && g_parallel_for.load() != nullptr ? 1 : 0; }

// The ONNX Runtime C API version this library requests.
LLMC_EXPORT uint32_t llmc_ort_api_version() { return kOrtApiVersion; }
