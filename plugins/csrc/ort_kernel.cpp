// The helpers every llmc ONNX Runtime op shares (declared and described in ort_kernel.h).

#include "ort_kernel.h"

namespace llmc_ort {

const void* const* g_api = nullptr;
std::atomic<int> g_num_threads{0};
std::atomic<ParallelForFn> g_parallel_for{nullptr};

void check(OrtStatus* status, const char* what) {
    if (status == nullptr) return;
    const std::string msg = api_fn<const char* (*)(const OrtStatus*)>(kGetErrorMessage)(status);
    api_fn<void (*)(OrtStatus*)>(kReleaseStatus)(status);
    throw Error(std::string(what) + ": " + msg);
}

OrtStatus* make_status(int code, const std::string& msg) {
    return api_fn<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, msg.c_str());
}

int effective_threads() {
    const int n = g_num_threads.load();
    return n > 0 ? n : omp_get_max_threads();
}

void ort_parallel_for(void* self, int64_t n, void (*body)(void*, int64_t), void* arg) {
    const OrtParallel& o = *static_cast<const OrtParallel*>(self);
    struct Call {
        void (*body)(void*, int64_t);
        void* arg;
    } call{body, arg};
    // num_batch 0: one task per index, handed out dynamically by the pool (items differ in cost).
    check(o.fn(o.ctx, [](void* c, size_t i) {
        const Call& x = *static_cast<const Call*>(c);
        x.body(x.arg, static_cast<int64_t>(i));
    }, static_cast<size_t>(n), 0, &call), "KernelContext_ParallelFor");
}

int64_t int_attr(const OrtKernelInfo* info, const char* name, bool required, int64_t fallback) {
    int64_t v = 0;
    OrtStatus* st = api_fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(
        kKernelInfoGetAttribute_int64)(info, name, &v);
    if (st == nullptr) return v;
    if (required) check(st, (std::string("attribute ") + name).c_str());
    api_fn<void (*)(OrtStatus*)>(kReleaseStatus)(st);
    return fallback;
}

float float_attr(const OrtKernelInfo* info, const char* name, float fallback) {
    float v = 0.0f;
    OrtStatus* st = api_fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(
        kKernelInfoGetAttribute_float)(info, name, &v);
    if (st == nullptr) return v;
    api_fn<void (*)(OrtStatus*)>(kReleaseStatus)(st);
    return fallback;
}

Tensor input(OrtKernelContext* ctx, size_t i, const char* name, bool optional) {
    if (optional) {
        size_t count = 0;
        check(api_fn<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(kKernelContext_GetInputCount)(ctx, &count),
              name);
        if (i >= count) return Tensor{};
    }
    const OrtValue* value = nullptr;
    check(api_fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput)(
              ctx, i, &value),
          name);
    if (value == nullptr) {
        if (optional) return Tensor{};
        throw Error(std::string(name) + " is missing");
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(api_fn<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(value, &info),
          name);
    Tensor t;
    size_t n = 0;
    OrtStatus* st = api_fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &n);
    if (st == nullptr) {
        t.dims.resize(n);
        st = api_fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(
            info, t.dims.data(), n);
    }
    api_fn<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
    check(st, name);
    // ORT's own API takes a non-const value here; inputs are only read.
    check(api_fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(value), &t.data),
          name);
    return t;
}

float* output(OrtKernelContext* ctx, const int64_t* dims, size_t n) {
    OrtValue* out = nullptr;
    check(api_fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
              kKernelContext_GetOutput)(ctx, 0, dims, n, &out),
          "output");
    void* data = nullptr;
    check(api_fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(out, &data), "output");
    return static_cast<float*>(data);
}

std::string dims_str(const std::vector<int64_t>& d) {
    std::string s = "(";
    for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + (d.size() == 1 ? ",)" : ")");
}

void require_rank(const Tensor& t, size_t rank, const char* name) {
    if (t.dims.size() != rank) {
        throw Error(std::string(name) + " must be " + std::to_string(rank) + "-D, got shape " + dims_str(t.dims));
    }
}

void require_shape(const Tensor& t, const std::vector<int64_t>& want, const char* name) {
    if (t.dims != want) throw Error(std::string(name) + " must have shape " + dims_str(want) + ", got " + dims_str(t.dims));
}

const char* op_provider(const OrtCustomOpV13*) { return nullptr; }
int32_t op_output_type(const OrtCustomOpV13*, size_t) { return kOrtFloat; }
size_t op_output_count(const OrtCustomOpV13*) { return 1; }
int32_t op_required(const OrtCustomOpV13*, size_t) { return 0; }
int32_t op_default_memory(const OrtCustomOpV13*, size_t) { return 0; }

}  // namespace llmc_ort
