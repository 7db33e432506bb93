"""``llmc plan``: the GPU memory arithmetic of a deployment, from ``config.json`` alone (no weights read).

For a model config, a recipe (``--quant``, ``--kv-cache-dtype``), a target from :mod:`llmc.compiler.targets` and a
tensor-parallel degree, :func:`plan` gives per GPU:

- the weight bytes llmc's CUDA engine would store, by tensor class (attention, MLP, experts, router, embeddings,
  LM head, norms and other vectors), sharded as ``llmc build --tp N`` shards them (:mod:`llmc.compiler.sharding`:
  column-parallel openers and row-parallel closers, query heads divided by N, KV heads split or replicated, MoE
  experts' weights divided by N, embeddings and LM head vocab-parallel (rows / N; replicated when the vocabulary
  does not divide), everything else replicated on every GPU, as the manifest's ``parallel`` section states);
- the KV bytes per token, layer by layer as the KV pool stores them (:func:`kv_layers`);
- how many tokens of KV fit at ``gpu_memory_utilization`` after the weights and the runtime's activation reserve,
  and the largest batch of ``max_model_len``-token sequences;
- the decode step's HBM roofline (bytes read per step / memory bandwidth) at batch 1 and at that batch;
- for N > 1, the all-reduce bytes per decode token.

Units: bytes (B), seconds (s), bandwidth in GB/s (1e9 B/s). What each recipe stores (the CUDA engine's layouts,
``compiler/backends/cuda.py``, after ``passes/quantize.py`` in its ``qdq`` form, which GPU builds use):

- every float weight in the engine dtype, bfloat16 (2 B);
- ``fp8``: linears (the LM head too) as E4M3 (1 B/weight) + one float32 scale per output channel + a float32
  activation scale;
- ``int4`` / ``int4-awq``: linears (the LM head too: the ``--lm-head int8`` choice applies to CPU builds only) as
  two codes per byte + one bf16 scale and one uint8 zero point per group of 128 inputs;
- ``nvfp4``: E2M1 (0.5 B/weight) + one E4M3 scale per 16 weights + float32 global scales. The CUDA engine refuses
  NVFP4 today (``--engine tensorrt`` exports it); the figures are what the recipe stores;
- kept unquantized by every recipe: embeddings (GPU builds keep the table in the engine dtype), MoE routers (their
  scores choose the experts), MoE experts' batched ``[E, N, K]`` weights (the quantize pass rewrites them only in
  the CPU form), norms, biases; attention sinks are float32 (what the attention kernels read). A tied embedding
  is one tensor unquantized; quantized, the LM head is a second (quantized) copy beside the embedding table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmc.errors import LlmcError, UnsupportedError

BLOCK_SIZE = 16  # tokens per KV block (llmc build's default --block-size)
ENGINE_DTYPE_BYTES = 2  # bfloat16, llmc build's default --dtype
MAX_NUM_TOKENS = 2048  # Engine.load's default token budget of one step
MAX_NUM_SEQS = 256  # Engine.load's default bound on running requests
DEFAULT_UTILIZATION = 0.9
MAX_MODEL_LEN_CAP = 32768  # the default --max-model-len: max_position_embeddings capped here
GROUP_SIZE = 128  # llmc's default INT4 group size
QUANTS = ("none", "fp8", "int4", "int4-awq", "nvfp4")
KV_DTYPES = ("fp8",)
GiB = 1 << 30

# Model types whose MLP is one up projection and one down (no gate); every other MLP is gated (SwiGLU, GeGLU).
_UNGATED_MLP = ("phi", "gpt_neox", "starcoder2", "falcon", "gpt_bigcode", "gpt2", "opt", "bloom", "mpt", "nemotron",
                "apertus")
# Tensor classes, in the order tables show them.
CLASSES = ("attention", "mlp", "experts", "router", "embeddings", "lm_head", "other")


@dataclass(frozen=True)
class Tensor:
    """One weight of the model: ``e`` stacked matrices of ``n`` outputs x ``k`` inputs (a vector: n x 1).

    ``kind``: ``linear`` (quantized by the recipe), ``head`` (the LM head: quantized like a linear), ``experts``,
    ``router``, ``embedding``, ``vector`` (all kept in the engine dtype), ``float32`` (attention sinks).
    ``split``: how tensor parallelism shards it: ``n`` (column-parallel, outputs / N), ``k`` (row-parallel,
    inputs / N), ``kv`` (KV-head rows: split when kv_heads >= N, one head per rank when replicated), ``e``
    (experts' bytes / N: each expert's intermediate columns split, the same bytes as whole experts partitioned),
    ``vocab`` (rows / N; whole when the vocabulary does not divide into N, as the sharding pass leaves them), or
    ``None`` (replicated). ``copies``: identical layers holding one each."""

    cls: str
    name: str
    kind: str
    e: int
    n: int
    k: int
    split: str | None
    copies: int = 1
    heads: int = 0  # split "kv": the KV heads its rows hold (heads x head size)


@dataclass(frozen=True)
class KVLayer:
    """One layer's attention cache as llmc's KV pool stores it. ``owner``: the layer whose cache it reads (itself,
    or an earlier layer for a KV-shared layer, which stores nothing); ``num_kv_heads`` x ``head_size`` per K and
    per V; ``window``: sliding window in tokens (0: full attention). The pool keeps every token of every owning
    layer (one block table for all layers): a window bounds what a step reads, not what is stored."""

    owner: int
    num_kv_heads: int
    head_size: int
    window: int = 0


@dataclass(frozen=True)
class Model:
    """What the plan needs from a config (units: elements; ``kv_layers`` one entry per decoder layer)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int | None
    tensors: tuple[Tensor, ...]
    kv_layers: tuple[KVLayer, ...]
    num_experts: int = 0
    experts_per_token: int = 0
    notes: tuple[str, ...] = ()

    @property
    def parameters(self) -> int:
        """Parameters as llmc stores them (elements; a tied embedding once)."""
        return sum(t.e * t.n * t.k * t.copies for t in self.tensors if t.kind != "tied_head")


@dataclass
class Plan:
    """One (target, tp) row. Bytes per GPU; times in seconds; ``ok`` False with ``reason`` for a refused row."""

    gpu: str
    tp: int
    ok: bool = True
    reason: str | None = None
    memory_bytes: int = 0
    usable_bytes: int = 0
    weights_bytes: int = 0
    weights_by_class: dict[str, int] = field(default_factory=dict)
    reserve_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_blocks: int = 0
    kv_tokens: int = 0
    max_batch: int = 0
    decode_b1_context: int = 0
    decode_b1_bytes: int = 0
    decode_b1_s: float = 0.0
    decode_bmax_bytes: int = 0
    decode_bmax_s: float = 0.0
    allreduce_bytes_per_token: int = 0
    allreduce_ring_bytes_per_gpu: int = 0
    allreduce_s_per_token: float | None = None
    allgather_bytes_per_token: int = 0  # the vocab-parallel LM head's logits of a sampled token
    weights_bytes_if_experts_quantized: int | None = None


# -- reading the config -----------------------------------------------------------------------------------------

def read_config(path: str | Path) -> tuple[Path, dict]:
    """``(config.json path, its text config)`` from a checkpoint directory or a config.json path. A multimodal
    config's ``text_config`` is the model planned. Raises :class:`LlmcError` (exit 2) naming the path."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        what = "holds no config.json" if p.is_dir() else "no such file"
        raise LlmcError(f"{p}: {what}; give a checkpoint directory holding config.json, or a config.json path")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LlmcError(f"{cfg_path}: not valid JSON ({exc}); give the config.json the model came with") from None
    if not isinstance(cfg, dict):
        raise LlmcError(f"{cfg_path}: the top level is {type(cfg).__name__}, not an object")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
    return cfg_path, cfg


def _int(cfg: dict, name: str, where: Path, default: int | None = None, minimum: int = 1) -> int:
    value = cfg.get(name)
    if value is None:  # absent, or null as transformers writes an unset field (Mixtral's head_dim)
        value = default
    if value is None:
        raise LlmcError(f"{where}: field {name!r} is missing; llmc plan needs it (a config.json as transformers "
                        "writes it)")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LlmcError(f"{where}: field {name!r} is {value!r}; must be an integer >= {minimum}")
    return value


def _first(cfg: dict, *names: str) -> int | None:
    for n in names:
        if isinstance(cfg.get(n), int) and not isinstance(cfg.get(n), bool):
            return cfg[n]
    return None


@dataclass(frozen=True)
class _Geometry:
    """The config facts every layer's tensors are drawn from (see :func:`model_from_config`)."""

    mt: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_pos: int | None
    mla: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    wide_qk_norm: bool
    n_exp: int  # routed experts per MoE layer (0: dense)
    top_k: int
    exp_inter: int
    shared_inter: int


def model_from_config(cfg: dict, where: Path) -> Model:
    """The weight tensors and KV layers of a decoder-only config (llama-like, Qwen3 / Mixtral / gpt-oss MoE,
    DeepSeek MLA + MoE, Gemma 3/4 per-layer geometry). Raises :class:`LlmcError` naming a missing or bad field."""
    g = _geometry(cfg, where)
    kv = kv_layers(cfg, where, g.layers, g.heads, g.kv_heads, g.head_dim)
    gemma4_shared = {i for i, e in enumerate(kv) if e.owner != i}
    tensors: list[Tensor] = []
    for i in range(g.layers):
        tensors += _layer_tensors(cfg, where, g, i, kv, gemma4_shared)
    tensors += _model_tensors(cfg, g)
    return Model(g.mt, g.layers, g.hidden, g.heads, g.kv_heads, g.vocab, g.max_pos, tuple(tensors), tuple(kv),
                 g.n_exp, g.top_k, tuple(_notes(cfg, g)))


def _geometry(cfg: dict, where: Path) -> _Geometry:
    """Widths, heads, biases and norms, and the MoE counts (experts, experts per token, intermediate sizes)."""
    mt = str(cfg.get("model_type") or "unknown")
    layers = _int(cfg, "num_hidden_layers", where)
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    vocab = _int(cfg, "vocab_size", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, default=heads)
    if cfg.get("head_dim") is None and hidden % heads:
        raise LlmcError(f"{where}: field 'head_dim' is missing and hidden_size {hidden} is not a multiple of "
                        f"num_attention_heads {heads}; give head_dim")
    head_dim = _int(cfg, "head_dim", where, default=hidden // heads)
    max_pos = cfg.get("max_position_embeddings")
    max_pos = max_pos if isinstance(max_pos, int) and not isinstance(max_pos, bool) and max_pos > 0 else None

    # MoE: experts per layer, their intermediate size, experts per token, shared experts.
    n_exp = _first(cfg, "n_routed_experts", "num_local_experts", "num_experts") or 0
    if mt.startswith("gemma4") and not cfg.get("enable_moe_block"):
        n_exp = 0
    top_k = _first(cfg, "num_experts_per_tok", "experts_per_token", "top_k_experts", "moe_topk") or 0
    if n_exp and not top_k:
        raise LlmcError(f"{where}: field 'num_experts_per_tok' is missing; a mixture-of-experts config needs the "
                        "number of experts each token uses")
    exp_inter = (_int(cfg, "moe_intermediate_size", where) if "moe_intermediate_size" in cfg
                 else _int(cfg, "intermediate_size", where)) if n_exp else 0
    shared_inter = 0
    if n_exp and cfg.get("n_shared_experts"):
        shared_inter = int(cfg["n_shared_experts"]) * exp_inter
    elif n_exp and cfg.get("shared_expert_intermediate_size"):
        shared_inter = int(cfg["shared_expert_intermediate_size"])
    elif n_exp and cfg.get("num_shared_expert"):  # Hunyuan MoE
        shared_inter = int(cfg["num_shared_expert"]) * exp_inter
    return _Geometry(
        mt, layers, hidden, heads, kv_heads, head_dim, vocab, max_pos,
        mla=cfg.get("kv_lora_rank") is not None,
        # biases: Qwen2's on q/k/v only; attention_bias elsewhere (Llama, gpt-oss) on o_proj too
        qkv_bias=bool(cfg.get("attention_bias")) or mt in ("qwen2", "qwen2_moe"),
        o_bias=bool(cfg.get("attention_bias")) and mt not in ("qwen2", "qwen2_moe"),
        qk_norm=mt.startswith(("qwen3", "gemma3", "gemma4", "olmo2", "olmo3", "apertus")),
        wide_qk_norm=mt.startswith(("olmo2", "olmo3")),  # a norm over all heads' width, not one head's
        n_exp=n_exp, top_k=top_k, exp_inter=exp_inter, shared_inter=shared_inter)


def _is_moe(cfg: dict, n_exp: int, i: int) -> bool:
    """Whether decoder layer ``i`` is a mixture-of-experts layer."""
    if not n_exp:
        return False
    if "first_k_dense_replace" in cfg:  # DeepSeek
        return i >= int(cfg["first_k_dense_replace"]) and i % int(cfg.get("moe_layer_freq") or 1) == 0
    if i in (cfg.get("mlp_only_layers") or []):  # Qwen MoE
        return False
    return (i + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0


def _layer_tensors(cfg: dict, where: Path, g: _Geometry, i: int, kv: list[KVLayer],
                   gemma4_shared: set[int]) -> list[Tensor]:
    """Decoder layer ``i``'s weights: attention, sinks, norms, then its experts or its MLP (or both: Gemma 4)."""
    mt, hidden, n_exp, a = g.mt, g.hidden, g.n_exp, "attention"
    tensors = _attention_tensors(cfg, g, i, kv, gemma4_shared)
    if mt == "gpt_oss":
        tensors.append(Tensor(a, "sinks", "float32", 1, g.heads, 1, "n"))
    norms = 4 if mt.startswith(("gemma2", "gemma3", "gemma4")) else 2  # gemma: pre- and post- norms
    if mt in ("cohere", "cohere2", "cohere2_moe"):
        norms = 1  # attention and MLP in parallel off one norm
    tensors.append(Tensor("other", "layer_norms", "vector", norms, hidden, 1, None))
    if _is_moe(cfg, n_exp, i):
        exp_inter, shared_inter = g.exp_inter, g.shared_inter
        tensors.append(Tensor("router", "router", "router", 1, n_exp, hidden, None))
        if mt == "gpt_oss":
            tensors.append(Tensor("router", "router_bias", "vector", 1, n_exp, 1, None))
        if "first_k_dense_replace" in cfg or cfg.get("topk_method") == "noaux_tc":
            tensors.append(Tensor("router", "e_score_correction_bias", "vector", 1, n_exp, 1, None))
        tensors += [Tensor("experts", "experts.gate_up_proj", "experts", n_exp, 2 * exp_inter, hidden, "e"),
                    Tensor("experts", "experts.down_proj", "experts", n_exp, hidden, exp_inter, "e")]
        if mt == "gpt_oss":
            tensors += [Tensor("experts", "experts.gate_up_bias", "vector", n_exp, 2 * exp_inter, 1, "e"),
                        Tensor("experts", "experts.down_bias", "vector", n_exp, hidden, 1, "e")]
        if shared_inter:
            tensors += [Tensor("mlp", "shared_experts.gate_up_proj", "linear", 1, 2 * shared_inter, hidden, "n"),
                        Tensor("mlp", "shared_experts.down_proj", "linear", 1, hidden, shared_inter, "k")]
            if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE's sigmoid gate on the shared expert
                tensors.append(Tensor("router", "shared_expert_gate", "router", 1, 1, hidden, None))
        if not (mt.startswith("gemma4") and cfg.get("enable_moe_block")):
            return tensors
    inter = _int(cfg, "intermediate_size", where,
                 default=(cfg.get("ffn_hidden_size") or 4 * hidden) if mt in _UNGATED_MLP else None)
    if mt.startswith("gemma4") and cfg.get("use_double_wide_mlp") and i in gemma4_shared:
        inter *= 2  # Gemma 4: KV-shared layers' MLPs are twice as wide
    opens = 1 if mt in _UNGATED_MLP else 2  # gate and up, or one up projection
    tensors += [Tensor("mlp", "gate_up_proj" if opens == 2 else "up_proj", "linear", 1, opens * inter, hidden,
                       "n"),
                Tensor("mlp", "down_proj", "linear", 1, hidden, inter, "k")]
    if cfg.get("mlp_bias"):
        tensors += [Tensor("mlp", "gate_up_bias", "vector", 1, 2 * inter, 1, "n"),
                    Tensor("mlp", "down_bias", "vector", 1, hidden, 1, None)]
    return tensors


def _attention_tensors(cfg: dict, g: _Geometry, i: int, kv: list[KVLayer], gemma4_shared: set[int]) -> list[Tensor]:
    """Layer ``i``'s attention weights: MLA's low-rank projections, or q/k/v/o with their biases and Q/K norms."""
    mt, hidden, heads, a = g.mt, g.hidden, g.heads, "attention"
    geo = kv[i] if kv[i].owner == i else kv[kv[i].owner]
    lh = _layer_override(cfg, i, "head_dim", g.head_dim)
    lkv = geo.num_kv_heads
    tensors: list[Tensor] = []
    if g.mla:
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        v_dim, lora, rope = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        if cfg.get("q_lora_rank"):
            q_lora = int(cfg["q_lora_rank"])
            tensors += [Tensor(a, "q_a_proj", "linear", 1, q_lora, hidden, None),
                        Tensor(a, "q_a_layernorm", "vector", 1, q_lora, 1, None),
                        Tensor(a, "q_b_proj", "linear", 1, heads * qk, q_lora, "n")]
        else:
            tensors.append(Tensor(a, "q_proj", "linear", 1, heads * qk, hidden, "n"))
        return tensors + [Tensor(a, "kv_a_proj_with_mqa", "linear", 1, lora + rope, hidden, None),
                          Tensor(a, "kv_a_layernorm", "vector", 1, lora, 1, None),
                          Tensor(a, "kv_b_proj", "linear", 1, heads * (qk - rope + v_dim), lora, "n"),
                          Tensor(a, "o_proj", "linear", 1, hidden, heads * v_dim, "k")]
    tensors.append(Tensor(a, "q_proj", "linear", 1, heads * lh, hidden, "n"))
    if i not in gemma4_shared or not mt.startswith("gemma4"):
        # KV-shared layers (Gemma 4) compute no keys or values: transformers builds no k/v projections
        tensors.append(Tensor(a, "k_proj", "linear", 1, lkv * lh, hidden, "kv", heads=lkv))
        types = cfg.get("layer_types") or []
        # Gemma 4's full-attention layers with attention_k_eq_v: values are the keys, no v_proj
        k_eq_v = bool(cfg.get("attention_k_eq_v")) and i < len(types) and types[i] == "full_attention"
        if not k_eq_v:
            tensors.append(Tensor(a, "v_proj", "linear", 1, lkv * lh, hidden, "kv", heads=lkv))
    tensors.append(Tensor(a, "o_proj", "linear", 1, hidden, heads * lh, "k"))
    if g.qkv_bias:
        tensors += [Tensor(a, "q_bias", "vector", 1, heads * lh, 1, "n"),
                    Tensor(a, "k_bias", "vector", 1, lkv * lh, 1, "kv", heads=lkv),
                    Tensor(a, "v_bias", "vector", 1, lkv * lh, 1, "kv", heads=lkv)]
    if g.o_bias:
        tensors.append(Tensor(a, "o_bias", "vector", 1, hidden, 1, None))
    if g.wide_qk_norm:
        tensors += [Tensor("other", "q_norm", "vector", 1, heads * lh, 1, "n"),
                    Tensor("other", "k_norm", "vector", 1, lkv * lh, 1, "kv", heads=lkv)]
    elif g.qk_norm:
        tensors += [Tensor("other", "q_norm", "vector", 1, lh, 1, None),
                    Tensor("other", "k_norm", "vector", 1, lh, 1, None)]
    return tensors


def _tied(cfg: dict, mt: str) -> bool:
    return cfg.get("tie_word_embeddings", mt.startswith("gemma"))


def _model_tensors(cfg: dict, g: _Geometry) -> list[Tensor]:
    """The weights outside the decoder layers: final norm, embeddings (Gemma 4's per-layer inputs too), LM head."""
    mt, layers, hidden, vocab = g.mt, g.layers, g.hidden, g.vocab
    tensors = [Tensor("other", "final_norm", "vector", 1, hidden, 1, None),
               Tensor("embeddings", "embed_tokens", "embedding", 1, vocab, hidden, "vocab")]
    if mt.startswith("gemma4") and cfg.get("hidden_size_per_layer_input"):
        # Gemma 4's per-layer inputs: one packed table, its projection from the residual, per-layer gates
        ple, ple_vocab = int(cfg["hidden_size_per_layer_input"]), int(cfg.get("vocab_size_per_layer_input", vocab))
        tensors += [Tensor("embeddings", "embed_tokens_per_layer", "embedding", 1, ple_vocab, layers * ple, None),
                    Tensor("other", "per_layer_model_projection", "linear", 1, layers * ple, hidden, None),
                    Tensor("other", "per_layer_input_gate", "linear", layers, ple, hidden, None),
                    Tensor("other", "per_layer_projection", "linear", layers, hidden, ple, None),
                    Tensor("other", "per_layer_norms", "vector", layers, hidden, 1, None),
                    Tensor("other", "per_layer_projection_norm", "vector", 1, ple, 1, None)]
    if not _tied(cfg, mt):
        tensors.append(Tensor("lm_head", "lm_head", "head", 1, vocab, hidden, "vocab"))
    else:
        tensors.append(Tensor("lm_head", "lm_head (tied, quantized copy)", "tied_head", 1, vocab, hidden, "vocab"))
    return tensors


def _notes(cfg: dict, g: _Geometry) -> list[str]:
    """What the figures leave out or count differently, in the order the report lists them."""
    notes: list[str] = []
    if g.mt.startswith("gemma4") and cfg.get("hidden_size_per_layer_input"):
        notes.append("Gemma 4: per-layer-input table, projection and gates counted; vision/audio towers not")
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"{cfg['num_nextn_predict_layers']} multi-token-prediction layer(s) in the checkpoint are not "
                     "counted: transformers' model (which llmc traces) does not use them")
    qm = (cfg.get("quantization_config") or {}).get("quant_method") if isinstance(
        cfg.get("quantization_config"), dict) else None
    if qm == "mxfp4":
        notes.append("the checkpoint ships MXFP4 experts: llmc's engines keep them as codes, 4.25 bits per weight "
                     "(compiler/prequantized_mxfp4.py; the CUDA engine decodes routed rows in torch, no Triton kernel "
                     "yet); planned here: the weights as the --quant recipe stores them, from the original")
    elif qm == "fp8":
        notes.append("the checkpoint's FP8 weights are dequantized on read; planned: as the --quant recipe stores "
                     "them")
    if g.mla:
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        latent = (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * g.layers * ENGINE_DTYPE_BYTES
        notes.append(f"MLA: llmc's KV pool stores the decompressed per-head K and V ({g.heads} heads x {qk}, V "
                     f"padded from {cfg['v_head_dim']} to {qk}), not the compressed latent "
                     f"({cfg['kv_lora_rank']} + {cfg['qk_rope_head_dim']} per layer, {latent} B/token in bf16)")
    if _tied(cfg, g.mt):
        notes.append("tied embeddings: one table unquantized; a quantized recipe adds a quantized LM head copy")
    return notes


def _layer_override(cfg: dict, i: int, name: str, default: int) -> int:
    per = cfg.get("per_layer_config")
    if isinstance(per, dict):
        over = per.get(str(i), per.get(i))
        if isinstance(over, dict) and isinstance(over.get(name), int):
            return over[name]
    elif str(cfg.get("model_type", "")).startswith("gemma4") and name in ("head_dim", "num_key_value_heads"):
        types = cfg.get("layer_types") or []
        if i < len(types) and types[i] == "full_attention":
            if name == "head_dim":
                return int(cfg.get("global_head_dim") or 512)
            g = cfg.get("num_global_key_value_heads")
            if g is not None and cfg.get("attention_k_eq_v", True):
                return int(g)
    return default


def kv_layers(cfg: dict, where: Path, layers: int, heads: int, kv_heads: int, head_dim: int) -> list[KVLayer]:
    """Per decoder layer, the cache llmc's pool stores (see :class:`KVLayer`): GQA's KV heads; MLA as
    transformers computes it (every head's decompressed K and V, V zero-padded to the K head size:
    ``compiler/frontend.py``); per-layer head sizes and KV heads (``per_layer_config``, Gemma 4's
    ``global_head_dim``); KV-shared layers (``num_kv_shared_layers``) reading the last earlier layer of their
    type; sliding windows from ``layer_types`` (or ``sliding_window`` on every layer)."""
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers):
        raise LlmcError(f"{where}: field 'layer_types' must list one type per layer ({layers})")
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else 0
    if cfg.get("use_sliding_window") is False:
        window = 0
    if cfg.get("kv_lora_rank") is not None:
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        if int(cfg["v_head_dim"]) > qk:
            raise UnsupportedError(f"{where}: v_head_dim {cfg['v_head_dim']} wider than the query/key heads ({qk}): "
                                   "llmc does not lower value heads wider than query/key heads")
        return [KVLayer(i, heads, qk, 0) for i in range(layers)]
    out: list[KVLayer] = []
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared if shared else layers
    for i in range(layers):
        t = types[i] if types else None
        w = window if (t is None or t == "sliding_attention") and window else 0
        if t is not None and t != "sliding_attention":
            w = 0
        if i >= first_shared:
            same = [j for j in range(first_shared) if (types[j] if types else None) == t]
            if not same:
                raise LlmcError(f"{where}: layer {i} shares the KV cache of an earlier {t} layer "
                                "(num_kv_shared_layers), but there is none")
            out.append(KVLayer(same[-1], out[same[-1]].num_kv_heads, out[same[-1]].head_size, w))
            continue
        d = _layer_override(cfg, i, "head_dim", head_dim)
        h = _layer_override(cfg, i, "num_key_value_heads", kv_heads)
        out.append(KVLayer(i, h, d, w))
    return out


# -- sharding and bytes -----------------------------------------------------------------------------------------

def check_tp(model: Model, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``model`` (None when it can): heads, every layer's KV heads, intermediate sizes
    and experts must divide evenly (KV heads may instead be replicated when tp is a multiple of them)."""
    if tp < 1:
        return f"--tp {tp}: must be at least 1"
    if model.num_heads % tp:
        return f"--tp {tp}: num_attention_heads {model.num_heads} is not a multiple of {tp}"
    for h in sorted({e.num_kv_heads for e in model.kv_layers}):
        if h % tp and tp % h:
            return (f"--tp {tp}: num_key_value_heads {h} is neither a multiple of {tp} (split the KV heads) nor a "
                    f"divisor of it (replicate them: {tp} must be a multiple of {h})")
    if model.num_experts and model.num_experts % tp:
        return f"--tp {tp}: the {model.num_experts} experts per layer do not partition evenly over {tp} GPUs"
    for t in model.tensors:
        dim = t.n if t.split == "n" else t.k if t.split == "k" else None
        if dim is not None and dim % tp:
            return f"--tp {tp}: {t.name} has {dim} {'outputs' if t.split == 'n' else 'inputs'}, not a multiple of {tp}"
    return None


def shard(t: Tensor, tp: int) -> tuple[int, int, int]:
    """``(e, n, k)`` of one rank's slice of ``t`` (see :class:`Tensor` ``split``)."""
    if t.split == "n":
        return t.e, t.n // tp, t.k
    if t.split == "k":
        return t.e, t.n, t.k // tp
    if t.split == "e":
        return t.e // tp, t.n, t.k
    if t.split == "vocab":
        return (t.e, t.n // tp, t.k) if t.n % tp == 0 else (t.e, t.n, t.k)
    if t.split == "kv":
        return t.e, (t.n // tp if t.heads >= tp else t.n // t.heads), t.k
    return t.e, t.n, t.k


def tensor_bytes(kind: str, e: int, n: int, k: int, quant: str) -> int:
    """Bytes llmc's CUDA engine stores for ``e`` matrices of ``n`` x ``k`` of ``kind`` under ``quant`` (see the
    module docstring). A ``tied_head`` is nothing unquantized (the embedding table serves) and a quantized head
    otherwise."""
    quantized = kind in ("linear", "head", "tied_head") and quant != "none"
    if kind == "tied_head" and not quantized:
        return 0
    if kind == "float32":
        return e * n * k * 4
    if not quantized:
        return e * n * k * ENGINE_DTYPE_BYTES
    if quant == "fp8":
        return e * (n * k + 4 * n + 4)
    if quant in ("int4", "int4-awq"):
        return e * (n * -(-k // 2) + n * -(-k // GROUP_SIZE) * (ENGINE_DTYPE_BYTES + 1))
    if quant == "nvfp4":
        return e * (n * k // 2 + n * -(-k // 16) + 8)
    raise ValueError(quant)


def kv_bytes_per_token(model: Model, tp: int, kv_dtype_bytes: int) -> int:
    """KV bytes one token takes on one GPU: sum over layers with their own cache of 2 (K and V) x KV heads on this
    rank x head size x bytes per element. KV heads per rank: h / tp, or 1 when tp > h (replicated)."""
    return sum(2 * max(1, e.num_kv_heads // tp) * e.head_size * kv_dtype_bytes
               for i, e in enumerate(model.kv_layers) if e.owner == i)


def kv_read_bytes(model: Model, tp: int, kv_dtype_bytes: int, context: int) -> int:
    """KV bytes one sequence's decode step reads on one GPU at ``context`` tokens: every layer (a KV-shared layer
    reads its owner's cache) reads min(context, window) tokens of K and V."""
    return sum(2 * max(1, e.num_kv_heads // tp) * e.head_size * kv_dtype_bytes
               * (min(context, e.window) if e.window else context) for e in model.kv_layers)


def expert_fraction(model: Model, batch: int) -> float:
    """Expected fraction of a rank's experts one decode step reads at ``batch`` tokens, each choosing
    ``experts_per_token`` of ``num_experts`` uniformly: 1 - (1 - k/E)^batch (an expectation, not the worst
    rank)."""
    if not model.num_experts:
        return 1.0
    return 1.0 - (1.0 - model.experts_per_token / model.num_experts) ** batch


def weight_bytes(model: Model, tp: int, quant: str, experts_quantized: bool = False) -> dict[str, int]:
    """Bytes of one GPU's weights by tensor class (:data:`CLASSES`). ``experts_quantized``: as if the recipe
    stored the experts' matrices as it stores linears (the CPU engine's INT4 form does; GPU builds do not yet)."""
    out = dict.fromkeys(CLASSES, 0)
    for t in model.tensors:
        e, n, k = shard(t, tp)
        kind = "linear" if experts_quantized and t.kind == "experts" else t.kind
        out[t.cls] += t.copies * tensor_bytes(kind, e, n, k, quant)
    return out


def step_weight_read(model: Model, tp: int, quant: str, batch: int) -> int:
    """Weight bytes one GPU reads in a decode step of ``batch`` tokens: every weight once, except embedding tables
    (``batch`` rows) and experts (:func:`expert_fraction` of them)."""
    total = 0.0
    for t in model.tensors:
        e, n, k = shard(t, tp)
        b = t.copies * tensor_bytes(t.kind, e, n, k, quant)
        if t.kind == "embedding":
            b = t.copies * min(batch, n) * k * ENGINE_DTYPE_BYTES
        elif t.cls == "experts":
            b *= expert_fraction(model, batch)
        total += b
    return int(total)


def activation_reserve(vocab_size: int, max_num_tokens: int = MAX_NUM_TOKENS) -> int:
    """The runtime's reserve for a step's activations and float32 logits (``Engine._load_cuda``):
    1 GiB + max_num_tokens x vocab_size x 8 B."""
    return GiB + max_num_tokens * vocab_size * 8


def plan(model: Model, target, tp: int, quant: str = "none", kv_cache_dtype: str | None = None,
         max_model_len: int = 4096, gpu_memory_utilization: float = DEFAULT_UTILIZATION) -> Plan:
    """One GPU's figures for ``model`` on ``target`` (a :class:`llmc.compiler.targets.Target`) at ``tp``.

    KV room: gpu_memory_utilization x memory - weights - :func:`activation_reserve`, in whole blocks of
    :data:`BLOCK_SIZE` tokens; largest batch: blocks // ceil(max_model_len / BLOCK_SIZE). Decode roofline:
    (weights read + KV read at max_model_len context, at batch 1 the KV tokens that fit when fewer) / HBM
    bandwidth. All-reduce: 2 per layer of hidden_size
    bf16 activations per token; a ring all-reduce sends 2 (tp - 1) / tp of that per GPU, timed at the
    interconnect's per-direction bandwidth (latency not counted)."""
    p = Plan(gpu=target.name, tp=tp)
    reason = check_tp(model, tp)
    if reason:
        p.ok, p.reason = False, reason
        return p
    p.memory_bytes = int(target.memory_gib * GiB)
    p.usable_bytes = int(gpu_memory_utilization * p.memory_bytes)
    p.weights_by_class = weight_bytes(model, tp, quant)
    p.weights_bytes = sum(p.weights_by_class.values())
    if model.num_experts and quant != "none":
        p.weights_bytes_if_experts_quantized = sum(weight_bytes(model, tp, quant, experts_quantized=True).values())
    p.reserve_bytes = activation_reserve(model.vocab_size)
    p.kv_budget_bytes = p.usable_bytes - p.weights_bytes - p.reserve_bytes
    kv_b = 1 if kv_cache_dtype == "fp8" else ENGINE_DTYPE_BYTES
    p.kv_bytes_per_token = kv_bytes_per_token(model, tp, kv_b)
    p.kv_blocks = max(0, p.kv_budget_bytes // (p.kv_bytes_per_token * BLOCK_SIZE))
    p.kv_tokens = p.kv_blocks * BLOCK_SIZE
    p.max_batch = p.kv_blocks // -(-max_model_len // BLOCK_SIZE)
    bw = target.memory_bandwidth_gbps * 1e9
    if p.kv_tokens:  # batch 1 at max_model_len, or at what fits when less does
        p.decode_b1_context = min(max_model_len, p.kv_tokens)
        p.decode_b1_bytes = step_weight_read(model, tp, quant, 1) + kv_read_bytes(model, tp, kv_b, p.decode_b1_context)
        p.decode_b1_s = p.decode_b1_bytes / bw
    if p.max_batch:
        b = p.max_batch
        p.decode_bmax_bytes = step_weight_read(model, tp, quant, b) + b * kv_read_bytes(model, tp, kv_b, max_model_len)
        p.decode_bmax_s = p.decode_bmax_bytes / bw
    if tp > 1:
        vocab_split = model.vocab_size % tp == 0  # the embedding lookup's all-reduce, the logits' all-gather
        p.allreduce_bytes_per_token = (2 * model.num_layers + vocab_split) * model.hidden_size * ENGINE_DTYPE_BYTES
        p.allgather_bytes_per_token = model.vocab_size * ENGINE_DTYPE_BYTES if vocab_split else 0
        p.allreduce_ring_bytes_per_gpu = 2 * (tp - 1) * p.allreduce_bytes_per_token // tp
        if target.interconnect_gbps:
            p.allreduce_s_per_token = p.allreduce_ring_bytes_per_gpu / (target.interconnect_gbps / 2 * 1e9)
    return p


def default_max_model_len(model: Model) -> tuple[int, str]:
    """``(length, why)``: max_position_embeddings capped at :data:`MAX_MODEL_LEN_CAP`."""
    if model.max_position_embeddings is None:
        return MAX_MODEL_LEN_CAP, f"config has no max_position_embeddings: {MAX_MODEL_LEN_CAP}"
    if model.max_position_embeddings > MAX_MODEL_LEN_CAP:
        return MAX_MODEL_LEN_CAP, (f"max_position_embeddings {model.max_position_embeddings} capped at "
                                   f"{MAX_MODEL_LEN_CAP}")
    return model.max_position_embeddings, "max_position_embeddings"


def to_json(p: Plan) -> dict:
    d = asdict(p)
    if not p.ok:
        return {k: d[k] for k in ("gpu", "tp", "ok", "reason")}
    return d


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant figures: 1.23 GiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def parse_tp(value: str) -> list[int]:
    """``--tp 1,2,4,8`` -> [1, 2, 4, 8]; raises :class:`LlmcError` naming ``--tp``."""
    try:
        tps = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise LlmcError(f"--tp {value!r}: give a positive integer or a comma-separated list (1,2,4,8)") from None
    if not tps or any(t < 1 for t in tps):
        raise LlmcError(f"--tp {value!r}: give a positive integer or a comma-separated list (1,2,4,8)")
    return tps


__all__ = ["Model", "Plan", "Tensor", "KVLayer", "model_from_config", "read_config", "plan", "parse_tp",
           "kv_bytes_per_token", "weight_bytes", "activation_reserve", "default_max_model_len"]


# -- the command's report ---------------------------------------------------------------------------------------

def report(path: str | Path, gpu: str, tp: str = "1", quant: str = "none", kv_cache_dtype: str | None = None,
           max_model_len: int | None = None, gpu_memory_utilization: float = DEFAULT_UTILIZATION) -> dict:
    """``llmc plan``'s JSON object: the model, the settings, one :class:`Plan` per (GPU, tp) and the notes.

    ``gpu``: a target name or ``all`` (every GPU row of ``llmc targets``); ``tp``: ``N`` or ``N,M,...``. Raises
    :class:`LlmcError` (exit 2) for a bad path, JSON, field or flag, :class:`UnsupportedError` (exit 3) when the
    one GPU named cannot run the recipe (with ``all``, such a target's rows say why instead)."""
    from llmc.compiler.targets import TARGETS
    from llmc.quant.recipe import QuantRecipe, check_target

    _check_flags(quant, kv_cache_dtype, max_model_len, gpu_memory_utilization)
    gpus = _gpus(gpu, TARGETS)
    tps = parse_tp(tp)
    cfg_path, cfg = read_config(path)
    model = model_from_config(cfg, cfg_path)
    for n in tps:
        reason = check_tp(model, n)
        if reason:
            raise LlmcError(reason)
    if max_model_len is None:
        max_model_len, why = default_max_model_len(model)
    else:
        why = "--max-model-len"
    recipe = QuantRecipe(quant=quant, kv_cache_dtype=kv_cache_dtype)
    rows = []
    for target in gpus:
        try:
            check_target(recipe, target.name, TARGETS)
        except UnsupportedError as exc:
            if len(gpus) == 1:
                raise
            rows += [Plan(gpu=target.name, tp=n, ok=False, reason=str(exc)) for n in tps]
            continue
        rows += [plan(model, target, n, quant, kv_cache_dtype, max_model_len, gpu_memory_utilization) for n in tps]
    return {
        "config": str(cfg_path),
        "model": {"model_type": model.model_type, "num_layers": model.num_layers, "hidden_size": model.hidden_size,
                  "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                  "vocab_size": model.vocab_size, "num_experts": model.num_experts,
                  "experts_per_token": model.experts_per_token, "parameters": model.parameters},
        "quant": quant, "kv_cache_dtype": kv_cache_dtype or "bfloat16",
        "max_model_len": max_model_len, "max_model_len_from": why,
        "gpu_memory_utilization": gpu_memory_utilization,
        "assumptions": _assumptions(),
        "plans": [to_json(p) for p in rows],
        "notes": _report_notes(model, tps, quant, rows, max_model_len),
    }


def _check_flags(quant: str, kv_cache_dtype: str | None, max_model_len: int | None,
                 gpu_memory_utilization: float) -> None:
    """Refuse a recipe or limit ``llmc plan`` does not take (exit 2), naming the flag."""
    if quant not in QUANTS:
        raise LlmcError(f"--quant {quant!r}: choose one of: {', '.join(QUANTS)}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_DTYPES:
        raise LlmcError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose fp8 (or leave it out for bfloat16)")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise LlmcError(f"--gpu-memory-utilization {gpu_memory_utilization}: must be in (0, 1]")
    if max_model_len is not None and max_model_len < 1:
        raise LlmcError(f"--max-model-len {max_model_len}: must be at least 1")


def _gpus(gpu: str, targets: dict) -> list:
    """The GPU targets ``--gpu`` names: one, or every GPU row of the target table for ``all``."""
    gpus = [t for t in targets.values() if t.sm is not None]
    if gpu != "all":
        target = targets.get(gpu)
        if target is None or target.sm is None:
            raise LlmcError(f"--gpu {gpu!r}: not a GPU in llmc's target table; choose one of: "
                            f"{', '.join(t.name for t in gpus)}, all (see `llmc targets`)")
        gpus = [target]
    return gpus


def _report_notes(model: Model, tps: list[int], quant: str, rows: list[Plan], max_model_len: int) -> list[str]:
    """The model's notes, then what the settings leave out: families --tp does not split yet, recipes the CUDA
    engine stores otherwise, a context beyond the model's positions, sliding windows."""
    notes = list(model.notes)
    from llmc.compiler.sharding import TP_FAMILIES

    if any(n > 1 for n in tps) and model.model_type not in TP_FAMILIES:
        notes.append(f"llmc build --tp does not split model_type {model.model_type!r} yet (it covers "
                     f"{', '.join(TP_FAMILIES)}); the tp > 1 rows are what it would store when it does")
    if quant == "nvfp4":
        notes.append("nvfp4: the CUDA engine has no NVFP4 kernels yet (llmc build refuses it; --engine tensorrt "
                     "exports it); the figures are what the recipe stores")
    if quant != "none" and model.num_experts:
        first = next((p for p in rows if p.ok), None)
        were = (f"; were they stored as {quant}, {first.gpu} tp {first.tp} would hold "
                f"{fmt_bytes(first.weights_bytes_if_experts_quantized)} per GPU, not "
                f"{fmt_bytes(first.weights_bytes)}" if first else "")
        notes.append(f"--quant {quant}: the experts' batched weights stay bfloat16 in GPU builds (the quantize pass "
                     f"rewrites them only for the CPU engine), as do the routers{were}")
    if model.max_position_embeddings and max_model_len > model.max_position_embeddings:
        notes.append(f"--max-model-len {max_model_len} is beyond max_position_embeddings "
                     f"{model.max_position_embeddings}")
    if any(e.window for e in model.kv_layers):
        notes.append("sliding-window layers store every token (one block table for all layers); their window "
                     "bounds only what a decode step reads")
    return notes


def _assumptions() -> dict:
    """What the figures assume (the report's ``assumptions``): engine dtype, block and group sizes, and how each
    figure is computed."""
    return {
        "engine_dtype": "bfloat16", "block_size": BLOCK_SIZE, "int4_group_size": GROUP_SIZE,
        "memory": "the target table's memory_gib x 2^30 (a real device reports a little less; the runtime also "
                  "loses its CUDA context, ~0.5 GiB, not counted)",
        "activation_reserve": f"1 GiB + max_num_tokens ({MAX_NUM_TOKENS}) x vocab_size x 8 B per GPU "
                              "(runtime/engine.py _load_cuda)",
        "kv_room": "gpu_memory_utilization x memory - weights - activation reserve, in whole blocks",
        "max_batch": f"KV blocks // ceil(max_model_len / {BLOCK_SIZE}) (the engine also caps running requests at "
                     f"max_num_seqs, {MAX_NUM_SEQS} by default)",
        "decode_roofline": "(weights read + KV read at max_model_len context per sequence; batch 1: the KV "
                           "tokens that fit, when fewer) / memory bandwidth; "
                           "MoE: a rank reads 1 - (1 - k/E)^batch of its experts (expected)",
        "allreduce": "2 all-reduces per layer of hidden_size bf16 activations per token, and one after the "
                     "vocab-parallel embedding lookup: (2 x layers + 1) x hidden x 2 B; a ring sends "
                     "2 (tp - 1) / tp of it per GPU, timed at half the interconnect's two-way bandwidth, latency "
                     "not counted; allgather_bytes_per_token: the vocab-parallel LM head's bf16 logits of a "
                     "sampled token (vocab x 2 B), not in the time",
    }


def render(rep: dict) -> str:
    """The report as a table, one row per (GPU, tp), then the notes."""
    m = rep["model"]
    moe = f", {m['num_experts']} experts (top {m['experts_per_token']})" if m["num_experts"] else ""
    lines = [f"{rep['config']}: {m['model_type']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} kv heads{moe}, "
             f"{m['parameters'] / 1e9:.3g}B parameters",
             f"quant {rep['quant']}, kv cache {rep['kv_cache_dtype']}, max-model-len {rep['max_model_len']} "
             f"({rep['max_model_len_from']}), gpu-memory-utilization {rep['gpu_memory_utilization']}",
             ""]
    head = (f"{'gpu':7} {'tp':>2}  {'weights/GPU':>11} {'attn':>9} {'mlp+exp':>9} {'embed':>9} {'lm_head':>9} "
            f"{'KV/token':>9} {'KV tokens':>10} {'batch':>6} {'decode b1':>10} {'decode bmax':>11} "
            f"{'allreduce/token':>18}")
    lines += [head, "-" * len(head)]
    for p in rep["plans"]:
        if not p["ok"]:
            lines.append(f"{p['gpu']:7} {p['tp']:>2}  refused: {p['reason']}")
            continue
        w = p["weights_by_class"]
        fits = p["kv_blocks"] > 0
        bmax = (f"{fmt_seconds(p['decode_bmax_s'])} @{p['max_batch']}" if p["max_batch"] else "-")
        ar = "-" if p["tp"] == 1 else fmt_bytes(p["allreduce_bytes_per_token"])
        if p["allreduce_s_per_token"]:
            ar += f" {fmt_seconds(p['allreduce_s_per_token'])}"
        lines.append(
            f"{p['gpu']:7} {p['tp']:>2}  {fmt_bytes(p['weights_bytes']):>11} {fmt_bytes(w['attention']):>9} "
            f"{fmt_bytes(w['mlp'] + w['experts'] + w['router']):>9} {fmt_bytes(w['embeddings']):>9} "
            f"{fmt_bytes(w['lm_head']):>9} {fmt_bytes(p['kv_bytes_per_token']):>9} "
            f"{(format(p['kv_tokens'], ',') if fits else 'no room'):>10} {p['max_batch']:>6} "
            f"{(fmt_seconds(p['decode_b1_s']) if fits else '-'):>10} {bmax:>11} {ar:>18}")
    lines.append("")
    lines.append("weights/GPU includes norms and other vectors; KV room = utilization x memory - weights - reserve "
                 "(1 GiB + 2048 x vocab x 8 B); decode = HBM roofline, bytes read per step / bandwidth; "
                 "allreduce = (2 x layers + 1) x hidden x 2 B per token, then its ring time at NVLink speed "
                 "(--json: every assumption and figure)")
    lines += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(lines)
