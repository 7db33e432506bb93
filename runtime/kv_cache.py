"""The KV cache: a pool of fixed-size blocks per layer, and the manager that hands blocks out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.errors import LlmcError


class BlockManager:
    """Allocates and frees KV blocks (ids ``0..num_blocks-1``) from a free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise LlmcError(f"KV pool of {num_blocks} blocks: needs at least 1 block; raise kv_cache_tokens")
        self.num_blocks = num_blocks
        # Popping from the end hands out low ids first, which keeps small pools cache-friendly.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks; raises MemoryError when fewer are free (nothing is taken then)."""
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool."""
        self._free.extend(reversed(blocks))


@dataclass
class KVPool:
    """Per-layer K and V caches ``[num_blocks, num_kv_heads, block_size, head_size]`` in host memory."""

    layers: list[tuple[np.ndarray, np.ndarray]]
    block_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                 dtype: str = "float32") -> KVPool:
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return cls([(np.zeros(shape, dtype), np.zeros(shape, dtype)) for _ in range(num_layers)], block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_size: int, dtype: str) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_size * np.dtype(dtype).itemsize
