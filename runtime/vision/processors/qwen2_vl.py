"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: dynamic resolution.

Each image is resized so both sides are multiples of ``patch_size * merge_size`` and its area lies within
``size["shortest_edge"]`` .. ``size["longest_edge"]`` pixels (``smart_resize``), rescaled, normalised, repeated
``temporal_patch_size`` times along time and cut into patches flattened as transformers flattens them:
``[grid_t * grid_h * grid_w, C * T * P * P]``, patches ordered by merge window (so the merger's 2x2 groups are
adjacent). Reproduces transformers' ``Qwen2VLImageProcessorPil`` (its default is the torchvision
``Qwen2VLImageProcessor``, which cannot be installed beside llmc's pinned CPU torch: llmc is held to the PIL one).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

DEFAULTS = dict(resample=BICUBIC, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                patch_size=14, temporal_patch_size=2, merge_size=2)
DEFAULT_TO_SQUARE = False
MAX_ASPECT_RATIO = 200


def adapt(raw: dict[str, Any]) -> dict[str, Any]:
    """Older Qwen configs give ``min_pixels`` / ``max_pixels``; they override ``size`` as the class's __init__ does."""
    raw = dict(raw)
    size = dict(raw.get("size") or DEFAULTS["size"])
    for pixels, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = raw.get(pixels) if raw.get(pixels) is not None else size.get(pixels)
        size.pop(pixels, None)
        if value is not None:
            size[edge] = value
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise LlmcError(f"image processor: Qwen's size needs shortest_edge and longest_edge (min and max pixels), "
                        f"got {size}")
    raw["size"] = size
    return raw


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width), multiples of ``factor``, nearest the image's aspect ratio with an area in range."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise LlmcError(f"image of {width}x{height} pixels: aspect ratio over {MAX_ASPECT_RATIO}:1, which Qwen's "
                        "processor refuses; crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[sum of patches, C*T*P*P]``; ``image_grid_thw`` int64 ``[N, 3]`` (1, h, w)."""
    patches, grids = [], []
    for image in images:
        flat, grid_h, grid_w = process_one(config, image)
        patches.append(flat)
        grids.append([1, grid_h, grid_w])
    return common.ImageFeatures(np.concatenate(patches, axis=0),
                                {"image_grid_thw": np.asarray(grids, dtype=np.int64)})


def process_one(config: ImageProcessorConfig, image: np.ndarray) -> tuple[np.ndarray, int, int]:
    """One ``uint8 [H, W, 3]`` image to its flat patches and its grid (height and width in patches)."""
    if config.do_resize:
        factor = config.patch_size * config.merge_size
        height, width = smart_resize(*image.shape[:2], factor, config.size["shortest_edge"],
                                     config.size["longest_edge"])
        image = common.resize(image, height, width, config.resample)
    pixels = common.channels_first(common.rescale_normalize(image, config))
    return patchify(pixels, config.patch_size, config.merge_size, config.temporal_patch_size)


def patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, int, int]:
    """float32 ``[C, H, W]`` to ``[grid_h * grid_w, C * temporal * patch * patch]``: rows ordered (merge-window
    row, merge-window column, row within window, column within window); columns (channel, time, y, x)."""
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    if grid_h % merge or grid_w % merge:
        raise LlmcError(f"image of {width}x{height} pixels is not a multiple of patch_size*merge_size="
                        f"{patch * merge}: resize it or keep do_resize on")
    blocks = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, *blocks.shape[5:]))
    return blocks.reshape(grid_h * grid_w, channels * temporal * patch * patch), grid_h, grid_w
