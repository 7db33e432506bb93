// llmc::CausalConv1d, llmc::GatedDeltaRule and llmc::SsdScan for ONNX Runtime, and the bound state pool they read
// and write. A translation unit of llmc's custom-op library (registered by plugins/csrc/ort_ops.cpp).
//
// The state pool is runtime state, as the KV pool is: per state array (one per recurrent layer and
// kind of state), a pointer to [num_slots, ...] float32 and the element count of one slot, bound by
// llmc_bind_state_pool through ctypes (llmc.plugins.recurrent.ort_native). Node attribute
// state_idx picks the array.

#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../csrc/ort_kernel.h"
#include "../../csrc/ort_ops.h"
#include "recurrent_core.h"

using namespace llmc_ort;

namespace {

struct StatePool {
    std::vector<float*> arrays;
    std::vector<int64_t> slot_elems;
    int64_t num_slots = 0;
};

std::mutex g_state_mutex;
StatePool g_state;
std::atomic<int64_t> g_state_calls{0};

// The bound array `idx`, checked to hold `elems` floats per slot.
float* state_array(int64_t idx, int64_t elems, int64_t* num_slots, const char* op) {
    std::lock_guard<std::mutex> lock(g_state_mutex);
    const int64_t n = static_cast<int64_t>(g_state.arrays.size());
    if (n == 0) {
        throw Error(std::string(op) + ": no state pool is bound: run the engine through llmc.runtime (it calls "
                    "llmc_bind_state_pool)");
    }
    if (idx < 0 || idx >= n) {
        throw Error(std::string(op) + ": state_idx " + std::to_string(idx) + " but the bound state pool has " +
                    std::to_string(n) + " arrays");
    }
    if (g_state.slot_elems[idx] != elems) {
        throw Error(std::string(op) + ": the bound state array " + std::to_string(idx) + " holds " +
                    std::to_string(g_state.slot_elems[idx]) + " values per slot but this node needs " +
                    std::to_string(elems));
    }
    *num_slots = g_state.num_slots;
    return g_state.arrays[idx];
}

struct ConvKernel {
    int64_t state_idx = 0, activation = 0;
};

void* create_conv_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new ConvKernel();
    try {
        k->state_idx = int_attr(info, "state_idx", true, 0);
        k->activation = int_attr(info, "activation", false, 0);
        if (k->activation != 0 && k->activation != 1) {
            throw Error("activation must be 0 (none) or 1 (silu), got " + std::to_string(k->activation));
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_conv_kernel(void* kernel) { delete static_cast<ConvKernel*>(kernel); }

// llmc::CausalConv1d(x [T, C], weight [C, K], bias [C] (optional: an empty input), state_slots [S], context_lens [S],
// query_start_loc [S + 1]) -> [T, C].
void compute_conv(void* kernel, OrtKernelContext* ctx) {
    const ConvKernel& k = *static_cast<const ConvKernel*>(kernel);
    const Tensor x = input(ctx, 0, "x"), w = input(ctx, 1, "weight"), b = input(ctx, 2, "bias", true);
    const Tensor slots = input(ctx, 3, "state_slots"), lens = input(ctx, 4, "context_lens");
    const Tensor qsl = input(ctx, 5, "query_start_loc");
    require_rank(x, 2, "x");
    require_rank(w, 2, "weight");
    require_rank(slots, 1, "state_slots");
    require_rank(lens, 1, "context_lens");
    require_rank(qsl, 1, "query_start_loc");
    const int64_t T = x.dims[0], C = x.dims[1], K = w.dims[1], S = slots.dims[0];
    if (w.dims[0] != C) throw Error("weight must have shape (C, K) with C = " + std::to_string(C) + ", got " +
                                    dims_str(w.dims));
    const bool has_bias = b.data != nullptr && !b.dims.empty() && b.dims[0] > 0;
    if (has_bias && (b.dims.size() != 1 || b.dims[0] != C)) {
        throw Error("bias must have shape (" + std::to_string(C) + ",), got " + dims_str(b.dims));
    }
    if (lens.dims[0] != S || qsl.dims[0] != S + 1) {
        throw Error("state_slots " + dims_str(slots.dims) + ", context_lens " + dims_str(lens.dims) +
                    " and query_start_loc " + dims_str(qsl.dims) + " must describe the same S sequences");
    }
    llmc_rec::ConvArgs a;
    a.x = static_cast<const float*>(x.data);
    a.x_row = C;
    a.weight = static_cast<const float*>(w.data);
    a.bias = has_bias ? static_cast<const float*>(b.data) : nullptr;
    a.state_slots = static_cast<const int64_t*>(slots.data);
    a.context_lens = static_cast<const int64_t*>(lens.data);
    a.query_start_loc = static_cast<const int64_t*>(qsl.data);
    a.T = T;
    a.S = S;
    a.C = C;
    a.K = K;
    a.activation = static_cast<int>(k.activation);
    a.state = state_array(k.state_idx, C * (K - 1), &a.num_slots, "CausalConv1d");
    if (S > 0 && a.query_start_loc[S] != T) {
        throw Error("query_start_loc[S] = " + std::to_string(a.query_start_loc[S]) + " but x has " +
                    std::to_string(T) + " rows");
    }
    llmc_rec::check_conv(a);
    const int64_t out_dims[2] = {T, C};
    a.out = output(ctx, out_dims, 2);
    // Channels are independent: blocks of 64 channels are the parallel items.
    const int64_t blocks = (C + 63) / 64;
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        struct Item {
            const llmc_rec::ConvArgs* a;
            int64_t C;
        } item{&a, C};
        auto body = [](void* p, int64_t i) {
            const Item& it = *static_cast<const Item*>(p);
            llmc_rec::causal_conv1d_channels(*it.a, i * 64, std::min(it.C, (i + 1) * 64));
        };
        if (pf != nullptr && blocks > 1 && T * C * K >= (1 << 16)) {
            pf->fn(pf->self, blocks, body, &item);  // bodies never throw: checked above
        } else {
            (void)threads;
            llmc_rec::causal_conv1d_channels(a, 0, C);
        }
    });
    g_state_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* conv_name(const OrtCustomOpV13*) { return "CausalConv1d"; }
int32_t conv_input_type(const OrtCustomOpV13*, size_t i) { return i < 3 ? kOrtFloat : kOrtInt64; }
size_t conv_input_count(const OrtCustomOpV13*) { return 6; }
int32_t conv_input_characteristic(const OrtCustomOpV13*, size_t i) { return i == 2 ? 1 : 0; }


// ---------------------------------------------------------------------------------------------
// llmc::GatedDeltaRule(query [T, Hk*Dk], key [T, Hk*Dk], value [T, Hv*Dv], g [T, Hv], beta [T, Hv], state_slots [S],
// context_lens [S], query_start_loc [S + 1]) -> [T, Hv*Dv]; attributes state_idx, num_k_heads, num_v_heads,
// use_qk_l2norm (default 1). State slot [Hv, Dk, Dv].

struct DeltaKernel {
    int64_t state_idx = 0, num_k_heads = 0, num_v_heads = 0, use_l2norm = 1;
};

void* create_delta_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new DeltaKernel();
    try {
        k->state_idx = int_attr(info, "state_idx", true, 0);
        k->num_k_heads = int_attr(info, "num_k_heads", true, 0);
        k->num_v_heads = int_attr(info, "num_v_heads", true, 0);
        k->use_l2norm = int_attr(info, "use_qk_l2norm", false, 1);
        if (k->num_k_heads <= 0 || k->num_v_heads <= 0 || k->num_v_heads % k->num_k_heads) {
            throw Error("num_v_heads (" + std::to_string(k->num_v_heads) + ") must be a positive multiple of "
                        "num_k_heads (" + std::to_string(k->num_k_heads) + ")");
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_delta_kernel(void* kernel) { delete static_cast<DeltaKernel*>(kernel); }

void compute_delta(void* kernel, OrtKernelContext* ctx) {
    const DeltaKernel& kk = *static_cast<const DeltaKernel*>(kernel);
    const Tensor q = input(ctx, 0, "query"), k = input(ctx, 1, "key"), v = input(ctx, 2, "value");
    const Tensor g = input(ctx, 3, "g"), beta = input(ctx, 4, "beta");
    const Tensor slots = input(ctx, 5, "state_slots"), lens = input(ctx, 6, "context_lens");
    const Tensor qsl = input(ctx, 7, "query_start_loc");
    for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&q, "query"}, {&k, "key"}, {&v, "value"},
                                  {&g, "g"}, {&beta, "beta"}}) {
        require_rank(*t, 2, name);
    }
    require_rank(slots, 1, "state_slots");
    require_rank(lens, 1, "context_lens");
    require_rank(qsl, 1, "query_start_loc");
    llmc_rec::DeltaArgs a;
    a.T = q.dims[0];
    a.S = slots.dims[0];
    a.Hk = kk.num_k_heads;
    a.Hv = kk.num_v_heads;
    if (q.dims[1] % a.Hk || v.dims[1] % a.Hv) {
        throw Error("query " + dims_str(q.dims) + " and value " + dims_str(v.dims) + " must have num_k_heads (" +
                    std::to_string(a.Hk) + ") and num_v_heads (" + std::to_string(a.Hv) + ") whole heads per row");
    }
    a.Dk = q.dims[1] / a.Hk;
    a.Dv = v.dims[1] / a.Hv;
    if (k.dims != q.dims || v.dims[0] != a.T || g.dims != std::vector<int64_t>{a.T, a.Hv} || beta.dims != g.dims) {
        throw Error("key must have query's shape " + dims_str(q.dims) + ", value " + std::to_string(a.T) +
                    " rows, g and beta shape (" + std::to_string(a.T) + ", " + std::to_string(a.Hv) + "); got key " +
                    dims_str(k.dims) + ", value " + dims_str(v.dims) + ", g " + dims_str(g.dims) + ", beta " +
                    dims_str(beta.dims));
    }
    if (lens.dims[0] != a.S || qsl.dims[0] != a.S + 1) {
        throw Error("state_slots " + dims_str(slots.dims) + ", context_lens " + dims_str(lens.dims) +
                    " and query_start_loc " + dims_str(qsl.dims) + " must describe the same S sequences");
    }
    a.q = static_cast<const float*>(q.data);
    a.k = static_cast<const float*>(k.data);
    a.v = static_cast<const float*>(v.data);
    a.g = static_cast<const float*>(g.data);
    a.beta = static_cast<const float*>(beta.data);
    a.q_row = a.k_row = q.dims[1];
    a.v_row = v.dims[1];
    a.g_row = a.beta_row = a.Hv;
    a.state_slots = static_cast<const int64_t*>(slots.data);
    a.context_lens = static_cast<const int64_t*>(lens.data);
    a.query_start_loc = static_cast<const int64_t*>(qsl.data);
    a.use_l2norm = kk.use_l2norm != 0;
    a.state = state_array(kk.state_idx, a.Hv * a.Dk * a.Dv, &a.num_slots, "GatedDeltaRule");
    if (a.S > 0 && a.query_start_loc[a.S] != a.T) {
        throw Error("query_start_loc[S] = " + std::to_string(a.query_start_loc[a.S]) + " but query has " +
                    std::to_string(a.T) + " rows");
    }
    llmc_rec::check_delta(a);
    const int64_t out_dims[2] = {a.T, a.Hv * a.Dv};
    a.out = output(ctx, out_dims, 2);
    struct Item {
        const llmc_rec::DeltaArgs* a;
    } item{&a};
    auto body = [](void* p, int64_t i) {
        const llmc_rec::DeltaArgs& x = *static_cast<const Item*>(p)->a;
        std::vector<float> scratch(2 * x.Dk + 2 * x.Dv);
        llmc_rec::gated_delta_rule_item(x, i / x.Hv, i % x.Hv, scratch.data());
    };
    const int64_t items = a.S * a.Hv;
    with_threads(ctx, [&](int, const llmc::ParallelFor* pf) {
        if (pf != nullptr && items > 1 && a.T * a.Hv * a.Dk * a.Dv >= (1 << 15)) {
            pf->fn(pf->self, items, body, &item);  // bodies never throw: checked above
        } else {
            for (int64_t i = 0; i < items; ++i) body(&item, i);
        }
    });
    g_state_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* delta_name(const OrtCustomOpV13*) { return "GatedDeltaRule"; }
int32_t delta_input_type(const OrtCustomOpV13*, size_t i) { return i < 5 ? kOrtFloat : kOrtInt64; }
size_t delta_input_count(const OrtCustomOpV13*) { return 8; }


// ---------------------------------------------------------------------------------------------
// llmc::SsdScan(x [T, H*P], B [T, G*N], C [T, G*N], dt [T, H], A_log [H], D [H], dt_bias [H], state_slots [S],
// context_lens [S], query_start_loc [S + 1]) -> [T, H*P]; attributes state_idx, num_heads, n_groups, dt_min, dt_max.
// State slot [H, P, N].

struct SsdKernel {
    int64_t state_idx = 0, num_heads = 0, n_groups = 0;
    float dt_min = 0.0f, dt_max = INFINITY;
};

void* create_ssd_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new SsdKernel();
    try {
        k->state_idx = int_attr(info, "state_idx", true, 0);
        k->num_heads = int_attr(info, "num_heads", true, 0);
        k->n_groups = int_attr(info, "n_groups", true, 0);
        k->dt_min = float_attr(info, "dt_min", 0.0f);
        k->dt_max = float_attr(info, "dt_max", INFINITY);
        if (k->num_heads <= 0 || k->n_groups <= 0 || k->num_heads % k->n_groups) {
            throw Error("num_heads (" + std::to_string(k->num_heads) + ") must be a positive multiple of n_groups (" +
                        std::to_string(k->n_groups) + ")");
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_ssd_kernel(void* kernel) { delete static_cast<SsdKernel*>(kernel); }

void compute_ssd(void* kernel, OrtKernelContext* ctx) {
    const SsdKernel& kk = *static_cast<const SsdKernel*>(kernel);
    const Tensor x = input(ctx, 0, "x"), b = input(ctx, 1, "B"), c = input(ctx, 2, "C"), dt = input(ctx, 3, "dt");
    const Tensor a_log = input(ctx, 4, "A_log"), d = input(ctx, 5, "D"), bias = input(ctx, 6, "dt_bias");
    const Tensor slots = input(ctx, 7, "state_slots"), lens = input(ctx, 8, "context_lens");
    const Tensor qsl = input(ctx, 9, "query_start_loc");
    for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"}, {&b, "B"}, {&c, "C"}, {&dt, "dt"}}) {
        require_rank(*t, 2, name);
    }
    require_rank(slots, 1, "state_slots");
    require_rank(lens, 1, "context_lens");
    require_rank(qsl, 1, "query_start_loc");
    llmc_rec::SsdArgs a;
    a.T = x.dims[0];
    a.S = slots.dims[0];
    a.H = kk.num_heads;
    a.G = kk.n_groups;
    if (x.dims[1] % a.H || b.dims[1] % a.G) {
        throw Error("x " + dims_str(x.dims) + " and B " + dims_str(b.dims) + " must have num_heads (" +
                    std::to_string(a.H) + ") and n_groups (" + std::to_string(a.G) + ") whole heads per row");
    }
    a.P = x.dims[1] / a.H;
    a.N = b.dims[1] / a.G;
    const std::vector<int64_t> heads{a.H};
    if (b.dims[0] != a.T || c.dims != b.dims || dt.dims != std::vector<int64_t>{a.T, a.H} || a_log.dims != heads ||
        d.dims != heads || bias.dims != heads) {
        throw Error("B and C must have shape (T, n_groups * N), dt (T, num_heads), A_log, D and dt_bias (num_heads,); "
                    "got B " + dims_str(b.dims) + ", C " + dims_str(c.dims) + ", dt " + dims_str(dt.dims) + ", A_log " +
                    dims_str(a_log.dims) + ", D " + dims_str(d.dims) + ", dt_bias " + dims_str(bias.dims));
    }
    if (lens.dims[0] != a.S || qsl.dims[0] != a.S + 1) {
        throw Error("state_slots " + dims_str(slots.dims) + ", context_lens " + dims_str(lens.dims) +
                    " and query_start_loc " + dims_str(qsl.dims) + " must describe the same S sequences");
    }
    a.x = static_cast<const float*>(x.data);
    a.b = static_cast<const float*>(b.data);
    a.c = static_cast<const float*>(c.data);
    a.dt = static_cast<const float*>(dt.data);
    a.a_log = static_cast<const float*>(a_log.data);
    a.d = static_cast<const float*>(d.data);
    a.dt_bias = static_cast<const float*>(bias.data);
    a.x_row = x.dims[1];
    a.bc_row = b.dims[1];
    a.dt_row = a.H;
    a.dt_min = kk.dt_min;
    a.dt_max = kk.dt_max;
    a.state_slots = static_cast<const int64_t*>(slots.data);
    a.context_lens = static_cast<const int64_t*>(lens.data);
    a.query_start_loc = static_cast<const int64_t*>(qsl.data);
    a.state = state_array(kk.state_idx, a.H * a.P * a.N, &a.num_slots, "SsdScan");
    if (a.S > 0 && a.query_start_loc[a.S] != a.T) {
        throw Error("query_start_loc[S] = " + std::to_string(a.query_start_loc[a.S]) + " but x has " +
                    std::to_string(a.T) + " rows");
    }
    llmc_rec::ConvArgs check;
    check.state_slots = a.state_slots;
    check.context_lens = a.context_lens;
    check.query_start_loc = a.query_start_loc;
    check.num_slots = a.num_slots;
    check.S = a.S;
    check.T = a.T;
    check.K = 1;
    llmc_rec::check_conv(check);
    const int64_t out_dims[2] = {a.T, a.H * a.P};
    a.out = output(ctx, out_dims, 2);
    struct Item {
        const llmc_rec::SsdArgs* a;
    } item{&a};
    auto body = [](void* p, int64_t i) {
        const llmc_rec::SsdArgs& s = *static_cast<const Item*>(p)->a;
        llmc_rec::ssd_scan_item(s, i / s.H, i % s.H);
    };
    const int64_t items = a.S * a.H;
    with_threads(ctx, [&](int, const llmc::ParallelFor* pf) {
        if (pf != nullptr && items > 1 && a.T * a.H * a.P * a.N >= (1 << 15)) {
            pf->fn(pf->self, items, body, &item);  // bodies never throw: checked above
        } else {
            for (int64_t i = 0; i < items; ++i) body(&item, i);
        }
    });
    g_state_calls.fetch_add(1, std::memory_order_relaxed);
}

const char* ssd_name(const OrtCustomOpV13*) { return "SsdScan"; }
int32_t ssd_input_type(const OrtCustomOpV13*, size_t i) { return i < 7 ? kOrtFloat : kOrtInt64; }
size_t ssd_input_count(const OrtCustomOpV13*) { return 10; }

}  // namespace

const OrtCustomOpV13 llmc_ort::kCausalConv1dOp = make_op(conv_name, conv_input_type, conv_input_count,
                                                         create_conv_kernel, compute_conv, destroy_conv_kernel,
                                                         conv_input_characteristic);
const OrtCustomOpV13 llmc_ort::kGatedDeltaRuleOp = make_op(delta_name, delta_input_type, delta_input_count,
                                                           create_delta_kernel, compute_delta, destroy_delta_kernel);
const OrtCustomOpV13 llmc_ort::kSsdScanOp = make_op(ssd_name, ssd_input_type, ssd_input_count, create_ssd_kernel,
                                                    compute_ssd, destroy_ssd_kernel);

// Bind the state pool every recurrent-state node of this process reads and writes: `num_arrays`
// float32 arrays, array i [num_slots, ...] with slot_elems[i] values per slot, C-contiguous. The arrays
// are referenced, not copied: the caller keeps them alive while bound. Returns 0, or -1 for an
// invalid argument (nothing bound then).
LLMC_EXPORT int llmc_bind_state_pool(int64_t num_arrays, void* const* arrays, const int64_t* slot_elems,
                                     int64_t num_slots) {
    if (num_arrays <= 0 || num_slots <= 0) return -1;
    StatePool pool;
    for (int64_t i = 0; i < num_arrays; ++i) {
        if (arrays[i] == nullptr || slot_elems[i] < 0) return -1;
        pool.arrays.push_back(static_cast<float*>(arrays[i]));
        pool.slot_elems.push_back(slot_elems[i]);
    }
    pool.num_slots = num_slots;
    std::lock_guard<std::mutex> lock(g_state_mutex);
    g_state = std::move(pool);
    return 0;
}

// Forget the bound state pool (a recurrent node that runs afterwards fails, naming the cause).
LLMC_EXPORT void llmc_unbind_state_pool() {
    std::lock_guard<std::mutex> lock(g_state_mutex);
    g_state = StatePool();
}

// Recurrent-state kernel calls completed since the library was loaded.
LLMC_EXPORT int64_t llmc_state_op_calls() { return g_state_calls.load(); }
