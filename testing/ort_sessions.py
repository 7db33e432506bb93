"""ONNX Runtime sessions on llmc's native custom-op library, for the tests of its ops."""

from __future__ import annotations

import onnxruntime as ort

from llmc.plugins.paged_attention import ort_native


def native_session(model: bytes, threads: int | None = None) -> ort.InferenceSession:
    """A CPU session of the serialized ``model`` with llmc's op library registered (quiet logs);
    ``threads`` sizes the intra-op pool (default: ONNX Runtime's)."""
    so = ort.SessionOptions()
    so.register_custom_ops_library(ort_native.library_path())
    if threads is not None:
        so.intra_op_num_threads = threads
    so.log_severity_level = 4
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
