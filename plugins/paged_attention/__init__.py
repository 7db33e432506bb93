"""PagedAttention: attention over a KV cache held in fixed-size blocks.

Semantics (the reference in :mod:`.reference` is normative):

Inputs, for one step over ``S`` sequences whose new tokens are packed into ``T`` rows:

- ``query``  ``[T, num_heads * head_size]``
- ``key``, ``value`` ``[T, num_kv_heads * head_size]`` (new tokens only, rotary already applied)
- ``slot_mapping`` ``[T]`` int64: cache slot of each new token, ``block_id * block_size + offset``
- ``block_tables`` ``[S, max_blocks]`` int64: the blocks of each sequence, in order
- ``context_lens`` ``[S]`` int64: tokens in each sequence's cache *after* this step's writes
- ``query_start_loc`` ``[S + 1]`` int64: sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]``,
  which are its last tokens (positions ``context_lens[s] - n_s ... context_lens[s] - 1``)

The op first writes every new token's K and V into its slot, then each query row attends
causally to its sequence's cached positions ``0..p``. Query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``. Softmax is computed in float32.

An optional last input ``sinks`` ``[num_heads]`` (attention sinks, gpt-oss) adds ``exp(sinks[h])`` to
every softmax denominator of query head ``h`` and nothing to its value sum. Attribute ``alibi_max_bias`` > 0
(ALiBi) adds ``slope_h * (key position - query position)`` to head ``h``'s scores (the standard slopes,
``reference.alibi_slopes``); ``attention_chunk`` = C > 0 (chunked local attention) lets a query at position ``p``
see only the keys ``[floor(p / C) * C, p]``.

An optional input after ``sinks`` (index 8; ``sinks`` may then be the empty name), ``attend_end`` ``[T]`` int64
(bidirectional spans: Gemma 3's image tokens attend to every token of their image), lets row ``t`` at position ``q``
also see the keys ``q < k < attend_end[t]``; the window's / chunk's lower bound still applies, so with a sliding
window ``W`` a row sees ``k > q - W AND (k <= q OR k < attend_end[t])`` (transformers' Gemma 3 masks). A value
``<= q + 1`` is plain causal attention. The caller guarantees ``attend_end[t] <= context_lens[s]`` (those keys are
written in this same step; every implementation writes the whole step's K/V before any row attends).

The KV cache of one layer is two arrays ``[num_blocks, num_kv_heads, block_size, head_size]``
(layout name ``"blocks_hnd"``) owned by the runtime; the graph never holds it.
"""

OP_TYPE = "PagedAttention"
# The same op on the packed Q/K/V projection ``qkv [..., T, (H + 2*Hkv) * D]`` with rotate-half rotary
# inside (inputs: qkv, cos, sin ``[..., T, D/2]``, then the four above from slot_mapping on): what the
# ONNX Runtime backend fuses a layer's Split + RotaryEmbedding x2 + Reshape x3 + PagedAttention into on
# the native route (reference: :func:`.reference.rotary_paged_attention`).
ROTARY_OP_TYPE = "RotaryPagedAttention"
DOMAIN = "llmc"
OPSET_VERSION = 1
KV_LAYOUT = "blocks_hnd"

INPUT_NAMES = (
    "query",
    "key",
    "value",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "query_start_loc",
)
# The optional input after INPUT_NAMES (index 7): attention-sink logits, one per query head.
SINKS_INPUT = "sinks"
# The optional input after that (index 8): per query row, the end (exclusive) of the keys it sees ahead of itself.
ATTEND_END_INPUT = "attend_end"
ATTEND_END_INDEX = 8
# Attributes the frontend sets only where a model uses them, with their "off" values (graphs without them are
# unchanged): ALiBi's maximum bias and chunked local attention's chunk.
OPTIONAL_ATTRS = {"alibi_max_bias": 0.0, "attention_chunk": 0}
# The Python ORT op (ort_op) of a node that sets any of OPTIONAL_ATTRS: its op type + this suffix.
PYOP_EXTENDED = "Ext"
# The Python ORT op of a node with attend_end: its op type (with "Sinks" when it has them) + this + PYOP_EXTENDED.
PYOP_ATTEND_END = "AttendEnd"
