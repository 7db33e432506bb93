"""The ONNX operator schema of ``llmc::PagedAttention`` (opset 1).

Registering it lets the ONNX checker, shape inference and the torch exporter treat the node as a
known single-output op instead of an opaque custom node.
"""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema

from llmc.plugins.paged_attention import ATTEND_END_INPUT, DOMAIN, INPUT_NAMES, OP_TYPE, OPSET_VERSION, SINKS_INPUT

ATTRIBUTES = {
    "layer_idx": OpSchema.AttrType.INT,
    "num_heads": OpSchema.AttrType.INT,
    "num_kv_heads": OpSchema.AttrType.INT,
    "head_size": OpSchema.AttrType.INT,
    "scale": OpSchema.AttrType.FLOAT,
    "sliding_window": OpSchema.AttrType.INT,
    "softcap": OpSchema.AttrType.FLOAT,
    "alibi_max_bias": OpSchema.AttrType.FLOAT,  # > 0: ALiBi with the standard slopes of this maximum bias
    "attention_chunk": OpSchema.AttrType.INT,  # > 0: chunked local attention (llama4)
}


def register() -> None:
    """Register the schema once per process (idempotent)."""
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    float_like = "T"
    inputs = [
        OpSchema.FormalParameter(name, float_like if i < 3 else "tensor(int64)")
        for i, name in enumerate(INPUT_NAMES)
    ]
    # Attention sinks [num_heads] (gpt-oss): a learned logit per query head in every softmax denominator.
    optional = OpSchema.FormalParameterOption.Optional
    inputs.append(OpSchema.FormalParameter(SINKS_INPUT, float_like, param_option=optional))
    # attend_end [T] (Gemma 3's images): row t also sees the keys before attend_end[t] ahead of its position.
    inputs.append(OpSchema.FormalParameter(ATTEND_END_INPUT, "tensor(int64)", param_option=optional))
    schema = OpSchema(
        OP_TYPE,
        DOMAIN,
        OPSET_VERSION,
        doc="Paged attention over a runtime-owned block KV cache; see llmc.plugins.paged_attention.",
        inputs=inputs,
        outputs=[OpSchema.FormalParameter("output", float_like)],
        type_constraints=[(float_like, ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(name, kind, required=False) for name, kind in ATTRIBUTES.items()],
    )
    onnx.defs.register_schema(schema)
