"""Scratch directories that name their owner, so that those of a killed process are removed by the next one.

A build or worker killed with SIGKILL (or by the OOM killer) cannot clean up after itself: 66 self-check
directories (8-44 MB each) and calibration spills (one of 881 MB: an 8B layer's INT4 weights waiting on disk)
had gathered in one machine's /tmp. Each scratch directory gets an ``owner.pid``; making a new one first removes
those of the same prefix whose owner has died.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

OWNER_FILE = "owner.pid"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned(root: Path, prefix: str) -> list[Path]:
    """Remove the directories ``root/prefix*`` whose owner process has died; returns them. Directories without an
    owner file (older llmc, or one being made) and those of live processes stay."""
    removed = []
    for d in root.glob(prefix + "*"):
        try:
            pid = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def mark(d: Path, prefix: str) -> None:
    """Name this process as ``d``'s owner, after sweeping the orphans of ``prefix`` beside it. Best effort: a full
    disk leaves the directory unmarked, and the work that follows reports the fault."""
    try:
        remove_orphaned(d.parent, prefix)
        (d / OWNER_FILE).write_text(str(os.getpid()))
    except OSError:
        pass
