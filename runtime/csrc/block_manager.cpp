// KV block manager of the llmc runtime (llmc.runtime._block_manager).
//
// Semantics are those of llmc/runtime/block_manager_ref.py (the Python reference model, tested
// against this on random operation sequences). Summary:
//
// Blocks. A pool of `num_blocks` fixed-size KV blocks with reference counts. A block is either
//   - in use (ref > 0),
//   - free (ref == 0, holds nothing worth keeping; on the free list, a stack that hands out low
//     ids first), or
//   - evictable (ref == 0, but holds a full, computed block that is registered in the prefix
//     cache; on an LRU list ordered by the time it became unused).
//   Allocation takes free blocks first, then evicts least-recently-used cached blocks; it is
//   all-or-nothing.
//
// Prefix cache. A full block whose KV has been computed is registered under a 64-bit hash of its
//   tokens chained to the previous block's hash (the first block chains to 0). The block also
//   keeps its tokens and its parent hash, and a lookup compares them, so a hash collision can
//   never hand out wrong KV: it is a miss. Only one block is registered per hash; a second block
//   with the same content (two identical prompts computed in the same step) stays unregistered.
//
// Cache events. With record_events(true), every registration (stored: hash, parent hash, tokens)
//   and every unregistration (removed: hash; eviction, reset, rewind) is logged in order until
//   drain_events() takes them: what a replica publishes for routers outside the process (vLLM's
//   KV-event stream, serve/kv_events.py). cached_hashes() lists the registered hashes.
//
// Sequences. A sequence owns a block table, its token list (prompt and generated tokens) and the
//   number of tokens whose KV is computed. `add_sequence` reuses every cached block of the
//   prompt's prefix (never the block holding the last prompt token, whose logits must be
//   computed), `append_slots` reserves slots for the next tokens, `mark_computed` advances the
//   computed count and registers newly full blocks, `rewind` drops a sequence's trailing tokens
//   (rejected speculative tokens) and the blocks that held only them. `fork` shares the parent's computed blocks
//   with a child (reference counts); the first write into a shared partially filled block
//   copies it (copy-on-write): `append_slots` returns the (src, dst) pairs whose KV the caller
//   must copy before running the step.
//
// Errors: bad arguments raise ValueError/KeyError; allocate() raises MemoryError when the pool
// is short (nothing is taken then); add_sequence/append_slots return False/None instead, since
// the scheduler handles shortage by preemption.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t NIL = -1;

// splitmix64's finaliser: a fast bijective 64-bit mixer.
inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t hash_block(uint64_t parent, const int32_t* tokens, int64_t n) {
    uint64_t h = mix64(parent);
    for (int64_t i = 0; i < n; ++i) h = mix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])));
    return h;
}

[[noreturn]] void raise_memory_error(const std::string& msg) {
    PyErr_SetString(PyExc_MemoryError, msg.c_str());
    throw py::error_already_set();
}

struct Block {
    int32_t ref = 0;
    bool hashed = false;
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    std::vector<int32_t> tokens;  // the block's tokens while hashed (to verify lookups)
    int32_t lru_prev = NIL;
    int32_t lru_next = NIL;
    bool in_lru = false;
};

struct CacheEvent {
    int32_t kind;  // 0 stored, 1 removed
    uint64_t hash;
    uint64_t parent;
    std::vector<int32_t> tokens;
};

struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int32_t> blocks;
    int64_t num_computed = 0;
    std::vector<uint64_t> hashes;  // chained hashes of the leading full computed blocks
    uint64_t root = 0;  // what the first block chains to: 0, or a key (a LoRA adapter) that KV depends on
};

class BlockManager {
   public:
    BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching)
        : block_size_(block_size), prefix_caching_(enable_prefix_caching) {
        if (num_blocks < 1) throw py::value_error("BlockManager: num_blocks must be >= 1");
        if (block_size < 1) throw py::value_error("BlockManager: block_size must be >= 1");
        if (num_blocks > INT32_MAX) throw py::value_error("BlockManager: num_blocks must fit in int32");
        blocks_.resize(static_cast<size_t>(num_blocks));
        free_.reserve(static_cast<size_t>(num_blocks));
        for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
    }

    // -- pool ---------------------------------------------------------------------------------

    int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
    int64_t block_size() const { return block_size_; }
    bool prefix_caching() const { return prefix_caching_; }
    int64_t num_free_blocks() const { return static_cast<int64_t>(free_.size()) + num_evictable_; }
    int64_t num_evictable_blocks() const { return num_evictable_; }
    int64_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
    int64_t num_cached_blocks() const { return static_cast<int64_t>(cache_.size()); }

    int32_t ref_count(int64_t block) const { return blocks_[check_block(block)].ref; }
    bool is_cached(int64_t block) const { return blocks_[check_block(block)].hashed; }

    std::vector<int32_t> allocate(int64_t n) {
        if (n < 0) throw py::value_error("allocate: n must be >= 0");
        if (n > num_free_blocks()) {
            std::ostringstream msg;
            msg << "KV pool exhausted: need " << n << " blocks, " << num_free_blocks() << " free of "
                << num_blocks();
            raise_memory_error(msg.str());
        }
        std::vector<int32_t> out;
        out.reserve(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) out.push_back(take_one());
        return out;
    }

    void free(const std::vector<int32_t>& blocks) {
        // Validate everything first (a block listed twice needs two references) so an error frees nothing.
        std::unordered_map<int32_t, int32_t> count;
        for (int32_t b : blocks) {
            check_block(b);
            if (++count[b] > blocks_[b].ref)
                throw py::value_error("free: block " + std::to_string(b) + " is not in use (or freed twice)");
        }
        // Reverse order: the free list is a stack, so the first block is handed out first again,
        // and the tail of a cached chain is evicted before its head.
        for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) release(*it);
    }

    void incref(int64_t block) {
        Block& b = blocks_[check_block(block)];
        if (b.ref == 0) {
            if (!b.in_lru) throw py::value_error("incref: block " + std::to_string(block) + " is free");
            lru_remove(static_cast<int32_t>(block));
        }
        ++b.ref;
    }

    // Drop every cached block that is not in use (they become free); in-use blocks keep their hash.
    void reset_prefix_cache() {
        while (lru_head_ != NIL) {
            int32_t b = lru_head_;
            lru_remove(b);
            unregister(b);
            free_.push_back(b);
        }
    }

    // -- prefix cache -------------------------------------------------------------------------

    static uint64_t py_hash_block(uint64_t parent, const std::vector<int32_t>& tokens) {
        return hash_block(parent, tokens.data(), static_cast<int64_t>(tokens.size()));
    }

    // Tokens of `tokens`' prefix that add_sequence would take from the cache (a multiple of
    // block_size, at most len - 1). No side effects.
    int64_t cached_prefix_tokens(const std::vector<int32_t>& tokens, uint64_t root) const {
        return static_cast<int64_t>(lookup(tokens, root).size()) * block_size_;
    }

    int64_t prefix_queries() const { return prefix_queries_; }
    int64_t prefix_hits() const { return prefix_hits_; }
    int64_t evictions() const { return evictions_; }
    int64_t cow_copies() const { return cow_copies_; }

    std::vector<uint64_t> cached_hashes() const {
        std::vector<uint64_t> out;
        out.reserve(cache_.size());
        for (const auto& kv : cache_) out.push_back(kv.first);
        return out;
    }

    void record_events(bool on) {
        record_events_ = on;
        if (!on) events_.clear();
    }

    // [(kind, hash, parent_hash, tokens)], kind 0 = stored, 1 = removed (parent 0, no tokens); oldest first.
    py::list drain_events() {
        py::list out;
        for (const CacheEvent& e : events_)
            out.append(py::make_tuple(e.kind, e.hash, e.parent, py::cast(e.tokens)));
        events_.clear();
        return out;
    }

    // -- sequences ----------------------------------------------------------------------------

    // Create a sequence from its tokens, reuse its cached prefix, and reserve slots for the next
    // `num_new_tokens` tokens after it. Returns the number of cached tokens, or -1 (and changes
    // nothing) when the pool is short. Raises if cached + num_new_tokens exceeds the tokens.
    // `root` keys the chain: blocks of sequences with other roots are never shared (KV computed with a LoRA
    // adapter differs from the base model's for the same tokens).
    int64_t add_sequence(int64_t seq_id, const std::vector<int32_t>& tokens, int64_t num_new_tokens, uint64_t root) {
        if (seqs_.count(seq_id)) throw py::value_error("add_sequence: sequence " + std::to_string(seq_id) + " exists");
        if (tokens.empty()) throw py::value_error("add_sequence: tokens is empty");
        if (num_new_tokens < 0) throw py::value_error("add_sequence: num_new_tokens must be >= 0");
        std::vector<std::pair<int32_t, uint64_t>> hits = lookup(tokens, root);
        const int64_t cached = static_cast<int64_t>(hits.size()) * block_size_;
        if (cached + num_new_tokens > static_cast<int64_t>(tokens.size())) {
            std::ostringstream msg;
            msg << "add_sequence: " << cached << " cached + " << num_new_tokens << " new tokens exceed the "
                << tokens.size() << " tokens of sequence " << seq_id << " (ask cached_prefix_tokens first)";
            throw py::value_error(msg.str());
        }
        const int64_t total_blocks = ceil_div(cached + num_new_tokens);
        const int64_t new_blocks = total_blocks - static_cast<int64_t>(hits.size());
        int64_t revived = 0;  // hits that are evictable now stop being available for allocation
        for (auto& hb : hits) revived += blocks_[hb.first].ref == 0;
        if (new_blocks > num_free_blocks() - revived) return -1;

        Sequence seq;
        seq.tokens = tokens;
        seq.root = root;
        for (auto& hb : hits) {
            incref(hb.first);
            seq.blocks.push_back(hb.first);
            seq.hashes.push_back(hb.second);
        }
        for (int64_t i = 0; i < new_blocks; ++i) seq.blocks.push_back(take_one());
        seq.num_computed = cached;
        if (prefix_caching_) {
            prefix_queries_ += (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
            prefix_hits_ += static_cast<int64_t>(hits.size());
        }
        seqs_.emplace(seq_id, std::move(seq));
        return cached;
    }

    // New blocks that append_slots(seq_id, n) would take (including a copy-on-write copy).
    int64_t blocks_needed(int64_t seq_id, int64_t n) const {
        const Sequence& s = get(seq_id);
        if (n < 0) throw py::value_error("blocks_needed: n must be >= 0");
        return needed(s, n);
    }

    // Reserve slots for the next `n` tokens. Returns the (src, dst) block copies the caller must
    // perform in the KV pool before writing (copy-on-write), or None (nothing changed) when the
    // pool is short.
    std::optional<std::vector<std::pair<int32_t, int32_t>>> append_slots(int64_t seq_id, int64_t n) {
        Sequence& s = get(seq_id);
        if (n < 0) throw py::value_error("append_slots: n must be >= 0");
        if (s.num_computed + n > static_cast<int64_t>(s.tokens.size())) {
            std::ostringstream msg;
            msg << "append_slots: sequence " << seq_id << " has " << s.tokens.size() << " tokens, "
                << s.num_computed << " computed; cannot reserve " << n << " more";
            throw py::value_error(msg.str());
        }
        if (needed(s, n) > num_free_blocks()) return std::nullopt;
        std::vector<std::pair<int32_t, int32_t>> copies;
        if (n > 0) {
            const int64_t first = s.num_computed / block_size_;
            if (first < static_cast<int64_t>(s.blocks.size()) && blocks_[s.blocks[first]].ref > 1) {
                const int32_t src = s.blocks[first];
                const int32_t dst = take_one();
                release(src);
                s.blocks[first] = dst;
                copies.emplace_back(src, dst);
                ++cow_copies_;
            }
        }
        const int64_t target = ceil_div(s.num_computed + n);
        while (static_cast<int64_t>(s.blocks.size()) < target) s.blocks.push_back(take_one());
        return copies;
    }

    // The next `n` reserved tokens now have their KV in the cache; newly full blocks enter the
    // prefix cache.
    void mark_computed(int64_t seq_id, int64_t n) {
        Sequence& s = get(seq_id);
        if (n < 0) throw py::value_error("mark_computed: n must be >= 0");
        const int64_t nc = s.num_computed + n;
        if (nc > static_cast<int64_t>(s.blocks.size()) * block_size_ || nc > static_cast<int64_t>(s.tokens.size())) {
            std::ostringstream msg;
            msg << "mark_computed: sequence " << seq_id << " would have " << nc << " computed tokens but has "
                << s.tokens.size() << " tokens and " << s.blocks.size() * block_size_ << " slots";
            throw py::value_error(msg.str());
        }
        s.num_computed = nc;
        if (!prefix_caching_) return;
        const int64_t full = nc / block_size_;
        for (int64_t i = static_cast<int64_t>(s.hashes.size()); i < full; ++i) {
            const uint64_t parent = i == 0 ? s.root : s.hashes[static_cast<size_t>(i - 1)];
            const int32_t* toks = s.tokens.data() + i * block_size_;
            const uint64_t h = hash_block(parent, toks, block_size_);
            s.hashes.push_back(h);
            Block& b = blocks_[s.blocks[static_cast<size_t>(i)]];
            if (b.hashed || cache_.count(h)) continue;
            b.hashed = true;
            b.hash = h;
            b.parent_hash = parent;
            b.tokens.assign(toks, toks + block_size_);
            cache_.emplace(h, s.blocks[static_cast<size_t>(i)]);
            if (record_events_) events_.push_back(CacheEvent{0, h, parent, b.tokens});
        }
    }

    void append_token(int64_t seq_id, int64_t token) {
        if (token < 0 || token > INT32_MAX) throw py::value_error("append_token: token id out of range");
        get(seq_id).tokens.push_back(static_cast<int32_t>(token));
    }

    // Speculative decoding: keep the first `num_tokens` tokens and drop the rest (rejected draft
    // tokens). The computed count drops to at most `num_tokens`; blocks past the last kept token are
    // released (a registered one keeps its hash: its KV is right for the tokens it was hashed with).
    // The block holding the last kept token and some dropped ones will have its tail overwritten, so it
    // leaves the prefix cache if this sequence alone holds it (a shared one is copied on the next write).
    void rewind(int64_t seq_id, int64_t num_tokens) {
        Sequence& s = get(seq_id);
        if (num_tokens < 1 || num_tokens > static_cast<int64_t>(s.tokens.size()))
            throw py::value_error("rewind: num_tokens must be in [1, number of tokens]");
        s.tokens.resize(static_cast<size_t>(num_tokens));
        s.num_computed = std::min(s.num_computed, num_tokens);
        const size_t keep = static_cast<size_t>(ceil_div(num_tokens));
        while (s.blocks.size() > keep) {
            release(s.blocks.back());
            s.blocks.pop_back();
        }
        const int64_t full = num_tokens / block_size_;
        if (static_cast<int64_t>(s.hashes.size()) > full) s.hashes.resize(static_cast<size_t>(full));
        if (num_tokens % block_size_ != 0 && static_cast<int64_t>(s.blocks.size()) > full) {
            const int32_t b = s.blocks[static_cast<size_t>(full)];
            if (blocks_[b].ref == 1) unregister(b);
        }
    }

    void fork(int64_t parent_id, int64_t child_id) {
        if (seqs_.count(child_id)) throw py::value_error("fork: sequence " + std::to_string(child_id) + " exists");
        const Sequence& p = get(parent_id);
        Sequence c;
        c.tokens = p.tokens;
        c.num_computed = p.num_computed;
        c.hashes = p.hashes;
        c.root = p.root;
        const int64_t shared = std::min<int64_t>(ceil_div(p.num_computed), static_cast<int64_t>(p.blocks.size()));
        c.blocks.assign(p.blocks.begin(), p.blocks.begin() + shared);
        for (int32_t b : c.blocks) incref(b);
        seqs_.emplace(child_id, std::move(c));
    }

    void free_sequence(int64_t seq_id) {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) throw py::key_error("free_sequence: no sequence " + std::to_string(seq_id));
        const std::vector<int32_t>& bl = it->second.blocks;
        for (auto b = bl.rbegin(); b != bl.rend(); ++b) release(*b);
        seqs_.erase(it);
    }

    bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) > 0; }
    int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }
    std::vector<int32_t> block_table(int64_t seq_id) const { return get(seq_id).blocks; }
    std::vector<int32_t> sequence_tokens(int64_t seq_id) const { return get(seq_id).tokens; }
    int64_t num_computed(int64_t seq_id) const { return get(seq_id).num_computed; }
    int64_t num_tokens(int64_t seq_id) const { return static_cast<int64_t>(get(seq_id).tokens.size()); }

    // Step inputs for sequences `seq_ids`, each computing its next `counts[i]` tokens (slots must be
    // reserved): input_ids, positions, slot_mapping [T]; block_tables [S, max_blocks] (padded with
    // 0); context_lens [S]; query_start_loc [S + 1]. All int64.
    py::tuple prepare_step(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts) const {
        if (seq_ids.size() != counts.size()) throw py::value_error("prepare_step: seq_ids and counts differ in length");
        const size_t S = seq_ids.size();
        std::vector<const Sequence*> seqs(S);
        int64_t total = 0, width = 1;
        for (size_t i = 0; i < S; ++i) {
            seqs[i] = &get(seq_ids[i]);
            const int64_t ctx = seqs[i]->num_computed + counts[i];
            if (counts[i] < 0 || ctx > static_cast<int64_t>(seqs[i]->tokens.size()) ||
                ctx > static_cast<int64_t>(seqs[i]->blocks.size()) * block_size_)
                throw py::value_error("prepare_step: sequence " + std::to_string(seq_ids[i]) +
                                      " has no reserved slots for " + std::to_string(counts[i]) + " tokens");
            total += counts[i];
            width = std::max(width, ceil_div(ctx));
        }
        py::array_t<int64_t> ids(total), pos(total), slots(total), ctx_lens(static_cast<py::ssize_t>(S)),
            qsl(static_cast<py::ssize_t>(S + 1));
        py::array_t<int64_t> tables({static_cast<py::ssize_t>(S), static_cast<py::ssize_t>(width)});
        int64_t *pi = ids.mutable_data(), *pp = pos.mutable_data(), *ps = slots.mutable_data();
        int64_t *pc = ctx_lens.mutable_data(), *pq = qsl.mutable_data(), *pt = tables.mutable_data();
        std::fill(pt, pt + S * width, 0);
        int64_t t = 0;
        pq[0] = 0;
        for (size_t i = 0; i < S; ++i) {
            const Sequence& s = *seqs[i];
            for (int64_t k = 0; k < counts[i]; ++k, ++t) {
                const int64_t p = s.num_computed + k;
                pi[t] = s.tokens[static_cast<size_t>(p)];
                pp[t] = p;
                ps[t] = static_cast<int64_t>(s.blocks[static_cast<size_t>(p / block_size_)]) * block_size_ +
                        p % block_size_;
            }
            const int64_t ctx = s.num_computed + counts[i];
            const int64_t nb = ceil_div(ctx);
            for (int64_t k = 0; k < nb; ++k) pt[i * width + k] = s.blocks[static_cast<size_t>(k)];
            pc[i] = ctx;
            pq[i + 1] = t;
        }
        return py::make_tuple(ids, pos, slots, tables, ctx_lens, qsl);
    }

   private:
    int64_t ceil_div(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

    int64_t check_block(int64_t b) const {
        if (b < 0 || b >= num_blocks())
            throw py::value_error("block id " + std::to_string(b) + " out of range [0, " +
                                  std::to_string(num_blocks()) + ")");
        return b;
    }

    const Sequence& get(int64_t seq_id) const {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(seq_id));
        return it->second;
    }
    Sequence& get(int64_t seq_id) {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) throw py::key_error("no sequence " + std::to_string(seq_id));
        return it->second;
    }

    int64_t needed(const Sequence& s, int64_t n) const {
        int64_t need = std::max<int64_t>(0, ceil_div(s.num_computed + n) - static_cast<int64_t>(s.blocks.size()));
        if (n > 0) {
            const int64_t first = s.num_computed / block_size_;
            if (first < static_cast<int64_t>(s.blocks.size()) && blocks_[s.blocks[first]].ref > 1) ++need;
        }
        return need;
    }

    std::vector<std::pair<int32_t, uint64_t>> lookup(const std::vector<int32_t>& tokens, uint64_t root) const {
        std::vector<std::pair<int32_t, uint64_t>> hits;
        if (!prefix_caching_ || tokens.empty()) return hits;
        // Never the block holding the last token: its logits have to be computed.
        const int64_t max_blocks = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
        uint64_t parent = root;
        for (int64_t i = 0; i < max_blocks; ++i) {
            const int32_t* toks = tokens.data() + i * block_size_;
            const uint64_t h = hash_block(parent, toks, block_size_);
            auto it = cache_.find(h);
            if (it == cache_.end()) break;
            const Block& b = blocks_[it->second];
            if (b.parent_hash != parent || !std::equal(toks, toks + block_size_, b.tokens.begin())) break;
            hits.emplace_back(it->second, h);
            parent = h;
        }
        return hits;
    }

    int32_t take_one() {
        int32_t b;
        if (!free_.empty()) {
            b = free_.back();
            free_.pop_back();
        } else if (lru_head_ != NIL) {
            b = lru_head_;
            lru_remove(b);
            unregister(b);
            ++evictions_;
        } else {
            raise_memory_error("KV pool exhausted");  // callers check first; kept as a safety net
        }
        blocks_[b].ref = 1;
        return b;
    }

    void release(int32_t b) {
        Block& blk = blocks_[b];
        if (blk.ref <= 0) throw py::value_error("release: block " + std::to_string(b) + " is not in use");
        if (--blk.ref > 0) return;
        if (blk.hashed) {
            lru_push_back(b);
        } else {
            free_.push_back(b);
        }
    }

    void unregister(int32_t b) {
        Block& blk = blocks_[b];
        if (!blk.hashed) return;
        auto it = cache_.find(blk.hash);
        if (it != cache_.end() && it->second == b) {
            cache_.erase(it);
            if (record_events_) events_.push_back(CacheEvent{1, blk.hash, 0, {}});
        }
        blk.hashed = false;
        blk.tokens.clear();
    }

    void lru_push_back(int32_t b) {
        Block& blk = blocks_[b];
        blk.lru_prev = lru_tail_;
        blk.lru_next = NIL;
        if (lru_tail_ != NIL) blocks_[lru_tail_].lru_next = b;
        lru_tail_ = b;
        if (lru_head_ == NIL) lru_head_ = b;
        blk.in_lru = true;
        ++num_evictable_;
    }

    void lru_remove(int32_t b) {
        Block& blk = blocks_[b];
        if (blk.lru_prev != NIL) blocks_[blk.lru_prev].lru_next = blk.lru_next;
        else lru_head_ = blk.lru_next;
        if (blk.lru_next != NIL) blocks_[blk.lru_next].lru_prev = blk.lru_prev;
        else lru_tail_ = blk.lru_prev;
        blk.lru_prev = blk.lru_next = NIL;
        blk.in_lru = false;
        --num_evictable_;
    }

    int64_t block_size_;
    bool prefix_caching_;
    std::vector<Block> blocks_;
    std::vector<int32_t> free_;
    int32_t lru_head_ = NIL;
    int32_t lru_tail_ = NIL;
    int64_t num_evictable_ = 0;
    std::unordered_map<uint64_t, int32_t> cache_;
    std::unordered_map<int64_t, Sequence> seqs_;
    int64_t prefix_queries_ = 0, prefix_hits_ = 0, evictions_ = 0, cow_copies_ = 0;
    bool record_events_ = false;
    std::vector<CacheEvent> events_;
};

}  // namespace

PYBIND11_MODULE(_block_manager, m) {
    m.doc() = "KV block manager of the llmc runtime (see llmc.runtime.block_manager_ref for the semantics).";
    m.def("hash_block", &BlockManager::py_hash_block, py::arg("parent_hash"), py::arg("tokens"),
          "Chained 64-bit hash of one block's tokens (parent_hash is 0 for the first block).");

    py::class_<BlockManager>(m, "BlockManager")
        .def(py::init<int64_t, int64_t, bool>(), py::arg("num_blocks"), py::arg("block_size") = 16,
             py::arg("enable_prefix_caching") = true)
        .def_property_readonly("num_blocks", &BlockManager::num_blocks)
        .def_property_readonly("block_size", &BlockManager::block_size)
        .def_property_readonly("enable_prefix_caching", &BlockManager::prefix_caching)
        .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks,
                               "Blocks available to allocate: free plus evictable cached ones.")
        .def_property_readonly("num_evictable_blocks", &BlockManager::num_evictable_blocks)
        .def_property_readonly("num_used_blocks", &BlockManager::num_used_blocks)
        .def_property_readonly("num_cached_blocks", &BlockManager::num_cached_blocks,
                               "Blocks registered in the prefix cache (in use or evictable).")
        .def_property_readonly("prefix_queries", &BlockManager::prefix_queries,
                               "Full prompt blocks looked up in the prefix cache by add_sequence.")
        .def_property_readonly("prefix_hits", &BlockManager::prefix_hits)
        .def_property_readonly("evictions", &BlockManager::evictions)
        .def_property_readonly("cow_copies", &BlockManager::cow_copies)
        .def("cached_hashes", &BlockManager::cached_hashes, "Hashes of the blocks registered in the prefix cache.")
        .def("record_events", &BlockManager::record_events, py::arg("on"),
             "Log cache registrations and removals for drain_events() (off: drop the log).")
        .def("drain_events", &BlockManager::drain_events,
             "The logged [(kind, hash, parent_hash, tokens)] (0 stored, 1 removed), oldest first; clears the log.")
        .def("ref_count", &BlockManager::ref_count, py::arg("block"))
        .def("is_cached", &BlockManager::is_cached, py::arg("block"))
        .def("allocate", &BlockManager::allocate, py::arg("n"),
             "Take n blocks (ref 1); MemoryError when fewer are available (nothing is taken then).")
        .def("free", &BlockManager::free, py::arg("blocks"), "Drop one reference to each block.")
        .def("incref", &BlockManager::incref, py::arg("block"))
        .def("reset_prefix_cache", &BlockManager::reset_prefix_cache)
        .def("cached_prefix_tokens", &BlockManager::cached_prefix_tokens, py::arg("tokens"), py::arg("root") = 0,
             "root: what the first block's hash chains to (0; a LoRA adapter's key).")
        .def("add_sequence", &BlockManager::add_sequence, py::arg("seq_id"), py::arg("tokens"),
             py::arg("num_new_tokens"), py::arg("root") = 0)
        .def("blocks_needed", &BlockManager::blocks_needed, py::arg("seq_id"), py::arg("n"))
        .def("append_slots", &BlockManager::append_slots, py::arg("seq_id"), py::arg("n"))
        .def("mark_computed", &BlockManager::mark_computed, py::arg("seq_id"), py::arg("n"))
        .def("append_token", &BlockManager::append_token, py::arg("seq_id"), py::arg("token"))
        .def("rewind", &BlockManager::rewind, py::arg("seq_id"), py::arg("num_tokens"),
             "Keep the first num_tokens tokens (speculative decoding drops rejected ones).")
        .def("fork", &BlockManager::fork, py::arg("parent_id"), py::arg("child_id"))
        .def("free_sequence", &BlockManager::free_sequence, py::arg("seq_id"))
        .def("has_sequence", &BlockManager::has_sequence, py::arg("seq_id"))
        .def_property_readonly("num_sequences", &BlockManager::num_sequences)
        .def("block_table", &BlockManager::block_table, py::arg("seq_id"))
        .def("sequence_tokens", &BlockManager::sequence_tokens, py::arg("seq_id"))
        .def("num_computed", &BlockManager::num_computed, py::arg("seq_id"))
        .def("num_tokens", &BlockManager::num_tokens, py::arg("seq_id"))
        .def("prepare_step", &BlockManager::prepare_step, py::arg("seq_ids"), py::arg("counts"));
}
