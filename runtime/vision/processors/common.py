"""The steps every family shares, each equal to transformers' PIL backend on the same input.

Images are ``uint8 [H, W, 3]`` until rescaled, then ``float32 [H, W, 3]``; families move channels first at the end.
Resizing goes through Pillow exactly as ``transformers.image_transforms.resize`` does (uint8 in, uint8 out), and
rescale / normalize repeat its arithmetic (float64 product cast to float32; float32 subtract and divide), so the
pixels are bit-identical to transformers', not just close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from llmc.errors import LlmcError

# A resize target no processor reaches from a sane image: a 2x3000 strip resized to a 336 shortest edge would be
# 336x504000 (0.5 GB of pixels) before its centre crop.
MAX_RESIZED_PIXELS = 64 * 1024 * 1024


@dataclass
class ImageFeatures:
    """A processor's output, named as transformers names it: ``pixel_values`` (float32; shape per family) and
    ``extras`` (``image_grid_thw``, ``image_sizes``, ``num_crops``, ``pixel_attention_mask``, …)."""

    pixel_values: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"pixel_values": self.pixel_values, **self.extras}


def resize(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """``uint8 [H, W, 3]`` to ``uint8 [height, width, 3]`` with PIL filter ``resample``."""
    if height <= 0 or width <= 0 or height * width > MAX_RESIZED_PIXELS:
        raise LlmcError(f"image of {image.shape[1]}x{image.shape[0]} pixels resizes to {width}x{height} for this "
                        "model's processor: its aspect ratio is too extreme; crop or pad it")
    resized = Image.fromarray(image).resize((width, height), resample=resample)
    return np.asarray(resized)


def rescale(image: np.ndarray, scale: float) -> np.ndarray:
    """``image * scale`` computed in float64, returned as float32 (transformers' ``rescale``)."""
    return (image.astype(np.float64) * scale).astype(np.float32)


def normalize(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``(image - mean) / std`` per channel (last axis), in float32 (or the image's float dtype)."""
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    return (image - np.asarray(mean, dtype=image.dtype)) / np.asarray(std, dtype=image.dtype)


def rescale_normalize(image: np.ndarray, config) -> np.ndarray:
    """The config's rescale then normalize; the result is float32 ``[H, W, C]``."""
    if config.do_rescale:
        image = rescale(image, config.rescale_factor)
    if config.do_normalize:
        image = normalize(image, config.image_mean, config.image_std)
    return image.astype(np.float32, copy=False)


def channels_first(image: np.ndarray) -> np.ndarray:
    """``[H, W, C]`` to ``[C, H, W]`` (contiguous)."""
    return np.ascontiguousarray(np.moveaxis(image, -1, 0))


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop``: the centred ``height x width`` window, zero-padded where the image is smaller."""
    orig_h, orig_w = image.shape[:2]
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0 and top + height <= orig_h and left + width <= orig_w:
        return image[top:top + height, left:left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((new_h, new_w, *image.shape[2:]), dtype=image.dtype)
    top_pad, left_pad = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[top_pad:top_pad + orig_h, left_pad:left_pad + orig_w] = image
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def output_size(height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
    """The (height, width) transformers' PIL backend ``resize`` picks for a size dict."""
    if size.get("shortest_edge") and size.get("longest_edge"):
        return size_with_aspect_ratio(height, width, size["shortest_edge"], size["longest_edge"])
    if size.get("shortest_edge"):
        return shortest_edge_size(height, width, size["shortest_edge"])
    if size.get("max_height") and size.get("max_width"):
        scale = min(size["max_height"] / height, size["max_width"] / width)
        return int(height * scale), int(width * scale)
    if size.get("height") and size.get("width"):
        return size["height"], size["width"]
    raise LlmcError(f"image processor: size {size} has none of height+width, shortest_edge, max_height+max_width")


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """The shorter side becomes ``edge``, the longer one scaled and truncated (torchvision's ``Resize(int)``)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' ``get_size_with_aspect_ratio``: shortest edge ``size`` unless the longest then passes
    ``max_size``."""
    raw_size = None
    if max(height, width) / min(height, width) * size > max_size:
        raw_size = max_size * min(height, width) / max(height, width)
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    scale = raw_size if raw_size is not None else size
    if width < height:
        return int(scale * height / width), size
    return size, int(scale * width / height)
