"""FP8 E4M3 with scales: ``x ≈ decode(code) * scale``, per tensor or per channel.

The scale maps the tensor's (or channel's) largest magnitude onto 448, E4M3's largest finite
value, so nothing saturates for the calibrated range; values beyond it (activations outside
the calibration range) saturate rather than overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.quant.minifloat import E4M3

FP8_MAX = E4M3.max_finite


@dataclass
class Fp8Tensor:
    """``codes`` uint8 E4M3 codes, the shape of the original; ``scale`` float32, a scalar (per tensor)
    or a vector along ``axis`` (per channel)."""

    codes: np.ndarray
    scale: np.ndarray
    axis: int | None

    def dequantize(self) -> np.ndarray:
        """float32 values, the shape of ``codes``."""
        return E4M3.decode(self.codes) * _broadcast(self.scale, self.axis, self.codes.ndim)


def _broadcast(scale: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    if axis is None:
        return scale
    shape = [1] * ndim
    shape[axis] = -1
    return scale.reshape(shape)


def scale_for(amax: np.ndarray | float) -> np.ndarray:
    """float32 scale(s) that map ``amax`` onto E4M3's largest finite value (1 where ``amax`` is 0)."""
    amax = np.asarray(amax, dtype=np.float64)
    return np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)


QUANTIZE_CHUNK = 1 << 18  # elements per step of quantize(): its temporaries stay in cache


def quantize(x: np.ndarray, axis: int | None = None) -> Fp8Tensor:
    """Quantize ``x`` to E4M3, one scale per tensor (``axis=None``) or per index along ``axis``."""
    x = np.asarray(x, dtype=np.float32)
    # max |x| as max(max x, -min x): no temporary the size of x (NaN still propagates). A GPU build quantizes
    # every weight again per scoring round and once more to emit it: ~4.6 s an 8B layer with np.abs and a whole-
    # tensor division, clip and cast (py-spy: a fifth of an 8B --gpu h100 --quant fp8 build's scoring).
    if axis is None:
        amax = np.maximum(x.max(), -x.min()) if x.size else 0.0
    else:
        axis = axis % x.ndim
        red = tuple(d for d in range(x.ndim) if d != axis)
        amax = np.maximum(x.max(axis=red), -x.min(axis=red))
    scale = scale_for(amax)
    s = _broadcast(scale, axis, x.ndim)
    # Divide in float32, as ONNX QuantizeLinear does, so the CPU graph and this codec agree bit for bit; in
    # chunks of rows (elementwise: the same codes), so that the quotient and the codec's temporaries stay in cache.
    if x.ndim == 0 or x.size <= QUANTIZE_CHUNK:
        return Fp8Tensor(encode(x / s), scale, axis)
    codes = np.empty(x.shape, np.uint8)
    rows = max(1, QUANTIZE_CHUNK // max(1, x[0].size))
    per_row = np.ndim(s) > 0 and s.shape[0] > 1
    for start in range(0, x.shape[0], rows):
        codes[start:start + rows] = encode(x[start:start + rows] / (s[start:start + rows] if per_row else s))
    return Fp8Tensor(codes, scale, axis)


def quantize_with_scale(x: np.ndarray, scale: float) -> np.ndarray:
    """E4M3 codes of ``x / scale`` (a static, calibrated per-tensor scale), saturating."""
    return encode(np.asarray(x, np.float32) / np.float32(scale))


def encode(x: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes of float32 ``x``: :meth:`Minifloat.encode`'s (round to nearest even, saturating, NaN keeping
    its sign), through its fast path (torch's or ml_dtypes' cast, tests/test_quant_codecs.py)."""
    return E4M3.encode(np.asarray(x, np.float32))
