"""llmc's attention for transformers' models while tracing: one call of the paged-attention op per attention layer.

The frontend registers :func:`attention` as a transformers attention implementation, so every model's attention
modules reach it; llmc's own forwards of attention that transformers computes inline (ALiBi in
``alibi_attention``, chunked local attention in ``llama4_text``) call it directly. The module-level tables below
are the current trace's: what the attention calls saw (the KV pool's geometry, shared caches, sinks) and the step's
paging tensors; the frontend clears and reads them around each trace.
"""

from __future__ import annotations

from llmc.errors import UnsupportedError

ATTN_IMPLEMENTATION = "llmc_paged"


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry: [1, H, T, D] query and [1, Hkv, T, D] key/value on packed tokens; returns the
    [1, T, H, Dv] output of ``torch.ops.llmc.paged_attention`` (and no attention weights)."""
    import torch

    _, num_heads, tokens, head_size = query.shape
    num_kv_heads = key.shape[1]
    value_size = value.shape[-1]
    if value_size < head_size:
        # Multi-head latent attention: value heads narrower than query/key heads. Zero columns appended
        # to V give zero output columns, cut off below: exact, at the cost of a wider V cache (what
        # transformers' flash-attention path does too).
        value = torch.nn.functional.pad(value, (0, head_size - value_size))
    elif value_size > head_size:
        raise UnsupportedError(f"llmc does not lower value heads wider than query/key heads (seen in layer "
                               f"{module.layer_idx}'s {type(module).__name__}: value heads of {value_size}, query/key "
                               f"heads of {head_size})")
    layer = int(module.layer_idx)
    # A KV-shared layer (Gemma 3n / Gemma 4) attends over the keys and values an earlier layer computed: the very
    # tensors come back here. It reads that layer's cache (its own would hold the same values).
    owner = next((i for i, (k_seen, _) in KV_OWNERS.items() if k_seen is key), None)
    if owner is None:
        KV_OWNERS[layer] = (key, value)
    else:
        layer = owner
    ATTENTION_SHAPES[int(module.layer_idx)] = (int(num_heads), int(num_kv_heads), int(head_size), layer)
    q = query[0].transpose(0, 1).reshape(tokens, num_heads * head_size)
    k = key[0].transpose(0, 1).reshape(tokens, num_kv_heads * head_size)
    v = value[0].transpose(0, 1).reshape(tokens, num_kv_heads * head_size)
    # The layer's own window: a model that passes ``sliding_window`` says it per layer (None on a full-attention
    # layer, whose module may still hold the config's window: EXAONE 4); the module's is for those that do not.
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    window = window or 0
    softcap = kwargs.get("softcap") or 0.0
    # Attention sinks (gpt-oss, granite_swa): a learned logit per query head in every softmax denominator, which
    # transformers hands attention functions as ``s_aux`` (what its flash-attention kernels take as sink logits). The
    # op's optional last input. A model whose sink parameters do not arrive here is refused after tracing.
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,):
            raise UnsupportedError(f"llmc lowers attention sinks of one logit per query head only (seen in layer "
                                   f"{module.layer_idx}'s {type(module).__name__}: sinks of shape "
                                   f"{tuple(getattr(sinks, 'shape', ()))} for {num_heads} heads)")
        SINK_MODULES.add(id(module))
    step = {name: kwargs.get(name, STEP.get(name)) for name in STEP_FIELDS}
    out = torch.ops.llmc.paged_attention(
        q,
        k,
        v,
        step["slot_mapping"],
        step["block_tables"],
        step["context_lens"],
        step["query_start_loc"],
        layer,
        int(num_heads),
        int(num_kv_heads),
        int(head_size),
        float(scaling if scaling is not None else head_size**-0.5),
        int(window),
        float(softcap),
        sinks,
        float(kwargs.get("alibi_max_bias") or 0.0),  # ALiBi: from llmc's forwards of inline-ALiBi attention only
        int(kwargs.get("attention_chunk") or 0),  # chunked local attention: from llmc's llama4 attention forward
        attend_end=_attend_end(window),  # bidirectional spans (Gemma 3 / 4's images): the step's input, or None
    )
    return out.reshape(1, tokens, num_heads, head_size)[..., :value_size], None


# The step's paging tensors, for attention modules that do not pass the model's keyword arguments through to
# the attention function (falcon): set by the traced wrapper's forward around the model call, so torch.export
# sees the very input tensors either way.
STEP_FIELDS = ("slot_mapping", "block_tables", "context_lens", "query_start_loc")
# An image build whose images attend bidirectionally (Gemma 3): the step's ``attend_end`` [T] int64, every attention
# call's last input (llmc.plugins.paged_attention.torch_op); absent (None) for every other model.
ATTEND_END = "attend_end"
# The current trace's layers that take it: "all" (Gemma 3), "sliding" (Gemma 4: its global layers stay causal), None.
BIDIRECTIONAL: dict[str, str | None] = {"layers": None}


def _attend_end(window: int):
    """The step's ``attend_end`` for a layer of sliding ``window`` (0: global), or None where the layer is causal."""
    layers = BIDIRECTIONAL["layers"]
    if layers is None or (layers == "sliding" and not window):
        return None
    return STEP.get(ATTEND_END)
# (A hybrid model's step also sets ``state_slots``, which only llmc's recurrent ops read.)
STEP: dict = {}

# Per layer index, (heads, kv heads, head size, the layer whose cache it uses) of every attention call of the
# current trace: the KV pool's geometry as the model computes it, which configs do not always state (MLA's
# head_dim is its rotary part only; Gemma 4's full-attention layers have other head sizes than its sliding ones).
ATTENTION_SHAPES: dict[int, tuple[int, int, int, int]] = {}
# Layer index -> the (key, value) tensors its attention call received, to recognise KV-shared layers.
KV_OWNERS: dict[int, tuple[object, object]] = {}
# ids of the attention modules whose sinks reached llmc's attention in the current trace (a model with sink
# parameters that never get there is refused).
SINK_MODULES: set[int] = set()


def register() -> None:
    """Make :func:`attention` transformers' attention implementation named :data:`ATTN_IMPLEMENTATION`."""
    from transformers import AttentionInterface

    import llmc.plugins.paged_attention.torch_op  # noqa: F401  (registers torch.ops.llmc)

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
