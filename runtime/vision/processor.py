"""Pick a checkpoint's image processor and run it: images in (paths, bytes, arrays), the encoder's inputs out.

``processor_for(model_type, config_dict)`` resolves the checkpoint's image processor JSON into an
:class:`ImageProcessor`; the build stores its ``config`` in the artifact (``config.write_config``) and the runtime
rebuilds it with :func:`load_processor`. No torch, no transformers: Pillow and numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime.vision.config import ImageProcessorConfig, read_config, resolve
from llmc.runtime.vision.image_io import DEFAULT_MAX_PIXELS, ImageSource, decode_image
from llmc.runtime.vision.processors import clip, gemma3, gemma4, idefics3, llama4, pixtral, qwen2_vl
from llmc.runtime.vision.processors.common import ImageFeatures


@dataclass(frozen=True)
class Family:
    """How one family is configured and run."""

    preprocess: Callable[[ImageProcessorConfig, list[np.ndarray]], ImageFeatures]
    defaults: dict[str, Any]
    default_to_square: bool
    adapt: Callable[[dict[str, Any]], dict[str, Any]] = dict


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(qwen2_vl.preprocess, qwen2_vl.DEFAULTS, qwen2_vl.DEFAULT_TO_SQUARE, qwen2_vl.adapt),
    "gemma3": Family(gemma3.preprocess, gemma3.DEFAULTS, gemma3.DEFAULT_TO_SQUARE),
    "gemma4": Family(gemma4.preprocess, gemma4.DEFAULTS, gemma4.DEFAULT_TO_SQUARE),
    "pixtral": Family(pixtral.preprocess, pixtral.DEFAULTS, pixtral.DEFAULT_TO_SQUARE),
    "clip": Family(clip.preprocess, clip.CLIP_DEFAULTS, clip.DEFAULT_TO_SQUARE),
    "siglip": Family(clip.preprocess, clip.SIGLIP_DEFAULTS, clip.DEFAULT_TO_SQUARE),
    "idefics3": Family(idefics3.preprocess, idefics3.DEFAULTS, idefics3.DEFAULT_TO_SQUARE),
    "llama4": Family(llama4.preprocess, llama4.DEFAULTS, llama4.DEFAULT_TO_SQUARE),
}

# The checkpoint's "image_processor_type" (its class, without a "Fast"/"Pil" suffix) decides first: released LLaVA
# checkpoints name CLIPImageProcessor, for instance.
PROCESSOR_CLASSES = {
    "Qwen2VLImageProcessor": "qwen2_vl",
    "Gemma3ImageProcessor": "gemma3",
    "Gemma4ImageProcessor": "gemma4",
    "PixtralImageProcessor": "pixtral",
    "CLIPImageProcessor": "clip",
    "LlavaImageProcessor": "clip",
    "SiglipImageProcessor": "siglip",
    "Idefics3ImageProcessor": "idefics3",
    "SmolVLMImageProcessor": "idefics3",
    "Llama4ImageProcessor": "llama4",
}
# Else the model type, as transformers' AutoImageProcessor maps it.
MODEL_TYPES = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), "qwen2_vl"),
    "gemma3": "gemma3",
    "gemma4": "gemma4",
    "mistral3": "pixtral",
    "pixtral": "pixtral",
    "llava": "clip",
    "vipllava": "clip",
    "paligemma": "siglip",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "llama4": "llama4",
}


@dataclass(frozen=True)
class ImageProcessor:
    """A family's preprocessing with its resolved parameters."""

    config: ImageProcessorConfig

    def __call__(self, images: Sequence[ImageSource], *, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageFeatures:
        """Decode each image (see ``decode_image``) and preprocess them together as transformers' image processor
        does for one sample; the arrays' shapes are the family's (see its module)."""
        if isinstance(images, str | bytes | np.ndarray) or not isinstance(images, Sequence):
            images = [images]
        if not images:
            raise LlmcError("image processor: no images given")
        arrays = [decode_image(image, max_pixels=max_pixels) for image in images]
        return self.preprocess(arrays)

    def preprocess(self, images: list[np.ndarray]) -> ImageFeatures:
        """Preprocess already decoded ``uint8 [H, W, 3]`` images."""
        return FAMILIES[self.config.family].preprocess(self.config, images)


def family_of(model_type: str, config_dict: dict[str, Any]) -> str:
    """The llmc family for a checkpoint, by its image processor class, else its model type."""
    declared = str(config_dict.get("image_processor_type") or "")
    for suffix in ("Fast", "Pil"):
        declared = declared.removesuffix(suffix)
    if declared in PROCESSOR_CLASSES:
        return PROCESSOR_CLASSES[declared]
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    named = f" (image processor {declared})" if declared else ""
    raise UnsupportedError(f"model type {model_type!r}{named}: llmc has no image processor for it; it reproduces "
                           f"{', '.join(sorted(PROCESSOR_CLASSES))}")


def processor_for(model_type: str, config_dict: dict[str, Any]) -> ImageProcessor:
    """The image processor for a checkpoint of ``model_type`` whose image processor JSON is ``config_dict``."""
    name = family_of(model_type, config_dict)
    family = FAMILIES[name]
    config = resolve(name, model_type, family.defaults, family.adapt(config_dict), family.default_to_square)
    return ImageProcessor(config)


def load_processor(artifact_dir: str | Path) -> ImageProcessor | None:
    """The artifact's image processor, or None when the artifact stores none (a text-only engine)."""
    config = read_config(artifact_dir)
    if config is None:
        return None
    if config.family not in FAMILIES:
        raise LlmcError(f"{artifact_dir}: image processor family {config.family!r} is not in this llmc: upgrade llmc")
    return ImageProcessor(config)
