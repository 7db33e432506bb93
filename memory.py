"""This process's memory: resident size, per-stage peaks, ``--max-memory`` sizes, and a guard that stops a build
with one line before the kernel's OOM killer would.

Linux only where it reads ``/proc`` (elsewhere the figures are None and the guard watches nothing). Peaks per stage
come from the kernel's own high-water mark (``VmHWM``), which writing ``5`` to ``/proc/self/clear_refs`` resets,
so a stage's peak is exact, not sampled.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

GB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": GB, "gb": GB, "gib": GB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``8G``, ``8GB``, ``512M``, ``1.5g``, ``4096`` (binary units: 1G = 2^30 bytes). Raises ValueError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 8G, 512M or 1.5G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / (1 << 20):.0f} MB"


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def rss() -> int | None:
    """Resident bytes now."""
    return _status_kb("VmRSS")


def rss_gb() -> float:
    return (rss() or 0) / GB


def peak_rss() -> int | None:
    """The resident high-water mark since the process started or :func:`reset_peak`."""
    return _status_kb("VmHWM")


def reset_peak() -> bool:
    """Start a new high-water mark at the current resident size; False where the kernel does not allow it, or
    accepts the write and keeps the old mark (some sandboxed kernels do)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    peak, now = peak_rss(), rss()
    # 64 MB of slack: other threads may allocate between the write and the two reads.
    return peak is not None and now is not None and peak <= now + (64 << 20)


def available() -> int | None:
    """``MemAvailable`` of the machine, or what this process's memory cgroups (v2 or v1, the process's own and
    every ancestor with a limit: a container's, a CI job's) leave before their limit, where that is lower; bytes.
    Reclaimable page cache (``inactive_file``) counts as available, as the kernel reclaims it before it kills."""
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    avail = int(m.group(1)) * 1024 if m else None
    room = cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1


def cgroup_room(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> int | None:
    """Bytes left under the tightest memory limit among this process's cgroups and their ancestors (None: none).

    ``proc_cgroup`` is ``/proc/self/cgroup``'s text; ``root`` where the hierarchies are mounted (for tests).
    """
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    rooms = []
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":  # v2 unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1 memory controller
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rooms.extend(_rooms_up(base, path, *files))
    return min(rooms) if rooms else None


def _rooms_up(base: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """Room under the limit of the cgroup at ``path`` and each ancestor that has one (a cgroup namespace shows
    ``/``: then the mount's own files are this cgroup's)."""
    parts = [p for p in path.strip().split("/") if p]
    out = []
    for depth in range(len(parts), -1, -1):
        d = base.joinpath(*parts[:depth])
        try:
            raw = (d / limit_file).read_text().strip()
            usage = int((d / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= _UNLIMITED:
            continue
        inactive = 0
        try:
            m = re.search(rf"^{inactive_key} (\d+)$", (d / "memory.stat").read_text(), re.M)
            inactive = int(m.group(1)) if m else 0
        except OSError:
            pass
        out.append(max(0, int(raw) - max(0, usage - inactive)))
    return out


class StagePeaks:
    """Peak resident memory per named stage, in GB (``figures``): ``start(name)`` ... ``stop()``, nestable (a
    sub-stage's peak counts for its parent too). Exact where the kernel lets the high-water mark be reset
    (``exact``); elsewhere each figure is the process's peak so far."""

    def __init__(self) -> None:
        # Before the first stage: start-up, reading the checkpoint's index, hashing its files.
        peak = peak_rss()
        self.figures: dict[str, float] = {"load": round(peak / GB, 3)} if peak is not None else {}
        self._stack: list[str] = []
        self.exact = reset_peak()

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def _fold(self) -> None:
        peak = peak_rss()
        if peak is not None:
            for name in self._stack:
                self.figures[name] = max(self.figures.get(name, 0.0), round(peak / GB, 3))

    def start(self, name: str) -> None:
        self._fold()
        self._stack.append(name)
        if self.exact:
            reset_peak()

    def stop(self) -> None:
        if not self._stack:
            return
        self._fold()
        self._stack.pop()
        if self.exact:
            reset_peak()


class MemoryExceeded(BaseException):
    """Raised in the main thread by :class:`Guard` when the build goes past its limit. A BaseException, like
    KeyboardInterrupt: it lands wherever the main thread is, and no ``except Exception`` there may swallow it."""


class Guard:
    """Watches this process's resident size (every ``interval`` seconds, in a thread) and stops the main thread
    with :class:`MemoryExceeded` when it passes ``limit`` bytes (``--max-memory``) or when the machine's available
    memory falls under ``reserve`` bytes (where the OOM killer would soon strike, with no message). ``what()``
    names the stage for the message. A main thread inside a long native call is stopped when the call returns;
    if it does not return within ``grace`` seconds past the limit, the guard cleans up with ``on_abort`` and ends
    the process with ``exit_code``, printing ``message`` itself."""

    def __init__(self, limit: int | None, what: Callable[[], str], *, reserve: int = 256 << 20,
                 interval: float = 0.1, grace: float = 20.0, exit_code: int = 7,
                 on_abort: Callable[[], None] | None = None) -> None:
        self.limit, self.what, self.reserve, self.interval = limit, what, reserve, interval
        self.grace, self.exit_code, self.on_abort = grace, exit_code, on_abort
        self.message: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_handler = None

    def __enter__(self) -> Guard:
        if rss() is None or threading.current_thread() is not threading.main_thread():
            return self  # nothing to read, or no way to interrupt the caller
        self._old_handler = signal.signal(signal.SIGUSR2, self._raise)
        self._thread = threading.Thread(target=self._watch, name="llmc-memory-guard", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR2, self._old_handler)

    def _raise(self, signum, frame) -> None:
        if self.message is not None and not self._stop.is_set():
            raise MemoryExceeded(self.message)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            now = rss() or 0
            avail = available()
            if self.limit is not None and now > self.limit:
                self.message = (f"--max-memory {format_size(self.limit)}: the build reached {format_size(now)} "
                                f"resident in {self.what()}")
            elif avail is not None and avail < self.reserve:
                self.message = (f"out of memory: the build held {format_size(now)} in {self.what()} with "
                                f"{format_size(avail)} left (the machine's available memory or its cgroup's limit, "
                                "whichever is lower)")
            else:
                continue
            os.kill(os.getpid(), signal.SIGUSR2)
            deadline = time.monotonic() + self.grace
            while not self._stop.wait(0.05):
                if time.monotonic() > deadline or (available() or self.reserve) < self.reserve // 4:
                    if self.on_abort is not None:
                        try:
                            self.on_abort()
                        except Exception:  # noqa: BLE001 - best effort before exiting
                            pass
                    os.write(2, f"error: {self.message}\n".encode())
                    os._exit(self.exit_code)
            return
