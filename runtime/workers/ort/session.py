"""Backend sessions: execute one packed step of an engine graph."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import llmc.runtime.workers.ort.spin_policy as spin_policy
from llmc.errors import LlmcError
from llmc.runtime.core.kv_cache import KVPool

# engine.custom_ops values (see llmc.compiler.backends.onnxruntime.CUSTOM_OPS): which custom-op
# library hosts the graph's PagedAttention.
NATIVE = "llmc_ort_ops"  # llmc's native library, domain "llmc": no Python per call
PYOP = "onnxruntime_extensions"  # onnxruntime-extensions' Python op, domain "ai.onnx.contrib"
CUSTOM_OPS = (NATIVE, PYOP)
_LOGITS = ["logits"]


def custom_ops_of(manifest: dict) -> str:
    """The custom-op library an engine's graph needs. Engines built before llmc recorded it use the Python op."""
    return manifest.get("engine", {}).get("custom_ops", PYOP)


class OrtSession:
    """ONNX Runtime CPU session with llmc's PagedAttention kernel registered.

    ``model`` is an ONNX file (its external weights beside it) or serialized ONNX bytes;
    ``custom_ops`` names the library its PagedAttention nodes need (:data:`NATIVE` or :data:`PYOP`).
    ``optimize=False`` runs the graph as written (no ORT graph rewrites). ``spin``: whether ORT's threads
    spin between ops; None (serving) decides by :mod:`llmc.runtime.workers.ort.spin_policy`, which samples the CPU
    load for 0.1 s, so one-off sessions (pass verification) pass False. ``initializers``: arrays for the
    graph's initializers that it declares without data (ONNX Runtime reads them in place; the session keeps
    them alive): how the accuracy report runs a model one layer at a time (llmc.quant.layerwise).
    """

    samples_on_device = False  # returns host logits; the engine samples them with numpy

    def __init__(self, model: Path | bytes, num_threads: int | None = None, custom_ops: str = NATIVE,
                 optimize: bool = True, spin: bool | None = None,
                 initializers: dict[str, np.ndarray] | None = None) -> None:
        import onnxruntime as ort

        if custom_ops == NATIVE:
            from llmc.plugins.paged_attention import ort_native

            self._native = ort_native
            library = ort_native.library_path()
        elif custom_ops == PYOP:
            # Importing ort_op registers the Python op with onnxruntime-extensions.
            from llmc.plugins.paged_attention import kv_binding, ort_op

            self._native = None
            self._binding = kv_binding.bound_pool
            library = ort_op.library_path()
        else:
            raise LlmcError(f"engine.custom_ops {custom_ops!r} is unknown to this runtime (it runs "
                            f"{', '.join(CUSTOM_OPS)}); rebuild the engine with this llmc")
        self.custom_ops = custom_ops
        so = ort.SessionOptions()
        so.register_custom_ops_library(library)
        so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                       else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        if num_threads:
            so.intra_op_num_threads = num_threads
        # Spin between ops only where the cores are free (spin_policy.py beside this file; LLMC_ORT_SPIN overrides).
        if spin is None:
            try:
                self.spinning, self.spin_reason = spin_policy.decide(num_threads or os.cpu_count() or 1)
            except ValueError as e:
                raise LlmcError(f"environment variable {e}") from None
        else:
            self.spinning, self.spin_reason = spin, "set by the caller"
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        # Block-wise INT4 DequantizeLinear + MatMul (the Q/DQ form of GPU builds, scored on the CPU) is fused by
        # ORT's optimizer into MatMulNBits at accuracy level 4 by default: int8 activations, not the W4A16
        # arithmetic of the engine being scored (4% of the logits' range on a tiny Llama). Level 1: float32.
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        if self._native is not None:  # process-wide, like the attention threads: the last session loaded decides
            self._native.set_int4_parallel_min(self._native.INT4_PARALLEL_MIN[bool(self.spinning)])
        so.log_severity_level = 3
        # LLMC_ORT_PROFILE=PREFIX writes ORT's per-node timing trace (PREFIX_<date>.json) when the
        # session ends profiling (end_profiling(), or process exit); benchmarks/profile_engine.py reads it.
        if os.environ.get("LLMC_ORT_PROFILE"):
            so.enable_profiling = True
            so.profile_file_prefix = os.environ["LLMC_ORT_PROFILE"]
        if initializers:
            self._initializers = initializers  # ORT reads them in place for the session's life
            names = list(initializers)
            so.add_external_initializers(names, [_ort_value(ort, initializers[n]) for n in names])
        source = model if isinstance(model, bytes) else str(model)
        self._session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        self.input_names = tuple(i.name for i in self._session.get_inputs())

    def run(self, feeds: dict[str, np.ndarray], pool: KVPool | Sequence[tuple[np.ndarray, np.ndarray]],
            outputs: list[str] | None = None, state: Sequence[np.ndarray] | None = None):
        """Run one step; returns logits ``[n_logits, vocab]`` (or, with ``outputs``, the list of those outputs).
        Writes the step's K/V into ``pool`` (a :class:`KVPool` or its per-layer ``(k_cache, v_cache)`` list) and, for
        a hybrid model, its recurrent state into ``state`` (the state pool's arrays, llmc.runtime.core.state_cache)."""
        layers = pool.layers if isinstance(pool, KVPool) else pool
        names = outputs or _LOGITS
        if state is not None and self._native is None:
            raise LlmcError("recurrent-state ops run only in llmc's native custom-op library (engine.custom_ops "
                            f"{NATIVE!r}); rebuild the engine with the native attention route")
        if self._native is not None:
            # Hot path: a lock and an identity check per step; pointers are re-sent only when the pool changes.
            with self._native.lock:
                self._native.bind(layers)
                if state is not None:
                    from llmc.plugins.recurrent import ort_native as state_native

                    state_native.bind(state)
                result = self._session.run(names, feeds)
        else:
            with self._binding(layers):
                result = self._session.run(names, feeds)
        return result if outputs is not None else result[0]

    def end_profiling(self) -> str | None:
        """Stop ORT profiling (on with LLMC_ORT_PROFILE) and return the trace file's path, else None."""
        path = self._session.end_profiling()
        return path or None

    def set_attention_threads(self, n: int) -> None:
        """Threads of the PagedAttention kernel this session calls, process-wide: 0 = this session's intra-op
        pool (native op; the Python op, which cannot reach that pool, runs on one thread), n >= 1 = n OpenMP
        threads."""
        if self.custom_ops == NATIVE:
            from llmc.plugins.paged_attention import ort_native

            ort_native.set_num_threads(n)
        else:
            from llmc.plugins.paged_attention.cpu import load_kernel

            load_kernel().set_num_threads(int(n) or 1)


# ONNX element types of the numpy dtypes (ml_dtypes') that ORT's numpy bridge does not take: passed as their bits.
_BITS_AS = {"bfloat16": (16, "uint16"), "float8_e4m3fn": (17, "uint8"), "float8_e5m2": (19, "uint8")}


def _ort_value(ort, array: np.ndarray):
    """``array`` as an OrtValue ORT reads in place (bfloat16 and FP8 arrays by their bits, with their ONNX type)."""
    bits = _BITS_AS.get(array.dtype.name)
    if bits is None:
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(bits[1]), bits[0])
