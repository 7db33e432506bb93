"""Write an engine artifact: copy the tokenizer files, then seal everything with manifest.json.

Everything sealed must be a function of the build's inputs only, so that two builds of the same
inputs are byte-identical; build timings, time of day and host go to the unsealed
``build_info.json`` (see :func:`write_build_info`).
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from pathlib import Path

from llmc import __version__
from llmc.runtime.artifact import BUILD_INFO, MANIFEST, SCHEMA_VERSION, sha256_file

# Files of a Hugging Face checkpoint that the runtime needs next to the engine.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

# Distributions whose versions shape the engine; recorded in the manifest and part of the cache key.
TOOLCHAIN_PACKAGES = ("numpy", "safetensors", "torch", "transformers", "onnx", "onnx-ir", "onnxscript", "onnxruntime",
                      "onnxruntime-extensions")


def copy_tokenizer(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """Copy the tokenizer and generation config files that exist; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = checkpoint_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied.append(name)
    shutil.copyfile(checkpoint_dir / "config.json", out_dir / "hf_config.json")
    copied.append("hf_config.json")
    return copied


def toolchain_versions() -> dict[str, str]:
    """Versions of every library whose behaviour shapes the engine."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in TOOLCHAIN_PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_build_info(out_dir: Path, info: dict) -> None:
    """Write ``build_info.json``: what differs between two builds of the same inputs (timings in
    seconds, UTC time the build finished, host), plus ``info``. It is not sealed (see seal)."""
    data = {
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        **info,
    }
    write_json(out_dir / BUILD_INFO, data)


def seal(out_dir: Path, manifest: dict) -> dict:
    """Add schema/llmc version and a sha256 of every file but build_info.json to ``manifest``,
    then write manifest.json."""
    files = {
        f.relative_to(out_dir).as_posix(): sha256_file(f)
        for f in sorted(out_dir.rglob("*"))
        if f.is_file() and f.relative_to(out_dir).as_posix() not in (MANIFEST, BUILD_INFO)
    }
    manifest = {"schema_version": SCHEMA_VERSION, "llmc_version": __version__, **manifest,
                "build_info": BUILD_INFO, "files": files}
    write_json(out_dir / MANIFEST, manifest)
    return manifest
