"""The C++ KV block manager against its Python reference model, on random operation sequences and targeted cases."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime import _block_manager
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.block_manager_ref import ReferenceBlockManager
from llmc.runtime.core.block_manager_ref import hash_block as ref_hash_block
from llmc.runtime.core.kv_cache import KVPool


def _state(m, seq_ids):
    return {
        "free": m.num_free_blocks, "evictable": m.num_evictable_blocks, "used": m.num_used_blocks,
        "cached": m.num_cached_blocks, "queries": m.prefix_queries, "hits": m.prefix_hits,
        "evictions": m.evictions, "cow": m.cow_copies, "nseq": m.num_sequences,
        "refs": [m.ref_count(b) for b in range(m.num_blocks)],
        "is_cached": [m.is_cached(b) for b in range(m.num_blocks)],
        "seqs": {s: (m.block_table(s), m.num_computed(s), m.sequence_tokens(s)) for s in seq_ids},
    }


def _same(fn_cpp, fn_ref):
    """Both raise the same exception type, or both return equal results."""
    out = []
    for fn in (fn_cpp, fn_ref):
        try:
            out.append(("ok", fn()))
        except (MemoryError, ValueError, KeyError) as exc:
            out.append(("raise", type(exc)))
    (kc, vc), (kr, vr) = out
    assert kc == kr, (out, "one raised, the other did not")
    if kc == "ok":
        if isinstance(vr, tuple) and vr and isinstance(vr[0], np.ndarray):
            assert len(vc) == len(vr) and all(np.array_equal(a, b) for a, b in zip(vc, vr, strict=True))
        else:
            assert vc == vr
    return vr if kc == "ok" else None


def _reserved(ref: ReferenceBlockManager, sid: int) -> int:
    """Slots reserved but not computed yet, limited by the known tokens."""
    return min(len(ref.block_table(sid)) * ref.block_size, ref.num_tokens(sid)) - ref.num_computed(sid)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_operations_match_reference(seed, prefix_caching):
    rng = np.random.default_rng(seed)
    num_blocks, block_size = int(rng.integers(6, 40)), int(rng.choice([1, 2, 4, 8]))
    cpp = _block_manager.BlockManager(num_blocks, block_size, prefix_caching)
    ref = ReferenceBlockManager(num_blocks, block_size, prefix_caching)
    cpp.record_events(True)  # the cache-event log (what serve/kv_events.py publishes) is part of the semantics
    ref.record_events(True)
    replayed: set[int] = set()  # the cached set rebuilt from the events alone
    # A few shared prefixes so that prompts hit the prefix cache.
    prefixes = [rng.integers(0, 50, size=int(rng.integers(1, 5 * block_size))).tolist() for _ in range(3)]
    seqs: list[int] = []
    raw: list[list[int]] = []
    next_id = 0
    for _ in range(400):
        op = rng.choice(["alloc", "free", "add", "append", "compute", "token", "fork", "drop", "step", "reset",
                         "rewind"], p=[0.06, 0.05, 0.15, 0.16, 0.16, 0.1, 0.06, 0.09, 0.1, 0.02, 0.05])
        if op == "alloc":
            n = int(rng.integers(0, 5))
            got = _same(lambda n=n: cpp.allocate(n), lambda n=n: ref.allocate(n))
            if got is not None:
                raw.append(got)
        elif op == "free" and raw:
            blocks = raw.pop(int(rng.integers(len(raw))))
            _same(lambda b=blocks: cpp.free(b), lambda b=blocks: ref.free(b))
        elif op == "add":
            toks = list(prefixes[int(rng.integers(3))]) + rng.integers(0, 50, size=int(rng.integers(1, 30))).tolist()
            cached = _same(lambda t=toks: cpp.cached_prefix_tokens(t), lambda t=toks: ref.cached_prefix_tokens(t))
            n_new = int(rng.integers(0, len(toks) - cached + 1))
            got = _same(lambda t=toks, n=n_new, i=next_id: cpp.add_sequence(i, t, n),
                        lambda t=toks, n=n_new, i=next_id: ref.add_sequence(i, t, n))
            if got is not None and got >= 0:
                assert got == cached
                seqs.append(next_id)
            next_id += 1
        elif op == "append" and seqs:
            sid = seqs[int(rng.integers(len(seqs)))]
            n = int(rng.integers(0, ref.num_tokens(sid) - ref.num_computed(sid) + 2))  # may exceed: both raise
            _same(lambda s=sid, n=n: cpp.blocks_needed(s, n), lambda s=sid, n=n: ref.blocks_needed(s, n))
            _same(lambda s=sid, n=n: cpp.append_slots(s, n), lambda s=sid, n=n: ref.append_slots(s, n))
        elif op == "compute" and seqs:
            sid = seqs[int(rng.integers(len(seqs)))]
            n = int(rng.integers(0, max(0, _reserved(ref, sid)) + 2))
            _same(lambda s=sid, n=n: cpp.mark_computed(s, n), lambda s=sid, n=n: ref.mark_computed(s, n))
        elif op == "token" and seqs:
            sid, t = seqs[int(rng.integers(len(seqs)))], int(rng.integers(0, 50))
            _same(lambda s=sid, t=t: cpp.append_token(s, t), lambda s=sid, t=t: ref.append_token(s, t))
        elif op == "fork" and seqs:
            parent = seqs[int(rng.integers(len(seqs)))]
            _same(lambda p=parent, i=next_id: cpp.fork(p, i), lambda p=parent, i=next_id: ref.fork(p, i))
            seqs.append(next_id)
            next_id += 1
        elif op == "drop" and seqs:
            sid = seqs.pop(int(rng.integers(len(seqs))))
            _same(lambda s=sid: cpp.free_sequence(s), lambda s=sid: ref.free_sequence(s))
        elif op == "step" and seqs:
            chosen = [s for s in seqs if rng.random() < 0.5]
            counts = [int(rng.integers(0, max(0, _reserved(ref, s)) + 1)) for s in chosen]
            _same(lambda c=chosen, n=counts: cpp.prepare_step(c, n), lambda c=chosen, n=counts: ref.prepare_step(c, n))
        elif op == "reset":
            _same(cpp.reset_prefix_cache, ref.reset_prefix_cache)
        elif op == "rewind" and seqs:  # speculative decoding drops rejected tokens (0 and too many raise)
            sid = seqs[int(rng.integers(len(seqs)))]
            n = int(rng.integers(0, ref.num_tokens(sid) + 2))
            _same(lambda s=sid, n=n: cpp.rewind(s, n), lambda s=sid, n=n: ref.rewind(s, n))
        assert _state(cpp, seqs) == _state(ref, seqs)
        events = cpp.drain_events()
        assert events == ref.drain_events()
        for kind, h, _, _ in events:  # stored only when absent, removed only when present
            assert (h in replayed) == (kind == 1), (kind, h)
            if kind == 0:
                replayed.add(h)
            else:
                replayed.remove(h)
        assert replayed == set(cpp.cached_hashes()) == set(ref.cached_hashes())
        # Reference counts are exactly the holders: sequences' block tables plus raw allocations.
        holders = np.zeros(num_blocks, int)
        for sid in seqs:
            np.add.at(holders, ref.block_table(sid), 1)
        for blocks in raw:
            np.add.at(holders, blocks, 1)
        assert holders.tolist() == [ref.ref_count(b) for b in range(num_blocks)]
    if prefix_caching:
        assert cpp.prefix_queries > 0


def test_hash_matches_reference():
    rng = np.random.default_rng()
    for _ in range(50):
        parent = int(rng.integers(0, 2**63))
        toks = rng.integers(0, 2**31 - 1, size=int(rng.integers(1, 33))).tolist()
        assert _block_manager.hash_block(parent, toks) == ref_hash_block(parent, toks)
    # The chain matters: the same tokens after a different parent hash differently.
    assert _block_manager.hash_block(1, [5, 6]) != _block_manager.hash_block(2, [5, 6])


def _run_prompt(m, sid, tokens):
    cached = m.cached_prefix_tokens(tokens)
    assert m.add_sequence(sid, tokens, len(tokens) - cached) == cached
    m.mark_computed(sid, len(tokens) - cached)
    return cached


@pytest.mark.parametrize("impl", [BlockManager, ReferenceBlockManager])
def test_prefix_reuse_and_lru_eviction(impl):
    m = impl(6, 4)
    a, b = list(range(100, 109)), list(range(200, 209))  # 9 tokens: 2 full blocks + 1
    assert _run_prompt(m, 1, a) == 0
    m.free_sequence(1)
    assert m.num_cached_blocks == 2 and m.num_evictable_blocks == 2 and m.num_free_blocks == 6
    # Same prompt again: both full blocks come from the cache (never the one holding the last token).
    assert _run_prompt(m, 2, a) == 8
    assert m.prefix_hits == 2 and m.prefix_queries == 4
    m.free_sequence(2)
    assert _run_prompt(m, 3, b) == 0
    m.free_sequence(3)
    assert m.num_cached_blocks == 4  # a's two blocks, then b's two, in LRU order
    m.allocate(4)  # 2 truly free blocks, then evicts a's chain (least recently used), tail first
    assert m.evictions == 2 and m.cached_prefix_tokens(a) == 0 and m.cached_prefix_tokens(b) == 8


@pytest.mark.parametrize("impl", [BlockManager, ReferenceBlockManager])
def test_fork_copies_a_shared_partial_block_on_write(impl):
    m = impl(8, 4, False)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6], 6)
    m.mark_computed(1, 6)
    parent_blocks = m.block_table(1)
    m.fork(1, 2)
    assert m.block_table(2) == parent_blocks and all(m.ref_count(b) == 2 for b in parent_blocks)
    m.append_token(2, 7)
    assert m.blocks_needed(2, 1) == 1
    copies = m.append_slots(2, 1)
    # The partially filled block 1 is copied for the writer; the full block 0 stays shared.
    assert len(copies) == 1 and copies[0][0] == parent_blocks[1]
    assert m.block_table(2) == [parent_blocks[0], copies[0][1]]
    assert m.ref_count(parent_blocks[0]) == 2 and m.ref_count(parent_blocks[1]) == 1
    m.append_token(1, 9)
    assert m.append_slots(1, 1) == []  # the parent now owns its block alone: no copy
    m.free_sequence(1)
    m.free_sequence(2)
    assert m.num_free_blocks == 8


def test_copy_on_write_copies_kv_data():
    rng = np.random.default_rng()
    pool = KVPool.allocate(2, 4, 2, 4, 8)
    for k, v in pool.layers:
        k[:] = rng.standard_normal(k.shape)
        v[:] = rng.standard_normal(v.shape)
    before = [(k.copy(), v.copy()) for k, v in pool.layers]
    pool.copy_blocks([(1, 3)])
    for (k, v), (k0, v0) in zip(pool.layers, before, strict=True):
        assert np.array_equal(k[3], k0[1]) and np.array_equal(v[3], v0[1]) and np.array_equal(k[:3], k0[:3])


def test_shortage_changes_nothing():
    m = BlockManager(3, 4)
    assert m.add_sequence(1, list(range(20)), 20) == -1 and not m.has_sequence(1) and m.num_free_blocks == 3
    assert m.add_sequence(1, list(range(20)), 8) == 0
    m.mark_computed(1, 8)
    assert m.append_slots(1, 12) is None and m.block_table(1) and len(m.block_table(1)) == 2
    with pytest.raises(MemoryError):
        m.allocate(2)
    assert m.num_free_blocks == 1


def test_bad_calls_raise():
    m = BlockManager(4, 4)
    with pytest.raises(ValueError):
        m.free([0])  # not allocated
    b = m.allocate(1)
    with pytest.raises(ValueError):
        m.free(b + b)  # one reference, freed twice: nothing is freed
    assert m.ref_count(b[0]) == 1
    with pytest.raises(KeyError):
        m.free_sequence(7)
    with pytest.raises(ValueError):
        m.add_sequence(1, [1, 2], 3)
    with pytest.raises(LlmcError):
        BlockManager(0)
