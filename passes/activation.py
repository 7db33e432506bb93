"""Gated activation: ``SiLU(gate) * up`` (exported as ``gate * Sigmoid(gate) * up``) → ``llmc.SwiGLU``."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

LLMC_DOMAIN = "llmc"


class _SwiGLU(pattern.RewriteRuleClassBase):
    def pattern(self, op, gate, up):
        silu = pattern.OrValue([op.Mul(gate, op.Sigmoid(gate)), op.Mul(op.Sigmoid(gate), gate)])
        return op.Mul(silu, up)

    def check(self, context, gate, up, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if gate.shape is None or up.shape is None or list(gate.shape) != list(up.shape):
            return result.fail("gate and up shapes differ (broadcasting is not a gated MLP)", gate)
        return result

    def rewrite(self, op, gate, up, **_):
        return op.SwiGLU(gate, up, _domain=LLMC_DOMAIN)


_rules = pattern.RewriteRuleSet([_SwiGLU.rule()])


def swiglu(model: ir.Model) -> dict[str, int]:
    """Fuse SiLU-gated products into ``llmc.SwiGLU(gate, up)``."""
    count = _rules.apply_to_model(model)
    if count:
        model.opset_imports.setdefault(LLMC_DOMAIN, 1)
    return {"matches": count}
