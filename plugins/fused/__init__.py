"""Fused Triton kernels of the CUDA engine (RMSNorm + residual, rotary, SwiGLU): requests and kernels."""
