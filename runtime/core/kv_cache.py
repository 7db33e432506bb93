"""The KV pool: fixed-size blocks of keys and values per layer, in host memory, and the layers' geometry.

Which blocks a sequence holds is the block manager's business (:mod:`llmc.runtime.core.block_manager`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.errors import LlmcError


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
