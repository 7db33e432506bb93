"""llmc's INT4 matmul for the CPU: ``llmc.Int4MatMul`` in the native ONNX Runtime custom-op library.

:mod:`.pack` lays group-wise INT4 weights out for the kernel (csrc/int4_matmul_core.h);
:mod:`.reference` computes in numpy exactly what the kernel computes, for the tests.
"""
