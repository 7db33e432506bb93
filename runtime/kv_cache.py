"""The KV cache: a pool of fixed-size blocks per layer, and the manager that hands blocks out.

The manager is the C++ core ``llmc.runtime._block_manager`` (reference counts, free list, prefix
cache with LRU eviction, copy-on-write for forked sequences); its semantics are defined by the
Python model in :mod:`llmc.runtime.block_manager_ref`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from llmc.errors import LlmcError


def _load_core():
    try:
        return importlib.import_module("llmc.runtime._block_manager")
    except ImportError as exc:
        raise ImportError(
            f"the KV block manager (llmc.runtime._block_manager) is not built or cannot be loaded: {exc}. It is "
            "compiled when llmc is installed: reinstall with `pip install .` (or `pip install -e . "
            "--no-build-isolation` for a development checkout; needs a C++17 compiler and pybind11)."
        ) from exc


_core = _load_core()
hash_block = _core.hash_block


class BlockManager(_core.BlockManager):
    """Allocates KV blocks ``0..num_blocks-1`` and tracks sequences' block tables (C++ core).

    ``allocate(n)`` raises ``MemoryError`` when fewer than ``n`` blocks are available (free, or
    cached and evictable); nothing is taken then. See ``llmc.runtime.block_manager_ref`` for the
    full semantics of every method.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise LlmcError(f"KV pool of {num_blocks} blocks: needs at least 1 block; raise kv_cache_tokens")
        if block_size < 1:
            raise LlmcError(f"KV block size {block_size}: must be at least 1")
        super().__init__(num_blocks, block_size, enable_prefix_caching)

    @property
    def num_free(self) -> int:
        """Blocks available to allocate (free plus evictable cached blocks)."""
        return self.num_free_blocks


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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of forked sequences)."""
        if not pairs:
            return
        src = np.asarray([p[0] for p in pairs], np.int64)
        dst = np.asarray([p[1] for p in pairs], np.int64)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]
