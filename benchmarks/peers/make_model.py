#!/usr/bin/env python3
"""Build the benchmark models locally (no downloads).

1. Train a byte-level BPE tokenizer (vocab 8192) on pydoc_data.topics.topics
   (English text that ships with CPython) and save it as a HF fast tokenizer.
2. Create a randomly initialised LlamaForCausalLM (torch.manual_seed(0)) and
   save it (safetensors, float32) together with the tokenizer.

usage: make_model.py [small|1b|all]
  small -> $PEERS_ROOT/model     (hidden 576, inter 1536, 30 layers, 9 heads, 3 kv)
  1b    -> $PEERS_ROOT/model-1b  (Llama-3.2-1B shape with vocab 8192)
"""
import json
import os
import sys

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
}


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


def make(name, tok):
    s = dict(SHAPES[name])
    out = s.pop("out")
    cfg = LlamaConfig(
        vocab_size=8192, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=None, attention_bias=False, mlp_bias=False, **s)
    cfg.torch_dtype = "float32"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n/1e6:.2f} M params -> {out}")
    model.save_pretrained(out, safe_serialization=True)
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TOK_DIR}/{f}", f"{out}/{f}")
    # make sure config says float32 whatever the transformers version writes
    cp = f"{out}/config.json"
    c = json.load(open(cp))
    c["torch_dtype"] = "float32"
    if "dtype" in c:
        c["dtype"] = "float32"
    json.dump(c, open(cp, "w"), indent=2)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    tok = train_tokenizer()
    for name in (["small", "1b"] if which == "all" else [which]):
        make(name, tok)
