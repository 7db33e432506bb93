"""Lay group-wise INT4 weights out for ``llmc.Int4MatMul`` (csrc/int4_matmul_core.h).

Input (the orientation of :class:`llmc.quant.int4.Int4Weights`, which the plugin does not import:
plugins sit below quant): codes uint8 ``[N, Kp]`` (0..15, Kp a whole number of groups), scales
float32 ``[N, n_groups]``, zero points uint8 ``[N, n_groups]`` or None (symmetric: 8).

Tile ``t`` holds output columns ``16t .. 16t+15``. Weights: uint8 ``[Np/16, Kp/8, 64]`` where byte
``4c + i`` of octet ``o`` holds code ``q[16t + c, 8o + i]`` in its low nibble and ``q[16t + c, 8o + 4 + i]``
in its high nibble, so one 64-byte load feeds two integer dot-product instructions whose int32 lanes
are the 16 columns. Scales and ``mins`` (scale x zero point) are float32 ``[Np/16, n_groups, 16]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 16  # output columns per tile: the int32 lanes of one 512-bit register
OCTET = 8  # inputs per 64-byte block row: two dot-product instructions of 4


@dataclass
class Int4Tiles:
    """The three initializers of one ``llmc.Int4MatMul`` node, and its attributes."""

    w: np.ndarray  # uint8 [Np/16, Kp/8, 64]
    scales: np.ndarray  # float32 [Np/16, n_groups, 16]
    mins: np.ndarray  # float32 [Np/16, n_groups, 16]
    n: int
    k: int
    group_size: int


def supported(group_size: int) -> bool:
    """Whether the kernel takes this group size (a multiple of the 8-input octet)."""
    return group_size > 0 and group_size % OCTET == 0


def pack(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, group_size: int,
         k: int) -> Int4Tiles:
    """Tile one linear's codes ``[N, Kp]`` (``k`` the unpadded input width) for the kernel."""
    if not supported(group_size):
        raise ValueError(f"Int4MatMul needs a group size that is a multiple of {OCTET}, got {group_size}")
    n, kp = codes.shape
    if kp % group_size or scales.shape != (n, kp // group_size) or not 0 < k <= kp:
        raise ValueError(f"codes {codes.shape}, scales {scales.shape}, K {k}: expected scales [N, Kp / {group_size}]")
    tiles = -(-n // TILE)
    pad = tiles * TILE - n
    codes = np.pad(codes, ((0, pad), (0, 0))).astype(np.uint8)
    # [tiles, 16 cols, Kp/8 octets, 2 halves, 4] -> [tiles, octets, 16 cols, 4] per half
    c = codes.reshape(tiles, TILE, kp // OCTET, 2, 4).transpose(0, 2, 1, 3, 4)
    w = (c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)).reshape(tiles, kp // OCTET, 64)
    zp = zero_points if zero_points is not None else np.full(scales.shape, 8, np.uint8)
    mins = scales * zp.astype(np.float32)

    def by_tile(a: np.ndarray) -> np.ndarray:
        a = np.pad(a.astype(np.float32), ((0, pad), (0, 0)))
        return np.ascontiguousarray(a.reshape(tiles, TILE, -1).transpose(0, 2, 1))

    return Int4Tiles(np.ascontiguousarray(w), by_tile(scales), by_tile(mins), n, k, group_size)


def gate_up_order(n: int) -> np.ndarray:
    """Tile order for the SwiGLU epilogue (``activation=1``) of a packed ``[gate | up]`` linear of ``n`` columns
    (``n % 32 == 0``): gate tile i, then up tile i, for each i. Index the tiles' first axis with it."""
    if n % (2 * TILE):
        raise ValueError(f"the SwiGLU epilogue needs whole 16-column gate and up tiles: "
                         f"N = {n} is not a multiple of 32")
    half = n // (2 * TILE)
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
