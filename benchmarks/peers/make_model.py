#!/usr/bin/env python3
"""Build the benchmark models locally (no downloads).

1. Train a byte-level BPE tokenizer (vocab 8192) on pydoc_data.topics.topics
   (English text that ships with CPython) and save it as a HF fast tokenizer.
2. Create a randomly initialised LlamaForCausalLM (torch.manual_seed(0)) and
   save it (safetensors, float32) together with the tokenizer.

usage: make_model.py [small|1b|3b|8b|oss20b|qwen35|gemma3-4b-vl|all] [--dtype float32|bfloat16] [--out DIR]
  small -> $PEERS_ROOT/model     (hidden 576, inter 1536, 30 layers, 9 heads, 3 kv)
  1b    -> $PEERS_ROOT/model-1b  (Llama-3.2-1B shape with vocab 8192)
  3b    -> $PEERS_ROOT/model-3b  (Llama-3.2-3B shape with vocab 8192: hidden 3072, 28 layers, 24/8 heads)
  8b    -> $PEERS_ROOT/model-8b  (Llama-3.1-8B shape with vocab 8192: hidden 4096, inter 14336, 32 layers,
                                  32/8 heads, untied LM head)
  oss20b -> $PEERS_ROOT/model-oss20b  (gpt-oss-20b's layer shape with vocab 8192 and 4 layers: hidden 2880,
                                  64/8 heads of 64, 32 experts of 2880, top 4, sinks, 128-token windows on
                                  alternate layers; the experts in OpenAI's MXFP4 layout as the hub ships them,
                                  random E2M1 codes with E8M0 scales 2^-8..2^-7, every other tensor bfloat16)
  qwen35 -> $PEERS_ROOT/model-qwen35  (Qwen3.5's layer shape, Qwen3_5TextConfig's defaults, with vocab 8192 and
                                  4 layers: three Gated DeltaNet layers and one full-attention layer; float32)
  gemma3-4b-vl -> $PEERS_ROOT/model-gemma3-4b-vl  (Gemma3ForConditionalGeneration at gemma-3-4b's released geometry:
                                  text hidden 2560, 8/4 heads of 256, MLP 10240, vocab 262208, window 1024, linear
                                  RoPE x8 on global layers, 6 layers = one 5:1 sliding/global cycle; SigLIP so400m at
                                  896 px, all 27 layers, 256 tokens per image; bfloat16, with a BPE tokenizer whose
                                  vocabulary covers Gemma 3's ids (<start_of_image> 255999, <end_of_image> 256000,
                                  <image_soft_token> 262144) and Gemma3ImageProcessor at 896x896)

``--dtype bfloat16`` (the default for 3b and 8b) writes the checkpoint tensor by tensor into 2 GB safetensors
shards with an index, as the hub's checkpoints are: an 8B model is never whole in memory (the build-scale
benchmark runs on a 24 GB machine). Weights are N(0, 0.02) (transformers' initializer_range), norms ones,
each tensor from its own generator seeded by its name, so a shape's checkpoint is the same on every machine.
With bfloat16 the output directory gets a ``-bf16`` suffix unless ``--out`` is given.
"""
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = os.environ.get("PEERS_ROOT", os.path.expanduser("~/.cache/llmc-peers"))
TOK_DIR = f"{ROOT}/tokenizer"

SHAPES = {
    "small": dict(out=f"{ROOT}/model", hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
    "1b": dict(out=f"{ROOT}/model-1b", hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    "3b": dict(out=f"{ROOT}/model-3b", hidden_size=3072, intermediate_size=8192,
               num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8),
    "8b": dict(out=f"{ROOT}/model-8b", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
# gpt-oss-20b's layers (GptOssConfig defaults: YaRN, sinks, clamped SwiGLU experts with biases), 4 of them.
OSS_SHAPES = {
    "oss20b": dict(out=f"{ROOT}/model-oss20b", hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 2),
}
# Qwen3.5's layer shape (Qwen3_5TextConfig's defaults: hidden 4096, 16/4 heads of 256, Gated DeltaNet with 16 key
# and 32 value heads of 128, MLP 12288) with vocab 8192 and one 3:1 cycle: three linear-attention layers, one full.
HYBRID_SHAPES = {
    "qwen35": dict(out=f"{ROOT}/model-qwen35", num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
# Gemma 3 4B's released geometry (google/gemma-3-4b-it config.json) with one 5:1 sliding/global cycle of text
# layers (the released model has 34) and the full SigLIP so400m encoder (27 layers, 896 px, patch 14 -> 4096 patches,
# pooled 4x4 -> 256 tokens per image).
VLM_SHAPES = {
    "gemma3-4b-vl": dict(
        out=f"{ROOT}/model-gemma3-4b-vl",
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                         query_pre_attn_scalar=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                             "rope_theta": 1_000_000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                         bos_token_id=2, eos_token_id=1, pad_token_id=0),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14, vision_use_head=False, layer_norm_eps=1e-6),
        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144),
}
GEMMA3_SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_image>": 255999,
                  "<end_of_image>": 256000, "<image_soft_token>": 262144}
# Shapes written streamed in bfloat16 unless --dtype says otherwise (they do not fit this machine in float32).
STREAMED = ("3b", "8b")
SHARD_BYTES = 2 << 30


def corpus():
    import pydoc_data.topics as t
    for k in sorted(t.topics):
        yield t.topics[k]


def train_tokenizer():
    if os.path.exists(f"{TOK_DIR}/tokenizer.json"):
        return PreTrainedTokenizerFast.from_pretrained(TOK_DIR)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        min_frequency=1,  # corpus is small: needed to reach 8192
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # prepend BOS like Llama tokenizers do
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    print("tokenizer vocab size:", tok.get_vocab_size())
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", model_max_length=2048)
    hf.save_pretrained(TOK_DIR)
    # portable tokenizer_config.json (transformers 5 writes "TokenizersBackend",
    # which older readers do not know)
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
               "add_eos_token": False, "model_max_length": 2048,
               "clean_up_tokenization_spaces": False},
              open(f"{TOK_DIR}/tokenizer_config.json", "w"), indent=2)
    return PreTrainedTokenizerFast.from_pretrained(TOK_DIR)


def _config(name, tok, dtype):
    s = dict(SHAPES[name])
    out = s.pop("out")
    s.setdefault("tie_word_embeddings", True)
    cfg = LlamaConfig(
        vocab_size=8192, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=None, attention_bias=False, mlp_bias=False, **s)
    cfg.torch_dtype = dtype
    return cfg, out


def _finish(out, tok_dir, dtype):
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok_dir}/{f}", f"{out}/{f}")
    # make sure config says the dtype whatever the transformers version writes
    cp = f"{out}/config.json"
    c = json.load(open(cp))
    c["torch_dtype"] = dtype
    if "dtype" in c:
        c["dtype"] = dtype
    json.dump(c, open(cp, "w"), indent=2)


def make_streamed(name, tok, dtype="bfloat16", out=None):
    """Write the checkpoint one tensor at a time (meta-device model for names and shapes)."""
    import hashlib

    from safetensors.torch import save_file

    cfg, default_out = _config(name, tok, dtype)
    out = out or default_out + ("-bf16" if dtype == "bfloat16" else "")
    os.makedirs(out, exist_ok=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = [(n, p.shape) for n, p in model.named_parameters()]
    torch_dtype = getattr(torch, dtype)
    shards, current, size = [], {}, 0
    for n, shape in params:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch_dtype.itemsize
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[n] = shape
        size += nbytes
    if current:
        shards.append(current)
    total = sum(1 for _ in params)
    index, done = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n, shape in shard.items():
            if n.endswith("norm.weight"):
                tensors[n] = torch.ones(shape, dtype=torch_dtype)
            else:
                g = torch.Generator().manual_seed(int(hashlib.sha256(n.encode()).hexdigest()[:12], 16))
                tensors[n] = (torch.randn(shape, generator=g) * 0.02).to(torch_dtype)
            index[n] = fname
            done += 1
        save_file(tensors, f"{out}/{fname}", metadata={"format": "pt"})
        del tensors
        print(f"  {fname}: {done}/{total} tensors", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    cfg.save_pretrained(out)
    json.dump({"metadata": {"total_size": n_params * torch_dtype.itemsize}, "weight_map": index},
              open(f"{out}/model.safetensors.index.json", "w"), indent=2)
    _finish(out, TOK_DIR, dtype)
    print(f"{name}: {n_params/1e6:.2f} M params ({dtype}) -> {out}")
    return out


def make_oss_mxfp4(name, tok, out=None):
    """A gpt-oss checkpoint as OpenAI publishes it: experts as ``<proj>_blocks`` (uint8 [E, N, K/32, 16], E2M1
    pairs, low nibble first) and ``<proj>_scales`` (uint8 [E, N, K/32], E8M0), ``quantization_config`` mxfp4; the
    rest bfloat16 N(0, 0.02), norms ones. One safetensors shard per layer (never the whole model in memory)."""
    import hashlib

    import numpy as np
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    s = dict(OSS_SHAPES[name])
    out = out or s.pop("out")
    s.pop("out", None)
    os.makedirs(out, exist_ok=True)
    cfg = GptOssConfig(vocab_size=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=None, tie_word_embeddings=False, **s)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    shards: dict[str, dict] = {}
    for n, p in model.named_parameters():
        layer = n.split(".")[2] if n.startswith("model.layers.") else "rest"
        seed = int(hashlib.sha256(n.encode()).hexdigest()[:12], 16)
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, m = p.shape  # [E, K, N]: input dimension first
            rng = np.random.default_rng(seed)
            shards.setdefault(layer, {})[n + "_blocks"] = torch.from_numpy(
                rng.integers(0, 256, (e, m, k // 32, 16), dtype=np.uint8))
            # E8M0 119..120 (2^-8, 2^-7): about N(0, 0.02)'s spread for uniformly random E2M1 codes
            shards[layer][n + "_scales"] = torch.from_numpy(rng.integers(119, 121, (e, m, k // 32)).astype(np.uint8))
        elif n.endswith("norm.weight"):
            shards.setdefault(layer, {})[n] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(seed)
            shards.setdefault(layer, {})[n] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
    index, total = {}, 0
    names = sorted(shards, key=lambda k: (k == "rest", int(k) if k.isdigit() else 0))
    for i, key in enumerate(names):
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file(shards[key], f"{out}/{fname}", metadata={"format": "pt"})
        for n, t in shards[key].items():
            index[n] = fname
            total += t.numel() * t.element_size()
        print(f"  {fname}: {len(shards[key])} tensors", flush=True)
    cfg.save_pretrained(out)
    c = json.load(open(f"{out}/config.json"))
    c["architectures"] = ["GptOssForCausalLM"]  # as model.save_pretrained writes it (llama.cpp's converter reads it)
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(c, open(f"{out}/config.json", "w"), indent=2)
    json.dump({"metadata": {"total_size": total}, "weight_map": index},
              open(f"{out}/model.safetensors.index.json", "w"), indent=2)
    _finish(out, TOK_DIR, "bfloat16")
    print(f"{name}: {total / 1e9:.2f} GB (MXFP4 experts, bfloat16 elsewhere) -> {out}")
    return out


def _save_random(model_cls, cfg, name, out):
    """A float32 model of ``cfg`` with torch's seed 0, saved with the tokenizer."""
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n/1e6:.2f} M params -> {out}")
    model.save_pretrained(out, safe_serialization=True)
    _finish(out, TOK_DIR, "float32")
    return out


def make_hybrid(name, tok, out=None):
    """A random Qwen3_5ForCausalLM (text only) in float32, seeded like ``make``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    s = dict(HYBRID_SHAPES[name])
    out = out or s.pop("out")
    s.pop("out", None)
    cfg = Qwen3_5TextConfig(vocab_size=8192, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=None, **s)
    return _save_random(Qwen3_5ForCausalLM, cfg, name, out)


def gemma3_tokenizer(out, vocab_size):
    """The peers' byte-level BPE (TOK_DIR) re-numbered into Gemma 3's id space: Gemma's <pad>/<eos>/<bos>/<unk> at
    0-3, the BPE's tokens from 4 on, the image tokens at the config's ids, ``<unusedN>`` fillers elsewhere so that
    the vocabulary covers all ``vocab_size`` embedding rows (llama.cpp's converter cuts the embedding to the
    tokenizer's size). Merges are by token text, so BPE encodings are unchanged (ids shifted)."""
    src = json.load(open(f"{TOK_DIR}/tokenizer.json"))
    old_special = {t["content"] for t in src["added_tokens"]}
    bpe = [t for t, _ in sorted(src["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in old_special]
    by_id = {i: n for n, i in GEMMA3_SPECIAL.items()}
    free = (i for i in range(vocab_size) if i not in by_id)
    for t in bpe:
        by_id[next(free)] = t
    for i in free:
        by_id[i] = f"<unused{i}>"
    src["model"]["vocab"] = {by_id[i]: i for i in range(vocab_size)}
    src["model"]["unk_token"] = "<unk>"
    src["added_tokens"] = [dict(id=i, content=n, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                special=True) for n, i in sorted(GEMMA3_SPECIAL.items(), key=lambda kv: kv[1])]
    src["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                      {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}}
    json.dump(src, open(f"{out}/tokenizer.json", "w"), ensure_ascii=False)
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
               "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False,
               "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
               "model_max_length": 131072, "clean_up_tokenization_spaces": False,
               # Gemma's turn format, with its image marker, written with this vocabulary's plain text (no
               # turn tokens): llama.cpp's mtmd-cli applies the GGUF's template
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                "{% endfor %}{% if add_generation_prompt %}model: {% endif %}"},
              open(f"{out}/tokenizer_config.json", "w"), indent=2)


def make_gemma3_vl(name, out=None):
    """A random Gemma3ForConditionalGeneration of ``VLM_SHAPES[name]``, bfloat16 (as the hub ships Gemma 3), saved
    with transformers' ``save_pretrained`` under the hub's tensor names, the tokenizer above and transformers' own
    Gemma 3 image processor at the encoder's size (``preprocessor_config.json``). Built bf16 in memory (~3.3 GB for
    the default shape). Matrices N(0, 0.02), each tensor from a generator seeded by its name; Gemma's (1 + w) RMS
    norms 0 (identity), SigLIP's layer norms 1, biases 0."""
    import hashlib

    import transformers
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    s = dict(VLM_SHAPES[name])
    out = out or s.pop("out")
    s.pop("out", None)
    cfg = Gemma3Config(**s)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    model.tie_weights()  # to_empty gives the tied LM head storage of its own
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                g = torch.Generator().manual_seed(int(hashlib.sha256(n.encode()).hexdigest()[:12], 16))
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
            elif "norm" in n and n.endswith("weight"):
                p.fill_(1.0 if "vision_tower" in n else 0.0)
            else:
                p.zero_()
    n_params = sum(p.numel() for p in model.parameters())
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    del model
    # transformers 5 saves the tower as ``vision_tower.*``; the hub's Gemma 3 checkpoints (and llama.cpp's converter,
    # which maps only those) have ``vision_tower.vision_model.*``, which transformers loads all the same
    from safetensors.torch import load_file, save_file
    tensors = load_file(f"{out}/model.safetensors")
    save_file({(k.replace("vision_tower.", "vision_tower.vision_model.", 1)
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}, f"{out}/model.safetensors", metadata={"format": "pt"})
    del tensors
    tc = s["text_config"]
    gemma3_tokenizer(out, tc["vocab_size"])
    size = s["vision_config"]["image_size"]
    transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size}).save_pretrained(out)
    pp = json.load(open(f"{out}/preprocessor_config.json"))
    pp.update(image_seq_length=s["mm_tokens_per_image"], do_pan_and_scan=None)  # as the hub's file has them
    json.dump(pp, open(f"{out}/preprocessor_config.json", "w"), indent=2)
    print(f"{name}: {n_params / 1e6:.1f} M params (bfloat16) -> {out}")
    return out


def make(name, tok):
    cfg, out = _config(name, tok, "float32")
    _save_random(LlamaForCausalLM, cfg, name, out)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="?", default="all",
                    choices=[*SHAPES, *OSS_SHAPES, *HYBRID_SHAPES, *VLM_SHAPES, "all"])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="checkpoint dtype (default: float32 for small/1b, bfloat16 for 3b/8b)")
    ap.add_argument("--out", default=None, help="output directory (default: under $PEERS_ROOT)")
    args = ap.parse_args()
    tok = train_tokenizer()
    if args.which in OSS_SHAPES:
        make_oss_mxfp4(args.which, tok, args.out)
        raise SystemExit(0)
    if args.which in VLM_SHAPES:
        make_gemma3_vl(args.which, args.out)
        raise SystemExit(0)
    if args.which in HYBRID_SHAPES:
        make_hybrid(args.which, tok, args.out)
        raise SystemExit(0)
    for name in (["small", "1b"] if args.which == "all" else [args.which]):
        dtype = args.dtype or ("bfloat16" if name in STREAMED else "float32")
        if dtype == "bfloat16" or name in STREAMED:
            make_streamed(name, tok, dtype, args.out)
        else:
            make(name, tok)
