"""PagedAttention for ONNX Runtime on the CPU, bridged through onnxruntime-extensions.

ORT calls the Python function registered here once per layer per step (measured ≈ 40 µs of
bridge overhead per call, see benchmarks/); the function hands ORT's numpy views and the bound
KV pool (:mod:`.kv_binding`) to llmc's C++ kernel. Importing this module registers the op;
sessions must then load :func:`library_path` as a custom-op library.
"""

from __future__ import annotations

import os

from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

from llmc.plugins.paged_attention import OP_TYPE, PYOP_ATTEND_END, PYOP_EXTENDED, kv_binding

ORT_DOMAIN = "ai.onnx.contrib"


def _select_kernel():
    # LLMC_PAGED_ATTENTION_KERNEL=reference runs the numpy definition instead, for debugging.
    if os.environ.get("LLMC_PAGED_ATTENTION_KERNEL", "cpp") == "reference":
        from llmc.plugins.paged_attention.reference import paged_attention

        return paged_attention
    from llmc.plugins.paged_attention.cpu import paged_attention_cpu

    return paged_attention_cpu


_kernel = _select_kernel()

_F, _I = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64
_ATTRS = {
    "layer_idx": PyCustomOpDef.dt_int64,
    "num_heads": PyCustomOpDef.dt_int64,
    "num_kv_heads": PyCustomOpDef.dt_int64,
    "head_size": PyCustomOpDef.dt_int64,
    "scale": PyCustomOpDef.dt_float,
    "sliding_window": PyCustomOpDef.dt_int64,
    "softcap": PyCustomOpDef.dt_float,
}
# onnxruntime-extensions' Python ops need every declared attribute on the node, so the attributes a model sets
# only where it uses them (OPTIONAL_ATTRS: ALiBi, chunked local attention) have ops of their own, OP_TYPE /
# SINKS_OP_TYPE + PYOP_EXTENDED, which the backend lowering picks for such nodes (filling the others in).
_ATTRS_EXT = {**_ATTRS, "alibi_max_bias": PyCustomOpDef.dt_float, "attention_chunk": PyCustomOpDef.dt_int64}


def _options(attrs: dict) -> dict:
    """The kernel's keyword arguments from a node's attributes (absent ones at their defaults)."""
    return dict(
        num_heads=int(attrs["num_heads"]),
        num_kv_heads=int(attrs["num_kv_heads"]),
        scale=float(attrs["scale"]),
        sliding_window=int(attrs.get("sliding_window", 0)),
        softcap=float(attrs.get("softcap", 0.0)),
        alibi_max_bias=float(attrs.get("alibi_max_bias", 0.0)),
        attention_chunk=int(attrs.get("attention_chunk", 0)),
    )


@onnx_op(
    op_type=OP_TYPE,
    domain=ORT_DOMAIN,
    inputs=[_F, _F, _F, _I, _I, _I, _I],
    outputs=[_F],
    attrs=_ATTRS,
)
def _paged_attention(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, **attrs):
    k_cache, v_cache = kv_binding.layer_cache(int(attrs["layer_idx"]))
    return _kernel(
        query,
        key,
        value,
        slot_mapping,
        block_tables,
        context_lens,
        query_start_loc,
        k_cache,
        v_cache,
        **_options(attrs),
    )


# A node with attention sinks (an 8th input) moves to this op: onnxruntime-extensions' Python ops have no
# optional inputs.
SINKS_OP_TYPE = OP_TYPE + "Sinks"


@onnx_op(
    op_type=SINKS_OP_TYPE,
    domain=ORT_DOMAIN,
    inputs=[_F, _F, _F, _I, _I, _I, _I, _F],
    outputs=[_F],
    attrs=_ATTRS,
)
def _paged_attention_sinks(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, sinks,
                           **attrs):
    k_cache, v_cache = kv_binding.layer_cache(int(attrs["layer_idx"]))
    return _kernel(
        query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, k_cache, v_cache,
        **_options(attrs),
        sinks=sinks,
    )


@onnx_op(op_type=OP_TYPE + PYOP_EXTENDED, domain=ORT_DOMAIN, inputs=[_F, _F, _F, _I, _I, _I, _I], outputs=[_F],
         attrs=_ATTRS_EXT)
def _paged_attention_ext(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, **attrs):
    return _paged_attention(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, **attrs)


@onnx_op(op_type=SINKS_OP_TYPE + PYOP_EXTENDED, domain=ORT_DOMAIN, inputs=[_F, _F, _F, _I, _I, _I, _I, _F],
         outputs=[_F], attrs=_ATTRS_EXT)
def _paged_attention_sinks_ext(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, sinks,
                               **attrs):
    return _paged_attention_sinks(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                                  sinks, **attrs)


# A node with attend_end (input 8, bidirectional spans) moves to the op of its type + PYOP_ATTEND_END +
# PYOP_EXTENDED: attend_end as its last input (after the sinks, when the node has them; an empty input 7 is dropped),
# every attribute of _ATTRS_EXT declared (the lowering fills in OPTIONAL_ATTRS).
def _attend_end_op(with_sinks: bool) -> None:
    floats = [_F] if with_sinks else []

    @onnx_op(op_type=(SINKS_OP_TYPE if with_sinks else OP_TYPE) + PYOP_ATTEND_END + PYOP_EXTENDED,
             domain=ORT_DOMAIN, inputs=[_F, _F, _F, _I, _I, _I, _I, *floats, _I], outputs=[_F], attrs=_ATTRS_EXT)
    def run(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, *rest, **attrs):
        k_cache, v_cache = kv_binding.layer_cache(int(attrs["layer_idx"]))
        return _kernel(
            query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, k_cache, v_cache,
            **_options(attrs),
            sinks=rest[0] if with_sinks else None,
            attend_end=rest[-1],
        )


_attend_end_op(with_sinks=False)
_attend_end_op(with_sinks=True)


def library_path() -> str:
    """The onnxruntime-extensions library that hosts the Python custom ops."""
    return get_library_path()
