"""Rotary embedding: transformers' rotate-half rotations → one ``RotaryEmbedding`` (opset 23).

Two written forms of the same half-split (GPT-NeoX style) rotation on ``[B, H, S, D]``:

- ``x*cos + rotate_half(x)*sin`` (llama and most families): onnxscript's rule, which checks that the split is
  exactly at ``D/2``;
- gpt-oss's ``x1, x2 = chunk(x, 2); cat(x1*cos - x2*sin, x2*cos + x1*sin)``, with ``cos`` / ``sin`` of half width
  ``[B, S, D/2]`` (already scaled by YaRN's attention factor): the rule below.

Interleaved or partial rotations match neither.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.rules.fusion import _rotary_embedding


class ChunkedRotaryFusion(pattern.RewriteRuleClassBase):
    """gpt-oss's ``_apply_rotary_emb``: a two-way Split of the last axis, four products, Sub, Add, Concat."""

    def __init__(self):
        # the Unsqueezes of cos and sin are shared by Q and K: left in place, dead code elimination drops them
        super().__init__(name="ChunkedRotaryEmbedding", remove_nodes=False)

    def pattern(self, op, x, cos, sin, axes1, axes2):
        x1, x2 = op.Split(x, _allow_other_attributes=True, _outputs=["x1", "x2"])
        cos_4d = op.Unsqueeze(cos, axes1)
        sin_4d = op.Unsqueeze(sin, axes2)
        first = op.Sub(op.Mul(x1, cos_4d), op.Mul(x2, sin_4d))
        second = op.Add(op.Mul(x2, cos_4d), op.Mul(x1, sin_4d))
        return op.Concat(first, second, axis=-1)

    def check(self, op, x, cos, sin, axes1, axes2, x1, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not (_ir_utils.is_singleton_value(axes1, 1) and _ir_utils.is_singleton_value(axes2, 1)):
            return result.fail("cos/sin are not unsqueezed on axis 1")
        if x is None or x.shape is None or len(x.shape) != 4:
            return result.fail("input is not known to be 4-D", x)
        heads, size = x.shape[1], x.shape[3]
        if not isinstance(heads, int) or not isinstance(size, int) or size % 2:
            return result.fail("heads or head size not static (or odd)", x)
        split = x1.producer()  # the matched Split
        axis = split.attributes.get_int("axis", 0)
        sizes = _ir_utils.get_numpy_value(split.inputs[1]) if len(split.inputs) > 1 else None
        if axis not in (3, -1) or (sizes is not None and sizes.tolist() != [size // 2, size // 2]):
            return result.fail("the split is not the last axis in two halves", x)
        for table in (cos, sin):
            if table.shape is None:
                continue
            last = table.shape[-1] if len(table.shape) == 3 else None
            if len(table.shape) != 3 or (isinstance(last, int) and last != size // 2):
                return result.fail("cos/sin are not [B, S, D/2]", table)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        return op.RotaryEmbedding(x, cos, sin, interleaved=0, num_heads=x.shape[1])


_chunked = pattern.RewriteRuleSet([ChunkedRotaryFusion.rule()])


def rotary_embedding(model: ir.Model) -> dict[str, int]:
    """Fuse the rotary subgraph of every Q and K into ``RotaryEmbedding``."""
    return {"matches": _rotary_embedding.fuse_rotary_embedding(model) + _chunked.apply_to_model(model)}
