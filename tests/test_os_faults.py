"""Faults of the machine, not of the request, each on a real filesystem: a disk that fills during `llmc build`,
`llmc pack` and `llmc unpack`; a read-only output or cache directory; an input file deleted mid-build. Each ends
in one line naming the path, the errno's meaning and the fix (exit 2), with no engine, archive or cache entry
half-written."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.errors import LlmcError


def _llmc(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stderr


def _mount_tmpfs(path: Path, options: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'}): a full or read-only "
                    "filesystem needs root or CAP_SYS_ADMIN")
    return path


@pytest.fixture
def mounts():
    made: list[Path] = []

    def mount(path: Path, options: str) -> Path:
        made.append(_mount_tmpfs(path, options))
        return path

    yield mount
    for path in reversed(made):
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture
def full_disk(tmp_path, mounts) -> Path:
    """A real filesystem with 128 KiB: the tiny engine (about 700 KiB) cannot fit."""
    return mounts(tmp_path / "full", "size=128k")


@pytest.fixture
def read_only_dir(tmp_path, mounts) -> Path:
    """A directory no write can enter: read-only mode bits (EACCES) for an ordinary user; root passes mode bits,
    so for root a tmpfs mounted read-only (EROFS)."""
    path = tmp_path / "ro"
    if os.geteuid() != 0:
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    yield mounts(path, "ro,size=64k")


def _assert_one_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _no_cache_entry(cache: Path) -> None:
    entries, staging = cache / "v1" / "entries", cache / "v1" / "tmp"
    assert not entries.exists() or not list(entries.iterdir()), "a cache entry was published"
    assert not staging.exists() or not list(staging.iterdir()), "a staging directory was left behind"


def _no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was left half-written"
    if out.parent.is_dir():
        assert not list(out.parent.glob(f".{out.name}.*")), "a temporary sibling of the output was left behind"


_NO_SPACE = ("No space left on device", "ENOSPC")


def test_build_into_a_full_disk(tiny_llama, full_disk):
    out, cache = full_disk / "engine", full_disk / "cache"
    code, err = _llmc("build", tiny_llama, "-o", out, "--cache-dir", cache, "-q")
    line = _assert_one_line(code, err, *_NO_SPACE, str(full_disk), "--cache-dir")
    assert "Traceback" not in line
    _no_leftovers(out)
    _no_cache_entry(cache)


def test_build_output_on_a_full_disk(tiny_llama, full_disk, tmp_path):
    """The engine builds into a cache with room, then the copy to -o fills its disk."""
    out = full_disk / "engine"
    code, err = _llmc("build", tiny_llama, "-o", out, "--cache-dir", tmp_path / "cache", "-q")
    _assert_one_line(code, err, *_NO_SPACE, str(out), "-o")
    _no_leftovers(out)


def test_build_output_in_a_read_only_directory(tiny_llama, read_only_dir, tmp_path):
    out = read_only_dir / "engine"
    code, err = _llmc("build", tiny_llama, "-o", out, "--cache-dir", tmp_path / "cache", "-q")
    _assert_one_line(code, err, str(read_only_dir))
    _no_leftovers(out)


def test_build_cache_in_a_read_only_directory(tiny_llama, read_only_dir, tmp_path):
    out = tmp_path / "engine"
    code, err = _llmc("build", tiny_llama, "-o", out, "--cache-dir", read_only_dir, "-q")
    _assert_one_line(code, err, str(read_only_dir), "cache")
    _no_leftovers(out)


def test_pack_onto_a_full_disk_and_into_a_read_only_directory(tiny_engine, full_disk, read_only_dir):
    for where, needles in ((full_disk, _NO_SPACE), (read_only_dir, ())):
        archive = where / "engine.tar"
        code, err = _llmc("pack", tiny_engine, "-o", archive)
        _assert_one_line(code, err, str(where), *needles)
        assert not list(where.iterdir()), "a partial archive was left behind"


def test_unpack_onto_a_full_disk_and_into_a_read_only_directory(tiny_engine, full_disk, read_only_dir, tmp_path):
    archive = tmp_path / "engine.tar"
    assert _llmc("pack", tiny_engine, "-o", archive)[0] == 0
    for where, needles in ((full_disk, _NO_SPACE), (read_only_dir, ())):
        out = where / "engine"
        code, err = _llmc("unpack", archive, "-o", out)
        _assert_one_line(code, err, str(out), *needles)
        _no_leftovers(out)


@pytest.mark.parametrize("model_type, stage", [
    ("llama", "[3/5]"),  # streamed: the passes and the backend read the weights after tracing
    ("mixtral", "[2/5]"),  # per-expert weights merged by transformers while tracing: read whole by from_pretrained
])
def test_checkpoint_deleted_during_the_build(model_type, stage, family_checkpoint, tmp_path):
    """The weights vanish after llmc indexed them, while the build still needs them."""
    from llmc.compiler.build import BuildOptions, build_cached

    ckpt = tmp_path / "ckpt"
    shutil.copytree(family_checkpoint(model_type), ckpt, ignore=shutil.ignore_patterns(".done", "*.lock"))
    weights = ckpt / "model.safetensors"
    seen = []

    def progress(msg: str) -> None:
        seen.append(msg)
        if msg.startswith(stage):
            weights.unlink()

    out, cache = tmp_path / "engine", tmp_path / "cache"
    with pytest.raises(LlmcError) as info:
        build_cached(ckpt, out, BuildOptions(self_check=False), progress=progress, cache_dir=cache)
    message = str(info.value)
    assert "\n" not in message and str(ckpt) in message and "vanished" in message, message
    assert info.value.exit_code == 2
    assert any(m.startswith(stage) for m in seen)
    _no_leftovers(out)
    _no_cache_entry(cache)


def test_self_check_scratch_space_on_a_full_disk(tiny_llama, full_disk, tmp_path, monkeypatch):
    """The self-check writes its random twin (checkpoint and engine) under TMPDIR; safetensors reports the full
    disk in its own exception type, which must still end in one line. The build runs through the CLI's entry in
    this process, tempfile's directory moved as TMPDIR moves a process's (the self-check's worker inherits TMPDIR)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(full_disk))
    monkeypatch.setenv("LLMC_SELF_CHECK", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(full_disk))  # tempfile read TMPDIR once, when first asked
    out = tmp_path / "engine"
    code, err = _llmc("build", tiny_llama, "-o", out, "--cache-dir", tmp_path / "cache", "-q")
    _assert_one_line(code, err, *_NO_SPACE, str(full_disk), "TMPDIR")
    _no_leftovers(out)
    _no_cache_entry(tmp_path / "cache")
