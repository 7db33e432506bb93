// llmc's native ONNX Runtime custom-op library: llmc::PagedAttention and llmc::Int4MatMul on the CPU,
// with no Python in the call (llmc.plugins.paged_attention._ort_ops; Python side:
// llmc.plugins.paged_attention.ort_native and llmc.plugins.int4_matmul).
//
// A session loads it with SessionOptions.register_custom_ops_library(path); ONNX Runtime then
// calls RegisterCustomOps, which adds the domain "llmc" with its ops (PagedAttention, RotaryPagedAttention:
// the same kernel on a packed QKV input with rotary inside, and Int4MatMul). PagedAttention's kernel is
// llmc_pa::run (paged_attention_core.h), the same code as the pybind11 module's; Int4MatMul's is
// llmc_i4::run (plugins/int4_matmul/csrc/int4_matmul_core.h).
//
// The KV cache is runtime state, not graph data: the runtime binds its pool (one K and one V
// array per layer) with llmc_bind_kv_pool, called through ctypes on the same file. dlopen of one
// path returns one handle, so ONNX Runtime's copy of this library and the runtime's are the same
// and share the binding. Each node reads its layer's caches (attribute layer_idx) from the pool
// bound when it runs. The runtime serialises binding and running with a lock (one pool at a time
// per process).
//
// Errors (bad shapes or indices, no pool bound) are thrown as llmc_pa::Error out of KernelCompute;
// ONNX Runtime catches std::exception around every kernel and fails the run with the message.
//
// Only the C ABI of ONNX Runtime is used, through llmc's own declarations in ort_abi.h.

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "ort_abi.h"
#include "paged_attention_core.h"
#include "../../int4_matmul/csrc/int4_matmul_core.h"

#define LLMC_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using llmc_pa::Error;

// ---------------------------------------------------------------------------------------------
// The OrtApi table, called by position (see ort_abi.h).

const void* const* g_api = nullptr;

template <typename Fn>
Fn api_fn(size_t index) {
    return reinterpret_cast<Fn>(const_cast<void*>(g_api[index]));
}

// Throw the message of a failed API call (and release its status).
void check(OrtStatus* status, const char* what) {
    if (status == nullptr) return;
    const std::string msg = api_fn<const char* (*)(const OrtStatus*)>(kGetErrorMessage)(status);
    api_fn<void (*)(OrtStatus*)>(kReleaseStatus)(status);
    throw Error(std::string(what) + ": " + msg);
}

OrtStatus* make_status(int code, const std::string& msg) {
    return api_fn<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, msg.c_str());
}

// ---------------------------------------------------------------------------------------------
// Library state: the bound KV pool, thread count, ISA, a call counter.

struct Pool {
    std::vector<void*> k, v;  // per layer, [num_blocks, num_kv_heads[i], block_size, head_size[i]]
    // Per layer: models such as Gemma 4 give full-attention layers other head sizes and KV heads.
    std::vector<int64_t> num_kv_heads, head_size;
    int64_t num_blocks = 0, block_size = 0;
    bool half = false;
};

std::mutex g_pool_mutex;
Pool g_pool;  // num_layers() == 0: nothing bound
std::atomic<int> g_num_threads{0};  // 0: the session's intra-op pool (OpenMP's default without it)
// OrtApi::KernelContext_ParallelFor, when the runtime serves API version 17; else nullptr.
using ParallelForFn = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
std::atomic<ParallelForFn> g_parallel_for{nullptr};
std::atomic<int> g_pa_isa{llmc_pa::best_isa()};
std::atomic<int64_t> g_calls{0};

int effective_threads() {
    const int n = g_num_threads.load();
    return n > 0 ? n : omp_get_max_threads();
}

// llmc_pa::ParallelFor over ORT's intra-op pool of the session running the node.
struct OrtParallel {
    OrtKernelContext* ctx;
    ParallelForFn fn;
};

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

// ---------------------------------------------------------------------------------------------
// The kernel: one per graph node, holding the node's attributes.

struct Kernel {
    int64_t layer_idx = 0, num_heads = 0, num_kv_heads = 0, head_size = 0, sliding_window = 0, attention_chunk = 0;
    float scale = 0.0f, softcap = 0.0f, alibi_max_bias = 0.0f;
};

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

void* create_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new Kernel();
    try {
        k->layer_idx = int_attr(info, "layer_idx", true, 0);
        k->num_heads = int_attr(info, "num_heads", true, 0);
        k->num_kv_heads = int_attr(info, "num_kv_heads", true, 0);
        k->head_size = int_attr(info, "head_size", true, 0);
        k->sliding_window = int_attr(info, "sliding_window", false, 0);
        k->softcap = float_attr(info, "softcap", 0.0f);
        k->alibi_max_bias = float_attr(info, "alibi_max_bias", 0.0f);
        k->attention_chunk = int_attr(info, "attention_chunk", false, 0);
        // The traced graphs always carry `scale`; the default is attention's usual 1/sqrt(head_size).
        k->scale = float_attr(info, "scale", k->head_size > 0 ? 1.0f / std::sqrt(float(k->head_size)) : 1.0f);
        if (int_attr(info, "rotary_interleaved", false, 0) != 0) {
            throw Error("rotary_interleaved=1 is not supported: RotaryPagedAttention rotates in the rotate-half "
                        "(GPT-NeoX) form only; leave the RotaryEmbedding nodes unfused");
        }
        llmc_pa::check_heads(k->num_heads, k->num_kv_heads);
        if (k->head_size <= 0) throw Error("head_size must be positive, got " + std::to_string(k->head_size));
        if (k->layer_idx < 0) throw Error("layer_idx must be >= 0, got " + std::to_string(k->layer_idx));
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

struct Tensor {
    void* data = nullptr;
    std::vector<int64_t> dims;
};

// Input i, or (optional inputs, `optional`) an empty Tensor (data nullptr) when the node omits it.
Tensor input(OrtKernelContext* ctx, size_t i, const char* name, bool optional = false) {
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

// Output 0 with these dims, as float32 data to write.
float* output(OrtKernelContext* ctx, const int64_t* dims, size_t n) {
    OrtValue* out = nullptr;
    check(api_fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
              kKernelContext_GetOutput)(ctx, 0, dims, n, &out),
          "output");
    void* data = nullptr;
    check(api_fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(out, &data), "output");
    return static_cast<float*>(data);
}

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

// What both attention ops share once their query, key and value rows are known: the sequence
// inputs (3-6), the bound pool, the output and the call.
void attend(const Kernel& k, OrtKernelContext* ctx, llmc_pa::Args& a) {
    const Tensor slots = input(ctx, 3, "slot_mapping"), tables = input(ctx, 4, "block_tables");
    const Tensor ctx_lens = input(ctx, 5, "context_lens"), qsl = input(ctx, 6, "query_start_loc");
    require_rank(slots, 1, "slot_mapping");
    require_rank(tables, 2, "block_tables");
    require_rank(ctx_lens, 1, "context_lens");
    require_rank(qsl, 1, "query_start_loc");
    // Optional input 7: attention sinks, one float32 logit per query head.
    const Tensor sinks = input(ctx, 7, "sinks", true);
    if (sinks.data != nullptr && (sinks.dims.size() != 1 || sinks.dims[0] != k.num_heads)) {
        throw Error("sinks must have shape (" + std::to_string(k.num_heads) + ",) = (num_heads,), got " +
                    dims_str(sinks.dims));
    }
    a.sinks = static_cast<const float*>(sinks.data);
    {
        std::lock_guard<std::mutex> lock(g_pool_mutex);
        const int64_t layers = static_cast<int64_t>(g_pool.k.size());
        if (layers == 0) {
            throw Error("no KV pool is bound: run the engine through llmc.runtime (it calls llmc_bind_kv_pool)");
        }
        if (k.layer_idx >= layers) {
            throw Error("layer_idx " + std::to_string(k.layer_idx) + " but the bound KV pool has " +
                        std::to_string(layers) + " layers");
        }
        const int64_t pool_heads = g_pool.num_kv_heads[k.layer_idx], pool_size = g_pool.head_size[k.layer_idx];
        if (pool_heads != k.num_kv_heads || pool_size != k.head_size) {
            throw Error("the bound KV pool's layer " + std::to_string(k.layer_idx) + " has " +
                        std::to_string(pool_heads) + " KV heads of size " + std::to_string(pool_size) +
                        " but this node (layer " + std::to_string(k.layer_idx) +
                        ") has num_kv_heads=" + std::to_string(k.num_kv_heads) +
                        ", head_size=" + std::to_string(k.head_size));
        }
        a.k_cache = g_pool.k[k.layer_idx];
        a.v_cache = g_pool.v[k.layer_idx];
        a.half = g_pool.half;
        a.num_blocks = g_pool.num_blocks;
        a.block_size = g_pool.block_size;
    }
    const int64_t T = a.T, S = ctx_lens.dims[0];
    if (slots.dims[0] != T) {
        throw Error("slot_mapping must have one entry per row of query (" + std::to_string(T) + "), got shape " +
                    dims_str(slots.dims));
    }
    if (qsl.dims[0] != S + 1) {
        throw Error("query_start_loc must have len(context_lens) + 1 = " + std::to_string(S + 1) +
                    " entries, got shape " + dims_str(qsl.dims));
    }
    if (tables.dims[0] < S) {
        throw Error("block_tables must have a row per sequence (" + std::to_string(S) + "), got shape " +
                    dims_str(tables.dims));
    }

    const int64_t out_dims[2] = {T, k.num_heads * k.head_size};
    a.out = output(ctx, out_dims, 2);
    a.slot_mapping = static_cast<const int64_t*>(slots.data);
    a.block_tables = static_cast<const int64_t*>(tables.data);
    a.bt_rows = tables.dims[0];
    a.bt_cols = tables.dims[1];
    a.context_lens = static_cast<const int64_t*>(ctx_lens.data);
    a.query_start_loc = static_cast<const int64_t*>(qsl.data);
    a.S = S;
    a.head_size = k.head_size;
    a.num_heads = k.num_heads;
    a.num_kv_heads = k.num_kv_heads;
    a.scale = k.scale;
    a.sliding_window = k.sliding_window;
    a.softcap = k.softcap;
    a.alibi_max_bias = k.alibi_max_bias;
    a.attention_chunk = k.attention_chunk;
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        llmc_pa::run(a, threads, static_cast<llmc_pa::Isa>(g_pa_isa.load()), pf);
    });
    g_calls.fetch_add(1, std::memory_order_relaxed);
}

// llmc::PagedAttention(query [T, H*D], key [T, Hkv*D], value [T, Hkv*D], slot_mapping, block_tables,
// context_lens, query_start_loc[, sinks [H]]) -> [T, H*D].
void compute(void* kernel, OrtKernelContext* ctx) {
    const Kernel& k = *static_cast<const Kernel*>(kernel);
    const Tensor q = input(ctx, 0, "query"), key = input(ctx, 1, "key"), value = input(ctx, 2, "value");
    require_rank(q, 2, "query");
    require_rank(key, 2, "key");
    require_rank(value, 2, "value");
    const int64_t T = q.dims[0], D = k.head_size;
    if (q.dims[1] != k.num_heads * D) {
        throw Error("query must have num_heads * head_size = " + std::to_string(k.num_heads * D) +
                    " columns, got shape " + dims_str(q.dims));
    }
    for (const Tensor* t : {&key, &value}) {
        if (t->dims[0] != T || t->dims[1] != k.num_kv_heads * D) {
            throw Error(std::string(t == &key ? "key" : "value") + " must have shape (" + std::to_string(T) + ", " +
                        std::to_string(k.num_kv_heads * D) + ") = (T, num_kv_heads * head_size), got " +
                        dims_str(t->dims));
        }
    }
    llmc_pa::Args a{};
    a.query = static_cast<const float*>(q.data);
    a.key = static_cast<const float*>(key.data);
    a.value = static_cast<const float*>(value.data);
    a.q_row = q.dims[1];
    a.k_row = key.dims[1];
    a.v_row = value.dims[1];
    a.T = T;
    attend(k, ctx, a);
}

// Rows of a tensor [..., T, cols] (every dim but the last), after checking its last dim.
int64_t rows_of(const Tensor& t, int64_t cols, const char* name, const std::string& what) {
    if (t.dims.size() < 2 || t.dims.back() != cols) {
        throw Error(std::string(name) + " must have shape (..., T, " + std::to_string(cols) + ") = " + what +
                    ", got " + dims_str(t.dims));
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < t.dims.size(); ++i) rows *= t.dims[i];
    return rows;
}

// llmc::RotaryPagedAttention(qkv [..., T, (H + 2 Hkv) D], cos [..., T, D/2], sin [..., T, D/2], slot_mapping,
// block_tables, context_lens, query_start_loc) -> [T, H*D]: the packed Q/K/V projection's output split
// in place (row strides, no copies), rotate-half rotary on Q and K, then PagedAttention. One node for
// what the traced graph does with a Split, two RotaryEmbeddings, three Reshapes and PagedAttention.
void compute_rotary(void* kernel, OrtKernelContext* ctx) {
    const Kernel& k = *static_cast<const Kernel*>(kernel);
    const Tensor qkv = input(ctx, 0, "qkv"), cs = input(ctx, 1, "cos"), sn = input(ctx, 2, "sin");
    const int64_t H = k.num_heads, Hkv = k.num_kv_heads, D = k.head_size, width = (H + 2 * Hkv) * D;
    const int64_t T = rows_of(qkv, width, "qkv", "(num_heads + 2 * num_kv_heads) * head_size columns");
    for (const Tensor* t : {&cs, &sn}) {
        const char* name = t == &cs ? "cos" : "sin";
        if (rows_of(*t, D / 2, name, "head_size / 2 columns") != T) {
            throw Error(std::string(name) + " must have one row per row of qkv (" + std::to_string(T) + "), got shape " +
                        dims_str(t->dims));
        }
    }
    const float* base = static_cast<const float*>(qkv.data);
    llmc_pa::Args a{};
    a.query = base;
    a.key = base + H * D;
    a.value = base + (H + Hkv) * D;
    a.q_row = a.k_row = a.v_row = width;
    a.T = T;
    a.rot_cos = static_cast<const float*>(cs.data);
    a.rot_sin = static_cast<const float*>(sn.data);
    a.rot_row = D / 2;
    attend(k, ctx, a);
}

// ---------------------------------------------------------------------------------------------
// The ops' schemas.

// What the ops share: one float output, every input and output required (but the attention ops' sinks), on the
// CPU provider.
const char* op_provider(const OrtCustomOpV13*) { return nullptr; }
int32_t op_output_type(const OrtCustomOpV13*, size_t) { return kOrtFloat; }
size_t op_output_count(const OrtCustomOpV13*) { return 1; }
int32_t op_required(const OrtCustomOpV13*, size_t) { return 0; }
// The attention ops' inputs: 0-6 required, 7 (sinks) optional (OrtCustomOpInputOutputCharacteristic 1).
int32_t attention_input_characteristic(const OrtCustomOpV13*, size_t i) { return i == 7 ? 1 : 0; }
int32_t op_default_memory(const OrtCustomOpV13*, size_t) { return 0; }

// An op of that shape; the rest of its schema and its kernel as given.
OrtCustomOpV13 make_op(const char* (*name)(const OrtCustomOpV13*),
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

// PagedAttention: 3 float inputs (query, key, value), 4 int64 inputs, then the optional float sinks.
const char* op_name(const OrtCustomOpV13*) { return "PagedAttention"; }
int32_t op_input_type(const OrtCustomOpV13*, size_t i) { return i < 3 || i == 7 ? kOrtFloat : kOrtInt64; }
size_t op_input_count(const OrtCustomOpV13*) { return 8; }

const OrtCustomOpV13 g_op = make_op(op_name, op_input_type, op_input_count, create_kernel, compute, destroy_kernel,
                                    attention_input_characteristic);

// RotaryPagedAttention: the same input types and attributes (plus rotary_interleaved, which must be 0).
const char* rotary_op_name(const OrtCustomOpV13*) { return "RotaryPagedAttention"; }
const OrtCustomOpV13 g_rotary_op = make_op(rotary_op_name, op_input_type, op_input_count, create_kernel,
                                           compute_rotary, destroy_kernel, attention_input_characteristic);

// ---------------------------------------------------------------------------------------------
// llmc::Int4MatMul(X float [..., K], W uint8, scales float, mins float) -> float [..., N], attributes
// K, N, group_size; weights in llmc_i4's tiled layout (int4_matmul_core.h). activation = 1: the tiles
// alternate gate and up and the output is SwiGLU(gate, up), [..., N/2].

struct Int4Kernel {
    int64_t K = 0, N = 0, G = 0;
    bool swiglu = false;  // attribute activation = 1: the SwiGLU epilogue, output [..., N/2]
};

std::atomic<int> g_int4_isa{static_cast<int>(llmc_i4::best_isa())};
std::atomic<int64_t> g_int4_calls{0};
std::atomic<int64_t> g_int4_parallel_min{llmc_i4::kParallelMinWork};

void* create_int4_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new Int4Kernel();
    try {
        k->K = int_attr(info, "K", true, 0);
        k->N = int_attr(info, "N", true, 0);
        k->G = int_attr(info, "group_size", true, 0);
        if (k->K <= 0 || k->N <= 0) {
            throw Error("K and N must be positive, got K=" + std::to_string(k->K) + ", N=" + std::to_string(k->N));
        }
        if (k->G <= 0 || k->G % 8) throw Error("group_size must be a positive multiple of 8, got " + std::to_string(k->G));
        const int64_t act = int_attr(info, "activation", false, 0);
        if (act != 0 && act != 1) throw Error("activation must be 0 (none) or 1 (swiglu), got " + std::to_string(act));
        k->swiglu = act == 1;
        if (k->swiglu && k->N % 32) {
            throw Error("activation=1 (swiglu) needs N % 32 == 0 (whole 16-column gate and up tiles), got N=" +
                        std::to_string(k->N));
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_int4_kernel(void* kernel) { delete static_cast<Int4Kernel*>(kernel); }

void require_shape(const Tensor& t, const std::vector<int64_t>& want, const char* name) {
    if (t.dims != want) throw Error(std::string(name) + " must have shape " + dims_str(want) + ", got " + dims_str(t.dims));
}

void compute_int4(void* kernel, OrtKernelContext* ctx) {
    const Int4Kernel& k = *static_cast<const Int4Kernel*>(kernel);
    const Tensor x = input(ctx, 0, "X"), w = input(ctx, 1, "W"), sc = input(ctx, 2, "scales"),
                 mn = input(ctx, 3, "mins");
    if (x.dims.empty() || x.dims.back() != k.K) {
        throw Error("X must have K = " + std::to_string(k.K) + " in its last dimension, got shape " + dims_str(x.dims));
    }
    const int64_t tiles = (k.N + 15) / 16, ng = (k.K + k.G - 1) / k.G;
    require_shape(w, {tiles, ng * k.G / 8, 64}, "W");
    require_shape(sc, {tiles, ng, 16}, "scales");
    require_shape(mn, {tiles, ng, 16}, "mins");
    int64_t M = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
    std::vector<int64_t> out_dims(x.dims);
    out_dims.back() = k.swiglu ? k.N / 2 : k.N;
    llmc_i4::Problem p{static_cast<const float*>(x.data), M, k.K,
                       static_cast<const uint8_t*>(w.data), static_cast<const float*>(sc.data),
                       static_cast<const float*>(mn.data), k.N, k.G, ng,
                       output(ctx, out_dims.data(), out_dims.size())};
    p.swiglu = k.swiglu;
    const auto isa = static_cast<llmc_i4::Isa>(g_int4_isa.load());
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        llmc_i4::run(p, isa, threads, pf, g_int4_parallel_min.load());
    });
    g_int4_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* int4_name(const OrtCustomOpV13*) { return "Int4MatMul"; }
int32_t int4_input_type(const OrtCustomOpV13*, size_t i) { return i == 1 ? kOrtUint8 : kOrtFloat; }
size_t int4_input_count(const OrtCustomOpV13*) { return 4; }

const OrtCustomOpV13 g_int4_op = make_op(int4_name, int4_input_type, int4_input_count, create_int4_kernel,
                                         compute_int4, destroy_int4_kernel);

// llmc::CausalConv1d and the bound state pool of recurrent layers (plugins/recurrent/csrc).
#include "../../recurrent/csrc/ort_recurrent.h"
// llmc::LoraApply: LoRA slot updates chosen per token (plugins/lora/csrc).
#include "../../lora/csrc/ort_lora.h"
// llmc::Mxfp4MoEMatMul: MoE experts straight from their MXFP4 codes (plugins/mxfp4/csrc).
#include "../../mxfp4/csrc/ort_mxfp4.h"
// llmc::Bf16MatMul: float32 rows times bfloat16 weights, exactly (plugins/bf16_matmul/csrc).
#include "../../bf16_matmul/csrc/ort_bf16_matmul.h"

std::mutex g_domain_mutex;
OrtCustomOpDomain* g_domain = nullptr;  // one domain object for every session; lives as long as the process

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points.

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
            for (const OrtCustomOpV13* op : {&g_op, &g_rotary_op, &g_int4_op, &g_conv_op, &g_delta_op,
                                              &g_ssd_op}) {
                check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain, op),
                      "CustomOpDomain_Add");
            }
            check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain, &g_lora_op),
                  "CustomOpDomain_Add");
            check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain, &g_mxfp4_op),
                  "CustomOpDomain_Add");
            check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain, &g_bf16_op),
                  "CustomOpDomain_Add");
            check(api_fn<OrtStatus* (*)(OrtCustomOpDomain*, const void*)>(kCustomOpDomain_Add)(domain,
                                                                                              &g_mxfp4_q8_op),
                  "CustomOpDomain_Add");
            g_domain = domain;
        }
        check(api_fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, g_domain),
              "AddCustomOpDomain");
    } catch (const std::exception& e) {
        return make_status(kOrtFail, e.what());
    }
    return nullptr;
}

// Bind the KV pool every PagedAttention node of this process reads: `num_layers` K and V arrays,
// layer i's each [num_blocks, num_kv_heads[i], block_size, head_size[i]] and C-contiguous, of
// float32 (`dtype` 1) or float16 (`dtype` 10); two layers may name the same arrays (KV-shared
// layers). The arrays are referenced, not copied: the caller keeps them alive while they are
// bound. Returns 0, or -1 for an invalid argument (nothing bound then).
LLMC_EXPORT int llmc_bind_kv_pool(int64_t num_layers, void* const* k, void* const* v, int64_t num_blocks,
                                  const int64_t* num_kv_heads, int64_t block_size, const int64_t* head_size,
                                  int32_t dtype) {
    if (num_layers <= 0 || num_blocks <= 0 || block_size <= 0) return -1;
    if (dtype != kOrtFloat && dtype != kOrtFloat16) return -1;
    Pool pool;
    for (int64_t i = 0; i < num_layers; ++i) {
        if (k[i] == nullptr || v[i] == nullptr || num_kv_heads[i] <= 0 || head_size[i] <= 0) return -1;
        pool.k.push_back(k[i]);
        pool.v.push_back(v[i]);
        pool.num_kv_heads.push_back(num_kv_heads[i]);
        pool.head_size.push_back(head_size[i]);
    }
    pool.num_blocks = num_blocks;
    pool.block_size = block_size;
    pool.half = dtype == kOrtFloat16;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    g_pool = std::move(pool);
    return 0;
}

// Forget the bound pool (a node that runs afterwards fails with "no KV pool is bound").
LLMC_EXPORT void llmc_unbind_kv_pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    g_pool = Pool();
}

// Threads the kernel uses: 0 (the default) = the intra-op thread pool of the ONNX Runtime session
// running the node (ONNX Runtime >= 1.17; older runtimes: the OpenMP default, OMP_NUM_THREADS or
// every core); n >= 1 = n OpenMP threads (1: the calling thread only). Returns -1 for n < 0.
LLMC_EXPORT int llmc_set_num_threads(int n) {
    if (n < 0) return -1;
    g_num_threads = n;
    return 0;
}

// The setting (0: the session's pool, or the OpenMP default without one).
LLMC_EXPORT int llmc_get_num_threads() { return g_num_threads.load(); }

// 1: with llmc_set_num_threads(0) the kernel runs on ONNX Runtime's intra-op pool; 0: on OpenMP.
LLMC_EXPORT int llmc_uses_ort_pool() { return g_num_threads.load() == 0 && g_parallel_for.load() != nullptr ? 1 : 0; }

// PagedAttention kernel calls completed by this library since it was loaded (tests use it to see
// which route a session took).
LLMC_EXPORT int64_t llmc_paged_attention_calls() { return g_calls.load(); }

// 1: the attention loop uses AVX2+FMA; 0: the x86-64-v2 baseline.
LLMC_EXPORT int llmc_uses_avx2() { return g_pa_isa.load() >= llmc_pa::kAvx2 ? 1 : 0; }

// PagedAttention's instruction set: 0 baseline, 1 AVX2+FMA, 2 AVX-512 (llmc_pa::Isa). Setting one the CPU
// cannot run returns -1 (nothing changed); the default is the best the CPU runs.
LLMC_EXPORT int llmc_pa_get_isa() { return g_pa_isa.load(); }
LLMC_EXPORT int llmc_pa_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_pa::best_isa())) return -1;
    g_pa_isa = isa;
    return 0;
}

// The ONNX Runtime C API version this library requests.
LLMC_EXPORT uint32_t llmc_ort_api_version() { return kOrtApiVersion; }

// Int4MatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 VNNI (default: the best this CPU has).
// Setting one the CPU lacks returns -1 and changes nothing (tests run every path this way).
LLMC_EXPORT int llmc_int4_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_i4::best_isa())) return -1;
    g_int4_isa = isa;
    return 0;
}

LLMC_EXPORT int llmc_int4_get_isa() { return g_int4_isa.load(); }

// The least work (M x N x K multiply-adds) Int4MatMul spreads over threads (for tuning; returns the old value).
LLMC_EXPORT int64_t llmc_int4_set_parallel_min(int64_t work) {
    return g_int4_parallel_min.exchange(work < 0 ? llmc_i4::kParallelMinWork : work);
}

// Int4MatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_int4_calls() { return g_int4_calls.load(); }

// Mxfp4MoEMatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 (default: the best this CPU has); -1 if absent.
LLMC_EXPORT int llmc_mxfp4_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_mx::best_isa())) return -1;
    g_mxfp4_isa = isa;
    return 0;
}

LLMC_EXPORT int llmc_mxfp4_get_isa() { return g_mxfp4_isa.load(); }

// Mxfp4MoEMatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_mxfp4_calls() { return g_mxfp4_calls.load(); }

// Mxfp4MoEMatMulQ8's path: 1 AVX-512 VNNI (the default where the CPU has it), 0 scalar; -1 if absent.
LLMC_EXPORT int llmc_mxfp4_q8_set_vnni(int on) {
    if (on != 0 && on != 1) return -1;
    if (on && !llmc_mxq::has_vnni()) return -1;
    g_mxfp4_q8_vnni = on;
    return 0;
}

// Mxfp4MoEMatMulQ8 kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_mxfp4_q8_calls() { return g_mxfp4_q8_calls.load(); }

// Bf16MatMul's instruction set: 0 scalar, 1 AVX2, 2 AVX-512 (default: the best this CPU has); -1 if absent.
LLMC_EXPORT int llmc_bf16_set_isa(int isa) {
    if (isa < 0 || isa > static_cast<int>(llmc_bf::best_isa())) return -1;
    g_bf16_isa = isa;
    return 0;
}

// Bf16MatMul kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_bf16_calls() { return g_bf16_calls.load(); }

#include "../../recurrent/csrc/ort_recurrent_exports.h"
