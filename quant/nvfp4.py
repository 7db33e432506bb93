"""NVFP4: E2M1 values in blocks of 16 along K, one E4M3 scale per block, one FP32 global scale per tensor.

``x ≈ e2m1(code) * e4m3(block_scale) * global_scale``. The global scale maps the tensor's largest
magnitude onto ``6 * 448`` (E2M1's and E4M3's largest finite values), so the largest block scale
is E4M3's largest value and smaller blocks keep E4M3's relative precision. Each block's scale is
its own largest magnitude over 6, rounded to E4M3; values are then divided by the decoded block
scale and rounded (nearest even, saturating) to E2M1. This is the recipe of NVIDIA's
TensorRT-Model-Optimizer, whose Blackwell kernels consume exactly these three tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.quant.minifloat import E2M1, E4M3

BLOCK = 16
E2M1_MAX = E2M1.max_finite
E4M3_MAX = E4M3.max_finite


@dataclass
class Nvfp4Tensor:
    """``codes`` uint8 E2M1 codes ``[..., K]``; ``block_scales`` uint8 E4M3 codes ``[..., K / 16]``;
    ``global_scale`` a float32 scalar."""

    codes: np.ndarray
    block_scales: np.ndarray
    global_scale: np.float32

    def block_scale_values(self) -> np.ndarray:
        """float32 ``[..., K / 16]``: each block's effective scale (E4M3 scale × global scale)."""
        return E4M3.decode(self.block_scales) * self.global_scale

    def dequantize(self) -> np.ndarray:
        """float32 ``[..., K]``."""
        values = E2M1.decode(self.codes)
        blocks = values.reshape(*values.shape[:-1], -1, BLOCK) * self.block_scale_values()[..., None]
        return blocks.reshape(values.shape)

    def packed_codes(self) -> np.ndarray:
        """uint8 ``[..., K / 2]``: two E2M1 codes per byte, element ``2i`` in the low nibble (ONNX FLOAT4E2M1)."""
        return (self.codes[..., 0::2] | (self.codes[..., 1::2] << 4)).astype(np.uint8)


def global_scale_for(amax: float) -> np.float32:
    """The FP32 global scale for a tensor whose largest magnitude is ``amax`` (1 if it is 0)."""
    return np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)


def quantize(x: np.ndarray, global_scale: float | None = None) -> Nvfp4Tensor:
    """NVFP4 of ``x [..., K]`` with K a multiple of 16, blocks along the last axis.

    ``global_scale`` defaults to the one computed from ``x`` itself (weights); activations pass
    their calibrated one. Raises ``ValueError`` if K is not a multiple of 16 or ``x`` holds NaN.
    """
    x = np.asarray(x, np.float32)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got {x.shape[-1]}")
    if global_scale is None:
        global_scale = global_scale_for(float(np.abs(x).max()) if x.size else 0.0)
    g = np.float32(global_scale)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    block_amax = np.abs(blocks).max(axis=-1)
    scale_codes = E4M3.encode(block_amax / np.float32(E2M1_MAX) / g)
    scale = E4M3.decode(scale_codes) * g
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = E2M1.encode(blocks / safe[..., None])
    return Nvfp4Tensor(codes.reshape(x.shape), scale_codes, g)
