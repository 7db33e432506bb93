"""Images for vision-language engines: decoding with limits (``image_io``), each family's preprocessing
(``processors/``), its parameters as stored in the artifact (``config``). Pillow and numpy only."""

from llmc.runtime.vision.config import ImageProcessorConfig, read_checkpoint_json, read_config, write_config
from llmc.runtime.vision.image_io import DEFAULT_MAX_PIXELS, SUPPORTED_FORMATS, decode_image
from llmc.runtime.vision.processor import ImageProcessor, load_processor, processor_for
from llmc.runtime.vision.processors.common import ImageFeatures

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "SUPPORTED_FORMATS",
    "ImageFeatures",
    "ImageProcessor",
    "ImageProcessorConfig",
    "decode_image",
    "load_processor",
    "processor_for",
    "read_checkpoint_json",
    "read_config",
    "write_config",
]
