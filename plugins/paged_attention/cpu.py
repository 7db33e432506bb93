"""CPU kernel of PagedAttention: a thin wrapper over the C++ extension ``llmc.plugins.paged_attention._cpu``.

Same semantics and signature as :func:`llmc.plugins.paged_attention.reference.paged_attention`
(the normative definition): the new K/V rows are written into ``k_cache``/``v_cache`` in place,
then every query row attends causally to its sequence's cached positions.

Requirements beyond the reference: ``query``/``key``/``value`` are float32; the caches are
C-contiguous, writeable float32 (or float16) numpy arrays, which are used in place and never
copied (anything else raises ``ValueError``). Every index is validated before the first write.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np

from llmc.errors import InstallError

_EXTENSION = "llmc.plugins.paged_attention._cpu"
_kernel: ModuleType | None = None


def load_kernel() -> ModuleType:
    """Import the compiled extension (cached), or raise ``ImportError`` saying how to build it."""
    global _kernel
    if _kernel is None:
        # OpenMP threads that spin-wait between calls (libgomp's default) wreck latency as soon as
        # the cores are shared (ONNX Runtime's own thread pool, other processes): measured here,
        # a 250 µs decode call took 24 ms with 2 threads on 2 busy cores, and 285 µs with passive
        # waiting. libgomp reads this when it is loaded, i.e. with the extension just below; an
        # explicit OMP_WAIT_POLICY in the environment wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            _kernel = importlib.import_module(_EXTENSION)
        except ImportError as exc:
            raise InstallError(
                f"the PagedAttention CPU kernel ({_EXTENSION}) is not built or cannot be loaded: {exc}. "
                "It is compiled when llmc is installed: reinstall with `pip install .` "
                "(or `pip install -e . --no-build-isolation` for a development checkout; "
                "needs a C++17 compiler with OpenMP and pybind11)."
            ) from exc
    return _kernel


def paged_attention_cpu(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    slot_mapping: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start_loc: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
    alibi_max_bias: float = 0.0,
    attention_chunk: int = 0,
    attend_end: np.ndarray | None = None,
) -> np.ndarray:
    """Write the new K/V into the caches, then attend. Returns ``[T, num_heads * head_size]`` float32.

    ``sinks``: None, or ``[num_heads]`` attention-sink logits (converted to float32). ``attend_end``: None, or
    ``[T]`` integers, bidirectional spans as in the reference (converted to int64)."""
    return load_kernel().forward(
        query,
        key,
        value,
        slot_mapping,
        block_tables,
        context_lens,
        query_start_loc,
        k_cache,
        v_cache,
        int(num_heads),
        int(num_kv_heads),
        float(scale),
        int(sliding_window),
        float(softcap),
        None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1),
        float(alibi_max_bias),
        int(attention_chunk),
        None if attend_end is None else np.asarray(attend_end).reshape(-1),
    )


def set_num_threads(n: int) -> None:
    """Threads the kernel uses (0: the OpenMP default, i.e. ``OMP_NUM_THREADS`` or every core)."""
    load_kernel().set_num_threads(int(n))


def get_num_threads() -> int:
    return int(load_kernel().get_num_threads())
