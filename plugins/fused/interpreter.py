"""Tests' fix for the Triton interpreter's ``tl.dot`` over bfloat16 operands.

The interpreter (Triton 3.x, ``InterpreterBuilder.create_dot``) holds bfloat16 tensors as their uint16 bit patterns
and hands them to ``np.matmul`` as they are: it multiplies the integers. A GPU's bfloat16 MMA multiplies the values
exactly and sums in float32, which is what :func:`bf16_dot_as_on_gpu` makes the interpreter do (the operands
widened to float32, exactly). Only the interpreter is touched; a kernel's compiled code is not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def bf16_dot_as_on_gpu() -> Iterator[None]:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
