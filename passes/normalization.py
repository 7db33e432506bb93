"""Normalization fusions: RMSNorm subgraph → ``RMSNormalization`` (opset 23); residual add + RMSNorm →
``llmc.SkipRMSNormalization`` (normalized output and the sum, which the next residual needs).

The RMSNorm rule is onnxscript's (it matches exactly ``x * 1/sqrt(mean(x²) + eps) * w``, with
optional casts); it does not fire on LayerNorm (mean subtraction) or on Gemma's ``(1 + w)``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.fusion import _rms_normalization

LLMC_DOMAIN = "llmc"


def rms_norm(model: ir.Model) -> dict[str, int]:
    """Fuse decomposed RMSNorm into one ``RMSNormalization`` node."""
    return {"matches": _rms_normalization.fuse_rms_normalization(model)}


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and list(a.shape) == list(b.shape)


class _SkipRmsNorm(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, b, weight):
        total = op.Add(a, b)
        normed = op.RMSNormalization(total, weight, _allow_other_attributes=True, _outputs=["normed"])
        return normed, total

    def check(self, context, a, b, weight, normed, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not _same_shape(a, b):
            return result.fail("residual add broadcasts (shapes differ); not a residual", a)
        if weight.shape is None or weight.shape.rank() != 1:
            return result.fail("scale is not 1-D", weight)
        attrs = normed.producer().attributes
        axis = attrs.get("axis")
        rank = a.shape.rank()
        if axis is not None and axis.value not in (-1, rank - 1):
            return result.fail("normalizes over an axis other than the last")
        return result

    def rewrite(self, op, a, b, weight, normed, **_):
        attrs = normed.producer().attributes
        eps = attrs["epsilon"].value if "epsilon" in attrs else 1e-5
        return op.SkipRMSNormalization(a, b, weight, epsilon=eps, _domain=LLMC_DOMAIN, _outputs=2)


_skip_rules = pattern.RewriteRuleSet([_SkipRmsNorm.rule()])


def skip_rms_norm(model: ir.Model) -> dict[str, int]:
    """Fuse ``Add`` + ``RMSNormalization`` into ``llmc.SkipRMSNormalization`` (outputs: normalized, sum)."""
    count = _skip_rules.apply_to_model(model)
    if count:
        model.opset_imports.setdefault(LLMC_DOMAIN, 1)
    return {"matches": count}
