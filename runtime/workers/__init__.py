"""Executors that run one packed engine step: ONNX Runtime on the CPU (``ort``) and the CUDA engine (``cuda``,
imported only for CUDA engines, so a CPU engine never loads torch)."""
