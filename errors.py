"""The one exception type for failures a user can cause, with the exit code the CLI returns.

Messages name the file or field, the constraint that failed, and the fix, in one line.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# Exit codes documented in README.md; CI pipelines branch on them.
EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3
EXIT_ACCURACY_GATE = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_INSTALL = 6
EXIT_INTERNAL = 70


class LlmcError(Exception):
    """A failure caused by input the user controls (files, flags, artifacts)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UnsupportedError(LlmcError):
    """The request is well formed but this version of llmc or this target cannot do it."""

    exit_code = EXIT_UNSUPPORTED


class InstallError(LlmcError, ImportError):
    """A compiled part of llmc is missing or cannot be loaded (an incomplete install, not a bug): the message says
    how to rebuild it. Also an ``ImportError``, so code that falls back when an optional part is absent still can."""

    exit_code = EXIT_INSTALL


# What the machine, not the request, can make a read or write fail with, and each errno's fix ({elsewhere}: where
# else to write, which the caller knows). A full disk, a read-only or foreign directory and a file deleted under
# llmc are the user's to fix, so they end in one line (exit 2) like bad input; any other OSError stays a bug.
_OS_FIXES = {
    errno.ENOSPC: "free space on that filesystem, or {elsewhere}",
    errno.EDQUOT: "free space within your disk quota, or {elsewhere}",
    errno.EFBIG: "{elsewhere} (that filesystem caps the size of a file)",
    errno.EACCES: "make it writable (and readable) by this user, or {elsewhere}",
    errno.EPERM: "make it writable (and readable) by this user, or {elsewhere}",
    errno.EROFS: "that filesystem is mounted read-only: {elsewhere}",
    errno.ENOENT: "a file or directory vanished while llmc used it: leave it in place until llmc finishes, then "
                  "run it again",
    errno.ENOTDIR: "a component of the path is a file, not a directory: {elsewhere}",
}
# numpy's tofile and other buffered writers report a short write this way, with no errno: the disk filled.
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")
# The temporary siblings llmc writes an output into before renaming it into place (".NAME.tmp-XXXX").
_TEMPORARY = re.compile(r"^\..+\.tmp-")


def os_fault_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` if it is an OS fault the user can fix (see :func:`os_fault`), else None.

    ``shutil.copytree`` gathers its failures into one ``shutil.Error`` whose args hold
    ``(src, dst, reason)`` triples, and a short write carries no errno; both count by their reason."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno in _OS_FIXES:
        return exc.errno
    reason = _reason(exc)
    if _SHORT_WRITE.search(reason):
        return errno.ENOSPC
    for code in _OS_FIXES:
        if os.strerror(code) in reason:
            return code
    return None


def _first_copy_error(exc: OSError) -> tuple | None:
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        first = exc.args[0][0]
        return first if isinstance(first, tuple) and len(first) == 3 else None
    return None


def _reason(exc: OSError) -> str:
    copy = _first_copy_error(exc)
    return str(copy[2]) if copy else (exc.strerror or str(exc))


def _os_path(exc: OSError) -> str | None:
    copy = _first_copy_error(exc)
    if copy:
        return str(copy[1])  # (src, dst, reason): the write failed at dst
    return str(exc.filename) if exc.filename is not None else None


def os_fault(exc: OSError, path: str | os.PathLike | None = None, doing: str = "",
             elsewhere: str = "write somewhere else") -> LlmcError:
    """One line for an OS fault (:func:`os_fault_errno` is not None): the path, what llmc was doing, the errno's
    meaning and name, and the fix. The path is the one the OS names, unless it is missing or inside one of llmc's
    temporary siblings (the user never named those): then ``path``, the file or directory the user gave."""
    code = os_fault_errno(exc)
    assert code is not None, exc
    where = _os_path(exc)
    if where is None or (path is not None and any(_TEMPORARY.match(part) for part in Path(where).parts)):
        where = str(path) if path is not None else "a file"
    short = _SHORT_WRITE.search(_reason(exc))
    meaning = os.strerror(code)
    if short:
        meaning = f"a write was cut short ({short.group(1)} bytes requested, {short.group(2)} written): {meaning}"
    doing = f" while {doing}" if doing else ""
    return LlmcError(f"{where}: {meaning} [{errno.errorcode[code]}]{doing}; "
                     f"{_OS_FIXES[code].format(elsewhere=elsewhere)}")
