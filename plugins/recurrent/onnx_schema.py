"""ONNX operator schemas of the recurrent-state ops (``llmc::CausalConv1d``, opset 1)."""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema

from llmc.plugins.recurrent import (
    CONV_INPUT_NAMES,
    CONV_OP_TYPE,
    DELTA_INPUT_NAMES,
    DELTA_OP_TYPE,
    DOMAIN,
    OPSET_VERSION,
    SSD_INPUT_NAMES,
    SSD_OP_TYPE,
)


def register() -> None:
    """Register the schemas once per process (idempotent)."""
    if onnx.defs.has(SSD_OP_TYPE, DOMAIN):
        return
    option = OpSchema.FormalParameterOption
    inputs = [OpSchema.FormalParameter(name, "T" if i < 3 else "tensor(int64)",
                                       param_option=option.Optional if name == "bias" else option.Single)
              for i, name in enumerate(CONV_INPUT_NAMES)]
    onnx.defs.register_schema(OpSchema(
        CONV_OP_TYPE, DOMAIN, OPSET_VERSION,
        doc="Causal depthwise convolution with per-sequence state slots; see llmc.plugins.recurrent.",
        inputs=inputs,
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute("state_idx", OpSchema.AttrType.INT, required=False),
                    OpSchema.Attribute("activation", OpSchema.AttrType.INT, required=False)],
    ))
    onnx.defs.register_schema(OpSchema(
        DELTA_OP_TYPE, DOMAIN, OPSET_VERSION,
        doc="The gated delta rule (Gated DeltaNet) with per-sequence state slots; see llmc.plugins.recurrent.",
        inputs=[OpSchema.FormalParameter(name, "T" if i < 5 else "tensor(int64)")
                for i, name in enumerate(DELTA_INPUT_NAMES)],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(n, OpSchema.AttrType.INT, required=False)
                    for n in ("state_idx", "num_k_heads", "num_v_heads", "use_qk_l2norm")],
    ))
    onnx.defs.register_schema(OpSchema(
        SSD_OP_TYPE, DOMAIN, OPSET_VERSION,
        doc="Mamba2's selective scan (SSD) with per-sequence state slots; see llmc.plugins.recurrent.",
        inputs=[OpSchema.FormalParameter(name, "T" if i < 7 else "tensor(int64)")
                for i, name in enumerate(SSD_INPUT_NAMES)],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(n, OpSchema.AttrType.INT, required=False)
                    for n in ("state_idx", "num_heads", "n_groups")]
        + [OpSchema.Attribute(n, OpSchema.AttrType.FLOAT, required=False) for n in ("dt_min", "dt_max")],
    ))
