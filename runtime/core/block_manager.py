"""The C++ KV block manager ``llmc.runtime._block_manager``, bound for the runtime.

It keeps reference counts, the free list, the prefix cache with LRU eviction and copy-on-write for forked
sequences; its semantics are defined by the Python model in :mod:`llmc.runtime.core.block_manager_ref`.
"""

from __future__ import annotations

import importlib

from llmc.errors import InstallError, LlmcError


def _load_core():
    try:
        return importlib.import_module("llmc.runtime._block_manager")
    except ImportError as exc:
        raise InstallError(
            f"the KV block manager (llmc.runtime._block_manager) is not built or cannot be loaded: {exc}. It is "
            "compiled when llmc is installed: reinstall with `pip install .` (or `pip install -e . "
            "--no-build-isolation` for a development checkout; needs a C++17 compiler and pybind11)."
        ) from exc


_core = _load_core()
hash_block = _core.hash_block


class BlockManager(_core.BlockManager):
    """Allocates KV blocks ``0..num_blocks-1`` and tracks sequences' block tables (C++ core).

    ``allocate(n)`` raises ``MemoryError`` when fewer than ``n`` blocks are available (free, or
    cached and evictable); nothing is taken then. See ``llmc.runtime.core.block_manager_ref`` for the
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
