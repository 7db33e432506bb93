"""Human sizes for `llmc cache prune --max-size` and `llmc cache ls`: binary units (1K = 1024 bytes)."""

from __future__ import annotations

import re

from llmc.errors import LlmcError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``123``, ``500M``, ``2G``, ``1.5GiB``, ``64KB`` (all units binary)."""
    m = _PATTERN.match(text)
    if not m:
        raise LlmcError(f"--max-size {text!r}: not a size; write a number with an optional unit K, M, G or T "
                        "(binary: 1K = 1024 bytes), e.g. 500M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    """``n`` bytes as a short string with a binary unit (``1.5G``, ``312K``, ``17B``)."""
    value = float(n)
    for unit in ("B", "K", "M", "G"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" or value >= 100 else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}T"
