"""Whether ONNX Runtime's intra-op threads spin between ops: chosen once per session, by measurement.

Spinning workers pick up the next op in microseconds; sleeping ones take tens of microseconds to
wake, which a 110M-parameter decode step (hundreds of ops) pays every step. But a spinning worker
holds its core: with other processes on the same cores it steals their time and they steal its.
Measured here (2 cores, 110M Llama int4, 2 threads): on an otherwise idle machine spinning made
decode b1 1.2-1.4x and b8 1.15x faster; with the cores shared with another busy process it made
b1 2x slower (22.7 vs 46.5 tok/s). ONNX Runtime (and ONNX Runtime GenAI, llama.cpp) always spin.

``LLMC_ORT_SPIN`` = ``1`` (spin), ``0`` (sleep) or ``auto`` (the default): spin when, sampled over
``SAMPLE_S`` at load time, the cores the session's threads need are idle.
"""

from __future__ import annotations

import os
import time

ENV = "LLMC_ORT_SPIN"
SAMPLE_S = 0.1
# Busy cores (other processes) that still leave a session's threads their cores: scheduler noise.
NOISE_CORES = 0.25


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def _own_jiffies() -> int:
    """CPU time of this process (all its threads) in the same clock ticks as /proc/stat."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    except (OSError, IndexError, ValueError):
        return 0


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """Cores kept busy over ``sample_s`` seconds by everything on this machine but this process
    (None: unknown, e.g. not Linux)."""
    a, own_a = _cpu_jiffies(), _own_jiffies()
    time.sleep(sample_s)
    b, own_b = _cpu_jiffies(), _own_jiffies()
    if a is None or b is None or b[1] <= a[1]:
        return None
    busy = max(0, (b[0] - a[0]) - (own_b - own_a))
    return busy / (b[1] - a[1]) * (os.cpu_count() or 1)


def decide(threads: int, setting: str | None = None, busy: float | None = None) -> tuple[bool, str]:
    """``(spin, why)`` for a session of ``threads`` intra-op threads. ``setting`` defaults to ``$LLMC_ORT_SPIN``;
    ``busy`` (cores busy elsewhere) is measured when the setting is ``auto`` and it is not given."""
    setting = (setting if setting is not None else os.environ.get(ENV, "auto")).strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True, f"{ENV}={setting}"
    if setting in ("0", "false", "no", "off"):
        return False, f"{ENV}={setting}"
    if setting != "auto":
        raise ValueError(f"{ENV}={setting!r}: expected 1 (spin), 0 (sleep) or auto")
    if busy is None:
        busy = busy_cores()
    if busy is None:
        return False, "auto: CPU load unknown (no /proc/stat), threads sleep"
    free = (os.cpu_count() or 1) - busy
    spin = free >= threads - NOISE_CORES
    return spin, f"auto: {busy:.2f} cores busy elsewhere, {free:.2f} free for {threads} threads"
