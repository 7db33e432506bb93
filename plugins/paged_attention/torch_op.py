"""``torch.ops.llmc.paged_attention``: the custom op the frontend puts in place of attention.

Tracing only needs its fake (shape) implementation; its eager implementation runs the numpy
reference against the KV pool bound by :func:`llmc.plugins.paged_attention.kv_binding.bound_pool`,
so a traced model can also be executed in torch for debugging.

Bidirectional spans (Gemma 3's images): pass ``attend_end=`` an int64 tensor ``[T]``, one entry per row of
``query``: row ``t`` at absolute position ``q`` then also sees its sequence's keys ``q < k < attend_end[t]`` (a
value ``<= q + 1``, e.g. 0, keeps it causal). For a token inside an image occupying positions ``[a, b)`` set
``attend_end = b``, for every other token 0: that is transformers' ``OR(causal, blockwise)``, and on sliding-window
layers ``AND(sliding_window, OR(causal, blockwise))`` (the window's lower bound still applies). Every layer of a
model reads the same tensor, so it is one graph input (the step's, like ``slot_mapping``) passed to each call. The
caller guarantees ``attend_end[t] <= context_lens`` of the row's sequence: an image's tokens are all written in
the step whose rows attend to them (chunked prefill must not split an image across steps with attend_end pointing
past the chunk). The exported node carries it as its optional input 8 (input 7, ``sinks``, left empty when absent).
"""

from __future__ import annotations

import numpy as np
import torch

from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, OPSET_VERSION, kv_binding, reference


@torch.library.custom_op("llmc::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
    alibi_max_bias: float = 0.0,
    attention_chunk: int = 0,
    attend_end: torch.Tensor | None = None,
) -> torch.Tensor:
    k_cache, v_cache = kv_binding.layer_cache(layer_idx)
    out = reference.paged_attention(
        *(t.detach().float().numpy() if t.is_floating_point() else t.numpy() for t in (query, key, value)),
        slot_mapping.numpy(),
        block_tables.numpy(),
        context_lens.numpy(),
        query_start_loc.numpy(),
        k_cache,
        v_cache,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=None if sinks is None else sinks.detach().float().numpy(),
        alibi_max_bias=alibi_max_bias,
        attention_chunk=attention_chunk,
        attend_end=None if attend_end is None else attend_end.numpy(),
    )
    return torch.from_numpy(np.ascontiguousarray(out)).to(query.dtype)


@paged_attention.register_fake
def _(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, *attrs):
    return torch.empty_like(query)


def onnx_translation(
    query,
    key,
    value,
    slot_mapping,
    block_tables,
    context_lens,
    query_start_loc,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks=None,
    alibi_max_bias: float = 0.0,
    attention_chunk: int = 0,
    attend_end=None,
):
    """Lowering for ``torch.onnx.export(custom_translation_table=...)``: one ``llmc.PagedAttention`` node
    (attention sinks, when given, as its optional input 7 and ``attend_end`` as input 8, input 7 then empty when
    there are no sinks; ALiBi and chunked local attention as attributes only where set, so graphs without any of
    them are unchanged)."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    inputs = [query, key, value, slot_mapping, block_tables, context_lens, query_start_loc]
    if sinks is not None or attend_end is not None:
        inputs.append(sinks)  # None: an empty input name, ONNX's way of skipping an optional input
    if attend_end is not None:
        inputs.append(attend_end)
    extra = {}
    if alibi_max_bias:
        extra["alibi_max_bias"] = alibi_max_bias
    if attention_chunk:
        extra["attention_chunk"] = attention_chunk
    return getattr(opset, OP_TYPE)(
        *inputs,
        layer_idx=layer_idx,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        **extra,
    )
