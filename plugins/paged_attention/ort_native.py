"""PagedAttention for ONNX Runtime on the CPU as a native custom-op library (no Python per call).

The library ``llmc.plugins._ort_ops`` (registered by plugins/csrc/ort_ops.cpp, built by setup.py) holds every
plugin's op in the domain ``llmc``; ``PagedAttention``'s (csrc/ort_paged_attention.cpp) runs the same C++ kernel
as :mod:`.cpu`. Sessions load it with ``SessionOptions.register_custom_ops_library(library_path())``.

The KV pool is bound through a small C ABI of the same library, called here with ctypes: dlopen of
one path returns one handle, so the library ONNX Runtime loaded and the one ctypes loaded are the
same, and the binding made here is what the kernels read. Binding is cheap (pointers only, the
arrays are never copied) and is redone only when the pool changes; :func:`bound_pool` holds a
process-wide lock so that two pools never interleave.

This module imports neither onnxruntime-extensions nor anything that calls back into Python.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from llmc.errors import InstallError
from llmc.plugins.paged_attention import DOMAIN

LIBRARY_MODULE = "llmc.plugins._ort_ops"
# What an engine's manifest names (engine.custom_ops) when its graph needs this library.
CUSTOM_OPS = "llmc_ort_ops"
ORT_DOMAIN = DOMAIN

_F32, _F16 = 1, 10  # ONNX element types of the caches
_lib: ctypes.CDLL | None = None
_path: str | None = None
_lock = threading.RLock()
_bound: Sequence[tuple[np.ndarray, np.ndarray]] | None = None  # kept alive while bound


def library_path() -> str:
    """Path of the compiled custom-op library; raises ``ImportError`` saying how to build it."""
    global _path
    if _path is None:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            raise InstallError(
                f"llmc's ONNX Runtime custom-op library ({LIBRARY_MODULE}) is not built. It is compiled when "
                "llmc is installed: reinstall with `pip install .` (or `pip install -e . --no-build-isolation` "
                "for a development checkout; needs a C++17 compiler with OpenMP)."
            )
        _path = spec.origin
    return _path


def load() -> ctypes.CDLL:
    """The library, loaded through ctypes (cached); the same loaded object ONNX Runtime uses."""
    global _lib
    if _lib is None:
        # See cpu.py: OpenMP threads that spin between calls wreck latency on shared cores. libgomp
        # reads this when it is first loaded, which may be right here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        lib = ctypes.CDLL(library_path())
        i64, vpp = ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)
        i64p = ctypes.POINTER(i64)
        lib.llmc_bind_kv_pool.argtypes = [i64, vpp, vpp, i64, i64p, i64, i64p, ctypes.c_int32]
        lib.llmc_bind_kv_pool.restype = ctypes.c_int
        lib.llmc_unbind_kv_pool.argtypes = []
        lib.llmc_unbind_kv_pool.restype = None
        lib.llmc_set_num_threads.argtypes = [ctypes.c_int]
        lib.llmc_set_num_threads.restype = ctypes.c_int
        lib.llmc_get_num_threads.restype = ctypes.c_int
        lib.llmc_paged_attention_calls.restype = ctypes.c_int64
        lib.llmc_uses_avx2.restype = ctypes.c_int
        lib.llmc_uses_ort_pool.restype = ctypes.c_int
        lib.llmc_ort_api_version.restype = ctypes.c_uint32
        lib.llmc_int4_set_isa.argtypes = [ctypes.c_int]
        lib.llmc_int4_set_isa.restype = ctypes.c_int
        lib.llmc_int4_get_isa.restype = ctypes.c_int
        lib.llmc_int4_calls.restype = ctypes.c_int64
        lib.llmc_int4_set_parallel_min.argtypes = [ctypes.c_int64]
        lib.llmc_int4_set_parallel_min.restype = ctypes.c_int64
        _lib = lib
    return _lib


def bind(layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Make ``layers`` (per layer ``(k_cache, v_cache)``, ``[blocks, kv_heads, block_size, head_size]``)
    the pool every PagedAttention kernel of this process reads and writes. No-op if already bound.

    The caches are used in place: they must be C-contiguous, writeable, float32 or float16, of one
    dtype, number of blocks and block size (``ValueError`` otherwise); layers may differ in KV heads
    and head size, and may share arrays (KV-shared layers). Call it with :data:`lock` held when other
    threads may run sessions.
    """
    global _bound
    if layers is _bound:
        return
    if not layers:
        raise ValueError("KV pool has no layers")
    k0 = layers[0][0]
    if k0.ndim != 4:
        raise ValueError(f"KV cache must be 4-D [num_blocks, num_kv_heads, block_size, head_size], got {k0.shape}")
    if k0.dtype not in (np.float32, np.float16):
        raise ValueError(f"KV cache dtype must be float32 or float16, got {k0.dtype}")
    for i, pair in enumerate(layers):
        shape = pair[0].shape
        for name, a in zip(("k_cache", "v_cache"), pair, strict=True):
            if (a.ndim != 4 or a.shape != shape or (a.shape[0], a.shape[2]) != (k0.shape[0], k0.shape[2])
                    or a.dtype != k0.dtype or not a.flags.c_contiguous or not a.flags.writeable):
                raise ValueError(
                    f"layer {i} {name}: every cache must be a C-contiguous, writeable {k0.dtype} array of "
                    f"{k0.shape[0]} blocks of {k0.shape[2]} tokens, K and V of one shape (it is written in "
                    f"place), got {a.dtype} {a.shape} contiguous={a.flags.c_contiguous} "
                    f"writeable={a.flags.writeable}")
    n = len(layers)
    ks = (ctypes.c_void_p * n)(*[k.ctypes.data for k, _ in layers])
    vs = (ctypes.c_void_p * n)(*[v.ctypes.data for _, v in layers])
    heads = (ctypes.c_int64 * n)(*[k.shape[1] for k, _ in layers])
    sizes = (ctypes.c_int64 * n)(*[k.shape[3] for k, _ in layers])
    rc = load().llmc_bind_kv_pool(n, ks, vs, k0.shape[0], heads, k0.shape[2], sizes,
                                  _F16 if k0.dtype == np.float16 else _F32)
    if rc != 0:
        raise ValueError(f"llmc_bind_kv_pool refused a pool of {n} layers of shape {k0.shape}")
    _bound = layers


def unbind() -> None:
    """Forget the bound pool (kernels that run afterwards fail, naming the cause)."""
    global _bound
    load().llmc_unbind_kv_pool()
    _bound = None


lock = _lock
"""Serialises binding and running across threads: hold it from :func:`bind` to the end of the run."""


@contextmanager
def bound_pool(layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> Iterator[None]:
    """Bind ``layers`` for the duration of one or more runs, under :data:`lock`."""
    with _lock:
        bind(layers)
        yield


def set_num_threads(n: int) -> None:
    """Threads the kernel uses, process-wide: 0 (the default) = the intra-op thread pool of the ONNX Runtime
    session running the node (ORT >= 1.17; see :func:`uses_ort_pool`), n >= 1 = n OpenMP threads."""
    if load().llmc_set_num_threads(int(n)) != 0:
        raise ValueError(f"set_num_threads: n must be >= 1 (or 0 for ONNX Runtime's pool), got {n}")


def uses_ort_pool() -> bool:
    """True when the kernel runs on ONNX Runtime's intra-op pool (thread setting 0 on ORT >= 1.17)."""
    return bool(load().llmc_uses_ort_pool())


def get_num_threads() -> int:
    return int(load().llmc_get_num_threads())


# Int4MatMul's parallel threshold (multiply-adds) by how the session's threads wait. Measured on the 110M
# int4 engine, b1, thresholds alternating step by step in one process: with spinning threads 2^16 gave
# 284 / 2^20 271 tok/s (and 243 / 233 in a second run); with passive ones 2^16 191 / 2^20 205 (waking a
# sleeping thread costs more than a 0.3 MB matmul saves).
INT4_PARALLEL_MIN = {True: 1 << 16, False: 1 << 20}


def set_int4_parallel_min(work: int) -> int:
    """The least work (M x N x K) Int4MatMul spreads over threads, process-wide; returns the previous value."""
    return int(load().llmc_int4_set_parallel_min(int(work)))


def int4_calls() -> int:
    """Int4MatMul kernel calls this library has completed in this process."""
    return int(load().llmc_int4_calls())


def call_count() -> int:
    """PagedAttention kernel calls this library has completed in this process."""
    return int(load().llmc_paged_attention_calls())
