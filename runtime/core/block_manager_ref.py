"""Python reference model of the KV block manager: the definition ``runtime/csrc/block_manager.cpp`` is tested against.

Slow and plain on purpose. Every observable result (block ids handed out, reference counts, LRU
eviction order, prefix-cache hits, copy-on-write pairs, step inputs) must equal the C++ core's on
any sequence of operations. The semantics are documented at the top of the C++ file.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def hash_block(parent_hash: int, tokens: list[int]) -> int:
    """Chained 64-bit hash of one block's tokens (``parent_hash`` is 0 for the first block)."""
    h = _mix64(parent_hash)
    for t in tokens:
        h = _mix64(h ^ (t & 0xFFFFFFFF))
    return h


@dataclass
class _Block:
    ref: int = 0
    hash: int | None = None
    parent_hash: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[int] = field(default_factory=list)
    root: int = 0  # what the first block chains to: 0, or a key (a LoRA adapter) its KV depends on


class ReferenceBlockManager:
    """Same interface and semantics as ``llmc.runtime._block_manager.BlockManager``."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("BlockManager: num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable cached blocks, least recent first
        self._cache: dict[int, int] = {}
        self._seqs: dict[int, _Seq] = {}
        self.prefix_queries = self.prefix_hits = self.evictions = self.cow_copies = 0
        self._record = False
        self._events: list[tuple[int, int, int, list[int]]] = []

    # -- pool ------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def ref_count(self, block: int) -> int:
        return self._blocks[self._check(block)].ref

    def is_cached(self, block: int) -> bool:
        return self._blocks[self._check(block)].hash is not None

    def cached_hashes(self) -> list[int]:
        return list(self._cache)

    def record_events(self, on: bool) -> None:
        """Log registrations (0, hash, parent, tokens) and removals (1, hash, 0, []) for :meth:`drain_events`."""
        self._record = on
        if not on:
            self._events.clear()

    def drain_events(self) -> list[tuple[int, int, int, list[int]]]:
        out, self._events = self._events, []
        return out

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("allocate: n must be >= 0")
        if n > self.num_free_blocks:
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {self.num_free_blocks} free of {self.num_blocks}")
        return [self._take() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        count: dict[int, int] = {}
        for b in blocks:
            self._check(b)
            count[b] = count.get(b, 0) + 1
            if count[b] > self._blocks[b].ref:
                raise ValueError(f"free: block {b} is not in use (or freed twice)")
        for b in reversed(blocks):
            self._release(b)

    def incref(self, block: int) -> None:
        b = self._blocks[self._check(block)]
        if b.ref == 0:
            if block not in self._lru:
                raise ValueError(f"incref: block {block} is free")
            del self._lru[block]
        b.ref += 1

    def reset_prefix_cache(self) -> None:
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            self._unregister(b)
            self._free.append(b)

    # -- prefix cache ----------------------------------------------------------------------------

    def cached_prefix_tokens(self, tokens: list[int], root: int = 0) -> int:
        return len(self._lookup(tokens, root)) * self.block_size

    # -- sequences -------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, tokens: list[int], num_new_tokens: int, root: int = 0) -> int:
        if seq_id in self._seqs:
            raise ValueError(f"add_sequence: sequence {seq_id} exists")
        if not tokens:
            raise ValueError("add_sequence: tokens is empty")
        if num_new_tokens < 0:
            raise ValueError("add_sequence: num_new_tokens must be >= 0")
        hits = self._lookup(tokens, root)
        cached = len(hits) * self.block_size
        if cached + num_new_tokens > len(tokens):
            raise ValueError("add_sequence: cached + new tokens exceed the sequence")
        new_blocks = self._ceil(cached + num_new_tokens) - len(hits)
        revived = sum(self._blocks[b].ref == 0 for b, _ in hits)
        if new_blocks > self.num_free_blocks - revived:
            return -1
        seq = _Seq(tokens=list(tokens), num_computed=cached, root=root)
        for b, h in hits:
            self.incref(b)
            seq.blocks.append(b)
            seq.hashes.append(h)
        seq.blocks += [self._take() for _ in range(new_blocks)]
        if self.enable_prefix_caching:
            self.prefix_queries += (len(tokens) - 1) // self.block_size
            self.prefix_hits += len(hits)
        self._seqs[seq_id] = seq
        return cached

    def blocks_needed(self, seq_id: int, n: int) -> int:
        if n < 0:
            raise ValueError("blocks_needed: n must be >= 0")
        return self._needed(self._get(seq_id), n)

    def append_slots(self, seq_id: int, n: int) -> list[tuple[int, int]] | None:
        s = self._get(seq_id)
        if n < 0:
            raise ValueError("append_slots: n must be >= 0")
        if s.num_computed + n > len(s.tokens):
            raise ValueError("append_slots: more slots than tokens")
        if self._needed(s, n) > self.num_free_blocks:
            return None
        copies = []
        first = s.num_computed // self.block_size
        if n > 0 and first < len(s.blocks) and self._blocks[s.blocks[first]].ref > 1:
            src = s.blocks[first]
            dst = self._take()
            self._release(src)
            s.blocks[first] = dst
            copies.append((src, dst))
            self.cow_copies += 1
        while len(s.blocks) < self._ceil(s.num_computed + n):
            s.blocks.append(self._take())
        return copies

    def mark_computed(self, seq_id: int, n: int) -> None:
        s = self._get(seq_id)
        nc = s.num_computed + n
        if n < 0 or nc > len(s.blocks) * self.block_size or nc > len(s.tokens):
            raise ValueError("mark_computed: beyond the reserved slots or the tokens")
        s.num_computed = nc
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(s.hashes), nc // bs):
            parent = s.hashes[i - 1] if i else s.root
            toks = s.tokens[i * bs : (i + 1) * bs]
            h = hash_block(parent, toks)
            s.hashes.append(h)
            blk = self._blocks[s.blocks[i]]
            if blk.hash is not None or h in self._cache:
                continue
            blk.hash, blk.parent_hash, blk.tokens = h, parent, list(toks)
            self._cache[h] = s.blocks[i]
            if self._record:
                self._events.append((0, h, parent, list(toks)))

    def append_token(self, seq_id: int, token: int) -> None:
        if not 0 <= token <= 0x7FFFFFFF:
            raise ValueError("append_token: token id out of range")
        self._get(seq_id).tokens.append(token)

    def rewind(self, seq_id: int, num_tokens: int) -> None:
        s = self._get(seq_id)
        if not 1 <= num_tokens <= len(s.tokens):
            raise ValueError("rewind: num_tokens must be in [1, number of tokens]")
        del s.tokens[num_tokens:]
        s.num_computed = min(s.num_computed, num_tokens)
        while len(s.blocks) > self._ceil(num_tokens):
            self._release(s.blocks.pop())
        full = num_tokens // self.block_size
        del s.hashes[full:]
        # The partly kept block gets its tail overwritten: out of the prefix cache unless shared.
        if num_tokens % self.block_size and len(s.blocks) > full and self._blocks[s.blocks[full]].ref == 1:
            self._unregister(s.blocks[full])

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self._seqs:
            raise ValueError(f"fork: sequence {child_id} exists")
        p = self._get(parent_id)
        shared = min(self._ceil(p.num_computed), len(p.blocks))
        c = _Seq(tokens=list(p.tokens), blocks=p.blocks[:shared], num_computed=p.num_computed, hashes=list(p.hashes),
                 root=p.root)
        for b in c.blocks:
            self.incref(b)
        self._seqs[child_id] = c

    def free_sequence(self, seq_id: int) -> None:
        if seq_id not in self._seqs:
            raise KeyError(f"free_sequence: no sequence {seq_id}")
        for b in reversed(self._seqs.pop(seq_id).blocks):
            self._release(b)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).blocks)

    def sequence_tokens(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).tokens)

    def num_computed(self, seq_id: int) -> int:
        return self._get(seq_id).num_computed

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get(seq_id).tokens)

    def prepare_step(self, seq_ids: list[int], counts: list[int]) -> tuple[np.ndarray, ...]:
        bs = self.block_size
        ids, pos, slots, ctx, qsl, tables = [], [], [], [], [0], []
        for sid, n in zip(seq_ids, counts, strict=True):
            s = self._get(sid)
            c = s.num_computed + n
            if n < 0 or c > len(s.tokens) or c > len(s.blocks) * bs:
                raise ValueError(f"prepare_step: sequence {sid} has no reserved slots for {n} tokens")
            for p in range(s.num_computed, c):
                ids.append(s.tokens[p])
                pos.append(p)
                slots.append(s.blocks[p // bs] * bs + p % bs)
            ctx.append(c)
            qsl.append(qsl[-1] + n)
            tables.append(s.blocks[: self._ceil(c)])
        width = max([1] + [len(t) for t in tables])
        table = np.zeros((len(tables), width), np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        as64 = [np.asarray(a, np.int64) for a in (ids, pos, slots)]
        return (*as64, table, np.asarray(ctx, np.int64), np.asarray(qsl, np.int64))

    # -- internals -------------------------------------------------------------------------------

    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _check(self, b: int) -> int:
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        return b

    def _get(self, seq_id: int) -> _Seq:
        if seq_id not in self._seqs:
            raise KeyError(f"no sequence {seq_id}")
        return self._seqs[seq_id]

    def _needed(self, s: _Seq, n: int) -> int:
        need = max(0, self._ceil(s.num_computed + n) - len(s.blocks))
        first = s.num_computed // self.block_size
        if n > 0 and first < len(s.blocks) and self._blocks[s.blocks[first]].ref > 1:
            need += 1
        return need

    def _lookup(self, tokens: list[int], root: int = 0) -> list[tuple[int, int]]:
        hits: list[tuple[int, int]] = []
        if not self.enable_prefix_caching or not tokens:
            return hits
        bs, parent = self.block_size, root
        for i in range((len(tokens) - 1) // bs):
            toks = list(tokens[i * bs : (i + 1) * bs])
            h = hash_block(parent, toks)
            b = self._cache.get(h)
            if b is None or self._blocks[b].parent_hash != parent or self._blocks[b].tokens != toks:
                break
            hits.append((b, h))
            parent = h
        return hits

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            self._unregister(b)
            self.evictions += 1
        else:
            raise MemoryError("KV pool exhausted")
        self._blocks[b].ref = 1
        return b

    def _release(self, b: int) -> None:
        blk = self._blocks[b]
        if blk.ref <= 0:
            raise ValueError(f"release: block {b} is not in use")
        blk.ref -= 1
        if blk.ref:
            return
        if blk.hash is not None:
            self._lru[b] = None
        else:
            self._free.append(b)

    def _unregister(self, b: int) -> None:
        blk = self._blocks[b]
        if blk.hash is None:
            return
        if self._cache.get(blk.hash) == b:
            del self._cache[blk.hash]
            if self._record:
                self._events.append((1, blk.hash, 0, []))
        blk.hash, blk.tokens = None, []
