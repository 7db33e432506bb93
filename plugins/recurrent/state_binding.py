"""Which state pool the recurrent ops of the current step read and write, for their Python implementations.

The native ONNX Runtime library has its own binding (llmc.plugins.recurrent.ort_native); this one serves
the eager torch op (a traced model run in torch for debugging), as kv_binding does for PagedAttention.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

_lock = threading.RLock()
_active: Sequence[np.ndarray] | None = None


@contextmanager
def bound_state(arrays: Sequence[np.ndarray]) -> Iterator[None]:
    """Bind the state arrays (``[num_slots, ...]`` each) for the duration of one step."""
    global _active
    with _lock:
        previous, _active = _active, arrays
        try:
            yield
        finally:
            _active = previous


def state_array(idx: int) -> np.ndarray:
    """The bound array ``idx``; raises if no state pool is bound."""
    if _active is None:
        raise RuntimeError("a recurrent-state op ran with no state pool bound; run it through llmc.runtime.Engine")
    return _active[idx]
