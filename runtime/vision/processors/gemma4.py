"""Gemma 4: an aspect-preserving resize into a soft-token budget (sides multiples of ``pooling_kernel_size *
patch_size``, at most ``max_soft_tokens * pooling_kernel_size**2`` patches), rescale to [0, 1] (no
normalisation by default), patches of ``patch_size`` flattened (y, x, channel), padded to the budget, and each
patch's (x, y) position (-1 for padding). Reproduces transformers' ``Gemma4ImageProcessorPil``.
"""

from __future__ import annotations

import math

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import BICUBIC

DEFAULTS = dict(resample=BICUBIC, do_normalize=False, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0),
                patch_size=16, max_soft_tokens=280, pooling_kernel_size=3)
DEFAULT_TO_SQUARE = True
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


def target_size(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The largest (height, width), multiples of ``pooling * patch``, within ``max_patches`` patches."""
    target_px = max_patches * patch**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch
    new_h = int(math.floor(factor * height / side)) * side
    new_w = int(math.floor(factor * width / side)) * side
    if new_h == 0 and new_w == 0:
        raise LlmcError(f"image of {width}x{height} pixels resizes to nothing under Gemma 4's patch budget")
    max_side = (max_patches // pooling**2) * side
    if new_h == 0:
        new_h, new_w = side, min(int(math.floor(width / height)) * side, max_side)
    elif new_w == 0:
        new_w, new_h = side, min(int(math.floor(height / width)) * side, max_side)
    if new_h * new_w > target_px:
        raise LlmcError(f"image of {width}x{height} pixels: resized to {new_w}x{new_h} it exceeds {max_patches} "
                        f"patches of {patch} pixels")
    return new_h, new_w


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[N, max_patches, P*P*3]``, ``image_position_ids`` int64 ``[N, max_patches, 2]``,
    ``num_soft_tokens_per_image`` int64 ``[N]``."""
    if config.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise LlmcError(f"image processor: max_soft_tokens {config.max_soft_tokens} is not one of "
                        f"{SUPPORTED_SOFT_TOKENS}")
    patch, pooling = config.patch_size, config.pooling_kernel_size
    max_patches = config.max_soft_tokens * pooling**2
    pixels, positions, soft_tokens = [], [], []
    for image in images:
        if config.do_resize:
            height, width = target_size(*image.shape[:2], patch, max_patches, pooling)
            if (height, width) != image.shape[:2]:
                image = common.resize(image, height, width, config.resample)
        image = common.rescale_normalize(image, config)
        rows, cols = image.shape[0] // patch, image.shape[1] // patch
        flat = image[:rows * patch, :cols * patch].reshape(rows, patch, cols, patch, -1).transpose(0, 2, 1, 3, 4)
        flat = flat.reshape(rows * cols, -1)
        xy = np.stack(np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy"), axis=-1).reshape(-1, 2)
        soft_tokens.append(flat.shape[0] // pooling**2)
        pad = max_patches - flat.shape[0]
        pixels.append(np.pad(flat, ((0, max(pad, 0)), (0, 0))))
        positions.append(np.pad(xy, ((0, max(pad, 0)), (0, 0)), constant_values=-1))
    return common.ImageFeatures(np.stack(pixels), {"image_position_ids": np.stack(positions),
                                                   "num_soft_tokens_per_image": np.asarray(soft_tokens)})
