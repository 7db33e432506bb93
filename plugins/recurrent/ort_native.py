"""The recurrent-state ops' side of llmc's native ONNX Runtime library: binding the state pool.

The ops live in the same library as PagedAttention (csrc/ort_recurrent.cpp is compiled into
llmc.plugins._ort_ops), so a session that registers that library runs them; the
runtime binds its state arrays here by pointer, as it binds the KV pool, under the same lock.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from llmc.plugins.paged_attention import ort_native

_bound: Sequence[np.ndarray] | None = None  # kept alive while bound
_ready = False


def _lib() -> ctypes.CDLL:
    global _ready
    lib = ort_native.load()
    if not _ready:
        i64, vpp = ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)
        lib.llmc_bind_state_pool.argtypes = [i64, vpp, ctypes.POINTER(i64), i64]
        lib.llmc_bind_state_pool.restype = ctypes.c_int
        lib.llmc_unbind_state_pool.argtypes = []
        lib.llmc_unbind_state_pool.restype = None
        lib.llmc_state_op_calls.restype = ctypes.c_int64
        _ready = True
    return lib


def bind(arrays: Sequence[np.ndarray]) -> None:
    """Make ``arrays`` (each ``[num_slots, ...]`` float32, C-contiguous, writeable, one slot count) the state pool
    of this process's recurrent-state nodes. No-op if already bound. Hold :data:`ort_native.lock` around it and
    the run, as for the KV pool."""
    global _bound
    if arrays is _bound:
        return
    if not arrays:
        raise ValueError("state pool has no arrays")
    slots = arrays[0].shape[0]
    for i, a in enumerate(arrays):
        if a.dtype != np.float32 or not a.flags.c_contiguous or not a.flags.writeable or a.shape[0] != slots:
            raise ValueError(f"state array {i}: must be a C-contiguous, writeable float32 array of {slots} slots "
                             f"(it is written in place), got {a.dtype} {a.shape}")
    n = len(arrays)
    ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    elems = (ctypes.c_int64 * n)(*[a[0].size if slots else 0 for a in arrays])
    if _lib().llmc_bind_state_pool(n, ptrs, elems, slots) != 0:
        raise ValueError(f"llmc_bind_state_pool refused {n} arrays of {slots} slots")
    _bound = arrays


def unbind() -> None:
    """Forget the bound state pool (recurrent nodes that run afterwards fail, naming the cause)."""
    global _bound
    _lib().llmc_unbind_state_pool()
    _bound = None


def call_count() -> int:
    """Recurrent-state kernel calls this library has completed in this process."""
    return int(_lib().llmc_state_op_calls())
