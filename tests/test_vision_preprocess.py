"""llmc's image processors (runtime/vision/, Pillow + numpy) against transformers' own (issue 49, processor parity).

Each family's reference is transformers' PIL image processor built with explicit arguments (no hub); where
transformers' default for a model is the torchvision ("fast") class — Qwen2-VL, Pixtral, Gemma 3, … — torchvision
cannot be installed beside llmc's pinned CPU torch, so llmc is held to the PIL class, which that default mirrors.
The checkpoint's JSON given to ``processor_for`` is the reference's own ``to_dict()`` (what ``save_pretrained``
writes). Images are fresh random ones (no fixed seed): smooth, so resampling matters, plus noise, written by Pillow
as PNG, JPEG and WebP, in RGB, RGBA (composited onto white) and greyscale, from 16x16 to 4000x3000.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime.vision import (
    ImageProcessorConfig,
    decode_image,
    load_processor,
    processor_for,
    read_checkpoint_json,
    write_config,
)

tfm = pytest.importorskip("transformers")

TOLERANCE = 1e-5


def _reference(name: str, **kwargs):
    return getattr(tfm, name)(**kwargs)


# family id -> (model type, transformers PIL class, its arguments): default and tiny configs, as checkpoints ship.
REFERENCES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLImageProcessorPil", {}),
    "qwen3_vl": ("qwen3_vl", "Qwen2VLImageProcessorPil",
                 {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16 * 16 * 4 * 512}}),
    "qwen3_5_small": ("qwen3_5", "Qwen2VLImageProcessorPil", {"min_pixels": 32 * 32, "max_pixels": 64 * 64 * 4,
                                                              "patch_size": 16}),
    "gemma3": ("gemma3", "Gemma3ImageProcessorPil", {"size": {"height": 896, "width": 896}}),
    "gemma3_pan_scan": ("gemma3", "Gemma3ImageProcessorPil",
                        {"size": {"height": 224, "width": 224}, "do_pan_and_scan": True,
                         "pan_and_scan_min_crop_size": 64, "pan_and_scan_max_num_crops": 4,
                         "pan_and_scan_min_ratio_to_activate": 1.2}),
    "gemma4": ("gemma4", "Gemma4ImageProcessorPil", {}),
    "mistral3": ("mistral3", "PixtralImageProcessorPil",
                 {"size": {"longest_edge": 1540}, "patch_size": {"height": 14, "width": 14}}),
    "pixtral": ("pixtral", "PixtralImageProcessorPil", {}),
    "llava_clip": ("llava", "CLIPImageProcessorPil",
                   {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}),
    "llava_pad": ("llava", "LlavaImageProcessorPil", {"do_pad": True}),
    "paligemma": ("paligemma", "SiglipImageProcessorPil", {"size": {"height": 448, "width": 448}}),
    "idefics3": ("idefics3", "Idefics3ImageProcessorPil", {}),
    "smolvlm": ("smolvlm", "SmolVLMImageProcessorPil",
                {"size": {"longest_edge": 2 * 384}, "max_image_size": {"longest_edge": 384}}),
}

# (format, mode, (width, height)): every family sees every format, RGBA and greyscale, small, odd and large sizes.
CASES = [
    ("PNG", "RGB", (16, 16)),
    ("JPEG", "RGB", (640, 480)),
    ("WEBP", "RGB", (480, 640)),
    ("PNG", "RGBA", (300, 200)),
    ("WEBP", "RGBA", (123, 77)),
    ("JPEG", "L", (1024, 768)),
    ("PNG", "L", (37, 23)),
    ("JPEG", "RGB", (4000, 3000)),
]
# The largest sizes are costly to decode and resize; every family gets one, the rest of the matrix stays small.
LARGE = {("PNG", "RGB", (3000, 4000))}


def _random_image(mode: str, width: int, height: int) -> Image.Image:
    """Smooth random colours (a few control points upsampled) plus noise, so every resampling filter matters."""
    rng = np.random.default_rng()
    coarse = rng.integers(0, 256, size=(max(2, height // 40), max(2, width // 40), 4), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse, "RGBA").resize((width, height), Image.Resampling.BILINEAR))
    noise = rng.integers(-12, 13, size=smooth.shape)
    pixels = np.clip(smooth.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """(format, mode, size) -> a file written by Pillow, made once per module."""
    folder = tmp_path_factory.mktemp("images")
    made: dict[tuple, Path] = {}

    def make(fmt: str, mode: str, size: tuple[int, int]) -> Path:
        key = (fmt, mode, size)
        if key not in made:
            path = folder / f"{mode}-{size[0]}x{size[1]}.{fmt.lower()}"
            options = {"JPEG": {"quality": 90}, "WEBP": {"quality": 90}, "PNG": {"compress_level": 1}}[fmt]
            _random_image(mode, *size).save(path, fmt, **options)
            made[key] = path
        return made[key]

    return make


def _parity(family: str, inputs_ref: list, inputs_llmc: list) -> float:
    """Max abs difference of pixel values; asserts every other output (grids, sizes, masks) equal."""
    model_type, cls, kwargs = REFERENCES[family]
    reference = _reference(cls, **kwargs)
    checkpoint_json = json.loads(json.dumps(reference.to_dict()))
    ours = processor_for(model_type, checkpoint_json)
    expected = reference(images=inputs_ref, return_tensors="np")
    got = ours(inputs_llmc).as_dict()
    for key, value in expected.items():
        if key == "pixel_values":
            continue
        assert key in got, f"{family}: llmc gives no {key}"
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=f"{family} {key}")
    want = np.asarray(expected["pixel_values"])
    assert got["pixel_values"].dtype == np.float32
    assert got["pixel_values"].shape == want.shape, family
    return float(np.max(np.abs(got["pixel_values"] - want))) if want.size else 0.0


@pytest.mark.parametrize("family", sorted(REFERENCES))
def test_pixels_equal_transformers(family, image_file):
    worst = {}
    for fmt, mode, size in CASES + sorted(LARGE):
        if (fmt, mode, size) in LARGE and family not in ("qwen2_vl", "mistral3", "idefics3"):
            continue
        path = image_file(fmt, mode, size)
        with Image.open(path) as opened:
            opened.load()
            diff = _parity(family, [opened], [path])
        worst[(fmt, mode)] = max(worst.get((fmt, mode), 0.0), diff)
        assert diff <= TOLERANCE, f"{family} {fmt} {mode} {size}: max abs {diff}"
    print(f"\n{family}: " + ", ".join(f"{f}/{m} {d:.1e}" for (f, m), d in sorted(worst.items())))


@pytest.mark.parametrize("family", ["qwen2_vl", "mistral3", "gemma3_pan_scan", "idefics3", "gemma4", "llava_pad"])
def test_two_images_in_one_call(family, image_file):
    """Several images preprocessed together: concatenated patches, padding to the largest, tile lists."""
    paths = [image_file("PNG", "RGB", (640, 480)), image_file("WEBP", "RGBA", (123, 77))]
    opened = [Image.open(p) for p in paths]
    assert _parity(family, opened, [p.read_bytes() for p in paths]) <= TOLERANCE


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "llava_clip"])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_arrays_follow_transformers_numpy_path(family, channels):
    """uint8 arrays [H, W, C] (alpha blended onto white with numpy, as transformers' convert_to_rgb does)."""
    rng = np.random.default_rng()
    array = rng.integers(0, 256, size=(97, 131, channels), dtype=np.uint8)
    assert _parity(family, [array], [array]) <= TOLERANCE


def test_artifact_round_trip(tmp_path, image_file):
    """The resolved parameters written to the artifact and read back preprocess identically."""
    model_type, cls, kwargs = REFERENCES["qwen3_vl"]
    ours = processor_for(model_type, _reference(cls, **kwargs).to_dict())
    write_config(ours.config, tmp_path)
    again = load_processor(tmp_path)
    assert again.config == ours.config
    assert ImageProcessorConfig.from_json(json.loads(json.dumps(ours.config.to_json()))) == ours.config
    path = image_file("JPEG", "RGB", (640, 480))
    np.testing.assert_array_equal(again([path]).pixel_values, ours([path]).pixel_values)
    assert load_processor(tmp_path / "nothing-here") is None


def test_checkpoint_json_from_either_file(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 16}}))
    assert read_checkpoint_json(tmp_path) == {"patch_size": 16}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    assert read_checkpoint_json(tmp_path) == {"patch_size": 14}
    assert read_checkpoint_json(tmp_path / "absent") is None


def test_family_chosen_by_processor_class_then_model_type():
    assert processor_for("llava", {"image_processor_type": "CLIPImageProcessor"}).config.family == "clip"
    assert processor_for("qwen3_5", {}).config.family == "qwen2_vl"
    assert processor_for("whatever", {"image_processor_type": "PixtralImageProcessorFast"}).config.family == "pixtral"
    with pytest.raises(UnsupportedError, match="'bert'.*no image processor"):
        processor_for("bert", {})


def test_qwen_pixel_bounds_in_any_spelling():
    """min/max pixels given at the top level or inside size override the default bounds; a size without them
    is refused in one line."""
    expected = {"shortest_edge": 1024, "longest_edge": 4096}
    assert processor_for("qwen2_5_vl", {"min_pixels": 1024, "max_pixels": 4096}).config.size == expected
    assert processor_for("qwen2_5_vl", {"size": {"min_pixels": 1024, "max_pixels": 4096}}).config.size == expected
    with pytest.raises(LlmcError, match="shortest_edge and longest_edge"):
        processor_for("qwen2_5_vl", {"size": {"height": 224, "width": 224}})


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels in a few dozen bytes: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _encoded(fmt: str, size=(64, 48), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    _random_image(mode, *size).save(buffer, fmt)
    return buffer.getvalue()


BAD_INPUTS = {
    "not an image": (lambda tmp: b"hello, this is text", "not an image"),
    "empty": (lambda tmp: b"", "not an image"),
    "truncated jpeg": (lambda tmp: _encoded("JPEG")[:400], "truncated"),
    "truncated png": (lambda tmp: _encoded("PNG")[:200], "truncated"),
    "decompression bomb": (lambda tmp: _png_header_only(100_000, 100_000), "too large, a decompression bomb"),
    "bomb under pillow's limit": (lambda tmp: _png_header_only(12_000, 8_000), "12000x8000 = 96000000 pixels"),
    "unsupported format": (lambda tmp: _encoded("PPM"), "unsupported image format PPM"),
    "missing file": (lambda tmp: tmp / "nope.png", "no such image file"),
    "directory": (lambda tmp: tmp, "directory"),
    "float array": (lambda tmp: np.zeros((8, 8, 3), np.float32), "must be uint8"),
    "five channels": (lambda tmp: np.zeros((8, 8, 5), np.uint8), "1, 3 or 4 channels"),
    "empty array": (lambda tmp: np.zeros((0, 8, 3), np.uint8), "no pixels"),
    "not an image object": (lambda tmp: 12345, "expected a path"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_image_is_one_line_error(case, tmp_path):
    make, words = BAD_INPUTS[case]
    with pytest.raises(LlmcError) as info:
        decode_image(make(tmp_path))
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_pixel_limit_is_the_callers():
    data = _encoded("PNG", size=(400, 300))
    assert decode_image(data, max_pixels=400 * 300).shape == (300, 400, 3)
    with pytest.raises(LlmcError, match="400x300 = 120000 pixels, over the limit of 100000"):
        decode_image(data, max_pixels=100_000)


def test_processor_refusals_are_one_line():
    qwen = processor_for("qwen2_vl", {})
    with pytest.raises(LlmcError, match="aspect ratio over 200") as info:
        qwen([np.zeros((2, 500, 3), np.uint8)])
    assert "\n" not in str(info.value)
    with pytest.raises(LlmcError, match="no images"):
        qwen([])
    clip = processor_for("llava", {"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(LlmcError, match="aspect ratio is too extreme"):
        clip([np.zeros((1, 300_000, 3), np.uint8)])


def test_exif_orientation_applied_to_files():
    """A photo saved sideways with an EXIF orientation is decoded upright, as transformers' load_image does."""
    image = _random_image("RGB", 60, 40)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif)
    assert decode_image(buffer.getvalue()).shape == (60, 40, 3)


def test_vision_runs_without_torch_or_transformers():
    """The runtime's image path imports neither (a CPU engine serves images where they are not installed)."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'torchvision'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np\n"
        "from llmc.runtime.vision import processor_for\n"
        "f = processor_for('qwen3_vl', {'patch_size': 16})([np.zeros((64, 96, 3), np.uint8)])\n"
        "print(f.pixel_values.shape, f.extras['image_grid_thw'].tolist())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(24, 1536) [[1, 4, 6]]"
