"""The KV cache: a pool of fixed-size blocks per layer, and the manager that hands blocks out.

The manager is the C++ core ``llmc.runtime._block_manager`` (reference counts, free list, prefix
cache with LRU eviction, copy-on-write for forked sequences); its semantics are defined by the
Python model in :mod:`llmc.runtime.block_manager_ref`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

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


def layer_geometry(num_layers: int, num_kv_heads: int, head_size: int,
                   layers: list[dict] | None = None) -> list[tuple[int, int, int]]:
    """Per layer ``(owner, num_kv_heads, head_size)``: the cache it reads and writes and that cache's shape.

    ``layers`` is the manifest's ``kv_cache.layers`` (absent when every layer has its own cache of one
    shape): per layer either ``{"num_kv_heads": h, "head_size": d}`` (its own cache) or ``{"shares": j}``
    (the cache of earlier layer ``j``, which a KV-shared layer such as Gemma 4's reads instead of
    computing keys and values). Raises ``LlmcError`` for a list that does not describe ``num_layers``.
    """
    if not layers:
        return [(i, num_kv_heads, head_size) for i in range(num_layers)]
    if len(layers) != num_layers:
        raise LlmcError(f"kv_cache.layers has {len(layers)} entries for {num_layers} layers")
    out: list[tuple[int, int, int]] = []
    for i, entry in enumerate(layers):
        if "shares" in entry:
            j = int(entry["shares"])
            if not 0 <= j < i or out[j][0] != j:
                raise LlmcError(f"kv_cache.layers[{i}] shares layer {j}, which is not an earlier layer with its "
                                "own cache")
            out.append(out[j])
        else:
            h, d = int(entry["num_kv_heads"]), int(entry["head_size"])
            if h < 1 or d < 1:
                raise LlmcError(f"kv_cache.layers[{i}]: num_kv_heads {h} and head_size {d} must be positive")
            out.append((i, h, d))
    return out


def distinct_pairs(layers: list) -> list:
    """``layers``' (K, V) pairs, each object once, in order (KV-shared layers alias their owner's pair)."""
    seen: set[int] = set()
    out = []
    for pair in layers:
        if id(pair[0]) not in seen:
            seen.add(id(pair[0]))
            out.append(pair)
    return out


@dataclass
class KVPool:
    """Per-layer K and V caches ``[num_blocks, num_kv_heads, block_size, head_size]`` in host memory.

    Layers may differ in ``num_kv_heads`` and ``head_size`` (one array pair per layer, each its own
    shape), and a KV-shared layer's entry is the very arrays of the layer it shares.
    """

    layers: list[tuple[np.ndarray, np.ndarray]]
    block_size: int

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                 dtype: str = "float32", layers: list[dict] | None = None) -> KVPool:
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for i, (owner, h, d) in enumerate(layer_geometry(num_layers, num_kv_heads, head_size, layers)):
            shape = (num_blocks, h, block_size, d)
            out.append((np.zeros(shape, dtype), np.zeros(shape, dtype)) if owner == i else out[owner])
        return cls(out, block_size)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_size: int, dtype: str,
                        layers: list[dict] | None = None) -> int:
        geometry = layer_geometry(num_layers, num_kv_heads, head_size, layers)
        per_token = sum(h * d for i, (owner, h, d) in enumerate(geometry) if owner == i)
        return 2 * per_token * block_size * np.dtype(dtype).itemsize

    def owned(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each distinct cache pair once (a shared layer's pair is its owner's)."""
        return distinct_pairs(self.layers)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of forked sequences)."""
        if not pairs:
            return
        src = np.asarray([p[0] for p in pairs], np.int64)
        dst = np.asarray([p[1] for p in pairs], np.int64)
        for k, v in self.owned():
            k[dst] = k[src]
            v[dst] = v[src]
