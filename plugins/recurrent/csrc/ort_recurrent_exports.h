// The C entry points of llmc's recurrent-state ops (see ort_recurrent.h), included at the end of
// plugins/paged_attention/csrc/ort_paged_attention.cpp, outside its anonymous namespace.

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
