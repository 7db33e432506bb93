"""The engine artifact format, as the runtime reads and checks it (no compiler imports).

An artifact is a directory: ``manifest.json``, the engine files, tokenizer and generation config,
and ``report.json``. The manifest lists a sha256 for every other file; :func:`verify` checks them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from llmc.errors import LlmcError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    """``"sha256:<hex>"`` of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


@dataclass
class Problem:
    """One reason an artifact cannot be trusted or run."""

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"


def read_manifest(path: str | Path) -> dict:
    """Read and schema-check ``manifest.json`` of the artifact at ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise LlmcError(f"{root}: no such engine directory; build one with `llmc build CHECKPOINT -o {root}`")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise LlmcError(f"{mpath}: missing; {root} is not an llmc engine (rebuild it with `llmc build`)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise LlmcError(f"{mpath}: not valid JSON ({exc}); the artifact is corrupt, rebuild it") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise LlmcError(
            f"{mpath}: field 'schema_version' is {version!r}, this llmc reads {SCHEMA_VERSION}; rebuild the "
            "engine with this version of llmc"
        )
    return manifest


def verify(path: str | Path) -> list[Problem]:
    """Check every file the manifest lists against its sha256, and look for unlisted files."""
    root = Path(path)
    manifest = read_manifest(root)
    problems = []
    listed = manifest.get("files", {})
    for name, digest in sorted(listed.items()):
        f = root / name
        if not f.is_file():
            problems.append(Problem(name, "missing (listed in manifest.json); rebuild the engine"))
        elif sha256_file(f) != digest:
            problems.append(Problem(name, "modified: its sha256 differs from manifest.json; rebuild the engine"))
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and rel != MANIFEST and rel not in listed:
            problems.append(Problem(rel, "not listed in manifest.json; remove it or rebuild the engine"))
    return problems


def require_valid(path: str | Path) -> dict:
    """Read the manifest and raise :class:`LlmcError` naming the first bad file, if any."""
    manifest = read_manifest(path)
    problems = verify(path)
    if problems:
        raise LlmcError(f"{Path(path) / problems[0].file}: {problems[0].message}")
    return manifest
