"""Backend sessions: execute one packed step of an engine graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.runtime.kv_cache import KVPool


class OrtSession:
    """ONNX Runtime CPU session with llmc's PagedAttention kernel registered."""

    def __init__(self, model_path: Path, num_threads: int | None = None) -> None:
        import onnxruntime as ort

        from llmc.plugins.paged_attention import kv_binding, ort_op

        self._bind = kv_binding.bound_pool
        so = ort.SessionOptions()
        so.register_custom_ops_library(ort_op.library_path())
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if num_threads:
            so.intra_op_num_threads = num_threads
        so.log_severity_level = 3
        self._session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])

    def run(self, feeds: dict[str, np.ndarray], pool: KVPool) -> np.ndarray:
        """Run one step; returns logits ``[n_logits, vocab]``. Writes the step's K/V into ``pool``."""
        with self._bind(pool.layers):
            return self._session.run(["logits"], feeds)[0]
