"""Cache keys: one sha256 over everything that shapes an engine, and nothing that does not.

The key covers the checkpoint's content digest, the canonical recipe, the target, the toolchain
versions, the llmc version and the sources of the code that shapes the engine (compiler, passes,
quantization, plugins). Paths, timestamps and the order of command-line flags are not inputs,
so they cannot change it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Folders of the llmc package whose sources decide what a build emits. The runtime is not
# among them (it reads artifacts, it does not shape them) except the artifact format module,
# which defines the manifest. build_cache/ and cli/ only move artifacts around. quant/corpus.py
# pins (by sha256) the built-in calibration text, which shapes quantized engines.
ENGINE_SHAPING_SOURCES = ("compiler", "passes", "quant", "plugins", "runtime/artifact.py")
_SOURCE_SUFFIXES = {".py", ".cpp", ".cc", ".h", ".hpp", ".cu", ".json"}


@dataclass(frozen=True)
class KeyInputs:
    """Everything a cache key is computed from; stored with each entry so `cache ls` can show it.

    ``recipe`` must be canonical already (see :func:`canonical_json`): only options that change
    the artifact, with list order only where order matters (the pass pipeline).
    """

    checkpoint_digest: str
    recipe: dict
    target: dict
    toolchain: dict
    llmc_version: str
    sources_digest: str

    def key(self) -> str:
        """The cache key: 64 hex digits of sha256 over the canonical JSON of these inputs."""
        return hashlib.sha256(canonical_json(asdict(self)).encode()).hexdigest()


def canonical_json(data) -> str:
    """JSON with sorted keys and no whitespace: equal data gives equal bytes."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sources_digest(package_root: Path, parts: tuple[str, ...] = ENGINE_SHAPING_SOURCES) -> str:
    """sha256 over the relative path and bytes of every source file under ``parts`` of ``package_root``.

    Compiled objects and caches (``__pycache__``, ``.so``) are skipped: they follow from the sources.
    Costs a few milliseconds (tens of small files).
    """
    h = hashlib.sha256()
    files: list[Path] = []
    for part in parts:
        p = package_root / part
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(f for f in p.rglob("*")
                         if f.is_file() and f.suffix in _SOURCE_SUFFIXES and "__pycache__" not in f.parts)
    for f in sorted(files, key=lambda f: f.relative_to(package_root).as_posix()):
        h.update(f.relative_to(package_root).as_posix().encode() + b"\0")
        data = f.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()
