"""`llmc pack` / `llmc unpack`: an engine artifact as one tar file, and back, safely.

Packing writes a reproducible archive (sorted members, fixed owner, modes and mtime), so the
same artifact always gives the same bytes. Unpacking treats the archive as hostile: every member
is checked before anything is written (no absolute paths, no ``..``, no links, no device files,
no duplicates), and llmc writes the members itself (plain files with mode 0644, directories 0755,
owned by the caller), into a temporary sibling of the target that is renamed into place only once
the result verifies. These checks stand alone: tarfile's ``data`` filter, a second guard, exists
only from Python 3.11.4, and ``requires-python`` admits 3.11.0 (Debian 12 ships 3.11.2).
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from llmc.errors import LlmcError, os_fault, os_fault_errno
from llmc.runtime import artifact

_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# tarfile's extraction filters (PEP 706) arrived in 3.11.4; None before that.
_DATA_FILTER = getattr(tarfile, "data_filter", None)


@dataclass
class PackResult:
    """``size_bytes`` is the archive's size; ``members`` the file names stored, sorted."""

    archive: Path
    members: list[str]
    size_bytes: int
    artifact_digest: str


def _compressed(path: Path) -> bool:
    name = path.name.lower()
    if not name.endswith(_SUFFIXES):
        raise LlmcError(f"-o {path}: name the archive *.tar or *.tar.gz")
    return not name.endswith(".tar")


def _mtime() -> int:
    # Reproducible archives: SOURCE_DATE_EPOCH is the convention build tools honour.
    try:
        return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    except ValueError:
        return 0


def pack(engine: str | Path, out: str | Path, *, force: bool = False) -> PackResult:
    """Write the artifact at ``engine`` into the tar ``out`` (gzip if it ends in .tar.gz/.tgz).

    Refuses an artifact that fails verification (it would carry the damage along). The members
    are the artifact's files at the archive's top level: ``tar -xf x.tar -C DIR`` also works.
    """
    root, out = Path(engine), Path(out)
    gz = _compressed(out)
    if out.exists() and not force:
        raise LlmcError(f"{out}: already exists; pass --force to replace it or choose another -o")
    check = artifact.check(root, loadable=False)
    if check.problems:
        raise LlmcError(f"{root}: refusing to pack a damaged engine: {check.problems[0]}", exit_code=1)
    names = sorted({*check.manifest["files"], artifact.MANIFEST}
                   | ({artifact.BUILD_INFO} if (root / artifact.BUILD_INFO).is_file() else set()))
    dirs = sorted({p.as_posix() for n in names for p in PurePosixPath(n).parents if p.as_posix() != "."})
    mtime = _mtime()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    except OSError as exc:
        raise _fault(exc, out, "creating the archive", out) from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) if gz else raw
            with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tf:
                for d in dirs:
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
                    tf.addfile(info)
                for name in names:
                    src = root / name
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = src.stat().st_size, 0o644, mtime
                    with open(src, "rb") as fh:
                        tf.addfile(info, fh)
            if gz:
                stream.close()
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        # The engine's files are read here too: name the one the OS names, else the archive being written.
        raise _fault(exc, out, "writing the archive", out) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return PackResult(out, names, out.stat().st_size, check.artifact_digest)


def _fault(exc: OSError, path: Path, doing: str, out: Path) -> BaseException:
    """An OS fault as one line (the original error otherwise: not the user's to fix)."""
    if os_fault_errno(exc) is None:
        return exc
    return os_fault(exc, path, doing, elsewhere=f"choose another -o than {out}")


def _normalise(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def check_member(member: tarfile.TarInfo) -> str | None:
    """Why ``member`` must not be extracted, or None if it may (a plain file or directory inside)."""
    name = member.name
    if not name or "\0" in name or "\\" in name:
        return "has an empty or malformed name"
    path = PurePosixPath(name)
    if path.is_absolute():
        return "has an absolute path; archive members must be relative to the engine directory"
    if ".." in path.parts:
        return "contains '..'; archive members must stay inside the engine directory"
    if member.issym() or member.islnk():
        kind = "symlink" if member.issym() else "hard link"
        base = path.parent if member.issym() else PurePosixPath()
        target = PurePosixPath(os.path.normpath(str(base / member.linkname)))
        where = ("points outside the target directory" if PurePosixPath(member.linkname).is_absolute()
                 or target.parts[:1] == ("..",) else "is not part of an llmc engine")
        return f"is a {kind} to {member.linkname!r}, which {where}; engines contain only files"
    if member.ischr() or member.isblk() or member.isfifo():
        return "is a device file or FIFO; engines contain only files"
    if not (member.isreg() or member.isdir()):
        return f"has tar type {member.type!r}; engines contain only files and directories"
    return None


def _second_guard(src: Path, members: list[tarfile.TarInfo], dest: Path) -> None:
    """tarfile's ``data`` filter over every member, where this Python has it (3.11.4+)."""
    if _DATA_FILTER is None:
        return
    for m in members:
        try:
            _DATA_FILTER(m, str(dest))
        except tarfile.TarError as exc:  # FilterError and its subclasses
            raise LlmcError(f"{src}: member {m.name!r}: {exc}; refusing to unpack") from None


def _extract(src: Path, tf: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Write the (checked) members under ``dest``: directories and plain files only, with fixed modes,
    so no owner, setuid bit or odd mode in the archive reaches the disk on any Python."""
    for m in members:
        path = dest / _normalise(m.name)
        try:
            if m.isdir():
                path.mkdir(mode=0o755, parents=True, exist_ok=True)
                continue
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            data = tf.extractfile(m)
            # "x": a member never writes through or over a path an earlier member made.
            with open(path, "xb") as fh:
                if data is not None:
                    shutil.copyfileobj(data, fh, 1 << 20)
            os.chmod(path, 0o644)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise LlmcError(f"{src}: member {m.name!r} clashes with another member's path; refusing to "
                            "unpack") from None


def unpack(archive: str | Path, out: str | Path, *, force: bool = False) -> artifact.Verification:
    """Extract the engine archive ``archive`` into the new directory ``out`` and verify it.

    Raises :class:`LlmcError` (exit 2) naming the first unsafe member before writing anything,
    or (exit 1) if the extracted engine fails verification; ``out`` is then left untouched.
    """
    src, out = Path(archive), Path(out)
    if not src.is_file():
        raise LlmcError(f"{src}: no such archive; pass a file written by `llmc pack`")
    if out.exists() and not force:
        raise LlmcError(f"{out}: already exists; pass --force to replace it or choose another -o")
    if out.exists() and not out.is_dir():
        raise LlmcError(f"{out}: exists and is not a directory; choose another -o")
    try:
        tf = tarfile.open(src, mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        raise LlmcError(f"{src}: not a readable tar archive ({exc}); pass a file written by `llmc pack`") from None
    with tf:
        members = tf.getmembers()
        seen: set[str] = set()
        for m in members:
            reason = check_member(m)
            name = _normalise(m.name)
            if reason is None and name in seen and not m.isdir():
                reason = "appears twice in the archive"
            if reason:
                raise LlmcError(f"{src}: member {m.name!r} {reason}; refusing to unpack")
            seen.add(name)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        except OSError as exc:
            raise _fault(exc, out, "creating the engine directory", out) from None
        try:
            _second_guard(src, members, tmp)
            _extract(src, tf, members, tmp)
            result = artifact.check(tmp, loadable=False)
            if result.problems:
                raise LlmcError(f"{src}: the unpacked engine fails verification: {result.problems[0]}",
                                exit_code=1)
            os.chmod(tmp, 0o755)
            if out.exists():
                trash = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.rename(out, trash)
                os.rename(tmp, out)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, out)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _fault(exc, out, "extracting the engine", out) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    result.engine = out
    return result
