"""Decode one image (a path, encoded bytes, a numpy array or a PIL image) into RGB pixels, refusing bad input.

Every failure a user can cause — not an image, a truncated file, a decompression bomb, a format outside the
allowed list, an array of the wrong shape or dtype — raises :class:`llmc.errors.LlmcError` with one line naming it.
The result is what transformers' image processors work on after their ``convert_to_rgb``: ``uint8 [H, W, 3]``.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from llmc.errors import LlmcError

# 64 Mpx: a 8192x8192 photo passes, a bomb (a tiny PNG that claims 100000x100000) is refused before decoding.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024
# What llmc decodes; MPO is the multi-picture JPEG phones write. Anything else Pillow recognises (EPS, PDF, ICNS,
# …) is refused: the list is what the OpenAI API accepts plus BMP/TIFF, and each here is a pure-Pillow decoder.
SUPPORTED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")

ImageSource = str | os.PathLike | bytes | bytearray | memoryview | np.ndarray | Image.Image


def decode_image(source: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None) -> np.ndarray:
    """Decode ``source`` to ``uint8 [H, W, 3]`` RGB.

    Encoded images (path or bytes) are turned upright by their EXIF orientation, as ``transformers.load_image``
    does; then, as the image processors' ``convert_to_rgb``: a transparent image is composited onto white, any
    other mode converted to RGB. Arrays follow transformers' numpy path (``[H, W]``, ``[H, W, C]`` or
    ``[C, H, W]`` with C in 1, 3, 4; uint8 only). ``max_pixels`` bounds width*height before any pixel is decoded.
    ``name`` is what error messages call the image (default: the path, or "image").
    """
    if isinstance(source, np.ndarray):
        return _from_array(source, max_pixels, name or "image array")
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, max_pixels, name or "image")
        return _to_rgb(source)
    if isinstance(source, bytes | bytearray | memoryview):
        label = name or "image"
        data = bytes(source)
    elif isinstance(source, str | os.PathLike):
        label = name or str(source)
        data = _read_file(Path(source), label)
    else:
        raise LlmcError(f"{name or 'image'}: expected a path, bytes or a uint8 array, got {type(source).__name__}")
    return _to_rgb(_open(data, label, max_pixels), exif=True)


def _read_file(path: Path, label: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise LlmcError(f"{label}: no such image file") from None
    except IsADirectoryError:
        raise LlmcError(f"{label}: is a directory, not an image file") from None
    except PermissionError:
        raise LlmcError(f"{label}: permission denied reading the image file") from None


def _open(data: bytes, label: str, max_pixels: int) -> Image.Image:
    """Identify, check the header's size and format, then decode every pixel (so truncation shows here)."""
    if not data:
        raise LlmcError(f"{label}: not an image (empty)")
    with warnings.catch_warnings():
        # Pillow's own bomb guard warns (then raises past twice its limit); ours is the pixel limit below.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise LlmcError(f"{label}: not an image (no image format recognised in {len(data)} bytes)") from None
        except Image.DecompressionBombError as exc:
            raise LlmcError(f"{label}: image too large, a decompression bomb ({_one_line(exc)})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise LlmcError(f"{label}: {_damage(exc, 'not a readable image')} ({_one_line(exc)})") from None
        if image.format not in SUPPORTED_FORMATS:
            raise LlmcError(f"{label}: unsupported image format {image.format} (llmc reads "
                            f"{', '.join(f for f in SUPPORTED_FORMATS if f != 'MPO')})")
        _check_pixels(image.width, image.height, max_pixels, label)
        try:
            image.load()
        except Image.DecompressionBombError as exc:
            raise LlmcError(f"{label}: image too large, a decompression bomb ({_one_line(exc)})") from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise LlmcError(f"{label}: {_damage(exc, 'corrupt image')} ({image.format}, {_one_line(exc)})") from None
    return image


def _check_pixels(width: int, height: int, max_pixels: int, label: str) -> None:
    if width <= 0 or height <= 0:
        raise LlmcError(f"{label}: image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise LlmcError(f"{label}: image too large ({width}x{height} = {width * height} pixels, over the limit of "
                        f"{max_pixels}; a decompression bomb or a photo to downscale first)")


def _to_rgb(image: Image.Image, *, exif: bool = False) -> np.ndarray:
    """transformers' ``convert_to_rgb`` on a PIL image: transparency composited onto opaque white."""
    if exif:
        image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)


def _from_array(array: np.ndarray, max_pixels: int, label: str) -> np.ndarray:
    """transformers' numpy path: channels inferred (first axis preferred), grey repeated, alpha blended on white."""
    if array.dtype != np.uint8:
        raise LlmcError(f"{label}: must be uint8 (0-255), got {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    elif array.ndim != 3:
        raise LlmcError(f"{label}: must be [H, W], [H, W, C] or [C, H, W], got shape {array.shape}")
    elif array.shape[0] in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)
    elif array.shape[-1] not in (1, 3, 4):
        raise LlmcError(f"{label}: needs 1, 3 or 4 channels, got shape {array.shape}")
    _check_pixels(array.shape[1], array.shape[0], max_pixels, label)
    channels = array.shape[-1]
    if channels == 1:
        return np.ascontiguousarray(np.repeat(array, 3, axis=-1))
    if channels == 4:
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(array)


def _damage(exc: BaseException, otherwise: str) -> str:
    """What a decoder's exception says about the file: cut short, or something else."""
    truncated = isinstance(exc, EOFError) or "truncat" in str(exc).lower()
    return "truncated image" if truncated else otherwise


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__

