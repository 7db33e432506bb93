"""Rotary embedding: transformers' ``x*cos + rotate_half(x)*sin`` → one ``RotaryEmbedding`` (opset 23).

onnxscript's rule matches the half-split (GPT-NeoX style) rotation on ``[B, H, S, D]`` and checks
that the split is exactly at ``D/2``; interleaved or partial rotations do not match it.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter.rules.fusion import _rotary_embedding


def rotary_embedding(model: ir.Model) -> dict[str, int]:
    """Fuse the rotary subgraph of every Q and K into ``RotaryEmbedding``."""
    return {"matches": _rotary_embedding.fuse_rotary_embedding(model)}
