"""Atomic output: a finished build renamed into place, and a cached artifact copied out and checked on the way."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from llmc.errors import LlmcError
from llmc.runtime import artifact as runtime_artifact


class CorruptEntry(Exception):
    """A cached artifact fails verification (the store evicts it and rebuilds)."""


def export(artifact_dir: Path, out: Path) -> None:
    """Copy a cached artifact to ``out`` (through a temporary sibling and a rename), checking every
    file against the manifest; raises :class:`CorruptEntry` if the cached copy is damaged."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # copyfile, not copy2: the output gets ordinary writable files, not the store's read-only ones.
        shutil.copytree(artifact_dir, tmp, dirs_exist_ok=True, copy_function=shutil.copyfile)
        try:
            problems = runtime_artifact.verify(tmp)
        except LlmcError as exc:
            raise CorruptEntry(str(exc)) from None
        if problems:
            raise CorruptEntry(str(problems[0]))
        os.chmod(tmp, 0o755)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished build into place; an existing output (with --force) is replaced only now."""
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)
