"""CLIP / LLaVA / SigLIP: resize (shortest edge or a fixed size), centre crop, rescale, normalise.

Reproduces transformers' ``CLIPImageProcessorPil``, ``LlavaImageProcessorPil`` (optionally padded to a square in
the mean colour first) and ``SiglipImageProcessorPil``; released LLaVA checkpoints name ``CLIPImageProcessor``.
"""

from __future__ import annotations

import numpy as np

from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import (
    BICUBIC,
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
)

CLIP_DEFAULTS = dict(resample=BICUBIC, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                     size={"shortest_edge": 224}, do_center_crop=True, crop_size={"height": 224, "width": 224})
SIGLIP_DEFAULTS = dict(resample=BICUBIC, image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD,
                       size={"height": 224, "width": 224})
DEFAULT_TO_SQUARE = False


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[N, 3, H, W]`` (the images must share a size after crop, as in a batch)."""
    return common.ImageFeatures(np.stack([process_one(config, image) for image in images]))


def process_one(config: ImageProcessorConfig, image: np.ndarray) -> np.ndarray:
    """One ``uint8 [H, W, 3]`` image to float32 ``[3, H', W']``."""
    if config.do_pad:
        image = pad_to_square(image, tuple(int(x * 255) for x in config.image_mean))
    if config.do_resize:
        image = common.resize(image, *common.output_size(*image.shape[:2], config.size), config.resample)
    if config.do_center_crop:
        image = common.center_crop(image, config.crop_size["height"], config.crop_size["width"])
    return common.channels_first(common.rescale_normalize(image, config))


def pad_to_square(image: np.ndarray, colour: tuple[int, ...]) -> np.ndarray:
    """LLaVA's ``pad_to_square``: centred on a square of the longer side, filled with ``colour``."""
    height, width = image.shape[:2]
    if height == width:
        return image
    side = max(height, width)
    square = np.empty((side, side, image.shape[2]), dtype=image.dtype)
    square[...] = np.asarray(colour, dtype=image.dtype)
    if width > height:
        start = (side - height) // 2
        square[start:start + height] = image
    else:
        start = (side - width) // 2
        square[:, start:start + width] = image
    return square
