// llmc::PagedAttention and llmc::RotaryPagedAttention for ONNX Runtime on the CPU, and the bound KV pool they read
// and write. A translation unit of llmc's custom-op library (registered by plugins/csrc/ort_ops.cpp); Python side:
// llmc.plugins.paged_attention.ort_native. The kernel is llmc_pa::run (paged_attention_core.h), the same code as
// the pybind11 module's (paged_attention_cpu.cpp); RotaryPagedAttention is the same kernel on a packed QKV input
// with rotary inside.
//
// The KV cache is runtime state, not graph data: the runtime binds its pool (one K and one V
// array per layer) with llmc_bind_kv_pool, called through ctypes on the same file. dlopen of one
// path returns one handle, so ONNX Runtime's copy of this library and the runtime's are the same
// and share the binding. Each node reads its layer's caches (attribute layer_idx) from the pool
// bound when it runs. The runtime serialises binding and running with a lock (one pool at a time
// per process).
//
// Errors (bad shapes or indices, no pool bound) are thrown out of KernelCompute (llmc_ort::Error, or llmc_pa::Error
// from the kernel's own checks); ONNX Runtime catches std::exception around every kernel and fails the run with the
// message.

#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
#include "paged_attention_core.h"

using namespace llmc_ort;

namespace {

// ---------------------------------------------------------------------------------------------
// Library state: the bound KV pool, the ISA, a call counter.

struct Pool {
    std::vector<void*> k, v;  // per layer, [num_blocks, num_kv_heads[i], block_size, head_size[i]]
    // Per layer: models such as Gemma 4 give full-attention layers other head sizes and KV heads.
    std::vector<int64_t> num_kv_heads, head_size;
    int64_t num_blocks = 0, block_size = 0;
    bool half = false;
};

std::mutex g_pool_mutex;
Pool g_pool;  // num_layers() == 0: nothing bound
std::atomic<int> g_pa_isa{llmc_pa::best_isa()};
std::atomic<int64_t> g_calls{0};

// ---------------------------------------------------------------------------------------------
// The kernel: one per graph node, holding the node's attributes.

struct Kernel {
    int64_t layer_idx = 0, num_heads = 0, num_kv_heads = 0, head_size = 0, sliding_window = 0, attention_chunk = 0;
    float scale = 0.0f, softcap = 0.0f, alibi_max_bias = 0.0f;
};

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
    // Optional input 8: attend_end, int64 [T] (bidirectional spans; input 7 may be empty then).
    const Tensor attend_end = input(ctx, 8, "attend_end", true);
    if (attend_end.data != nullptr && (attend_end.dims.size() != 1 || attend_end.dims[0] != a.T)) {
        throw Error("attend_end must have one entry per query row, shape (" + std::to_string(a.T) + ",), got " +
                    dims_str(attend_end.dims));
    }
    a.attend_end = static_cast<const int64_t*>(attend_end.data);
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
// context_lens, query_start_loc[, sinks [H][, attend_end [T]]]) -> [T, H*D].
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
// block_tables, context_lens, query_start_loc[, sinks][, attend_end]) -> [T, H*D]: the packed Q/K/V projection's output split
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
// The ops' schemas: 3 float inputs (query, key, value, or qkv, cos, sin), 4 int64 inputs, then the optional float
// sinks and the optional int64 attend_end; inputs 0-6 required, 7 and 8 optional (OrtCustomOpInputOutputCharacteristic
// 1). A node may stop after any of inputs 6-8, and name input 7 "" to give attend_end without sinks.

const char* op_name(const OrtCustomOpV13*) { return "PagedAttention"; }
const char* rotary_op_name(const OrtCustomOpV13*) { return "RotaryPagedAttention"; }
int32_t op_input_type(const OrtCustomOpV13*, size_t i) { return i < 3 || i == 7 ? kOrtFloat : kOrtInt64; }
size_t op_input_count(const OrtCustomOpV13*) { return 9; }
int32_t attention_input_characteristic(const OrtCustomOpV13*, size_t i) { return i >= 7 ? 1 : 0; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kPagedAttentionOp = make_op(op_name, op_input_type, op_input_count, create_kernel,
                                                          compute, destroy_kernel, attention_input_characteristic);
// The same input types and attributes (plus rotary_interleaved, which must be 0).
const OrtCustomOpV13 llmc_ort::kRotaryPagedAttentionOp = make_op(rotary_op_name, op_input_type, op_input_count,
                                                                create_kernel, compute_rotary, destroy_kernel,
                                                                attention_input_characteristic);

// ---------------------------------------------------------------------------------------------
// Entry points.

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
