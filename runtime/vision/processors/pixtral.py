"""Mistral 3 / Pixtral: the longest edge scaled down to fit ``size["longest_edge"]`` (never up), each side then
rounded up to a multiple of the patch size, rescale, normalise; a batch is zero-padded to its largest image and
``image_sizes`` keeps each image's (height, width). Reproduces transformers' ``PixtralImageProcessorPil`` (the
default is the torchvision ``PixtralImageProcessor``, which cannot be installed beside llmc's pinned CPU torch).
"""

from __future__ import annotations

import math

import numpy as np

from llmc.runtime.vision.config import ImageProcessorConfig, size_dict
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

DEFAULTS = dict(resample=BICUBIC, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                size={"longest_edge": 1024}, patch_size={"height": 16, "width": 16}, do_pad=True)
DEFAULT_TO_SQUARE = True


def target_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): fit within the limit, then whole patches (ceil)."""
    size = config.size
    max_h, max_w = (size["longest_edge"],) * 2 if size.get("longest_edge") else (size["height"], size["width"])
    patch = size_dict(config.patch_size, True, "patch_size")
    ratio = max(height / max_h, width / max_w)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    rows = (height - 1) // patch["height"] + 1
    cols = (width - 1) // patch["width"] + 1
    return rows * patch["height"], cols * patch["width"]


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[N, 3, H_max, W_max]`` (padded when ``do_pad``); ``image_sizes`` int64 ``[N, 2]``."""
    pixels, sizes = [], []
    for image in images:
        if config.do_resize:
            image = common.resize(image, *target_size(*image.shape[:2], config), config.resample)
        if config.do_center_crop:
            image = common.center_crop(image, config.crop_size["height"], config.crop_size["width"])
        pixels.append(common.channels_first(common.rescale_normalize(image, config)))
        sizes.append(image.shape[:2])
    if config.do_pad:
        max_h, max_w = max(h for h, _ in sizes), max(w for _, w in sizes)
        pixels = [np.pad(p, ((0, 0), (0, max_h - p.shape[1]), (0, max_w - p.shape[2]))) for p in pixels]
    return common.ImageFeatures(np.stack(pixels), {"image_sizes": np.asarray(sizes, dtype=np.int64)})
