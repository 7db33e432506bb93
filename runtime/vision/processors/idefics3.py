"""Idefics3 / SmolVLM: the longest edge resized to ``size["longest_edge"]`` (even sides, at most 4096), then up to
whole tiles of ``max_image_size["longest_edge"]``, cut into those tiles row by row plus the whole image shrunk
to one tile (the global image, last); rescale, normalise, zero-padded to the largest frame with a pixel mask.
Reproduces transformers' ``Idefics3ImageProcessorPil`` / ``SmolVLMImageProcessorPil`` (the same code) for one
sample: the images given are the images of one message.
"""

from __future__ import annotations

import math

import numpy as np

from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, LANCZOS

DEFAULTS = dict(resample=LANCZOS, image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD,
                size={"longest_edge": 4 * 364}, max_image_size={"longest_edge": 364}, do_image_splitting=True,
                do_pad=True)
DEFAULT_TO_SQUARE = True
MAX_IMAGE_SIZE = 4096


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest side set to ``longest`` (the other kept in ratio, made even), then capped at 4096."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * ratio)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Sides rounded up to whole tiles (the longer first, the shorter from it in ratio)."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def frames_of(config: ImageProcessorConfig, image: np.ndarray) -> tuple[list[np.ndarray], int, int]:
    """One ``uint8 [H, W, 3]`` image to its frames (tiles then the global image, uint8) and tile rows, cols."""
    tile = config.max_image_size["longest_edge"]
    if config.do_resize:
        image = _resize_to(image, config.size, config.resample)
    if not config.do_image_splitting:
        return [common.resize(image, tile, tile, config.resample)], 0, 0
    image = common.resize(image, *tile_multiple_size(*image.shape[:2], tile), config.resample)
    height, width = image.shape[:2]
    if height <= tile and width <= tile:
        return [image], 0, 0
    rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
    frames = [image[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    frames.append(common.resize(image, tile, tile, config.resample))
    return frames, rows, cols


def _resize_to(image: np.ndarray, size: dict[str, int], resample: int) -> np.ndarray:
    if size.get("longest_edge"):
        return common.resize(image, *longest_edge_size(*image.shape[:2], size["longest_edge"]), resample)
    return common.resize(image, size["height"], size["width"], resample)


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[1, frames, 3, H, W]``, ``pixel_attention_mask`` int64 ``[1, frames, H, W]``
    (when ``do_pad``), ``rows`` / ``cols`` int64 ``[1, N]`` (tile grid of each image; 0 when not split)."""
    frames, rows, cols = [], [], []
    for image in images:
        parts, r, c = frames_of(config, image)
        frames.extend(common.channels_first(common.rescale_normalize(p, config)) for p in parts)
        rows.append(r)
        cols.append(c)
    extras = {"rows": np.asarray([rows], dtype=np.int64), "cols": np.asarray([cols], dtype=np.int64)}
    if not config.do_pad:
        return common.ImageFeatures(np.stack(frames)[None], extras)
    max_h, max_w = max(f.shape[1] for f in frames), max(f.shape[2] for f in frames)
    padded = np.zeros((1, len(frames), frames[0].shape[0], max_h, max_w), dtype=np.float32)
    mask = np.zeros((1, len(frames), max_h, max_w), dtype=np.int64)
    for i, frame in enumerate(frames):
        padded[0, i, :, :frame.shape[1], :frame.shape[2]] = frame
        mask[0, i, :frame.shape[1], :frame.shape[2]] = 1
    return common.ImageFeatures(padded, {"pixel_attention_mask": mask, **extras})
