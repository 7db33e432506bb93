"""The on-disk store of built artifacts, keyed by :mod:`llmc.build_cache.key`.

Layout under the store root (``--cache-dir``, else ``$LLMC_CACHE_DIR``, else
``$XDG_CACHE_HOME/llmc``, else ``~/.cache/llmc``)::

    v1/entries/<key>/            one complete entry: artifact/, entry.json, last_used
    v1/tmp/<key>.<random>/       an entry being built (never read as an entry)
    v1/tmp/trash.<random>/       an entry being deleted
    v1/locks/<key>.lock          held by whoever builds, reads or deletes <key>

Invariants that make the store safe to share between processes and to kill at any instant:

- An entry appears in ``entries/`` only by ``os.rename`` of a fully written staging directory
  (atomic on one filesystem), so a directory there is always complete. A build killed before
  the rename leaves only a staging directory, which no lookup reads.
- Everything that touches ``<key>`` (build, copy out, delete) holds ``locks/<key>.lock``, an
  ``flock`` lock that the kernel releases when its holder dies, even by SIGKILL. Concurrent
  builders of one key therefore run one build; the others wait and then find the entry.
- A staging directory of ``<key>`` whose lock is free belongs to a dead build and is deleted
  (when the next build of ``<key>`` starts, and by :meth:`Store.sweep`).

Keep the store on a local filesystem: ``flock`` over NFS is not reliable.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from llmc.errors import LlmcError, os_fault, os_fault_errno

STORE_FORMAT = 1
ENTRY_META = "entry.json"
ARTIFACT = "artifact"
LAST_USED = "last_used"
_TRASH = "trash."


def default_root() -> Path:
    """``$LLMC_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmc``, else ``~/.cache/llmc``."""
    if os.environ.get("LLMC_CACHE_DIR"):
        return Path(os.environ["LLMC_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmc"


@dataclass
class Entry:
    """One complete entry. ``size_bytes`` is the artifact's size; ``last_used`` a Unix time in seconds."""

    key: str
    path: Path
    meta: dict
    size_bytes: int
    last_used: float

    @property
    def artifact(self) -> Path:
        return self.path / ARTIFACT


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


class Store:
    """A build-cache store rooted at ``root`` (created on first write)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        base = self.root / f"v{STORE_FORMAT}"
        self.entries_dir = base / "entries"
        self.tmp_dir = base / "tmp"
        self.locks_dir = base / "locks"

    # -- locking -------------------------------------------------------------------------------

    def _lock(self, key: str) -> FileLock:
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.locks_dir / f"{key}.lock"))

    @contextmanager
    def lock(self, key: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold ``key``'s lock; calls ``on_wait()`` once if another process holds it and we must wait."""
        try:
            lock = self._lock(key)
            try:
                lock.acquire(blocking=False)
            except Timeout:
                if on_wait is not None:
                    on_wait()
                lock.acquire()
        except OSError as exc:
            raise self._fault(exc, "locking a build cache entry") from None
        try:
            yield
        finally:
            lock.release()

    def _try_lock(self, key: str) -> FileLock | None:
        lock = self._lock(key)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            return None
        return lock

    # -- entries -------------------------------------------------------------------------------

    def _read(self, path: Path) -> Entry | None:
        try:
            meta = json.loads((path / ENTRY_META).read_text())
            last_used = (path / LAST_USED).stat().st_mtime
        except (OSError, ValueError):
            return None
        return Entry(key=path.name, path=path, meta=meta, size_bytes=int(meta.get("size_bytes", 0)),
                     last_used=last_used)

    def get(self, key: str) -> Entry | None:
        """The complete entry for ``key``, or None. Hold ``key``'s lock to use it."""
        return self._read(self.entries_dir / key)

    def touch(self, entry: Entry) -> None:
        """Record that ``entry`` was used now (for least-recently-used pruning)."""
        now = time.time()
        os.utime(entry.path / LAST_USED, (now, now))
        entry.last_used = now

    def list(self) -> list[Entry]:
        """Every complete entry, most recently used first."""
        if not self.entries_dir.is_dir():
            return []
        found = [e for p in self.entries_dir.iterdir() if (e := self._read(p)) is not None]
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def resolve(self, prefix: str) -> str:
        """The one key that starts with ``prefix`` (at least 4 hex digits)."""
        prefix = prefix.strip().lower()
        if len(prefix) < 4 or any(c not in "0123456789abcdef" for c in prefix):
            raise LlmcError(f"cache key {prefix!r}: give at least 4 hex digits of a key shown by `llmc cache ls`")
        keys = [e.key for e in self.list() if e.key.startswith(prefix)]
        if not keys:
            raise LlmcError(f"cache key {prefix!r}: no entry in {self.root} starts with it (see `llmc cache ls`)")
        if len(keys) > 1:
            raise LlmcError(f"cache key {prefix!r}: matches {len(keys)} entries; give more digits")
        return keys[0]

    # -- writing -------------------------------------------------------------------------------

    def _clear_staging(self, key: str) -> None:
        # Caller holds key's lock, so any staging directory of key is from a build that died.
        if self.tmp_dir.is_dir():
            for p in self.tmp_dir.glob(f"{key}.*"):
                shutil.rmtree(p, ignore_errors=True)

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        """A fresh directory in the store to build ``key`` into; removed if the body raises.

        The caller must hold ``key``'s lock, write the artifact into ``<dir>/artifact`` and then
        call :meth:`publish`.
        """
        self._clear_staging(key)
        path = self.tmp_dir / f"{key}.{uuid.uuid4().hex[:12]}"
        try:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except OSError as exc:
            raise self._fault(exc, "creating a build directory in the build cache") from None
        try:
            yield path
        except OSError as exc:
            shutil.rmtree(path, ignore_errors=True)
            if os_fault_errno(exc) is None:
                raise
            # Most writes of a build land here; the OS rarely names the file of a failed write.
            raise self._fault(exc, "writing the engine into the build cache") from None
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def _fault(self, exc: OSError, doing: str) -> LlmcError:
        if os_fault_errno(exc) is None:
            raise exc
        return os_fault(exc, self.root, doing, elsewhere="pass --cache-dir or set LLMC_CACHE_DIR to another directory")

    def publish(self, key: str, staged: Path, meta: dict) -> Entry:
        """Seal ``staged`` (holding ``artifact/``) as the entry for ``key`` by one atomic rename.

        Replaces an existing entry (``--no-cache`` refreshes it). The caller holds ``key``'s lock.
        """
        artifact = staged / ARTIFACT
        if not artifact.is_dir():
            raise RuntimeError(f"{staged}: no {ARTIFACT}/ to publish")
        try:
            return self._publish(key, staged, artifact, meta)
        except OSError as exc:
            raise self._fault(exc, "publishing a build cache entry") from None

    def _publish(self, key: str, staged: Path, artifact: Path, meta: dict) -> Entry:
        # Read-only files: a hard link or an accidental write cannot change a cached artifact.
        for f in artifact.rglob("*"):
            if f.is_file():
                f.chmod(0o444)
        size = _tree_size(artifact)
        meta = {**meta, "key": key, "size_bytes": size, "created": time.time()}
        (staged / ENTRY_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        (staged / LAST_USED).touch()
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        final = self.entries_dir / key
        if final.exists():
            self._discard(final)
        os.rename(staged, final)
        entry = self.get(key)
        assert entry is not None
        return entry

    def _discard(self, path: Path) -> None:
        # Rename out of entries/ first (atomic: the entry disappears whole), then delete at leisure.
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        trash = self.tmp_dir / f"{_TRASH}{uuid.uuid4().hex[:12]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_locked(self, key: str) -> None:
        """Delete ``key``'s entry; the caller holds its lock."""
        path = self.entries_dir / key
        if path.exists():
            self._discard(path)

    def remove(self, key: str, timeout: float = 10.0) -> Entry:
        """Delete ``key``'s entry, waiting up to ``timeout`` seconds for a build or copy that holds it."""
        entry = self.get(key)
        if entry is None:
            raise LlmcError(f"cache key {key}: no such entry in {self.root}")
        lock = self._lock(key)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise LlmcError(f"cache key {key[:16]}: in use by a running llmc build; retry when it finishes") from None
        try:
            self.remove_locked(key)
        finally:
            lock.release()
        return entry

    def prune(self, max_bytes: int) -> list[Entry]:
        """Delete least-recently-used entries until the store holds at most ``max_bytes`` of entries.

        Entries in use (lock held by a build or copy) are skipped. Also sweeps leftovers of killed
        builds. Returns the entries removed.
        """
        self.sweep()
        entries = self.list()
        total = sum(e.size_bytes for e in entries)
        removed = []
        for entry in reversed(entries):  # least recently used first
            if total <= max_bytes:
                break
            lock = self._try_lock(entry.key)
            if lock is None:
                continue
            try:
                self.remove_locked(entry.key)
            finally:
                lock.release()
            total -= entry.size_bytes
            removed.append(entry)
        return removed

    def stale(self) -> list[Path]:
        """Staging directories of builds that died and trash not yet deleted (never entries)."""
        if not self.tmp_dir.is_dir():
            return []
        out = []
        for p in sorted(self.tmp_dir.iterdir()):
            if p.name.startswith(_TRASH):
                out.append(p)
                continue
            lock = self._try_lock(p.name.split(".", 1)[0])
            if lock is not None:
                lock.release()
                out.append(p)
        return out

    def sweep(self) -> int:
        """Delete what :meth:`stale` finds; returns the bytes freed."""
        freed = 0
        for p in self.stale():
            key = p.name.split(".", 1)[0]
            lock = None if p.name.startswith(_TRASH) else self._try_lock(key)
            if lock is None and not p.name.startswith(_TRASH):
                continue  # a build of this key started since stale() looked
            try:
                freed += _tree_size(p)
                shutil.rmtree(p, ignore_errors=True)
            finally:
                if lock is not None:
                    lock.release()
        return freed
