"""The rewrites a recipe adds around the standard pipeline (llmc.passes.registry.ALL_PASSES), as passes.

Each factory returns a :class:`GraphPass` bound to the build's arguments; the build's stages run them
(llmc.compiler.build.stages) and ``llmc build --print-passes`` lists :data:`RECIPE_PASSES`:

- ``lora-slots`` (``--lora-slots``): before the pipeline, while each linear is still ``MatMul(x, Transpose(W))``;
- ``quantize`` (``--quant`` / ``--kv-cache-dtype``): inside the pipeline, after the fusions (llmc.quant.stage);
- ``fold-lora-updates``: after the pipeline, on engines that keep LoRA updates as graph ops (ONNX Runtime);
- ``mxfp4-experts``: after the pipeline, on checkpoints whose MoE experts arrive as MXFP4 codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.passes.base import GraphPass

RECIPE_PASSES: dict[str, str] = {
    "lora-slots": "--lora-slots: a rank-R update per linear of the targets, read from slot tensors (before the "
                  "pipeline)",
    "quantize": "--quant / --kv-cache-dtype: weights (and activations) to the recipe's format (in the pipeline, "
                "after the fusions; changes numerics on purpose)",
    "fold-lora-updates": "LoRA updates of packed projections moved in front of their Split (after the pipeline; "
                         "ONNX Runtime engines)",
    "mxfp4-experts": "routed expert matmuls over MXFP4 weights -> llmc.Mxfp4MoEMatMul(Q8) on the checkpoint's codes "
                     "(after the pipeline)",
}


@dataclass
class Outcome:
    """What a recipe pass made, for the manifest (e.g. the LoRA geometry)."""

    value: object = None
    stats: dict = field(default_factory=dict)


def lora_slots(slots: int, max_rank: int, targets: tuple[str, ...], out: Outcome) -> GraphPass:
    from llmc.passes.lora import add_lora

    def run(model) -> dict[str, int]:
        out.value = add_lora(model, slots, max_rank, targets)
        return {"matches": len(out.value.sites)}

    return GraphPass("lora-slots", run, RECIPE_PASSES["lora-slots"], fusion=False)


def fold_lora_updates() -> GraphPass:
    from llmc.passes.lora import fold_into_packed

    return GraphPass("fold-lora-updates", lambda model: {"matches": fold_into_packed(model)},
                     RECIPE_PASSES["fold-lora-updates"], fusion=False)


def mxfp4_experts(sources: dict, q8: bool, out: Outcome) -> GraphPass:
    from llmc.passes.mxfp4_experts import lower_mxfp4_experts

    def run(model) -> dict[str, int]:
        out.value = lower_mxfp4_experts(model, sources, q8=q8)
        return {"matches": out.value}

    return GraphPass("mxfp4-experts", run, RECIPE_PASSES["mxfp4-experts"], fusion=False)
