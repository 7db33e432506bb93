// The part of ONNX Runtime's C ABI that llmc's custom-op library uses, declared here because the
// onnxruntime pip wheel ships the shared library but no C headers.
//
// These are llmc's own declarations of a stable, versioned binary interface, written against the
// documented C API (OrtApiBase, the OrtApi function table, the OrtCustomOp callback struct) of
// API version 13 (ONNX Runtime 1.13), which every later runtime still serves:
//
// - OrtApiBase::GetApi(version) returns the function table *as that version laid it out*; later
//   versions only append entries, so an entry's position never changes. We ask for version 13
//   and call entries by position (OrtApiIndex below).
// - A custom op states the version its OrtCustomOp struct was written for; the runtime reads
//   only the callbacks that version had (later ones are gated on op->version). We fill in the
//   13 fields of version 13 and leave zeroed padding behind them.
//
// tests/test_ort_native_op.py checks all of it against the installed runtime: a status made and
// read back through the table, attributes and inputs arriving intact, the output matching the
// numpy reference, and a kernel error reaching Python with its message.

#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

constexpr uint32_t kOrtApiVersion = 13;

struct OrtStatus;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtApi;  // used only through OrtApiTable

// ONNX TensorProto data types (the values are the ONNX standard's).
enum OrtElementType : int32_t {
    kOrtFloat = 1,
    kOrtUint8 = 2,
    kOrtUint16 = 4,
    kOrtInt64 = 7,
    kOrtFloat16 = 10,
};

enum OrtErrorCodeValue : int32_t {
    kOrtOk = 0,
    kOrtFail = 1,
    kOrtInvalidArgument = 2,
};

struct OrtApiBase {
    const OrtApi* (*GetApi)(uint32_t version) noexcept;
    const char* (*GetVersionString)() noexcept;
};

// Positions in the OrtApi function table (API version 13 and every later version).
enum OrtApiIndex : size_t {
    kCreateStatus = 0,          // OrtStatus* (int code, const char* msg)
    kGetErrorCode = 1,          // int (const OrtStatus*)
    kGetErrorMessage = 2,       // const char* (const OrtStatus*)
    kCreateCustomOpDomain = 26, // OrtStatus* (const char* domain, OrtCustomOpDomain** out)
    kCustomOpDomain_Add = 27,   // OrtStatus* (OrtCustomOpDomain*, const OrtCustomOp*)
    kAddCustomOpDomain = 28,    // OrtStatus* (OrtSessionOptions*, OrtCustomOpDomain*)
    kGetTensorMutableData = 51, // OrtStatus* (OrtValue*, void** out)
    kGetTensorElementType = 60, // OrtStatus* (const OrtTensorTypeAndShapeInfo*, int* out)
    kGetDimensionsCount = 61,   // OrtStatus* (const OrtTensorTypeAndShapeInfo*, size_t* out)
    kGetDimensions = 62,        // OrtStatus* (const OrtTensorTypeAndShapeInfo*, int64_t* dims, size_t n)
    kGetTensorTypeAndShape = 65,          // OrtStatus* (const OrtValue*, OrtTensorTypeAndShapeInfo** out)
    kKernelInfoGetAttribute_float = 85,   // OrtStatus* (const OrtKernelInfo*, const char* name, float* out)
    kKernelInfoGetAttribute_int64 = 86,   // OrtStatus* (const OrtKernelInfo*, const char* name, int64_t* out)
    kKernelContext_GetInputCount = 88,    // OrtStatus* (const OrtKernelContext*, size_t* out)
    kKernelContext_GetOutputCount = 89,   // OrtStatus* (const OrtKernelContext*, size_t* out)
    kKernelContext_GetInput = 90,         // OrtStatus* (const OrtKernelContext*, size_t i, const OrtValue** out)
    kKernelContext_GetOutput = 91,        // OrtStatus* (OrtKernelContext*, size_t i, const int64_t* dims,
                                          //             size_t n, OrtValue** out)
    kReleaseStatus = 93,                  // void (OrtStatus*)
    kReleaseTensorTypeAndShapeInfo = 99,  // void (OrtTensorTypeAndShapeInfo*)
    // API version 17 (ONNX Runtime 1.17) and later only: fetched from GetApi(kOrtApiVersionParallelFor),
    // used when that returns a table (else the kernel runs its own OpenMP threads).
    kKernelContext_ParallelFor = 274,     // OrtStatus* (const OrtKernelContext*, void (*fn)(void*, size_t),
                                          //             size_t total, size_t num_batch, void* usr_data)
};

constexpr uint32_t kOrtApiVersionParallelFor = 17;

// The OrtCustomOp struct of API version 13. `version` says which fields exist.
struct OrtCustomOpV13 {
    uint32_t version;
    void* (*CreateKernel)(const OrtCustomOpV13* op, const OrtApi* api, const OrtKernelInfo* info);
    const char* (*GetName)(const OrtCustomOpV13* op);
    const char* (*GetExecutionProviderType)(const OrtCustomOpV13* op);  // nullptr: the CPU provider
    int32_t (*GetInputType)(const OrtCustomOpV13* op, size_t index);     // an OrtElementType
    size_t (*GetInputTypeCount)(const OrtCustomOpV13* op);
    int32_t (*GetOutputType)(const OrtCustomOpV13* op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOpV13* op);
    void (*KernelCompute)(void* kernel, OrtKernelContext* context);
    void (*KernelDestroy)(void* kernel);
    int32_t (*GetInputCharacteristic)(const OrtCustomOpV13* op, size_t index);   // 0: required
    int32_t (*GetOutputCharacteristic)(const OrtCustomOpV13* op, size_t index);  // 0: required
    int32_t (*GetInputMemoryType)(const OrtCustomOpV13* op, size_t index);       // 0: the provider's default
    // Never read for version 13; zeroed so that a runtime that did read past the version-13 fields
    // would find null callbacks (meaning "not provided") rather than garbage.
    void* reserved[32];
};

}  // extern "C"
