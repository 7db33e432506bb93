"""Write an engine artifact: copy the tokenizer files, then seal everything with manifest.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmc import __version__
from llmc.runtime.artifact import MANIFEST, SCHEMA_VERSION, sha256_file

# Files of a Hugging Face checkpoint that the runtime needs next to the engine.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


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

    out = {}
    for pkg in ("torch", "transformers", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "onnxruntime-extensions"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def seal(out_dir: Path, manifest: dict) -> dict:
    """Add schema/llmc version and a sha256 of every file to ``manifest``, then write manifest.json."""
    files = {
        f.relative_to(out_dir).as_posix(): sha256_file(f)
        for f in sorted(out_dir.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    manifest = {"schema_version": SCHEMA_VERSION, "llmc_version": __version__, **manifest, "files": files}
    write_json(out_dir / MANIFEST, manifest)
    return manifest
