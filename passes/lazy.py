"""Weights derived from other weights without reading them now.

Passes that repack weights (transpose, concatenate) must not pull the checkpoint into RAM: the
new initializer is a lazy tensor computed from its sources when the backend writes it.

A transposed or concatenated weight also records how it was made (:func:`derivation_of`), so a
later pass that wants the weight in another layout reads the sources directly instead of undoing
the first pass's copy: the quantization pass reads ``nn.Linear``'s ``[N, K]`` weights as stored
rather than transposing a lazy ``[K, N]`` back (two strided copies of every weight, 37 s of a 1B
INT4 build).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

DERIVATION = "llmc.derivation"
# Set by the frontend on each checkpoint tensor it reads lazily: the dtype the checkpoint stores it in.
SOURCE_DTYPE = "llmc.source_dtype"


@dataclass(frozen=True)
class Derivation:
    """How a lazy weight is made from ``sources``: ``op`` is ``"transpose"`` (``arg`` = the
    permutation) or ``"concat"`` (``arg`` = the axis)."""

    op: str
    sources: tuple[ir.TensorProtocol, ...]
    arg: tuple[int, ...] | int


def derived(sources: Sequence[ir.TensorProtocol], fn: Callable[..., np.ndarray], dtype: ir.DataType,
            shape: Sequence[int], name: str, derivation: Derivation | None = None) -> ir.LazyTensor:
    """A lazy tensor equal to ``fn(*[s.numpy() for s in sources])``, evaluated on first use."""

    def load() -> ir.Tensor:
        return ir.tensor(np.ascontiguousarray(fn(*[s.numpy() for s in sources])), name=name)

    tensor = ir.LazyTensor(load, dtype=dtype, shape=ir.Shape(list(shape)), name=name)
    if derivation is not None:
        tensor.meta[DERIVATION] = derivation
    return tensor


def derivation_of(tensor: ir.TensorProtocol | None) -> Derivation | None:
    """How ``tensor`` was derived by :func:`transposed` or :func:`concatenated`, else None."""
    meta = getattr(tensor, "meta", None)
    return meta.get(DERIVATION) if meta is not None else None


def transpose_array(a: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """``np.ascontiguousarray(np.transpose(a, perm))``, through torch's blocked, multi-threaded copy
    (3x numpy's strided one for a 2048 x 8192 float32 matrix on 2 cores). Bytes are moved as
    same-width integers, so any dtype (bfloat16, float8) transposes the same way."""
    a = np.asarray(a)
    if a.ndim < 2 or a.size < (1 << 16) or a.dtype.itemsize not in (1, 2, 4, 8):
        return np.ascontiguousarray(np.transpose(a, perm))
    import torch  # the compiler has torch; imported here so reading this module stays cheap

    as_int = np.ascontiguousarray(a).view(f"int{8 * a.dtype.itemsize}")
    with warnings.catch_warnings():  # a checkpoint's memory map is read-only; this only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(as_int)
    return source.permute(*perm).contiguous().numpy().view(a.dtype)


def transposed(tensor: ir.TensorProtocol, perm: Sequence[int], name: str) -> ir.LazyTensor:
    """``tensor`` transposed by ``perm``, lazily."""
    perm = tuple(int(p) for p in perm)
    shape = [tensor.shape[p] for p in perm]
    return derived([tensor], lambda a: transpose_array(a, perm), tensor.dtype, shape, name,
                   Derivation("transpose", (tensor,), perm))


def concatenated(tensors: Sequence[ir.TensorProtocol], axis: int, name: str) -> ir.LazyTensor:
    """``tensors`` concatenated along ``axis``, lazily."""
    shape = [int(d) for d in tensors[0].shape]
    shape[axis] = sum(int(t.shape[axis]) for t in tensors)
    return derived(tensors, lambda *a: np.concatenate(a, axis=axis), tensors[0].dtype, shape, name,
                   Derivation("concat", tuple(tensors), axis))


def constant_of(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant tensor of an initializer value (not a graph input), else None."""
    if value is None or not value.is_initializer() or value.is_graph_input():
        return None
    return value.const_value
