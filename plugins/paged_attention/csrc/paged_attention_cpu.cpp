// CPU kernel of the PagedAttention plugin (llmc.plugins.paged_attention._cpu): the Python binding.
//
// The kernel itself (semantics, work items, attention loop) is paged_attention_core.h, shared with
// the native ONNX Runtime custom-op library (ort_paged_attention.cpp). This file checks the numpy
// arrays (dtype, layout, writeability), hands raw pointers to llmc_pa::run and releases the GIL
// while it runs. llmc_pa::Error (a std::invalid_argument) reaches Python as ValueError.
//
// Caches are numpy arrays owned by the caller and are never copied: a cache that cannot be used in
// place is rejected with ValueError.
//
// The module is compiled for the baseline ISA given in setup.py (x86-64-v2); the per-item
// attention loop is additionally compiled for AVX2+FMA and chosen at run time when the CPU has
// both, so the binary never executes an instruction the machine lacks.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <sstream>

#include "paged_attention_core.h"

namespace py = pybind11;

namespace {

using llmc_pa::fail;

// ---------------------------------------------------------------------------------------------
// Module state: thread count and ISA choice.

std::atomic<int> g_num_threads{0};  // 0: OpenMP's default
std::atomic<int> g_isa{llmc_pa::kBaseline};
const char* const kIsaNames[] = {"baseline", "avx2", "avx512"};

int effective_threads() {
    const int n = g_num_threads.load();
    return n > 0 ? n : omp_get_max_threads();
}

// ---------------------------------------------------------------------------------------------
// Validation helpers.

std::string shape_str(const py::array& a) {
    std::ostringstream os;
    os << "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
    if (a.ndim() == 1) os << ",";
    os << ")";
    return os.str();
}

std::string dtype_str(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

bool is_f32(const py::array& a) { return a.dtype().equal(py::dtype::of<float>()); }
bool is_f16(const py::array& a) { return a.dtype().equal(py::dtype("float16")); }

py::array as_ndarray(const py::object& obj, const char* name) {
    if (!py::isinstance<py::array>(obj)) {
        fail(std::string(name) + " must be a numpy.ndarray, got " +
             py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
    }
    return py::reinterpret_borrow<py::array>(obj);
}

// A float32 2-D input (query/key/value). These are inputs, so a copy is allowed when the rows
// themselves are not contiguous; rows may be strided (e.g. views into a fused QKV tensor).
py::array float_rows(const py::object& obj, const char* name, int64_t& row_stride) {
    py::array a = as_ndarray(obj, name);
    if (!is_f32(a)) fail(std::string(name) + " must be float32, got " + dtype_str(a));
    if (a.ndim() != 2) fail(std::string(name) + " must be 2-D, got shape " + shape_str(a));
    const bool aligned = reinterpret_cast<uintptr_t>(a.data()) % alignof(float) == 0;
    const bool inner_ok = a.shape(1) <= 1 || a.strides(1) == static_cast<py::ssize_t>(sizeof(float));
    const bool row_ok = a.strides(0) >= 0 && a.strides(0) % static_cast<py::ssize_t>(sizeof(float)) == 0;
    if (!(aligned && inner_ok && row_ok)) {
        a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
        if (!a) throw py::error_already_set();
    }
    row_stride = a.shape(0) <= 1 ? a.shape(1) : a.strides(0) / static_cast<py::ssize_t>(sizeof(float));
    return a;
}

// An integer metadata array, as contiguous int64 (a copy when it is another integer type).
py::array_t<int64_t> int_array(const py::object& obj, const char* name, int ndim) {
    py::array a = as_ndarray(obj, name);
    const char kind = a.dtype().kind();
    if (kind != 'i' && kind != 'u') fail(std::string(name) + " must be an integer array, got " + dtype_str(a));
    if (a.ndim() != ndim) {
        fail(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " + shape_str(a));
    }
    auto out = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!out) throw py::error_already_set();
    return out;
}

// A KV cache: used in place, so it must be exactly what the kernel addresses.
py::array cache_array(const py::object& obj, const char* name) {
    py::array a = as_ndarray(obj, name);
    if (!is_f32(a) && !is_f16(a)) {
        fail(std::string(name) + " must be float32 or float16 (native byte order), got " + dtype_str(a) +
             "; caches are written in place and are never converted or copied");
    }
    if (a.ndim() != 4) {
        fail(std::string(name) + " must be 4-D [num_blocks, num_kv_heads, block_size, head_size], got shape " +
             shape_str(a));
    }
    if (!(a.flags() & py::array::c_style)) {
        fail(std::string(name) + " must be C-contiguous (it is written in place and never copied)");
    }
    if (!a.writeable()) fail(std::string(name) + " must be writeable (it is written in place)");
    if (reinterpret_cast<uintptr_t>(a.data()) % a.itemsize() != 0) fail(std::string(name) + " is not aligned");
    return a;
}


// ---------------------------------------------------------------------------------------------

py::array_t<float> forward(const py::object& query_obj, const py::object& key_obj, const py::object& value_obj,
                           const py::object& slot_obj, const py::object& bt_obj, const py::object& ctx_obj,
                           const py::object& qsl_obj, const py::object& kc_obj, const py::object& vc_obj,
                           int64_t num_heads, int64_t num_kv_heads, double scale_d, int64_t sliding_window,
                           double softcap_d, const py::object& sinks_obj, double alibi_max_bias,
                           int64_t attention_chunk, const py::object& attend_end_obj) {
    // --- heads and caches
    llmc_pa::check_heads(num_heads, num_kv_heads);
    // Attention sinks: None, or one float32 logit per query head.
    py::array_t<float> sinks;
    if (!sinks_obj.is_none()) {
        py::array s = as_ndarray(sinks_obj, "sinks");
        if (!is_f32(s)) fail("sinks must be float32, got " + dtype_str(s));
        if (s.ndim() != 1 || s.shape(0) != num_heads) {
            fail("sinks must have shape (" + std::to_string(num_heads) + ",) = (num_heads,), got " + shape_str(s));
        }
        sinks = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(s);
        if (!sinks) throw py::error_already_set();
    }
    py::array k_cache = cache_array(kc_obj, "k_cache");
    py::array v_cache = cache_array(vc_obj, "v_cache");
    if (!k_cache.dtype().equal(v_cache.dtype())) {
        fail("k_cache and v_cache must have the same dtype, got " + dtype_str(k_cache) + " and " +
             dtype_str(v_cache));
    }
    for (int i = 0; i < 4; ++i) {
        if (k_cache.shape(i) != v_cache.shape(i)) {
            fail("k_cache and v_cache must have the same shape, got " + shape_str(k_cache) + " and " +
                 shape_str(v_cache));
        }
    }
    const int64_t num_blocks = k_cache.shape(0), block_size = k_cache.shape(2), D = k_cache.shape(3);
    if (k_cache.shape(1) != num_kv_heads) {
        fail("k_cache has " + std::to_string(k_cache.shape(1)) + " KV heads (shape " + shape_str(k_cache) +
             ") but num_kv_heads=" + std::to_string(num_kv_heads));
    }
    if (block_size <= 0 || D <= 0) fail("cache block_size and head_size must be positive, got " + shape_str(k_cache));

    // --- query / key / value
    int64_t q_row = 0, k_row = 0, v_row = 0;
    py::array query = float_rows(query_obj, "query", q_row);
    py::array key = float_rows(key_obj, "key", k_row);
    py::array value = float_rows(value_obj, "value", v_row);
    const int64_t T = query.shape(0);
    if (query.shape(1) != num_heads * D) {
        fail("query must have num_heads * head_size = " + std::to_string(num_heads) + " * " + std::to_string(D) +
             " = " + std::to_string(num_heads * D) + " columns, got shape " + shape_str(query));
    }
    for (const auto& [arr, nm] : {std::pair<const py::array*, const char*>{&key, "key"}, {&value, "value"}}) {
        if (arr->shape(0) != T || arr->shape(1) != num_kv_heads * D) {
            fail(std::string(nm) + " must have shape (" + std::to_string(T) + ", " +
                 std::to_string(num_kv_heads * D) + ") = (T, num_kv_heads * head_size), got " + shape_str(*arr));
        }
    }

    // --- metadata
    auto slots = int_array(slot_obj, "slot_mapping", 1);
    auto block_tables = int_array(bt_obj, "block_tables", 2);
    auto context_lens = int_array(ctx_obj, "context_lens", 1);
    auto qsl = int_array(qsl_obj, "query_start_loc", 1);
    if (slots.shape(0) != T) {
        fail("slot_mapping must have one entry per row of query (" + std::to_string(T) + "), got shape " +
             shape_str(slots));
    }
    const int64_t S = context_lens.shape(0);
    if (qsl.shape(0) != S + 1) {
        fail("query_start_loc must have len(context_lens) + 1 = " + std::to_string(S + 1) + " entries, got shape " +
             shape_str(qsl));
    }
    if (block_tables.shape(0) < S) {
        fail("block_tables must have a row per sequence (" + std::to_string(S) + "), got shape " +
             shape_str(block_tables));
    }

    // Bidirectional spans: None, or one integer per query row (the kernel checks each against its context).
    py::array_t<int64_t> attend_end;
    if (!attend_end_obj.is_none()) {
        attend_end = int_array(attend_end_obj, "attend_end", 1);
        if (attend_end.shape(0) != T) {
            fail("attend_end must have one entry per row of query (" + std::to_string(T) + "), got shape " +
                 shape_str(attend_end));
        }
    }

    py::array_t<float> out({T, num_heads * D});
    llmc_pa::Args a{};
    a.query = static_cast<const float*>(query.data());
    a.key = static_cast<const float*>(key.data());
    a.value = static_cast<const float*>(value.data());
    a.q_row = q_row;
    a.k_row = k_row;
    a.v_row = v_row;
    a.T = T;
    a.slot_mapping = slots.data();
    a.block_tables = block_tables.data();
    a.bt_rows = block_tables.shape(0);
    a.bt_cols = block_tables.shape(1);
    a.context_lens = context_lens.data();
    a.query_start_loc = qsl.data();
    a.S = S;
    a.k_cache = k_cache.mutable_data();
    a.v_cache = v_cache.mutable_data();
    a.half = is_f16(k_cache);
    a.num_blocks = num_blocks;
    a.block_size = block_size;
    a.head_size = D;
    a.out = out.mutable_data();
    a.num_heads = num_heads;
    a.num_kv_heads = num_kv_heads;
    a.scale = static_cast<float>(scale_d);
    a.sliding_window = sliding_window;
    a.softcap = static_cast<float>(softcap_d);
    a.sinks = sinks_obj.is_none() ? nullptr : sinks.data();
    a.alibi_max_bias = static_cast<float>(alibi_max_bias);
    a.attention_chunk = attention_chunk;
    a.attend_end = attend_end_obj.is_none() ? nullptr : attend_end.data();
    const int nthreads = effective_threads();
    const auto isa = static_cast<llmc_pa::Isa>(g_isa.load());
    {
        py::gil_scoped_release nogil;  // run() touches no Python object; an Error re-takes the GIL on unwind
        llmc_pa::run(a, nthreads, isa);
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
    m.doc() = "CPU kernel of the llmc PagedAttention plugin (see llmc.plugins.paged_attention.reference).";
    g_isa = llmc_pa::best_isa();

    m.def("forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("slot_mapping"),
          py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("scale"),
          py::arg("sliding_window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
          py::arg("alibi_max_bias") = 0.0, py::arg("attention_chunk") = 0, py::arg("attend_end") = py::none(),
          R"doc(Write the new K/V into k_cache/v_cache in place, then attend; returns [T, num_heads * head_size] float32.

Same semantics as llmc.plugins.paged_attention.reference.paged_attention. query/key/value are float32
[T, H * head_size]; the caches are C-contiguous, writeable float32 or float16 arrays
[num_blocks, num_kv_heads, block_size, head_size], used in place (never copied). Metadata arrays are integer
(int64 preferred). sinks: None or float32 [num_heads] attention-sink logits (exp(sinks[h]) joins head h's softmax
denominator). alibi_max_bias > 0: ALiBi with the standard slopes of that maximum bias (slope[h] * (key position -
query position) joins the scores). attention_chunk > 0: a query at position p sees keys [floor(p / C) * C, p].
attend_end: None or integer [T]: row t at position p also sees keys p < k < attend_end[t] (each <= its sequence's
context_lens; the window / chunk lower bound still applies). Raises ValueError on any inconsistent shape or out-of-range index, before writing anything.)doc");

    m.def(
        "set_num_threads",
        [](int n) {
            if (n < 0) throw py::value_error("set_num_threads: n must be >= 1 (or 0 for the OpenMP default)");
            g_num_threads = n;
        },
        py::arg("n"), "Threads used by forward(); 0 restores the OpenMP default (OMP_NUM_THREADS / all cores).");
    m.def("get_num_threads", &effective_threads, "Threads forward() will use.");

    m.def(
        "get_isa", []() { return std::string(kIsaNames[g_isa.load()]); },
        "Instruction set of the attention loops in use: 'avx512' (the tiled loop at width 16; AVX2 elsewhere), "
        "'avx2' (AVX2+FMA) or 'baseline' (x86-64-v2).");
    m.def(
        "_set_isa",
        [](const std::string& isa) {
            const int best = llmc_pa::best_isa();
            if (isa == "auto") {
                g_isa = best;
                return;
            }
            for (int i = 0; i <= llmc_pa::kAvx512; ++i) {
                if (isa != kIsaNames[i]) continue;
                if (i > best) throw py::value_error("_set_isa: this CPU cannot run '" + isa + "'");
                g_isa = i;
                return;
            }
            throw py::value_error("_set_isa: expected 'baseline', 'avx2', 'avx512' or 'auto', got '" + isa + "'");
        },
        py::arg("isa"), "Testing hook: force the 'baseline', 'avx2' or 'avx512' code path, or 'auto'.");
}
