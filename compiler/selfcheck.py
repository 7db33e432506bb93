"""The architecture self-check: every build proves, on a shrunk random twin of its checkpoint, that llmc's
lowering of this exact configuration computes what transformers computes.

The twin keeps the checkpoint's model class and every semantic field of its config (layer types, sliding
windows, sinks, biases, norms, rope scaling, MoE routing, head sizes) and shrinks what is only size:
hidden width, heads (keeping the grouped-query ratio), intermediate widths, experts, layer count (keeping
every layer type that occurs). It gets random weights from a fixed seed, goes through the same frontend,
passes and backend as the real build (unquantized: quantization error is the accuracy report's business),
and is executed by the runtime (a CUDA engine on torch's CPU ops). Two prompts are generated greedily; at
every generated position the engine's log-probability of its own token must equal transformers' on the
same sequence (so the decode path is checked, and near-ties cannot make the check flaky), and one
prefill's logits must match. A mismatch stops the build (exit 3).

A passing result is cached by (model type, the twin's config, the lowering options, llmc version and
sources, toolchain) under the build cache root, so a family costs seconds once, not every build.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import llmc
from llmc import scratch
from llmc.compiler.twin_fault import TransformersFailed, blame, in_transformers
from llmc.errors import LlmcError, UnsupportedError, os_fault, os_fault_errno

LOGPROB_ATOL = 2e-3  # nats; float32 engines agree with transformers to ~1e-5
LOGIT_RTOL = 2e-3  # of the logits' largest magnitude
PROMPT_LENGTHS = (5, 37)  # the second crosses the twin's sliding windows (at most 24)
NEW_TOKENS = 8
_WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model")
# Per-layer lists whose values are kinds (attention / MLP types, rotary on or off): the twin keeps a layer of
# each kind, so up to the first layer of the last kind; a list of more distinct values (sizes) is cut only.
_FEW_KINDS = 4
_NOT_PER_LAYER = {"architectures", "bad_words_ids"}
# Lists of layer indices (not one entry per layer): the indices past the twin's last layer go.
_LAYER_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "attn_layer_indices", "full_attn_idxs")
# Index lists of the layers of one kind among others (Bamba's attention layers between Mamba2 layers): the twin keeps
# layers up to the first one listed, so that it has a layer of each kind.
_KIND_INDEX_LISTS = ("attn_layer_indices",)
_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)")
_SIZE_ONLY = {"torch_dtype", "dtype", "quantization_config", "_name_or_path", "architectures", "transformers_version",
              "use_cache", "auto_map"}


@dataclasses.dataclass
class SelfCheckResult:
    status: str  # "passed" | "cached"
    key: str
    seconds: float
    twin: dict
    max_logprob_error: float | None = None
    max_logit_rel_error: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _pick(c: dict, *names, default=None):
    for n in names:
        if c.get(n) is not None:
            return n, c[n]
    return None, default


def shrink_config(config: dict) -> dict:
    """A small config with the same semantics as ``config`` (a ``config.json`` dict). A vision-language wrapper's
    text model is shrunk as any text model, and its encoders to one layer each, their widths kept (the twin is built
    and checked on text: compiler/multimodal.py)."""
    from llmc.compiler import multimodal

    if not multimodal.is_wrapper(config):
        return _shrink_flat(config)
    text = _shrink_flat(config["text_config"])
    out = {**config, "text_config": text}
    for field in multimodal.encoders(config):
        out[field] = _one_layer_encoder(config[field], config["text_config"], text)
    return out


def _one_layer_encoder(enc: dict, text: dict, twin_text: dict) -> dict:
    """An encoder config cut to one layer; its output widths that meet the text model follow the twin's width."""
    c = dict(enc)
    for key in ("num_hidden_layers", "depth", "num_layers"):
        if isinstance(c.get(key), int) and c[key] > 1:
            c = cut_layers(c, key, 1)  # and its per-layer lists (an encoder's layer_types: LFM3-VL, Muse)
    for key in ("deepstack_visual_indexes",):
        if isinstance(c.get(key), list):
            c[key] = [i for i in c[key] if i < 1][:1]
    width, twin_width = text.get("hidden_size"), twin_text.get("hidden_size")
    for key in ("out_hidden_size", "projector_output_dim", "vision_output_dim", "text_hidden_size"):
        if c.get(key) == width and width is not None:
            c[key] = twin_width
    return c


def _shrink_flat(config: dict) -> dict:
    """:func:`shrink_config` of a config without a nested text model."""
    c = {k: v for k, v in config.items() if k not in _SIZE_ONLY}
    hkey, heads = _pick(c, "num_attention_heads", "n_head", "num_heads")
    wkey, width = _pick(c, *_WIDTH_FIELDS)
    if heads and width:
        kvkey, kv = _pick(c, "num_key_value_heads", "num_kv_heads", default=heads)
        kv = kv or heads
        group = max(1, heads // kv)
        new_kv = min(kv, 2)
        new_heads = new_kv * min(group, 4)
        head_dim = c.get("head_dim") or width // heads
        new_dim = min(head_dim, 32)
        c[hkey] = new_heads
        if kvkey:
            c[kvkey] = new_kv
        # Where heads x head_dim is the width (Helium's o_proj is hidden x hidden) the twin keeps it so; where the
        # config sets them apart (Gemma), the twin keeps them apart.
        tied = c.get("head_dim") is None or heads * c["head_dim"] == width
        c[wkey] = new_heads * new_dim if tied else max(32, new_heads * new_dim // 2)
        if c.get("head_dim") is not None:
            c["head_dim"] = new_dim
    for key in ("intermediate_size", "n_inner", "ffn_dim"):
        if isinstance(c.get(key), int):
            c[key] = 2 * c[wkey] if wkey else 64
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(c.get(key), int):
            c[key] = c[wkey] if wkey else 32
    # HunYuan calls it moe_topk; the twin needs as many experts as a token is routed to.
    top_k = next((c[k] for k in ("num_experts_per_tok", "moe_topk") if isinstance(c.get(k), int)), 1)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(c.get(key), int) and c[key] > 1:
            c[key] = max(top_k, min(c[key], 4))
    if isinstance(c.get("n_group"), int) and c["n_group"] > 1 and isinstance(c.get("n_routed_experts"), int):
        # Grouped routing: experts split evenly into groups, top-k drawn from the best topk_group groups.
        groups = min(c["n_group"], 2)
        chosen = min(c.get("topk_group") or 1, groups)
        per_group = max(2, -(-top_k // chosen))
        c["n_group"], c["topk_group"], c["n_routed_experts"] = groups, chosen, groups * per_group
    # Multi-head latent attention: low ranks and head parts are sizes; their existence is the semantics.
    rope_dim = c.get("qk_rope_head_dim")
    for key, cap in (("kv_lora_rank", 32), ("q_lora_rank", 48), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8),
                     ("v_head_dim", 16)):
        if isinstance(c.get(key), int) and c[key] > cap:
            c[key] = cap
    if isinstance(rope_dim, int) and config.get("head_dim") == rope_dim:
        c["head_dim"] = c["qk_rope_head_dim"]  # DeepSeek's head_dim is its rotary part
    lkey, layers = _pick(c, "num_hidden_layers", "n_layer", "num_layers")
    if isinstance(layers, int) and layers > 0:
        c = _keep_layers_of_each_kind(c, lkey, layers)
    _shrink_per_layer_config(c, config)
    _shrink_linear_attention(c)
    _shrink_mamba(c)
    if isinstance(c.get("hidden_size_per_layer_input"), int) and c["hidden_size_per_layer_input"] > 8:
        c["hidden_size_per_layer_input"] = 8  # Gemma 4's per-layer input embeddings: a width
    if isinstance(c.get("sliding_window"), int) and c["sliding_window"] > 24:
        c["sliding_window"] = 24
    return c


def cut_like_twin(config: dict) -> dict:
    """``config`` at its own sizes, cut to the layers its twin keeps (what transformers is tried on, on the meta
    device, when it cannot run the twin: compiler/twin_fault.py)."""
    c = {k: v for k, v in config.items() if k not in _SIZE_ONLY}
    lkey, layers = _pick(c, "num_hidden_layers", "n_layer", "num_layers")
    return _keep_layers_of_each_kind(c, lkey, layers) if isinstance(layers, int) and layers > 0 else c


def _keep_layers_of_each_kind(c: dict, lkey: str, layers: int) -> dict:
    """``c`` cut to its first few of ``layers`` decoder layers: at least two, and up to the first layer of every
    kind (dense and MoE, each layer type, KV-shared layers of each type)."""
    keep = 2
    for key in ("first_k_dense_replace", "decoder_sparse_step", "interleave_moe_layer_step"):
        if isinstance(c.get(key), int) and c[key] > 0:  # keep a layer of each kind: dense and MoE
            keep = max(keep, c[key] + 1)
    for key in _KIND_INDEX_LISTS:
        listed = [i for i in c.get(key) or () if isinstance(i, int) and 0 <= i < layers]
        if listed:
            keep = max(keep, min(listed) + 1)
    for key in _per_layer_lists(c, layers):
        values = c[key]
        if all(isinstance(v, (str, bool, int)) for v in values) and len(set(values)) <= _FEW_KINDS:
            seen: set = set()
            for i, v in enumerate(values):  # up to the first layer of the last kind to appear
                if v not in seen:
                    seen.add(v)
                    keep = max(keep, i + 1)
    shared = c.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < layers:
        # KV-shared layers (Gemma 4) read the cache of the last earlier layer of their type: the twin keeps
        # layers of each kind before the shared ones, then shared layers of each kind.
        first = layers - shared
        types = c.get("layer_types") if isinstance(c.get("layer_types"), list) else []
        tail = 1
        seen = set()
        for j, v in enumerate(types[first:]):
            if v not in seen:
                seen.add(v)
                tail = j + 1
        head = list(range(min(keep, first)))
        return cut_layers(c, lkey, len(head) + tail, picked=head + list(range(first, first + tail)))
    return cut_layers(c, lkey, min(layers, keep))


def _per_layer_lists(config: dict, layers: int) -> list[str]:
    """Fields holding one entry per decoder layer (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``,
    whatever a family names them): any list as long as the layer count, except token ids."""
    return [k for k, v in config.items() if isinstance(v, list) and len(v) == layers and k not in _NOT_PER_LAYER
            and not k.endswith(("_token_id", "_token_ids"))]


def cut_layers(config: dict, lkey: str, n: int, picked: list[int] | None = None) -> dict:
    """``config`` with its first ``n`` decoder layers only (or the ``n`` layers ``picked``, by their indices): the
    count and every per-layer list cut to match (config classes refuse a per-layer list whose length differs
    from the count), layer-index lists filtered, per-layer config entries renumbered, and KV-shared layers
    (``num_kv_shared_layers``, the last layers) counted among the layers kept."""
    layers = config[lkey]
    picked = list(range(n)) if picked is None else picked
    new_index = {old: new for new, old in enumerate(picked)}
    c = {**config, lkey: n}
    for key in _per_layer_lists(config, layers):
        c[key] = [config[key][i] for i in picked]
    for key in _LAYER_INDEX_LISTS:
        if isinstance(c.get(key), list) and key not in _per_layer_lists(config, layers):
            c[key] = [new_index.get(i, -1) if isinstance(i, int) else i for i in c[key]]
            c[key] = [i for i in c[key] if i != -1]
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, dict):  # transformers' heterogeneous configs: {layer index: overrides}
        c["per_layer_config"] = {str(new_index[int(k)]): v for k, v in per_layer.items()
                                 if str(k).isdigit() and int(k) in new_index}
    shared = config.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:
        c["num_kv_shared_layers"] = sum(1 for i in picked if i >= layers - shared)
    return c


def _shrink_linear_attention(c: dict) -> None:
    """Gated DeltaNet heads (Qwen3.5, Qwen3-Next): at most 2 key heads, value heads a multiple of them as in the
    config (each key head serves value_heads / key_heads value heads), head sizes at most 16."""
    kh, vh = c.get("linear_num_key_heads"), c.get("linear_num_value_heads")
    if isinstance(kh, int) and isinstance(vh, int) and kh > 0 and vh % kh == 0:
        c["linear_num_key_heads"] = min(kh, 2)
        c["linear_num_value_heads"] = c["linear_num_key_heads"] * min(vh // kh, 2)
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if isinstance(c.get(key), int) and c[key] > 16:
            c[key] = 16


def _shrink_mamba_heads(c: dict, heads_key: str, dim_key: str, groups_key: str, inner_key: str | None) -> None:
    """Mamba2 heads whose inner width is their own (Falcon-H1's mamba_d_ssm, Nemotron-H's heads x head_dim): at
    most 8 heads, a multiple of at most 2 groups, heads of at most 16 channels, inner = heads x head_dim."""
    heads, inner = c.get(heads_key), c.get(inner_key) if inner_key else None
    dim = c.get(dim_key)
    if not isinstance(heads, int) or heads <= 0:
        return
    if not isinstance(dim, int):  # Falcon-H1's "auto": inner / heads
        dim = inner // heads if isinstance(inner, int) else None
    if dim is None:
        return
    groups = max(1, min(int(c.get(groups_key) or 1), 2))
    new_heads = min(heads, 8)
    c.update({heads_key: new_heads if new_heads % groups == 0 else 8, groups_key: groups, dim_key: min(dim, 16)})
    if inner_key:
        c[inner_key] = c[heads_key] * c[dim_key]


def _shrink_mamba(c: dict) -> None:
    """Mamba2 widths the twin's smaller hidden size must still satisfy (Bamba, Granite-4 hybrid: mamba_n_heads *
    mamba_d_head = mamba_expand * hidden_size, heads a multiple of the groups), and a small SSM state."""
    hidden, expand = c.get("hidden_size"), c.get("mamba_expand")
    if all(isinstance(v, int) for v in (hidden, expand, c.get("mamba_n_heads"))) and c.get("mamba_d_ssm") is None:
        groups = max(1, min(int(c.get("mamba_n_groups") or 1), 2))
        inner = expand * hidden
        heads = next((h for h in (8, 4, 2, 1) if inner % h == 0 and h % groups == 0), None)
        if heads is not None:
            c.update(mamba_n_heads=heads, mamba_n_groups=groups)
            if isinstance(c.get("mamba_d_head"), int):
                c["mamba_d_head"] = inner // heads
    if isinstance(c.get("mamba_d_ssm"), int):
        _shrink_mamba_heads(c, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_ssm")
    if isinstance(c.get("mamba_num_heads"), int) and "n_groups" in c:
        _shrink_mamba_heads(c, "mamba_num_heads", "mamba_head_dim", "n_groups", None)
    for key in ("mamba_d_state", "ssm_state_size"):
        if isinstance(c.get(key), int) and c[key] > 16:
            c[key] = 16


def _shrink_per_layer_config(c: dict, config: dict) -> None:
    """Scale per-layer head sizes and KV heads (``per_layer_config``) as the twin's global ones were scaled, so
    layers of other geometries stay other (Gemma 4's full-attention layers: twice the sliding head size)."""
    per_layer = c.get("per_layer_config")
    if not isinstance(per_layer, dict):
        return
    old_dim, new_dim = config.get("head_dim"), c.get("head_dim")
    old_kv = config.get("num_key_value_heads")
    new_kv = c.get("num_key_value_heads")
    heads = c.get("num_attention_heads")
    out = {}
    for k, v in per_layer.items():
        v = dict(v) if isinstance(v, dict) else v
        if isinstance(v, dict):
            if isinstance(v.get("head_dim"), int) and isinstance(old_dim, int) and isinstance(new_dim, int):
                scaled = max(8, min(64, v["head_dim"] * new_dim // old_dim))
                v["head_dim"] = scaled + scaled % 2
            if isinstance(v.get("num_key_value_heads"), int) and isinstance(old_kv, int) and isinstance(new_kv, int):
                kv = max(1, min(new_kv, v["num_key_value_heads"]))
                while isinstance(heads, int) and heads % kv:
                    kv -= 1
                v["num_key_value_heads"] = kv
        out[k] = v
    c["per_layer_config"] = out


def check_key(model_type: str, twin: dict, lowering: dict, toolchain: dict, sources: str) -> str:
    blob = json.dumps({"model_type": model_type, "twin": twin, "lowering": lowering, "toolchain": toolchain,
                       "llmc": llmc.__version__, "sources": sources}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _auto(config: dict):
    """transformers' auto class of the twin: the wrapper's own for a vision-language config (as the build)."""
    from llmc.compiler.multimodal import auto_class

    return auto_class(config)


def write_twin(config: dict, out: Path, seed: int = 0) -> Path:
    """Write a random checkpoint of ``config`` to ``out`` (weights drawn so that logits are not flat)."""
    import torch
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    cfg = in_transformers("instantiate", AutoConfig.from_pretrained, out)
    torch.manual_seed(seed)
    model = in_transformers("instantiate", _auto(config).from_config, cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if ("embed" in name or "lm_head" in name or "wte" in name) else 0.15)
            else:  # norms around 1, biases around 0, neither exactly
                p.uniform_(0.8, 1.2) if "norm" in name or "ln" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def compare(engine_dir: Path, twin_dir: Path, cuda: bool, seed: int = 0) -> tuple[float, float, str | None]:
    """(max |logprob error| over generated tokens, max relative logit error of one prefill, failure or None)."""
    import numpy as np
    import torch

    from llmc.runtime import Engine, SamplingParams

    auto = _auto(json.loads((twin_dir / "config.json").read_text()))
    hf = in_transformers("forward", auto.from_pretrained, twin_dir, dtype=torch.float32).eval()
    engine = Engine.load(engine_dir, device="cpu" if cuda else None, kv_cache_tokens=512, verify=False)
    rng = np.random.default_rng(seed)
    vocab = min(engine.vocab_size, int(hf.config.get_text_config().vocab_size))
    worst_lp = 0.0
    for n in PROMPT_LENGTHS:
        prompt = rng.integers(1, vocab, n).tolist()
        out = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))[0]
        with torch.no_grad():
            ref = torch.log_softmax(in_transformers("forward", hf, torch.tensor([prompt + out.token_ids]))
                                    .logits[0].double(), -1)
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            want = float(ref[n - 1 + i, tok])
            err = abs(want - float(lp[tok]))
            worst_lp = max(worst_lp, err)
            if not err <= LOGPROB_ATOL:
                return worst_lp, float("nan"), (f"generated token {i} of a {n}-token prompt: log-probability "
                                                f"{float(lp[tok]):.5f} vs transformers {want:.5f}")
    ids = rng.integers(1, vocab, max(PROMPT_LENGTHS)).tolist()
    got = engine.score(ids)
    with torch.no_grad():
        want = in_transformers("forward", hf, torch.tensor([ids])).logits[0].numpy()
    rel = float(np.abs(got[:, :want.shape[1]] - want).max() / max(1e-6, float(np.abs(want).max())))
    if not rel <= LOGIT_RTOL:
        return worst_lp, rel, f"prefill logits differ from transformers' by {rel:.3g} of their range"
    return worst_lp, rel, None


def _layer_count_key(twin: dict) -> str | None:
    return _pick(twin, "num_hidden_layers", "n_layer", "num_layers")[0]


def diagnose(twin: dict, ckpt: Path, tmp: Path, build_twin, cuda: bool) -> tuple[str, int | None]:
    """Where a failing twin first differs: a clause for the error (``""`` when it cannot tell) and the first
    decoder layer whose output differs (None when the fault is not in one layer's traced graph).

    Only runs after a mismatch, on the tiny twin, so its extra builds cost seconds. In order:
    (1) the same build with every graph pass verified against the graph before it (compiler/verify.py)
    names the first pass that changes the numerics; (2) otherwise the graph as traced (every fusion, graph
    and backend, disabled) is checked: if it matches, the fault is in a fusion's lowering; (3) twins cut to
    the first k decoder layers, k = 1, 2, …, name the first layer whose output differs.
    """
    from llmc.errors import LlmcError
    from llmc.passes.registry import BACKEND_FUSIONS, BY_NAME

    log = logging.getLogger("llmc")
    try:
        build_twin(ckpt, tmp / "diag-verified", verify_passes=True)
    except LlmcError as exc:
        msg = str(exc)
        if "--verify-passes: pass " in msg:
            name = msg.split("--verify-passes: pass ", 1)[1].split(" ", 1)[0].strip("'")
            hint = f" (build with --disable-pass {name} to leave it out)" if name in BY_NAME else ""
            return f"; the graph first differs after pass {name!r}{hint}", None
        log.debug("self-check diagnosis: verified build failed: %s", msg)
        return "", None
    unfused = ("all-fusions", *BACKEND_FUSIONS)
    try:
        build_twin(ckpt, tmp / "diag-unfused", disabled_passes=unfused)
        if compare(tmp / "diag-unfused", ckpt, cuda)[2] is None:
            return "; the graph as traced matches, so a fusion's lowering is at fault (every pass verified exact)", None
        lkey = _layer_count_key(twin)
        layers = twin.get(lkey) if lkey else None
        for k in range(1, layers if isinstance(layers, int) else 1):
            cut = cut_layers(twin, lkey, k)
            cut_ckpt = write_twin(cut, tmp / f"diag-cut{k}")
            build_twin(cut_ckpt, tmp / f"diag-cut{k}-engine", disabled_passes=unfused)
            if compare(tmp / f"diag-cut{k}-engine", cut_ckpt, cuda)[2] is not None:
                kind = f" ({twin['layer_types'][k - 1]})" if isinstance(twin.get("layer_types"), list) else ""
                return f"; the traced graph already differs, first in decoder layer {k - 1}{kind}", k - 1
        last = layers - 1 if isinstance(layers, int) else None
        if last is None:  # no layer count this check can cut (mbart's decoder_layers): say what is known
            return "; the traced graph already differs (its layers could not be cut to find the first)", None
        return f"; the traced graph already differs, first in decoder layer {last} or after the last layer", last
    except (LlmcError, TransformersFailed) as exc:
        log.debug("self-check diagnosis stopped: %s", exc)
        return "", None


def layer_modules(twin_dir: Path, layer: int) -> tuple[str | None, list[str], list[str]]:
    """Decoder layer ``layer`` of the twin's transformers model: its class, its children's classes
    (``"self_attn: DiffLlamaAttention"``, ...) and the classes of every module deeper inside it (a mechanism can sit
    below the attention module: Zaya's ZayaCCAProjection), read from a model built on the meta device (no weights)."""
    import torch
    from transformers import AutoConfig

    try:
        with torch.device("meta"):
            auto = _auto(json.loads((twin_dir / "config.json").read_text()))
            model = auto.from_config(AutoConfig.from_pretrained(twin_dir))
    except Exception:  # noqa: BLE001 - naming is best effort; the check's verdict stands without it
        return None, [], []
    found = re.compile(rf"(?:^|\.)(?:layers|h|layer|blocks)\.{layer}$")
    for name, module in model.named_modules():
        if found.search(name):
            children = [f"{child}: {type(m).__name__}" for child, m in module.named_children()]
            below = [type(m).__name__ for child, m in module.named_modules() if child.count(".") >= 1]
            return type(module).__name__, children, below
    return None, [], []


def mismatch_cause(twin: dict, twin_dir: Path, layer: int | None) -> str | None:
    """"llmc does not lower X (seen in decoder layer N's Y)" for a twin whose traced graph first differs in decoder
    layer ``layer``, when the mechanism can be named (compiler/mechanisms.py, from the layer's module classes, then
    the config's fields); None otherwise."""
    from llmc.compiler.mechanisms import name_mechanism

    layer_class, children, below = (None, [], []) if layer is None else layer_modules(twin_dir, layer)
    classes = [c.split(": ", 1)[1] for c in children] + ([layer_class] if layer_class else []) + below
    mechanism = name_mechanism(twin, classes)
    if layer is None:
        return f"llmc does not lower {mechanism}" if mechanism else None
    if mechanism is None:
        inside = f" ({', '.join(children)})" if children else ""
        return f"llmc lowers decoder layer {layer}{inside} differently from transformers"
    owner = next((c for c in children if any(p in c.split(": ", 1)[1].lower() for p in ("attention", "attn"))),
                 None) if "attention" in mechanism else None
    seen = f"decoder layer {layer}'s {owner}" if owner else f"decoder layer {layer} ({layer_class})"
    return f"llmc does not lower {mechanism} (seen in {seen})"


def run(config: dict, model_type: str, build_twin, lowering: dict, toolchain: dict, sources: str,
        cache_root: Path | None, cuda: bool, cacheable: bool, say, lookup_only: bool = False
        ) -> SelfCheckResult | None:
    """Run (or find cached) the self-check. ``build_twin(twin_ckpt, out_dir)`` builds the twin's engine the way
    the real build will. Raises :class:`UnsupportedError` (exit 3) on a mismatch. ``lookup_only``: return the
    cached result or None, running nothing."""
    t0 = time.perf_counter()
    twin = shrink_config(config)
    key = check_key(model_type, twin, lowering, toolchain, sources)
    record = (cache_root / "selfcheck" / f"{key}.json") if cache_root is not None else None
    if cacheable and record is not None and record.is_file():
        return SelfCheckResult("cached", key, round(time.perf_counter() - t0, 3), twin)
    if lookup_only:
        return None
    say(f"      self-check: a {twin.get('num_hidden_layers', '?')}-layer random twin of this {model_type} config "
        "through the same pipeline, against transformers")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the twin's save/load bars are not the user's build progress
    try:
        return _run_twin(twin, model_type, key, record, build_twin, cuda, cacheable, t0)
    except TransformersFailed as failed:  # the user's config (exit 2) or llmc's shrinking of it (exit 70)
        raise blame(failed, config, cut_like_twin(config), twin, model_type) from None
    except Exception as exc:
        fault = _scratch_fault(exc)
        if fault is None:
            raise
        raise fault from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _scratch_fault(exc: Exception) -> LlmcError | None:
    """A full or read-only temporary directory (the twin's checkpoint and engine live there) as one line; None
    for anything else. safetensors, written in Rust, reports the OS error in its message only."""
    if not isinstance(exc, OSError):
        found = _OS_ERROR_IN_MESSAGE.search(str(exc))
        if found is None:
            return None
        code = int(found.group(1))
        exc = OSError(code, os.strerror(code))
    if os_fault_errno(exc) in (None, errno.ENOENT, errno.ENOTDIR):
        return None
    return os_fault(exc, tempfile.gettempdir(), "writing the self-check's random twin",
                    elsewhere="set TMPDIR to a writable directory with a few MiB free")


SCRATCH_PREFIX = "llmc-selfcheck-"
OWNER_FILE = scratch.OWNER_FILE


def mark_scratch(d: Path) -> None:
    """Name this process as the self-check scratch directory ``d``'s owner (llmc/scratch.py)."""
    scratch.mark(d, SCRATCH_PREFIX)


def _run_twin(twin: dict, model_type: str, key: str, record: Path | None, build_twin, cuda: bool, cacheable: bool,
              t0: float) -> SelfCheckResult:
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as tmp:
        mark_scratch(Path(tmp))
        ckpt = write_twin(twin, Path(tmp) / "twin")
        engine_dir = Path(tmp) / "engine"
        quiet = logging.getLogger("llmc")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the twin's own warnings (no tokenizer, untested type) are not the user's
        try:
            build_twin(ckpt, engine_dir)
        except UnsupportedError as exc:  # the twin's refusal is this config's: say so without the temporary path
            raise UnsupportedError(str(exc).replace(f"{ckpt}:", f"a random twin of this {model_type} config:")
                                   .replace(str(ckpt), "the twin")) from None
        finally:
            quiet.setLevel(level)
        lp, rel, failure = compare(engine_dir, ckpt, cuda)
        where, cause = "", None
        if failure is not None:
            quiet.setLevel(logging.ERROR)
            try:
                where, layer = diagnose(twin, ckpt, Path(tmp), build_twin, cuda)
                if "fusion" not in where and "after pass" not in where:  # a pass's fault is llmc's bug, not a gap
                    cause = mismatch_cause(twin, ckpt, layer)
            finally:
                quiet.setLevel(level)
    if failure is not None:
        said = f"{cause}: " if cause else ""
        raise UnsupportedError(
            f"architecture self-check failed for model_type {model_type!r}: {said}on a random twin of this config, "
            f"llmc's engine differs from transformers ({failure}){where}; llmc {llmc.__version__} cannot build "
            "this configuration correctly, so it stops here rather than write a wrong engine (please report it)")
    result = SelfCheckResult("passed", key, round(time.perf_counter() - t0, 3), twin, lp, rel)
    if cacheable and record is not None:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp_record = record.with_suffix(".tmp")
            tmp_record.write_text(json.dumps(result.to_json(), sort_keys=True))
            tmp_record.replace(record)
        except OSError:
            pass  # an unwritable cache costs the check again next time, nothing more
    return result
