"""INT4 group-wise weights: ``W[n, k] ≈ (q[n, k] - zp[n, g]) * scale[n, g]`` with ``g = k // group_size``.

Weights are held in the orientation ONNX Runtime's ``MatMulNBits`` wants: ``[N, K]`` (output
channels by input channels, i.e. ``nn.Linear.weight``), groups running along K. Codes are
unsigned 0..15. Symmetric quantization has no stored zero point (``MatMulNBits`` then uses 8)
and, as ONNX Runtime's own quantizer (MLAS) does, gives each group the scale that maps its
largest-magnitude weight exactly onto -8, so that value is exact and all 16 levels are used
(the scale's sign follows that weight). Asymmetric quantization spans ``[min(w, 0), max(w, 0)]``
with a zero point per group.

Packing (``MatMulNBits``, ``bits=4``): ``B`` is uint8 ``[N, n_groups, group_size / 2]`` with
element ``2i`` of a group in the low nibble of byte ``i``; zero points are uint8
``[N, ceil(n_groups / 2)]``, two groups per byte, low nibble first. K is padded with zero
weights up to a whole number of groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP_SIZES = (32, 64, 128)
QMAX = 15


@dataclass
class Int4Weights:
    """``q`` uint8 ``[N, n_groups * group_size]`` codes 0..15; ``scales`` float32 ``[N, n_groups]``;
    ``zero_points`` uint8 ``[N, n_groups]`` (None: symmetric, implicit 8); ``k`` the unpadded K."""

    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    group_size: int
    k: int

    @property
    def n(self) -> int:
        return int(self.q.shape[0])

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[1])

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``."""
        zp = self.zero_points if self.zero_points is not None else np.full_like(self.q[:, :1], 8)
        groups = self.q.reshape(self.n, self.n_groups, self.group_size).astype(np.float32)
        zp = zp.reshape(self.n, -1, 1).astype(np.float32)
        w = (groups - zp) * self.scales[:, :, None]
        return w.reshape(self.n, -1)[:, : self.k]

    def matmulnbits_b(self) -> np.ndarray:
        """uint8 ``[N, n_groups, group_size // 2]``: the ``B`` input of ``MatMulNBits``."""
        pairs = self.q.reshape(self.n, self.n_groups, self.group_size // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)

    def matmulnbits_zero_points(self) -> np.ndarray | None:
        """uint8 ``[N, ceil(n_groups / 2)]`` (two 4-bit zero points per byte), or None if symmetric."""
        if self.zero_points is None:
            return None
        zp = self.zero_points
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.full_like(zp[:, :1], 8)], axis=1)
        return (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)

    def signed_codes(self) -> np.ndarray:
        """int8 ``[N, K_padded]`` codes minus 8 (-8..7), the INT4 storage of a symmetric tensor."""
        return self.q.astype(np.int8) - 8


@dataclass
class SpilledInt4:
    """:class:`Int4Weights` written to ``path`` (codes two to a byte), so that a model's calibrated INT4 weights
    wait for the graph pass and the backend on disk, not in memory (an 8B model's codes are 3.5 GB)."""

    path: object
    n: int
    k: int
    group_size: int

    def load(self) -> Int4Weights:
        with np.load(self.path) as f:
            packed, scales = f["packed"], f["scales"]
            zp = f["zero_points"] if "zero_points" in f.files else None
        q = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
        q[:, 0::2] = packed & 0xF
        q[:, 1::2] = packed >> 4
        return Int4Weights(q, scales, zp, self.group_size, self.k)

    def dequantize(self) -> np.ndarray:
        return self.load().dequantize()


def spill(w: Int4Weights, path) -> SpilledInt4:
    """Write ``w`` to ``path`` (an .npz) and return the handle that reads it back."""
    packed = (w.q[:, 0::2] | (w.q[:, 1::2] << 4)).astype(np.uint8)  # group sizes are even: K padded is too
    arrays = {"packed": packed, "scales": w.scales}
    if w.zero_points is not None:
        arrays["zero_points"] = w.zero_points
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return SpilledInt4(path, w.n, w.k, w.group_size)


def materialize(w: Int4Weights | SpilledInt4) -> Int4Weights:
    return w.load() if isinstance(w, SpilledInt4) else w


def padded_groups(w: np.ndarray, group_size: int) -> np.ndarray:
    n, k = w.shape
    n_groups = -(-k // group_size)
    if n_groups * group_size != k:
        w = np.concatenate([w, np.zeros((n, n_groups * group_size - k), w.dtype)], axis=1)
    return w.reshape(n, n_groups, group_size)


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group size {group_size}: choose one of {', '.join(map(str, GROUP_SIZES))}")


def group_params(groups: np.ndarray, symmetric: bool,
                 clip: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (float32) and zero point (uint8, or None if symmetric) of each group along the last axis.

    ``clip`` (scalar or per group, in (0, 1]) shrinks the range first: values outside are clipped,
    which AWQ's clipping search trades against finer steps for the rest.
    """
    groups = np.asarray(groups, np.float32)
    clip = np.asarray(clip, np.float32)
    if symmetric:
        idx = np.abs(groups).argmax(axis=-1)[..., None]
        peak = np.take_along_axis(groups, idx, axis=-1)[..., 0] * clip
        scale = np.where(peak != 0, peak / np.float32(-8.0), np.float32(1.0)).astype(np.float32)
        return scale, None
    lo = np.minimum(groups.min(axis=-1), 0.0) * clip
    hi = np.maximum(groups.max(axis=-1), 0.0) * clip
    scale = ((hi - lo) / np.float32(QMAX)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, QMAX).astype(np.uint8)
    return scale, zp


def quantize_groups(groups: np.ndarray, scale: np.ndarray, zp: np.ndarray | None) -> np.ndarray:
    """uint8 codes of ``groups [..., group_size]`` with per-group ``scale``/``zp`` (round half to even)."""
    zero = np.float32(8.0) if zp is None else zp[..., None].astype(np.float32)
    q = np.rint(np.asarray(groups, np.float32) / scale[..., None]) + zero
    return np.clip(q, 0, QMAX).astype(np.uint8)


def quantize_rtn(w: np.ndarray, group_size: int = 128, symmetric: bool = False,
                 clip: np.ndarray | float = 1.0) -> Int4Weights:
    """Round-to-nearest group-wise INT4 of ``w [N, K]`` (float); ``clip`` as in :func:`group_params`."""
    check_group_size(group_size)
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"INT4 weights must be 2-D [N, K], got shape {list(w.shape)}")
    groups = padded_groups(w, group_size)
    if groups.size >= TORCH_MIN_ELEMENTS:
        scale, zp, q = _rtn_torch(groups, symmetric, clip)
    else:
        scale, zp = group_params(groups, symmetric, clip)
        q = quantize_groups(groups, scale, zp)
    return Int4Weights(q.reshape(w.shape[0], -1), scale, zp, group_size, w.shape[1])


# Above this many weights quantize_rtn runs in torch: the same float32 operations (IEEE division and
# multiplication, round half to even), so the same codes, on every core (numpy's run on one), a third of a
# 1B model's INT4 emit. Below it torch's per-call overhead is not worth it.
TORCH_MIN_ELEMENTS = 1 << 20


def _rtn_torch(groups: np.ndarray, symmetric: bool, clip) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """:func:`group_params` and :func:`quantize_groups` of ``groups [..., group_size]`` in torch."""
    import torch

    g = torch.from_numpy(np.ascontiguousarray(groups, np.float32))
    c = torch.from_numpy(np.array(np.broadcast_to(np.asarray(clip, np.float32), groups.shape[:-1])))  # a copy
    scale, zero = torch_params(torch_extremes(g, symmetric), symmetric, c)
    zp = None if symmetric else zero.to(torch.uint8).numpy()
    return scale.numpy(), zp, torch_codes(g, scale, zero).to(torch.uint8).numpy()


# The torch form of group_params / quantize_groups (float32, round half to even: the same codes), shared by
# quantize_rtn's large-tensor path and AWQ's clip search, which scales one set of extremes by every ratio.

def torch_extremes(g, symmetric: bool):
    """Per group of ``g [..., group_size]`` (a float32 torch tensor): its largest-magnitude value (symmetric), or
    ``(min(w, 0), max(w, 0))``."""
    import torch

    if symmetric:
        return torch.gather(g, -1, g.abs().argmax(-1, keepdim=True))[..., 0]
    return torch.clamp(g.amin(-1), max=0.0), torch.clamp(g.amax(-1), min=0.0)


def torch_params(extremes, symmetric: bool, clip):
    """``(scale, zero)`` float32 tensors per group from :func:`torch_extremes` shrunk by ``clip`` (a float32
    tensor, scalar or per group); ``zero`` is 8 when symmetric."""
    import torch

    if symmetric:
        peak = extremes * clip
        scale = torch.where(peak != 0, peak / -8.0, torch.ones_like(peak))
        return scale, torch.full_like(scale, 8.0)
    lo, hi = extremes[0] * clip, extremes[1] * clip
    scale = (hi - lo) / float(QMAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.clamp(torch.round(-lo / scale), 0, QMAX)


def torch_codes(g, scale, zero):
    """float32 codes 0..15 of ``g [..., group_size]``."""
    import torch

    return torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, QMAX)


def torch_rtn_dequantized(w, group_size: int, symmetric: bool):
    """``quantize_rtn(w, group_size, symmetric).dequantize()`` of a float32 torch ``w [N, K]``, as a float32
    torch tensor: the same float32 operations, so the same values bit for bit, without leaving torch (AWQ's
    scale search runs it once per candidate)."""
    import torch

    n, k = w.shape
    pad = -k % group_size
    g = (torch.nn.functional.pad(w, (0, pad)) if pad else w).reshape(n, -1, group_size)
    scale, zero = torch_params(torch_extremes(g, symmetric), symmetric, torch.tensor(1.0, dtype=torch.float32))
    deq = (torch_codes(g, scale, zero) - zero[..., None]) * scale[..., None]
    return deq.reshape(n, -1)[:, :k]


def rows(w: Int4Weights, start: int, stop: int) -> Int4Weights:
    """Output channels ``start:stop`` of ``w`` (the inverse of :func:`concat`)."""
    zps = None if w.zero_points is None else w.zero_points[start:stop].copy()
    return Int4Weights(w.q[start:stop].copy(), w.scales[start:stop].copy(), zps, w.group_size, w.k)


def concat(parts: list[Int4Weights]) -> Int4Weights:
    """Stack along N (output channels): the weights of projections packed into one matmul."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.k != first.k for p in parts):
        raise ValueError("concatenated INT4 weights must share K and group size")
    if any((p.zero_points is None) != (first.zero_points is None) for p in parts):
        raise ValueError("concatenated INT4 weights must all be symmetric or all have zero points")
    zps = None if first.zero_points is None else np.concatenate([p.zero_points for p in parts])
    return Int4Weights(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]), zps,
                       first.group_size, first.k)
