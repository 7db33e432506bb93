"""Gemma 3 (SigLIP encoder): a fixed-size resize (896x896 in released checkpoints), rescale, normalise; with
``do_pan_and_scan`` (off by default) an elongated image also yields crops, each processed like the image.

Reproduces transformers' ``Gemma3ImageProcessorPil``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from llmc.runtime.vision.config import ImageProcessorConfig
from llmc.runtime.vision.processors import common
from llmc.runtime.vision.processors.constants import BILINEAR, IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD

DEFAULTS = dict(resample=BILINEAR, image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD,
                size={"height": 224, "width": 224})
DEFAULT_TO_SQUARE = True


def preprocess(config: ImageProcessorConfig, images: list[np.ndarray]) -> common.ImageFeatures:
    """``pixel_values`` float32 ``[N + crops, 3, H, W]`` (each image then its crops), ``num_crops`` int64 ``[N]``."""
    pixels, num_crops = [], []
    for image in images:
        crops = pan_and_scan(config, image) if config.do_pan_and_scan else []
        num_crops.append(len(crops))
        for part in [image, *crops]:
            if config.do_resize:
                part = common.resize(part, *common.output_size(*part.shape[:2], config.size), config.resample)
            pixels.append(common.channels_first(common.rescale_normalize(part, config)))
    return common.ImageFeatures(np.stack(pixels), {"num_crops": np.asarray(num_crops, dtype=np.int64)})


def pan_and_scan(config: ImageProcessorConfig, image: np.ndarray) -> list[np.ndarray]:
    """The crops of an image whose aspect ratio reaches ``pan_and_scan_min_ratio_to_activate`` (else none)."""
    height, width = image.shape[:2]
    min_crop, max_crops = config.pan_and_scan_min_crop_size, config.pan_and_scan_max_num_crops
    long, short = (width, height) if width >= height else (height, width)
    if long / short < config.pan_and_scan_min_ratio_to_activate:
        return []
    count = int(math.floor(long / short + 0.5))
    count = min(max_crops, max(2, min(int(math.floor(long / min_crop)), count)))
    crops_w, crops_h = (count, 1) if width >= height else (1, count)
    crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    if min(crop_w, crop_h) < min_crop:
        return []
    return [image[y:y + crop_h, x:x + crop_w]
            for y, x in itertools.product(range(0, crop_h * crops_h, crop_h), range(0, crop_w * crops_w, crop_w))]
