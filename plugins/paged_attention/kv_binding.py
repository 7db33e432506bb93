"""Which KV pool the PagedAttention kernels of the current step read and write.

The KV cache is runtime state, not graph data: the runtime binds its pool around each
``session.run`` and the kernel looks its layer's caches up here, so the pool is referenced,
never copied through the graph. Steps of one process are serialised by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

_lock = threading.RLock()
_active: Sequence[tuple[np.ndarray, np.ndarray]] | None = None


@contextmanager
def bound_pool(layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> Iterator[None]:
    """Bind per-layer ``(k_cache, v_cache)`` arrays for the duration of one step."""
    global _active
    with _lock:
        previous, _active = _active, layers
        try:
            yield
        finally:
            _active = previous


def layer_cache(layer_idx: int) -> tuple[np.ndarray, np.ndarray]:
    """The caches of one layer in the bound pool; raises if no pool is bound."""
    if _active is None:
        raise RuntimeError("PagedAttention ran with no KV pool bound; run it through llmc.runtime.Engine")
    return _active[layer_idx]
