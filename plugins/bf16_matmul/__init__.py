"""llmc's bfloat16-weight matmul for the CPU: ``llmc.Bf16MatMul`` in the native ONNX Runtime custom-op library
(csrc/bf16_matmul_core.h, its ONNX Runtime op csrc/ort_bf16_matmul.cpp), its weight packing
and its numpy reference.

``Y[..., N] = X[..., K] @ W[K, N]`` with X float32 and W bfloat16: widening a bfloat16 to float32 is exact, so the
op computes what a float32 MatMul of the same weight computes, while a decode step reads half the bytes. The weight
is packed in column panels of :data:`PANEL` outputs, ``uint16 [ceil(N / PANEL), K, PANEL]`` (zero-padded), so that
each panel is one contiguous stream. Each output is one fused multiply-add chain along k in order, whatever the
number of rows: a row's result does not depend on its batch."""

from __future__ import annotations

import numpy as np

OP_TYPE = "Bf16MatMul"
PANEL = 48  # output columns per panel (kNr in csrc/bf16_matmul_core.h)


def bf16_exact(w: np.ndarray) -> bool:
    """Whether every value of the float32 array ``w`` is a bfloat16 (its low 16 bits are zero)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return not np.any(w.view(np.uint32) & np.uint32(0xFFFF))


def pack(w: np.ndarray) -> np.ndarray:
    """A float32 weight ``[K, N]`` whose values are all bfloat16 as the op's ``uint16 [P, K, PANEL]`` panels.
    Raises ValueError if a value is not a bfloat16 (packing never rounds)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    if not bf16_exact(w):
        raise ValueError("weight has values that are not bfloat16; Bf16MatMul carries bfloat16 weights exactly only")
    k, n = w.shape
    panels = -(-n // PANEL)
    bits = np.zeros((k, panels * PANEL), dtype=np.uint16)
    bits[:, :n] = (w.view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(bits.reshape(k, panels, PANEL).transpose(1, 0, 2))


def unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """The float32 ``[K, N]`` weight that ``packed`` holds (the inverse of :func:`pack`)."""
    panels, k, width = packed.shape
    bits = packed.transpose(1, 0, 2).reshape(k, panels * width)[:, :n]
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference(x: np.ndarray, packed: np.ndarray, n: int) -> np.ndarray:
    """float64 reference of the op: ``x @ unpack(packed, n)``, for tests (the kernel sums in float32)."""
    return (x.astype(np.float64) @ unpack(packed, n).astype(np.float64)).astype(np.float32)


def single_op_model(packed: np.ndarray, n: int) -> bytes:
    """An ONNX model of the op alone, ``Y[S, N] = Bf16MatMul(X[S, K])`` with ``packed`` as an initializer: for the
    op's tests and benchmark. onnx is imported here, not with the package (the runtime does not need it)."""
    from onnx import TensorProto, helper, numpy_helper

    k = packed.shape[1]
    node = helper.make_node(OP_TYPE, ["X", "W"], ["Y"], domain="llmc", N=n)
    graph = helper.make_graph(
        [node], "bf16", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["S", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["S", n])], [numpy_helper.from_array(packed, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("llmc", 1)]).SerializeToString()
