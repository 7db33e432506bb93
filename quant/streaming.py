"""Lazy quantized weights: several tensors (codes, scales, zero points) computed together from one
weight when the backend writes them, so a build still streams weights one matrix at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir


@dataclass(frozen=True)
class Spec:
    """Name, dtype and shape of one output of a shared computation."""

    name: str
    dtype: ir.DataType
    shape: tuple[int, ...]


class _Shared:
    """Computes ``fn(*sources)`` on first demand and keeps the result only until every output has
    been taken once, then drops it (a later read recomputes: correct, just slower)."""

    def __init__(self, sources: Sequence[ir.TensorProtocol], fn: Callable[..., Sequence[np.ndarray]], n: int) -> None:
        self.sources, self.fn, self.n = list(sources), fn, n
        self.result: list[np.ndarray] | None = None
        self.taken: set[int] = set()

    def get(self, i: int) -> np.ndarray:
        if self.result is None:
            self.result = [np.asarray(a) for a in self.fn(*[s.numpy() for s in self.sources])]
            self.taken = set()
        out = self.result[i]
        self.taken.add(i)
        if len(self.taken) == self.n:
            self.result = None
        return out


def shared_derived(sources: Sequence[ir.TensorProtocol], fn: Callable[..., Sequence[np.ndarray]],
                   specs: Sequence[Spec]) -> list[ir.LazyTensor]:
    """Lazy tensors equal to the outputs of ``fn(*[s.numpy() for s in sources])``, one per spec.

    The arrays ``fn`` returns must already have each spec's numpy dtype (ml_dtypes types for
    FLOAT8/INT4) and shape.
    """
    shared = _Shared(sources, fn, len(specs))
    out = []
    for i, spec in enumerate(specs):
        def load(i=i, spec=spec) -> ir.Tensor:
            return ir.tensor(np.ascontiguousarray(shared.get(i)), name=spec.name)

        out.append(ir.LazyTensor(load, dtype=spec.dtype, shape=ir.Shape(list(spec.shape)), name=spec.name))
    return out
