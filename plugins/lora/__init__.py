"""Multi-LoRA kernels for the CUDA engine: a shrink/expand pair (Triton, compiled ahead of time) and their torch
reference. The graph side is :mod:`llmc.passes.lora`; the run-time side :mod:`llmc.runtime.lora`."""
