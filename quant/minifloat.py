"""Rounding float32 values to small floating-point formats (FP8 E4M3, FP4 E2M1) as integer codes.

One generic, vectorised encoder serves every minifloat: round to nearest with ties to even,
subnormals included, saturating to the largest finite value (the behaviour quantizers want; IEEE
overflow to Inf/NaN would turn one outlier into a poisoned tensor). Decoding is a table lookup
over every code, so encode and decode are each other's inverse on representable values by
construction. The tests check both, bit for bit, against torch and ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Minifloat:
    """A sign-exponent-mantissa format of at most 8 bits without infinities.

    ``nan_code`` is the code (sign bit clear) of NaN, or None when the format has no NaN (E2M1);
    ``max_finite`` is the largest finite magnitude.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_finite: float
    nan_code: int | None

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)

    @cached_property
    def table(self) -> np.ndarray:
        """float32 ``[2**bits]``: the value of every code (NaN for the NaN codes)."""
        codes = np.arange(1 << self.bits)
        mant = codes & ((1 << self.mantissa_bits) - 1)
        exp = (codes >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        frac = mant / float(1 << self.mantissa_bits)
        normal = np.ldexp(1.0 + frac, exp - self.bias)
        subnormal = np.ldexp(frac, 1 - self.bias)
        mag = np.where(exp == 0, subnormal, normal)
        values = np.where(codes & self.sign_bit, -mag, mag)
        if self.nan_code is not None:
            values[(codes & ~self.sign_bit) == self.nan_code] = np.nan
        return values.astype(np.float32)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """uint8 codes of ``x`` (any float array): round to nearest even, saturate at ``±max_finite``.

        Infinities saturate; NaN becomes the NaN code with its sign, and raises ``ValueError`` in a
        format that has no NaN.

        Encodes ``ENCODE_CHUNK`` elements at a time: the float64 arithmetic below makes a dozen temporaries
        the size of its input, which for an 8B model's gate/up weight would be 16 GB.
        """
        x = np.asarray(x)
        if self.name == "float8_e4m3fn" and x.dtype in (np.float32, np.float16):
            return _e4m3_fast(x)
        if x.ndim == 0 or x.size <= ENCODE_CHUNK:
            return self._encode(x)
        out = np.empty(x.shape, np.uint8)
        rows = max(1, ENCODE_CHUNK // max(1, x[0].size))
        for start in range(0, x.shape[0], rows):
            out[start : start + rows] = self._encode(x[start : start + rows])
        return out

    def _encode(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        nan = np.isnan(x)
        if nan.any() and self.nan_code is None:
            raise ValueError(f"{self.name} has no NaN encoding, and the input holds {int(nan.sum())} NaN value(s)")
        negative = np.signbit(x)
        a = np.minimum(np.abs(np.where(nan, 0.0, x)), self.max_finite)
        min_exp = 1 - self.bias
        _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
        exponent = np.maximum(e - 1, min_exp)
        quantum = np.ldexp(1.0, exponent - self.mantissa_bits)
        # Division by a power of two is exact in float64, so rint sees the true quotient: ties go to even.
        q = np.minimum(np.rint(a / quantum) * quantum, self.max_finite)
        _, e2 = np.frexp(q)
        exp2 = e2 - 1
        is_sub = (exp2 < min_exp) | (q == 0)
        sub_mant = q / np.ldexp(1.0, min_exp - self.mantissa_bits)
        norm_mant = q / np.ldexp(1.0, exp2 - self.mantissa_bits) - (1 << self.mantissa_bits)
        exp_field = np.where(is_sub, 0, exp2 + self.bias)
        mant = np.where(is_sub, sub_mant, norm_mant)
        codes = (exp_field.astype(np.int64) << self.mantissa_bits) | mant.astype(np.int64)
        if self.nan_code is not None:
            codes = np.where(nan, self.nan_code, codes)
        codes = np.where(negative, codes | self.sign_bit, codes)
        return codes.astype(np.uint8)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """float32 values of uint8 ``codes``."""
        return self.table[np.asarray(codes, dtype=np.uint8)]

    def round(self, x: np.ndarray) -> np.ndarray:
        """``decode(encode(x))``: ``x`` rounded onto the format's grid, as float32."""
        return self.decode(self.encode(x))


ENCODE_CHUNK = 1 << 20  # elements per step of Minifloat.encode (float64 temporaries of 8 MB each)


def _e4m3_fast(x: np.ndarray) -> np.ndarray:
    """E4M3 codes of a float32/float16 array in one C conversion (one rounding, to nearest even) after saturating at
    ±448 (both libraries below turn out-of-range values into NaN): the codes of :meth:`Minifloat._encode`, which
    stays the reference (tests hold them equal bit for bit). Building a GPU engine encodes every FP8 weight twice
    (to score the quantized graph on the CPU and to emit it): an 8B model's, ~5 s a layer each in the reference.

    torch's vectorised cast where torch is installed (the compiler's processes: 4096x4096 in 11 ms), else
    ml_dtypes' (the runtime-only install: 53 ms); ~20x the reference either way."""
    try:
        import torch
    except ImportError:
        return _e4m3_ml_dtypes(x)
    # numpy's clip: a new writable array (torch warns on a read-only one, e.g. a memory-mapped weight), NaN kept
    y = np.clip(np.ascontiguousarray(x, np.float32), -448.0, 448.0)
    return torch.from_numpy(y.reshape(-1)).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(x.shape)


def _e4m3_ml_dtypes(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    nan = np.isnan(x)
    y = np.clip(x, -448.0, 448.0)
    codes = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    if nan.any():  # keep NaN's sign, as the reference does
        codes = np.where(nan, np.where(np.signbit(x), 0xFF, 0x7F), codes).astype(np.uint8)
    return codes


E4M3 = Minifloat("float8_e4m3fn", exponent_bits=4, mantissa_bits=3, bias=7, max_finite=448.0, nan_code=0x7F)
E2M1 = Minifloat("float4_e2m1fn", exponent_bits=2, mantissa_bits=1, bias=1, max_finite=6.0, nan_code=None)
