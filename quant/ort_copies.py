"""Whether this ONNX Runtime copies the external initializers a session is given.

The layer-by-layer report hands each stage's weights to ONNX Runtime as external initializers
(``SessionOptions.add_external_initializers``). ONNX Runtime 1.32 copies them into the session when it is made (the
arrays may be overwritten afterwards without changing its outputs): holding them for the session's life then
keeps each layer's weights twice. Whether it copies is asked once per process of the ONNX Runtime installed, with a
tiny session (a Gather and a MatMul, the ops a stage's weights feed), instead of assumed from its version.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def ort_copies_initializers() -> bool:
    """True when ONNX Runtime's sessions no longer read their external initializers' arrays once made."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 64)).astype(np.float32)
    proto = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=weight.shape,
                        data_location=TensorProto.EXTERNAL)
    entry = proto.external_data.add()
    entry.key, entry.value = "location", "llmc-external-initializer"
    graph = helper.make_graph(
        [helper.make_node("Gather", ["w", "ids"], ["rows"]), helper.make_node("MatMul", ["x", "w"], ["y"])], "probe",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, 64]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 64])], initializer=[proto])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_external_initializers(["w"], [ort.OrtValue.ortvalue_from_numpy(weight)])
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"ids": np.arange(64, dtype=np.int64), "x": rng.standard_normal((4, 64)).astype(np.float32)}
    before = session.run(None, feeds)
    weight[:] = np.nan
    after = session.run(None, feeds)
    return all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand memory freed in malloc's arenas back to the system (glibc's ``malloc_trim``; elsewhere nothing). The
    stage weights read on a thread are freed in that thread's arena, which glibc otherwise keeps resident."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
