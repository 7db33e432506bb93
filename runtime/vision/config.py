"""An image processor's parameters: read from a checkpoint's JSON, stored in and read back from the artifact.

One plain dataclass for every family; each family module (``processors/``) supplies its defaults (the class
attributes of the transformers processor it reproduces), and the checkpoint's ``preprocessor_config.json`` (or the
``image_processor`` section of ``processor_config.json``) overrides them, as ``from_pretrained`` does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.errors import LlmcError

# The artifact's copy of the resolved parameters (the build writes it, the runtime reads it).
ARTIFACT_FILE = "image_processor.json"
SCHEMA = 1

# PIL's resampling filters by the numbers transformers saves (PILImageResampling).
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Every parameter an llmc image processor reads. Sizes are in pixels; ``size`` / ``crop_size`` /
    ``max_image_size`` are transformers' size dicts (``height``+``width``, ``shortest_edge``[+``longest_edge``],
    ``longest_edge``, ``max_height``+``max_width``); ``resample`` is a PIL filter number."""

    family: str
    model_type: str = ""
    do_resize: bool = True
    size: dict[str, int] | None = None
    resample: int = 2
    do_center_crop: bool = False
    crop_size: dict[str, int] | None = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    image_std: tuple[float, ...] = (0.229, 0.224, 0.225)
    do_pad: bool = False
    # Patch geometry: an int, or {"height", "width"} for Pixtral.
    patch_size: int | dict[str, int] | None = None
    temporal_patch_size: int | None = None
    merge_size: int | None = None
    # Gemma 3 pan-and-scan crops.
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int | None = None
    pan_and_scan_max_num_crops: int | None = None
    pan_and_scan_min_ratio_to_activate: float | None = None
    # Gemma 4 soft-token budget.
    max_soft_tokens: int | None = None
    pooling_kernel_size: int | None = None
    # Idefics3 / SmolVLM tiles.
    do_image_splitting: bool = False
    max_image_size: dict[str, int] | None = None
    # Llama 4 tile canvases.
    max_patches: int | None = None
    resize_to_max_canvas: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples as lists), with the schema version."""
        data = dataclasses.asdict(self)
        data["image_mean"] = list(self.image_mean)
        data["image_std"] = list(self.image_std)
        return {"schema": SCHEMA, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageProcessorConfig:
        """The inverse of :meth:`to_json`; unknown keys are an error (an artifact from a newer llmc)."""
        data = dict(data)
        schema = data.pop("schema", SCHEMA)
        if schema != SCHEMA:
            raise LlmcError(f"{ARTIFACT_FILE}: schema {schema}, this llmc reads schema {SCHEMA}: upgrade llmc")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise LlmcError(f"{ARTIFACT_FILE}: unknown fields {unknown}: the artifact is from a newer llmc")
        for key in ("image_mean", "image_std"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


def resolve(family: str, model_type: str, defaults: dict[str, Any], raw: dict[str, Any],
            default_to_square: bool) -> ImageProcessorConfig:
    """The family's ``defaults`` overridden by the checkpoint's ``raw`` JSON; a ``null`` keeps the default.

    Sizes given as an int or a list become size dicts the way transformers' ``get_size_dict`` makes them
    (``default_to_square`` is the family's class attribute)."""
    names = {f.name for f in dataclasses.fields(ImageProcessorConfig)} - {"family", "model_type"}
    values = dict(defaults)
    values.update({k: v for k, v in raw.items() if k in names and v is not None})
    values["size"] = size_dict(values.get("size"), default_to_square, "size")
    values["crop_size"] = size_dict(values.get("crop_size"), True, "crop_size")
    for key in ("image_mean", "image_std"):
        value = values.get(key)
        if value is not None:
            values[key] = tuple(float(v) for v in value) if isinstance(value, list | tuple) else (float(value),) * 3
    if isinstance(values.get("resample"), str):
        by_name = {v: k for k, v in RESAMPLE_NAMES.items()}
        values["resample"] = by_name.get(values["resample"].lower(), values["resample"])
    if values.get("resample") not in RESAMPLE_NAMES:
        raise LlmcError(f"image processor: resample {values.get('resample')!r} is not a PIL filter "
                        f"({', '.join(f'{k}={v}' for k, v in RESAMPLE_NAMES.items())})")
    return ImageProcessorConfig(family=family, model_type=model_type, **values)


def size_dict(size: Any, default_to_square: bool, what: str) -> dict[str, int] | None:
    """transformers' ``get_size_dict``: an int is a square (or the shortest edge), a list is (height, width)."""
    if size is None or isinstance(size, dict):
        return dict(size) if size is not None else None
    if isinstance(size, int):
        return {"height": size, "width": size} if default_to_square else {"shortest_edge": size}
    if isinstance(size, list | tuple) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    raise LlmcError(f"image processor: {what} {size!r} is neither an int, a (height, width) pair nor a size dict")


def read_checkpoint_json(checkpoint: str | Path) -> dict[str, Any] | None:
    """The image processor's JSON of a checkpoint directory: ``preprocessor_config.json``, else the
    ``image_processor`` section of ``processor_config.json``; None when it has neither (a text-only model)."""
    root = Path(checkpoint)
    pre = root / "preprocessor_config.json"
    if pre.is_file():
        return _load(pre)
    proc = root / "processor_config.json"
    if proc.is_file():
        section = _load(proc).get("image_processor")
        return dict(section) if isinstance(section, dict) else None
    return None


def write_config(config: ImageProcessorConfig, artifact_dir: str | Path) -> Path:
    """Write ``config`` as the artifact's ``image_processor.json``; returns its path."""
    path = Path(artifact_dir) / ARTIFACT_FILE
    path.write_text(json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def read_config(artifact_dir: str | Path) -> ImageProcessorConfig | None:
    """The artifact's image processor, or None for an artifact without images."""
    path = Path(artifact_dir) / ARTIFACT_FILE
    return ImageProcessorConfig.from_json(_load(path)) if path.is_file() else None


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmcError(f"{path}: not readable JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise LlmcError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
