"""Fault injection for tests, at named points of a build (after-trace, after-emit, before-publish, after-publish).

``LLMC_TEST_KILL_AT=<name>[:<SIGNAL>]`` sends this process SIGKILL (or the named signal, e.g. INT) there, to prove
that a build dying at any point leaves the cache and the output consistent. ``LLMC_TEST_HOLD_AT=<name>:<MB>`` holds
that much more memory from there on, to prove that the memory guard stops a build past --max-memory with one line
and leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import time

_HELD: list = []


def kill_point(name: str) -> None:
    point, _, sig = os.environ.get("LLMC_TEST_KILL_AT", "").partition(":")
    if point == name:
        os.kill(os.getpid(), getattr(signal, f"SIG{sig or 'KILL'}"))
    point, _, mb = os.environ.get("LLMC_TEST_HOLD_AT", "").partition(":")
    if point == name:
        import numpy as np

        for _ in range(max(1, int(mb) // 32)):  # in steps, as a build grows: the guard samples every 0.1 s
            _HELD.append(np.ones(32 << 20, np.uint8))
            time.sleep(0.02)
        time.sleep(1.0)
