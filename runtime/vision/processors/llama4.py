"""Llama 4: the image fitted without distortion into the best canvas of whole tiles (``size``, 336x336 in released
checkpoints) up to ``max_patches`` tiles, padded to it, rescaled and normalised in bfloat16, cut into tiles row by
row, plus the whole image resized to one tile (the global tile, last) when there is more than one tile.

Follows transformers' ``Llama4ImageProcessor`` (its only processor, a torchvision one) step by step: the canvases
of ``find_supported_resolutions``, ``get_best_fit`` (float32 scales, the smallest upscale else the largest downscale,
ties to the smallest area, first in its order), the upscale cap at one tile side, ``get_max_res_without_distortion``,
zero padding at the bottom and right, ``rescale_and_normalize`` in bfloat16 (each step rounded to bfloat16, as torch
computes it), ``split_to_tiles``. Parity with transformers could not be checked here: torchvision cannot be
installed beside the pinned CPU torch, so transformers' processor does not run; resizing goes through Pillow's
filter of the same name (torchvision's antialiased uint8 resize is a port of Pillow's, so pixels may still differ
by a rounding step). The model path is tested on these pixels (tests/test_vlm_llama4_images.py).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import BILINEAR

DEFAULTS = dict(resample=BILINEAR, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                size={"height": 336, "width": 336}, max_patches=16, resize_to_max_canvas=False)
DEFAULT_TO_SQUARE = True


def supported_resolutions(max_chunks: int, tile: int) -> list[tuple[int, int]]:
    """Every canvas (height, width) of at most ``max_chunks`` tiles, in transformers' order (grouped by aspect
    ratio in the order each ratio first appears, from ``max_chunks`` tiles down)."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for chunks in range(max_chunks, 0, -1):
        for factor in sorted({d for i in range(1, int(chunks ** 0.5) + 1) if chunks % i == 0
                              for d in (i, chunks // i)}):
            by_ratio[factor / (chunks // factor)].append((factor, chunks // factor))
    return [(h * tile, w * tile) for group in by_ratio.values() for h, w in group]


def best_fit(height: int, width: int, resolutions: list[tuple[int, int]], to_max_canvas: bool) -> tuple[int, int]:
    """``get_best_fit``: the canvas the image scales into without distortion, the least upscale (the most with
    ``to_max_canvas``) else the least downscale; among equals the smallest area (the first such)."""
    res = np.asarray(resolutions, np.int64)
    # torch divides the int64 canvases by the int side in float32
    scale_h = res[:, 0].astype(np.float32) / np.float32(height)
    scale_w = res[:, 1].astype(np.float32) / np.float32(width)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if to_max_canvas else up.min()
    else:
        chosen = scales[scales < 1].max()
    canvas = res[scales == chosen]
    best = canvas[int(np.argmin(canvas[:, 0] * canvas[:, 1]))] if len(canvas) > 1 else canvas[0]
    return int(best[0]), int(best[1])


def max_res_without_distortion(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """``get_max_res_without_distortion``: the largest size of the image's aspect within the target."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_h), target_w
    return target_h, min(math.floor(width * scale_h), target_w)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), kept as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def rescale_normalize_bf16(image: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """``rescale_and_normalize`` of uint8 ``[H, W, 3]``: with both steps, the pixels cast to bfloat16, times the
    factor, minus the mean, over the std, each result rounded to bfloat16 (torch's bfloat16 arithmetic in float32);
    float32 ``[3, H, W]``."""
    x = image.astype(np.float32)
    if config.do_rescale and config.do_normalize:
        x = _bf16(_bf16(x) * np.float32(config.rescale_factor))
        x = _bf16(x - _bf16(np.asarray(config.image_mean, np.float32)))
        x = _bf16(x / _bf16(np.asarray(config.image_std, np.float32)))
    elif config.do_rescale:
        x = x * np.float32(config.rescale_factor)
    elif config.do_normalize:
        x = (x - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
    return common.channels_first(x)


def tiles_of(config: ImageProcessorConfig, image: np.ndarray) -> tuple[list[np.ndarray], int, int]:
    """One ``uint8 [H, W, 3]`` image to its tiles (row-major, then the global tile when there are several),
    float32 ``[3, tile, tile]`` each, and the tile grid (rows, columns)."""
    size = config.size or {}
    if not config.do_resize or not (size.get("height") and size.get("width")):
        raise LlmcError("image processor (Llama 4): do_resize with size {height, width} is required (transformers' "
                        f"Llama4ImageProcessor refuses do_resize false), got do_resize {config.do_resize}, size "
                        f"{size}; fix preprocessor_config.json")
    tile_h, tile_w = int(size["height"]), int(size["width"])
    if tile_h != tile_w:
        raise LlmcError(f"image processor (Llama 4): size {size} must be square (transformers' "
                        "find_supported_resolutions); fix preprocessor_config.json")
    height, width = image.shape[:2]
    target = best_fit(height, width, supported_resolutions(int(config.max_patches or 16), tile_h),
                      bool(config.resize_to_max_canvas))
    if not config.resize_to_max_canvas:  # never upscale past one tile side
        target_free = (min(max(height, tile_h), target[0]), min(max(width, tile_h), target[1]))
    else:
        target_free = target
    new_h, new_w = max_res_without_distortion(height, width, *target_free)
    resized = common.resize(image, max(new_h, 1), max(new_w, 1), config.resample)
    canvas = np.zeros((target[0], target[1], 3), np.uint8)  # zero padding at the bottom and right
    canvas[:resized.shape[0], :resized.shape[1]] = resized
    pixels = rescale_normalize_bf16(canvas, config)
    rows, cols = target[0] // tile_h, target[1] // tile_w
    tiles = [pixels[:, r * tile_h:(r + 1) * tile_h, c * tile_w:(c + 1) * tile_w] for r in range(rows)
             for c in range(cols)]
    if rows * cols > 1:
        tiles.append(rescale_normalize_bf16(common.resize(image, tile_h, tile_w, config.resample), config))
    return tiles, rows, cols


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[tiles of every image, 3, S, S]`` (bfloat16 values), ``aspect_ratios`` int64
    ``[N, 2]`` (each image's tile rows and columns)."""
    frames, ratios = [], []
    for image in images:
        tiles, rows, cols = tiles_of(config, image)
        frames.extend(tiles)
        ratios.append((rows, cols))
    return common.ImageFeatures(np.ascontiguousarray(np.stack(frames), np.float32),
                                {"aspect_ratios": np.asarray(ratios, np.int64)})
