"""Which decoder layer a weight belongs to, from its name (no dependencies: the build's memory plan reads it on
cache hits, which import no compiler stack)."""

from __future__ import annotations

import re

# The first dotted all-digit component of a weight's name is its decoder layer (``model.layers.3.``,
# ``transformer.h.3.``, ``model.layers.3.mlp.experts.5.``).
_LAYER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_of(name: str) -> int | None:
    """The decoder layer a weight belongs to, from its name; None for weights of no layer."""
    m = _LAYER.search(name or "")
    return int(m.group(1)) if m else None
