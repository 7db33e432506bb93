"""Trace a Hugging Face causal LM into an ONNX graph on packed tokens.

transformers is the reference definition of every architecture, so the frontend instantiates the
model class itself and swaps only attention, through ``AttentionInterface``, for llmc's
``PagedAttention`` custom op. The model is instantiated without initialising or loading weights
(untouched ``torch.empty`` storage costs no RAM); the exported graph's initializers are then bound
by name to the checkpoint's safetensors tensors as lazy tensors, which the backend reads one at a
time when it writes the engine.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from llmc.compiler import alibi_attention, attention_hook, deepstack, llama4_text, mla_trace
from llmc.compiler import positions as position_tables
from llmc.compiler.attention_hook import (
    ATTEND_END,
    ATTENTION_SHAPES,
    ATTN_IMPLEMENTATION,
    BIDIRECTIONAL,
    KV_OWNERS,
    SINK_MODULES,
    STEP,
)
from llmc.compiler.binding import account, bind
from llmc.compiler.checkpoint import Checkpoint
from llmc.compiler.safetensors_io import TensorEntry, changed_during_build, read_tensor
from llmc.errors import LlmcError, UnsupportedError
from llmc.passes.lazy import SOURCE_DTYPE
from llmc.plugins.paged_attention import INPUT_NAMES
from llmc.plugins.recurrent import ACTIVATIONS, STATE_SLOTS

# Graph inputs, in order: flat token ids and positions of every sequence in the step, then the
# attention metadata (see llmc.plugins.paged_attention), then which rows need logits.
GRAPH_INPUTS = ("input_ids", "positions", *INPUT_NAMES[3:], "logits_indices")
GRAPH_OUTPUTS = ("logits",)
OPSET = 23
# Extra input of engines whose rotary factors depend on the sequence length (``longrope``): for every
# token, the total length of its sequence in this step, which is what transformers compares with
# ``original_max_position_embeddings`` to pick the short or the long factors.
ROPE_LENGTHS = "rope_lengths"


@dataclass
class TracedModel:
    """The traced graph plus what later stages need to know about the model."""

    model: ir.Model
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    compute_dtype: str
    inputs: tuple[str, ...] = GRAPH_INPUTS
    # longrope: the sequence length above which the long factors apply; a sequence that grows past it
    # has its KV recomputed with them (transformers drops the cache there), so the runtime must know it.
    rope_recompute_at: int | None = None
    # Per layer, when layers differ in KV geometry or share caches: the manifest's ``kv_cache.layers``
    # (see llmc.runtime.kv_cache.layer_geometry); None when every layer has its own cache of one shape.
    kv_layers: list[dict] | None = None
    # Hybrid models (layers that keep recurrent state): per state array of the runtime's state pool, the
    # decoder layer, the kind of state and one slot's shape (the manifest's ``state_cache.arrays``); None
    # without such layers. ``num_layers`` then counts the attention layers (the KV pool's).
    state_layers: list[dict] | None = None
    # An image build (compiler/vision_encoder.py): further graphs of the artifact (name -> graph), what the
    # manifest records of its images, and the image processor the runtime reproduces.
    graphs: dict[str, ir.Model] = field(default_factory=dict)
    images: object = None  # llmc.compiler.vision_encoder.ImageSpec
    image_processor: object = None  # llmc.runtime.vision.ImageProcessor


# The state arrays the recurrent ops of the current trace asked for, in order (a node's state_idx is its index).
STATE_LAYERS: list[dict] = []


def _causal_conv1d_forward(conv1d, hidden_states, cache=None, layer_idx=0, activation=None, state_idx=0, **kwargs):
    """transformers' ``causal_conv1d_forward`` (LFM2's short convolutions, and the conv of Mamba2 / Gated DeltaNet
    layers) as llmc's ``CausalConv1d`` op on packed tokens: ``hidden_states`` ``[1, C, T]`` in, ``[1, C, T]`` out,
    each sequence's last K-1 inputs carried in its state slot instead of transformers' cache."""
    import torch

    from llmc.plugins.recurrent import torch_op  # noqa: F401  (registers torch.ops.llmc.causal_conv1d)

    if activation not in ACTIVATIONS:
        raise UnsupportedError(f"llmc's causal conv1d lowers activations {sorted(a for a in ACTIVATIONS if a)} or none "
                               f"(seen in layer {layer_idx}: {activation!r})")
    weight = conv1d.weight.squeeze(1)  # [C, K]
    channels, width = (int(d) for d in weight.shape)
    index = len(STATE_LAYERS)
    STATE_LAYERS.append({"layer": int(layer_idx), "kind": "conv", "shape": [channels, width - 1]})
    x = hidden_states[0].transpose(0, 1)  # [T, C]
    out = torch.ops.llmc.causal_conv1d(x, weight, conv1d.bias, STEP[STATE_SLOTS], STEP["context_lens"],
                                       STEP["query_start_loc"], index, ACTIVATIONS[activation])
    return out.transpose(0, 1)[None].to(hidden_states.dtype)


def _gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (Gated DeltaNet:
    Qwen3-Next, Qwen3.5) as llmc's ``GatedDeltaRule`` op on packed tokens: query/key ``[1, T, Hk, Dk]``, value
    ``[1, T, Hv, Dv]``, g/beta ``[1, T, Hv]`` in, ``([1, T, Hv, Dv], None)`` out;
    each sequence's state lives in its slot."""
    import torch

    from llmc.plugins.recurrent import torch_op  # noqa: F401  (registers torch.ops.llmc.gated_delta_rule)

    if initial_state is not None:
        raise UnsupportedError("llmc's gated delta rule takes its state from the runtime's state pool; a model that "
                               "passes an initial state while tracing is not lowered")
    num_k_heads, head_k = (int(d) for d in key.shape[-2:])  # (the token count stays symbolic)
    num_v_heads, head_v = (int(d) for d in value.shape[-2:])
    index = len(STATE_LAYERS)
    layer = _CURRENT_LAYER.get("idx", -1)
    STATE_LAYERS.append({"layer": layer, "kind": "gated_delta", "shape": [num_v_heads, head_k, head_v]})
    flat = [t[0].flatten(1) for t in (query, key, value)]
    out = torch.ops.llmc.gated_delta_rule(*flat, g[0].float(), beta[0].float(), STEP[STATE_SLOTS],
                                            STEP["context_lens"], STEP["query_start_loc"], index, num_k_heads,
                                            num_v_heads, int(bool(use_qk_l2norm_in_kernel)))
    return out.reshape(1, -1, num_v_heads, head_v).to(value.dtype), None


def _mamba2_scan_forward(module, hidden_states, B, C, dt, cache=None, **kwargs):
    """transformers' ``mamba2_scan_forward`` (Mamba2 layers of Nemotron-H, Falcon-H1, Granite-4 hybrid, Bamba, ...) as
    llmc's ``SsdScan`` op on packed tokens: ``hidden_states`` ``[1, T, H*P]``, B/C ``[1, T, G*N]``, dt ``[1, T, H]``
    in, ``[1, T, H*P]`` out (the D skip included); each sequence's SSM state lives in its slot."""
    import torch

    from llmc.plugins.recurrent import torch_op  # noqa: F401  (registers torch.ops.llmc.ssd_scan)

    heads, groups, width = int(module.num_heads), int(module.n_groups), int(module.head_dim)
    state_size = int(module.ssm_state_size)
    lo, hi = (float(v) for v in getattr(module, "time_step_limit", (0.0, float("inf"))))
    index = len(STATE_LAYERS)
    STATE_LAYERS.append({"layer": int(module.layer_idx), "kind": "ssm", "shape": [heads, width, state_size]})
    f32 = [t.float() for t in (module.A_log, module.D, module.dt_bias)]
    out = torch.ops.llmc.ssd_scan(hidden_states[0], B[0], C[0], dt[0], *f32, STEP[STATE_SLOTS], STEP["context_lens"],
                                  STEP["query_start_loc"], index, heads, groups, lo, hi)
    return out[None].to(hidden_states.dtype)


# transformers' functions of recurrent layers that llmc replaces by its ops, by their name in the modeling module.
_RECURRENT_FUNCTIONS = {"causal_conv1d_forward": _causal_conv1d_forward,
                        "torch_chunk_gated_delta_rule": _gated_delta_rule,
                        "torch_recurrent_gated_delta_rule": _gated_delta_rule,
                        "mamba2_scan_forward": _mamba2_scan_forward}
# The decoder layer whose recurrent layer runs now (Gated DeltaNet's functions are not given it), set by a forward
# pre-hook on the modules that hold a ``layer_idx`` while tracing.
_CURRENT_LAYER: dict[str, int] = {}


def _recurrent_modules(hf) -> list:
    """The modeling modules of ``hf``'s classes that define a function llmc replaces (a hybrid model's)."""
    import sys

    found = {}
    for m in hf.modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and any(callable(getattr(mod, n, None)) for n in _RECURRENT_FUNCTIONS):
            found[mod.__name__] = mod
    return list(found.values())


class _PatchedRecurrent:
    """Swap the recurrent functions of ``modules`` for llmc's while tracing (the modules' globals, which the
    layers' forwards look up at call time), and put transformers' back afterwards."""

    def __init__(self, modules: list, hf=None) -> None:
        self.saved = [(m, n, getattr(m, n)) for m in modules for n in _RECURRENT_FUNCTIONS if hasattr(m, n)]
        self.hf, self.hooks = hf, []

    def __enter__(self):
        for m, n, _ in self.saved:
            setattr(m, n, _RECURRENT_FUNCTIONS[n])
        if self.saved and self.hf is not None:
            def enter(module, args):
                _CURRENT_LAYER["idx"] = int(module.layer_idx)

            self.hooks = [m.register_forward_pre_hook(enter) for m in self.hf.modules()
                          if isinstance(getattr(m, "layer_idx", None), int)]

    def __exit__(self, *exc):
        for m, n, f in self.saved:
            setattr(m, n, f)
        for h in self.hooks:
            h.remove()
        _CURRENT_LAYER.clear()


def _auto_class(checkpoint: Checkpoint):
    """transformers' auto class the model is built with (compiler/multimodal.py: a vision-language wrapper as
    itself, traced on text)."""
    from llmc.compiler.multimodal import auto_class

    return auto_class(checkpoint.config)


def _build_module(checkpoint: Checkpoint, compute_dtype: str):
    import torch
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    from llmc.compiler import multimodal

    attention_hook.register()
    try:
        config = AutoConfig.from_pretrained(checkpoint.path, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        # Its messages can span lines (validator name, then the reason); the error is one line.
        reason = " ".join(str(exc).split())
        raise LlmcError(f"{checkpoint.path / 'config.json'}: transformers cannot read it: {reason.rstrip('.')}; give "
                        "each field the type and range the model's config class takes, or use the config.json the "
                        "model came with") from None
    sub_configs = getattr(type(config), "sub_configs", None) or {}
    if checkpoint.config.get("text_config") is not None and "text_config" not in sub_configs:
        # transformers keeps the stray object as a plain dict, then fails deep inside model construction
        raise LlmcError(f"{checkpoint.path / 'config.json'}: field 'text_config' is set, but model_type "
                        f"{checkpoint.model_type!r} ({type(config).__name__}) has no text sub-model; remove the "
                        "field or fix 'model_type'")
    config._attn_implementation = ATTN_IMPLEMENTATION
    with no_init_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Gather-then-batched-matmul experts trace into plain ONNX ops (the default grouped_mm path is a
        # transformers custom op no exporter knows). Set for every model, whatever its config calls its experts
        # (num_experts, moe_num_experts, ...): a model without experts ignores it.
        extra = {"experts_implementation": "batched_mm"}
        hf = _auto_class(checkpoint).from_config(config, dtype=getattr(torch, compute_dtype),
                                                 attn_implementation=ATTN_IMPLEMENTATION, **extra)
    hf.eval()
    alibi_attention.install(hf)  # bloom, mpt: attention computed inline, with ALiBi
    llama4_text.install(hf)  # llama4: chunked local attention, NoPE temperature tuning, complex rotary
    mla_trace.install(hf)  # DeepSeek-V3's latent attention: per-head keys by cat, not new_empty + copy_
    position_tables.install(hf)  # position tables that ignore position_ids (mbart, ...) or offset them (RoBERTa)
    rope = _select_longrope(hf, config)

    class PackedCausalLM(torch.nn.Module):
        """Packed-token step: all new tokens through the model, logits only for ``logits_indices``.

        The transformers model's own forward runs (final norm, logit soft-capping and all), with
        ``logits_to_keep`` selecting the sampled rows before the LM head.
        """

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens, query_start_loc,
                    logits_indices, rope_lengths=None, state_slots=None, image_embeds=None, image_rows=None,
                    mrope_positions=None, attend_end=None):
            if rope is not None:
                rope.lengths = rope_lengths
            paging = dict(slot_mapping=slot_mapping, block_tables=block_tables, context_lens=context_lens,
                          query_start_loc=query_start_loc)
            STEP.update(paging)
            STEP[STATE_SLOTS] = state_slots
            STEP[ATTEND_END] = attend_end  # Gemma 3's images: bidirectional spans (llmc.compiler.attention_hook)
            position_tables.STEP["positions"] = positions
            try:
                keep = dict(logits_to_keep=logits_indices) if takes_logits_to_keep else {}
                with _images_at_rows(self.inner, image_embeds, image_rows):
                    out = self.inner(
                        input_ids=input_ids[None],
                        position_ids=_position_ids(torch, positions, mrope_positions),
                        use_cache=False, **keep, **paging,
                    )
            finally:
                STEP.clear()
                position_tables.STEP.clear()
            # A head without logits_to_keep (whisper's) returns every token's row: select the sampled ones here.
            logits = out.logits[0] if takes_logits_to_keep else out.logits[0][logits_indices]
            return logits.float()

    takes_logits_to_keep = "logits_to_keep" in inspect.signature(hf.forward).parameters
    # The geometry the engine is laid out by is the text model's (a wrapper's own config nests it).
    text_config = config.get_text_config() if multimodal.is_wrapper(checkpoint.config) else config
    return text_config, hf, PackedCausalLM(hf).eval(), rope


def _position_ids(torch, positions, mrope_positions):
    """``positions`` ``[1, T]``, or for M-RoPE (compiler/vision_encoder.py) transformers' ``[4, 1, T]``: the text row
    (each token's index), then the (time, height, width) rows of ``mrope_positions`` ``[3, T]``."""
    if mrope_positions is None:
        return positions[None]
    return torch.cat([positions[None], mrope_positions])[:, None]


@contextmanager
def _images_at_rows(hf, image_embeds, image_rows):
    """An image build's step: the wrapper runs its own text path on the ids (its padding of multimodal token ids,
    Gemma 4's per-layer embeddings, Gemma 3's embedding scale) and the rows ``image_rows`` ``[M]`` of its token
    embeddings are replaced by ``image_embeds`` ``[M, hidden]`` as they leave the embedding module: where the
    wrapper's masked_scatter places an image's features."""
    if image_rows is None:
        yield
        return

    def place(_module, _inputs, embeds):
        flat = embeds.reshape(-1, embeds.shape[-1])  # [1, T, hidden] -> [T, hidden]
        features = deepstack.split(image_embeds, flat.shape[-1], image_rows)  # Qwen3-VL: [M, hidden * (1 + D)]
        return flat.index_put((image_rows,), features.to(flat.dtype)).reshape(embeds.shape)

    handle = hf.get_input_embeddings().register_forward_hook(place)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class _LongRope:
    """The rotary modules switched to per-token factor selection, and the step's ``rope_lengths``."""

    threshold: int
    lengths: object = None  # the traced [T] int64 tensor, set by the wrapper's forward


def _select_longrope(hf, config) -> _LongRope | None:
    """Make ``longrope`` rotary embeddings pick short or long factors per token, not per batch.

    transformers' ``dynamic_rope_update`` picks the long factors for the whole forward when
    ``max(position_ids) + 1 > original_max_position_embeddings``. On packed tokens that would let
    one long sequence switch every other sequence of the step, and a prefill chunk would see only
    its own positions; so the rotary forward is replaced by one that selects per token on the
    ``rope_lengths`` input (each token's sequence length, as transformers would compute it when
    running that sequence alone). Both factor sets are graph constants. The arithmetic is
    transformers' own (positions × inv_freq in float32, cos/sin × attention scaling), so the
    cos/sin tables are bit-identical to the eager model's.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    modules = [m for m in hf.modules() if hasattr(m, "original_inv_freq") and hasattr(m, "rope_type")]
    kinds = [m.rope_type if isinstance(m.rope_type, str) else sorted(set(m.rope_type.values())) for m in modules]
    if not any("longrope" in (k if isinstance(k, list) else [k]) for k in kinds):
        return None
    if any(not isinstance(m.rope_type, str) for m in modules):
        raise UnsupportedError(
            f"{config.model_type}: per-layer-type longrope rotary embeddings are not supported yet "
            "(rope_parameters per layer type with rope_type 'longrope')")
    threshold = int(config.rope_parameters["original_max_position_embeddings"])
    state = _LongRope(threshold)
    for m in modules:
        if m.rope_type != "longrope":
            continue
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](getattr(m, "config", config), None, seq_len=threshold + 1)
        m.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        m.forward = _longrope_forward.__get__(m)
        m.llmc_rope = state
    return state


def _longrope_forward(self, x, position_ids, layer_type=None):
    """``(cos, sin)`` ``[1, T, rotary_dim]`` with each token's factors chosen by its ``rope_lengths``."""
    import torch

    positions = position_ids[..., None].float()  # [1, T, 1]
    long = (self.llmc_rope.lengths > self.llmc_rope.threshold)[None, :, None]
    freqs = torch.where(long, positions * self.long_inv_freq.float(), positions * self.original_inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


WRAPPER_PREFIX = "inner."


def _param_name(graph_name: str) -> str:
    """The checkpoint key of a graph initializer (the wrapper adds a prefix to every parameter)."""
    return graph_name[len(WRAPPER_PREFIX):] if graph_name.startswith(WRAPPER_PREFIX) else graph_name


def trace(checkpoint: Checkpoint, compute_dtype: str = "float32",
          image_size: tuple[int, int] | None = None) -> TracedModel:
    """Trace ``checkpoint`` into an ``onnx_ir.Model`` whose weights are lazily bound to the safetensors.

    ``compute_dtype`` is the dtype of the graph (weights are converted on write when it differs
    from the checkpoint's storage dtype). ``image_size`` (pixels, the image processor's output): an image build,
    whose vision encoder is traced into a second graph (``TracedModel.graphs``) and whose language model takes
    image embeddings (compiler/vision_encoder.py).
    """
    import torch

    from llmc.plugins.paged_attention import onnx_schema, torch_op

    onnx_schema.register()
    try:
        return _trace(checkpoint, compute_dtype, torch, torch_op, image_size)
    except LlmcError:
        raise
    except Exception as exc:  # a supported family failing here is llmc's bug (exit 70); another is a refusal
        from llmc.compiler.checkpoint import SUPPORTED_MODEL_TYPES, supported_text

        if checkpoint.model_type in SUPPORTED_MODEL_TYPES:
            raise
        root = exc
        while root.__cause__ is not None:  # torch.export wraps the cause in a generic "step 1/3" message
            root = root.__cause__
        if isinstance(root, LlmcError):  # raised inside the traced forward (llmc's attention), wrapped by the tracer
            raise type(root)(f"{checkpoint.path}: model_type {checkpoint.model_type!r}: {root}") from None
        first = (str(root).strip().splitlines() or [""])[0][:300]
        raise UnsupportedError(_untraceable(checkpoint, root, first, supported_text())) from None


def _untraceable(checkpoint: Checkpoint, root: BaseException, first: str, supported: str) -> str:
    """The refusal of a family the generic path cannot trace: the mechanism (compiler/mechanisms.py) and the
    module where tracing stopped, where they can be told; the tracer's own words otherwise."""
    from llmc.compiler.mechanisms import name_mechanism

    where, classes = failing_module(root)
    mechanism = name_mechanism(checkpoint.config, classes, first)
    cause = f"{type(root).__name__}: {first}"
    head = f"{checkpoint.path}: model_type {checkpoint.model_type!r}"
    tail = f"{supported[0].upper()}{supported[1:]}"
    if mechanism:
        seen = f"seen in {where}; " if where else ""
        return f"{head}: llmc does not lower {mechanism} ({seen}tracing stopped with {cause}). {tail}"
    if where:
        return (f"{head}: llmc's generic path cannot trace {where} ({cause}); it computes something llmc does not "
                f"lower yet. {tail}")
    return (f"{head} cannot be traced by llmc's generic path ({cause}); its attention or layers use something llmc "
            f"does not lower yet. {tail}")


def failing_module(exc: BaseException) -> tuple[str | None, list[str]]:
    """Where in the model ``exc`` was raised: ``("layer 0's self_attn (DiffLlamaAttention)", class names of the
    modules on the traceback, innermost first)``; ``(None, [])`` when no module was running (e.g. the ONNX
    translation after tracing). Module paths come from the outermost module's ``named_modules()``."""
    import torch

    modules = []
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and (not modules or modules[-1] is not owner):
            modules.append(owner)
        tb = tb.tb_next
    if not modules:
        return None, []
    names = {id(m): n for n, m in modules[0].named_modules()}
    inner = modules[-1]
    classes = [type(m).__name__ for m in reversed(modules)]
    path = names.get(id(inner))
    if not path:  # raised while the model was being built (no root yet): its class is what can be named
        return f"{type(inner).__name__}", classes
    path = path.removeprefix(WRAPPER_PREFIX)
    found = re.search(r"(?:^|\.)(?:layers|h|layer|blocks|decoder_layers)\.(\d+)(?:\.(.+))?$", path)
    if found:
        part = found.group(2) or "block"
        return f"layer {found.group(1)}'s {part} ({type(inner).__name__})", classes
    return f"{path} ({type(inner).__name__})", classes


def _trace(checkpoint: Checkpoint, compute_dtype: str, torch, torch_op,
           image_size: tuple[int, int] | None = None) -> TracedModel:
    config, hf, module, rope = _build_module(checkpoint, compute_dtype)
    if image_size is not None:  # Qwen3-VL: the step's deepstack features reach the first layers
        deepstack.install(hf)
    sinks = [n for n, _ in hf.named_parameters() if n.rsplit(".", 1)[-1] in ("sinks", "sink")]
    # Every checkpoint tensor bound or known unused, every weight found with its shape: before tracing.
    binding = bind(checkpoint, hf)
    account(checkpoint, binding)

    recurrent = _recurrent_modules(hf)
    # an image row's width: the text width, times 1 + Qwen3-VL's deepstack layers (compiler/deepstack.py)
    image_width = config.hidden_size * (1 + deepstack.layers(hf.config)) if image_size is not None else 0
    example, kwargs, dynamic, inputs = _example_inputs(torch, config, rope is not None, bool(recurrent),
                                                       image_width, _mrope(checkpoint, image_size),
                                                       _bidirectional(checkpoint, image_size))
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    ATTENTION_SHAPES.clear()
    BIDIRECTIONAL["layers"] = _bidirectional(checkpoint, image_size)
    KV_OWNERS.clear()
    SINK_MODULES.clear()
    STATE_LAYERS.clear()
    program = _export(torch, torch_op, module, hf, recurrent, example, kwargs, inputs, dynamic)
    model = program.model
    _refuse_unused_sinks(checkpoint, hf, sinks)
    _refuse_static_shapes(checkpoint, model)
    _bind_initializers(checkpoint, model, module, binding, compute_dtype)
    graphs, images = _vision_graphs(checkpoint, hf, binding, compute_dtype, image_size) if image_size else ({}, None)
    attention_module = _first_attention_module(hf)
    del hf, module, program, binding
    KV_OWNERS.clear()
    num_layers, geometry, kv_layers, state_layers, inputs = _layer_geometry(
        checkpoint, config, model, inputs, bool(recurrent), attention_module)
    num_heads, num_kv_heads, head_size = geometry
    return TracedModel(
        model=model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        vocab_size=config.vocab_size,
        compute_dtype=compute_dtype,
        inputs=inputs,
        rope_recompute_at=rope.threshold if rope is not None else None,
        kv_layers=kv_layers,
        state_layers=state_layers,
        graphs=graphs,
        images=images,
    )


def _vision_graphs(checkpoint: Checkpoint, hf, binding, compute_dtype: str, image_size: tuple[int, int]):
    """The vision encoder traced into its own graph (compiler/vision_encoder.py), bound like the text model."""
    import torch

    from llmc.compiler import vision_encoder

    def bind_encoder(model: ir.Model, module) -> None:
        _bind_initializers(checkpoint, model, module, binding, compute_dtype)

    encoder = vision_encoder.trace(torch, hf, image_size, OPSET, bind_encoder)
    return {vision_encoder.ENCODER_GRAPH: encoder}, vision_encoder.spec_of(hf.config, image_size, checkpoint.path)


def _mrope(checkpoint: Checkpoint, image_size) -> bool:
    """Whether the image build's language model takes M-RoPE positions (compiler/vision_encoder.py)."""
    from llmc.compiler.vision_encoder import uses_mrope

    return image_size is not None and uses_mrope(checkpoint.model_type)


def _bidirectional(checkpoint: Checkpoint, image_size) -> str | None:
    """Which layers of the image build's language model attend bidirectionally within an image
    (compiler/vision_encoder.py: "all", "sliding" or None); such a model takes ``attend_end`` ``[T]``."""
    from llmc.compiler.vision_encoder import bidirectional_images

    return bidirectional_images(checkpoint.model_type, checkpoint.config) if image_size is not None else None


def _example_inputs(torch, config, longrope: bool, recurrent: bool, image_width: int = 0, mrope: bool = False,
                    bidirectional: str | None = None) -> tuple[tuple, dict, dict, tuple[str, ...]]:
    """The example step torch.export traces, its keyword inputs, the dynamic dimensions and the graph's input names.

    Eleven tokens of three sequences (block tables ``[3, 5]``, 2 logits rows), plus ``rope_lengths`` for longrope,
    ``state_slots`` for hybrid models, six image rows of ``image_width`` for image builds and ``[3, T]`` positions
    for M-RoPE."""
    # Small, pairwise distinct sizes so that torch.export keeps every dimension symbolic.
    tokens, seqs, max_blocks = 11, 3, 5
    example = (
        torch.randint(0, config.vocab_size, (tokens,)),
        torch.arange(tokens),
        torch.arange(tokens),
        torch.zeros(seqs, max_blocks, dtype=torch.long),
        torch.tensor([4, 3, 4]),
        torch.tensor([0, 4, 7, 11]),
        torch.tensor([3, 10]),
    )
    t, s, b, n = (torch.export.Dim(x) for x in ("tokens", "seqs", "max_blocks", "n_logits"))
    dynamic = {
        "input_ids": {0: t},
        "positions": {0: t},
        "slot_mapping": {0: t},
        "block_tables": {0: s, 1: b},
        "context_lens": {0: s},
        "query_start_loc": {0: s + 1},
        "logits_indices": {0: n},
    }
    inputs = GRAPH_INPUTS
    kwargs = {}
    if longrope:
        example += (torch.tensor([4] * 4 + [3] * 3 + [10] * 4),)
        dynamic[ROPE_LENGTHS] = {0: t}
        inputs = (*GRAPH_INPUTS, ROPE_LENGTHS)
    if recurrent:  # each sequence's state slot (hybrid models)
        kwargs[STATE_SLOTS] = torch.tensor([2, 0, 1])
        dynamic[STATE_SLOTS] = {0: s}
        inputs = (*inputs, STATE_SLOTS)
    if image_width:  # rows of the packed step whose embedding an image's features replace (compiler/vision_encoder.py)
        m = torch.export.Dim("image_rows")
        kwargs["image_embeds"] = torch.randn(6, image_width)
        kwargs["image_rows"] = torch.tensor([1, 2, 3, 8, 9, 10])
        dynamic["image_embeds"] = {0: m}
        dynamic["image_rows"] = {0: m}
        inputs = (*inputs, "image_embeds", "image_rows")
    if mrope:  # (time, height, width) positions of every token
        kwargs["mrope_positions"] = torch.arange(tokens).expand(3, -1) + torch.tensor([[0], [2], [1]])
        dynamic["mrope_positions"] = {1: t}
        inputs = (*inputs, "mrope_positions")
    if bidirectional:  # each token's end of the keys it sees beyond itself (0: causal), for the attention op
        kwargs[ATTEND_END] = torch.zeros(tokens, dtype=torch.long)
        dynamic[ATTEND_END] = {0: t}
        inputs = (*inputs, ATTEND_END)
    return example, kwargs, dynamic, inputs


def _export(torch, torch_op, module, hf, recurrent: list, example: tuple, kwargs: dict, inputs: tuple[str, ...],
            dynamic: dict):
    """torch.onnx.export (dynamo) of the wrapped model, llmc's ops translated to their ONNX nodes."""
    from llmc.plugins.recurrent import onnx_schema as recurrent_schema
    from llmc.plugins.recurrent import torch_op as recurrent_op

    recurrent_schema.register()
    with warnings.catch_warnings(), _PatchedRecurrent(recurrent, hf):
        warnings.simplefilter("ignore")
        return torch.onnx.export(
            module,
            example,
            kwargs=kwargs or None,
            input_names=list(inputs),
            output_names=list(GRAPH_OUTPUTS),
            dynamo=True,
            # Opset 23 has RMSNormalization and RotaryEmbedding, which ORT and TensorRT both run natively.
            opset_version=OPSET,
            dynamic_shapes=dynamic,
            custom_translation_table={torch.ops.llmc.paged_attention.default: torch_op.onnx_translation,
                                      torch.ops.llmc.causal_conv1d.default: recurrent_op.onnx_translation,
                                      torch.ops.llmc.gated_delta_rule.default: recurrent_op.delta_onnx_translation,
                                      torch.ops.llmc.ssd_scan.default: recurrent_op.ssd_onnx_translation},
            # Folding here would materialise weights in RAM; ORT folds at load, passes fold later.
            optimize=False,
            verbose=False,
        )


def _refuse_unused_sinks(checkpoint: Checkpoint, hf, sinks: list[str]) -> None:
    """Sink parameters that llmc's attention never received (a family that applies them outside AttentionInterface's
    ``s_aux`` / ``module.sinks``) would be dropped silently: refuse."""
    unused = [n for n in sinks if id(hf.get_submodule(n.rpartition(".")[0])) not in SINK_MODULES]
    SINK_MODULES.clear()
    if unused:
        raise UnsupportedError(f"{checkpoint.path}: model_type {checkpoint.model_type!r} has attention sinks "
                               f"({unused[0]}: a learned logit in every softmax denominator) that its attention does "
                               "not pass to llmc's paged attention (as transformers' s_aux or the module's sinks), so "
                               "llmc stops rather than drop them")


def _bind_initializers(checkpoint: Checkpoint, model: ir.Model, module, binding, compute_dtype: str) -> None:
    """Give every initializer of the exported graph its value: the checkpoint tensor it is bound to (read lazily,
    renamed to its checkpoint key), the converted weight, the module's computed buffer or the captured constant."""
    buffers = {name: buf for name, buf in module.named_buffers()}
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    loaded = _load_converted(checkpoint, compute_dtype) if binding.needs_converter else None
    for name, value in list(model.graph.initializers.items()):
        entry = binding.source(_param_name(name))
        if loaded is not None and _param_name(name) in loaded:
            del model.graph.initializers[name]
            value.name = _param_name(name)
            model.graph.register_initializer(value)
            value.const_value = ir.tensor(loaded[value.name].numpy(), name=value.name)
        elif entry is not None:
            # Initializers are named by their checkpoint key, as in the Hugging Face model.
            del model.graph.initializers[name]
            value.name = _param_name(name)
            model.graph.register_initializer(value)
            value.const_value = _lazy_tensor(entry, compute_dtype, value.name)
        elif name in buffers:  # computed buffers such as rotary inv_freq are not in the checkpoint
            value.const_value = ir.tensor(buffers[name].detach().cpu().numpy(), name=name)
        elif name not in parameters and value.const_value is not None:
            pass  # a constant the forward creates (e.g. longrope factors), captured by torch.export
        else:
            raise LlmcError(
                f"{checkpoint.path}: the model needs tensor {name!r} but no safetensors file holds it; "
                "the checkpoint is incomplete or for another architecture"
            )


def _layer_geometry(checkpoint: Checkpoint, config, model: ir.Model, inputs: tuple[str, ...], recurrent: bool,
                    attention_module: str | None):
    """What the trace's attention and recurrent calls saw, as the KV pool's and the state pool's layout.

    Returns ``(num_layers, (num_heads, num_kv_heads, head_size), kv_layers, state_layers, inputs)``; ``inputs``
    loses ``state_slots`` where the family's recurrent layers are all absent from this configuration."""
    num_layers = config.num_hidden_layers
    num_heads, num_kv_heads, head_size = _config_geometry(config)
    kv_layers = None
    state_layers = [dict(d) for d in STATE_LAYERS] or None
    STATE_LAYERS.clear()
    if recurrent and not state_layers:
        # The family has recurrent layers but this configuration uses none (an LFM2 config of attention layers only):
        # a plain model, without the state_slots input. (A recurrent layer that bypassed llmc's ops would compute
        # each step's tokens alone; the build's self-check stops such a model, its decode steps differing.)
        slots = next(v for v in model.graph.inputs if v.name == STATE_SLOTS)
        if not slots.uses():
            model.graph.inputs.remove(slots)
            inputs = tuple(n for n in inputs if n != STATE_SLOTS)
    if not ATTENTION_SHAPES and not state_layers:
        _refuse_inline_attention(checkpoint, attention_module)
    if state_layers and ATTENTION_SHAPES:
        # Hybrid: only the attention layers have KV caches; the graph's PagedAttention nodes index a pool of those.
        num_layers = _compact_attention_layers(model, checkpoint)
    if ATTENTION_SHAPES:
        if sorted(ATTENTION_SHAPES) != list(range(num_layers)):
            raise UnsupportedError(f"{checkpoint.path}: model_type {checkpoint.model_type!r}: attention ran in layers "
                                   f"{sorted(ATTENTION_SHAPES)} of {num_layers}; llmc's KV pool needs one attention "
                                   "call per decoder layer (layers without attention are not lowered yet)")
        shapes = [ATTENTION_SHAPES[i] for i in range(num_layers)]
        num_heads, num_kv_heads, head_size, _ = shapes[0]
        if any(s[:3] != shapes[0][:3] or s[3] != i for i, s in enumerate(shapes)):
            # Layers of other geometries each get a cache of their own shape; KV-shared layers name their owner.
            kv_layers = [{"shares": s[3]} if s[3] != i else {"num_kv_heads": s[1], "head_size": s[2]}
                         for i, s in enumerate(shapes)]
        ATTENTION_SHAPES.clear()
    return num_layers, (num_heads, num_kv_heads, head_size), kv_layers, state_layers, inputs


def _first_attention_module(hf) -> str | None:
    """``"layer 0's attention (MegatronBertAttention)"``: the model's first attention module, for a refusal."""
    import torch

    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict):  # xlm's ``attentions`` list, not one module
            continue
        last = name.rsplit(".", 1)[-1].lower()
        cls = type(module).__name__
        if "attention" in cls.lower() or last in ("attn", "self_attn", "attention", "attentions"):
            found = re.search(r"(?:^|\.)(layers|h|layer|blocks|attentions)\.(\d+)(?:\.(.+))?$", name)
            if found:  # xlm keeps its attention modules in a list of their own, beside the layers
                return f"layer {found.group(2)}'s {found.group(3) or found.group(1)} ({cls})"
            return f"{name} ({cls})"
    return None


def _refuse_inline_attention(checkpoint: Checkpoint, where: str | None) -> None:
    """Refuse (exit 3) a model whose attention never reached llmc's paged attention: its attention modules compute
    attention themselves instead of calling transformers' AttentionInterface (megatron-bert, openai-gpt, xglm, ...),
    so the traced step would attend over its own tokens only, with no KV cache of earlier steps."""
    seen = f"seen in {where}: " if where else ""
    raise UnsupportedError(
        f"{checkpoint.path}: model_type {checkpoint.model_type!r}: llmc does not lower attention computed inside the "
        f"family's own attention modules ({seen}they never call transformers' AttentionInterface, where llmc swaps in "
        "its paged attention over the KV cache), so the engine's steps could not see earlier tokens")


def _compact_attention_layers(model: ir.Model, checkpoint: Checkpoint) -> int:
    """Renumber a hybrid model's attention layers 0..A-1 (their order in the model), in ``ATTENTION_SHAPES`` and in
    every PagedAttention node's ``layer_idx``, so that the KV pool holds caches for attention layers only. Returns A."""
    from llmc.plugins.paged_attention import DOMAIN, OP_TYPE

    index = {layer: i for i, layer in enumerate(sorted(ATTENTION_SHAPES))}
    shapes = {index[layer]: (h, kv, d, index[owner]) for layer, (h, kv, d, owner) in ATTENTION_SHAPES.items()}
    ATTENTION_SHAPES.clear()
    ATTENTION_SHAPES.update(shapes)
    for node in model.graph.all_nodes():
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            old = node.attributes["layer_idx"].as_int()
            if old not in index:
                raise UnsupportedError(f"{checkpoint.path}: model_type {checkpoint.model_type!r}: a PagedAttention "
                                       f"node of layer {old} has no attention call recorded")
            node.attributes["layer_idx"] = ir.AttrInt64("layer_idx", index[old])
    return len(index)


def _config_geometry(config) -> tuple[int, int, int]:
    """(heads, kv heads, head size) as the config states them, for a model whose trace ran no attention.

    Configs with per-layer attributes (transformers' heterogeneous configs) refuse a global read of
    ``head_dim``; the traced shapes are what count then, so the first layer's stand in here.
    """
    per_layer = getattr(config, "per_layer_config", None)
    cfg = per_layer[0] if per_layer else config
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return num_heads, num_kv_heads, head_size


def _refuse_static_shapes(checkpoint: Checkpoint, model: ir.Model) -> None:
    """Refuse (exit 3) a graph whose token or sequence dimensions the tracer fixed to the example's sizes: the
    model's forward computed something from them as Python numbers (CPM-Ant's position buckets), so the engine
    would run only steps of exactly that shape."""
    from llmc.compiler.mechanisms import name_mechanism

    fixed = [f"{v.name} (dimension {i}: {d})" for v in model.graph.inputs if v.shape is not None
             for i, d in enumerate(v.shape) if isinstance(d, int) and v.name in _DYNAMIC_INPUTS]
    if fixed:
        mechanism = name_mechanism(checkpoint.config) or "a forward that computes with the number of tokens as a " \
                                                          "Python number"
        raise UnsupportedError(
            f"{checkpoint.path}: model_type {checkpoint.model_type!r}: llmc does not lower {mechanism} (the traced "
            f"graph fixed {', '.join(fixed[:2])} to the example step's size, so the engine could not run other "
            "steps)")


# Inputs whose first dimension is the step's token count and which every model reads (an input a model ignores,
# such as positions without rotary, may keep the example's shape).
_DYNAMIC_INPUTS = ("input_ids",)


def _load_converted(checkpoint: Checkpoint, dtype: str) -> dict:
    """State dict of the model loaded by transformers, for checkpoints whose tensors need merging.

    Such checkpoints (per-expert MoE weights, for one) are read whole into RAM once instead of streamed.
    """
    import torch

    from llmc.compiler.multimodal import auto_class

    logging.getLogger(__name__).warning(
        "%s: checkpoint tensors need transformers' weight conversion; loading them into RAM instead of streaming",
        checkpoint.path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            # the class the build traced (a vision-language wrapper as itself: its state dict's names are the trace's)
            hf = auto_class(checkpoint.config).from_pretrained(checkpoint.path, dtype=getattr(torch, dtype))
        except OSError as exc:  # the files load_checkpoint indexed are gone (transformers says which)
            raise changed_during_build(checkpoint.path, exc) from None
    return {k: v.detach() for k, v in hf.state_dict().items()}


def _lazy_tensor(entry: TensorEntry, dtype: str, name: str) -> ir.LazyTensor:
    ir_dtype = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16}[dtype]

    def load() -> ir.Tensor:
        array = read_tensor(entry)
        if array.dtype != np.dtype(dtype):
            array = array.astype(dtype)
        return ir.tensor(array, name=name)

    tensor = ir.LazyTensor(load, dtype=ir_dtype, shape=ir.Shape(entry.shape), name=name)
    # What the checkpoint stores (the ONNX Runtime backend keeps bfloat16 weights as such: ort_bf16_weights).
    tensor.meta[SOURCE_DTYPE] = entry.dtype
    return tensor
