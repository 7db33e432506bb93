"""This machine's side of the roofline: its read bandwidth (C++ probe) and load average."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import numpy as np

PROBE_SETTLE_S = 0.25  # idle time before each bandwidth probe (see driver.run())


@dataclass
class BandwidthProbe:
    """This machine's read bandwidth in GB/s (1e9 bytes/s): ``threads`` threads each take the maximum of
    their share of a ``nbytes`` float32 array; ``read_GBps`` is the median of ``samples``."""

    read_GBps: float
    samples: list[float]
    nbytes: int
    threads: int
    method: str = "C++ OpenMP stream of float32 sums, one slice per thread"


def measure_read_bandwidth(nbytes: int = 1 << 28, repeats: int = 9, threads: int = 1,
                           buffer: np.ndarray | None = None) -> BandwidthProbe:
    """Read bandwidth in GB/s of a float32 array of ``nbytes`` (8x this machine's L3): ``threads`` threads
    each stream their own slice; median of ``repeats`` after one untimed pass. Pass ``buffer`` to reuse an
    array across probes. The probe is C++ (llmc.runtime._membench, the method of benchmarks/peers/bw_read.c):
    a numpy reduction from Python threads read ~0.85x of that C loop here."""
    from llmc.runtime import _membench

    a = buffer if buffer is not None else np.ones(nbytes // 4, dtype=np.float32)
    samples = list(_membench.read_bandwidth(a, repeats, threads))
    return BandwidthProbe(round(statistics.median(samples), 2), [round(s, 2) for s in samples], a.nbytes, threads)


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (how busy the machine was), where the OS reports them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
