"""Weights derived from other weights without reading them now.

Passes that repack weights (transpose, concatenate) must not pull the checkpoint into RAM: the
new initializer is a lazy tensor computed from its sources when the backend writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir


def derived(sources: Sequence[ir.TensorProtocol], fn: Callable[..., np.ndarray], dtype: ir.DataType,
            shape: Sequence[int], name: str) -> ir.LazyTensor:
    """A lazy tensor equal to ``fn(*[s.numpy() for s in sources])``, evaluated on first use."""

    def load() -> ir.Tensor:
        return ir.tensor(np.ascontiguousarray(fn(*[s.numpy() for s in sources])), name=name)

    return ir.LazyTensor(load, dtype=dtype, shape=ir.Shape(list(shape)), name=name)


def constant_of(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant tensor of an initializer value (not a graph input), else None."""
    if value is None or not value.is_initializer() or value.is_graph_input():
        return None
    return value.const_value
