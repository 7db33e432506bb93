"""Write tiny random Hugging Face checkpoints in the exact on-disk format of real ones.

No hub downloads are possible here, so every test model is generated from a transformers config
with a fixed seed: config.json, model.safetensors (or shards + model.safetensors.index.json),
tokenizer.json + tokenizer_config.json (with a chat template) and generation_config.json.
"""

from __future__ import annotations

from pathlib import Path

from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def write_tiny_llama(out_dir: str | Path, *, dtype: str = "float32", seed: int = 0,
                     max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random tiny Llama checkpoint to ``out_dir`` and return the path.

    ``dtype`` is ``"float32"`` or ``"bfloat16"``; ``max_shard_size`` (e.g. ``"100KB"``) writes a
    sharded checkpoint with ``model.safetensors.index.json``. Weights are drawn with a larger
    standard deviation than transformers' default so that logits are not nearly uniform.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = train_bpe_tokenizer(vocab_size=(overrides.get("vocab_size") or TINY_LLAMA["vocab_size"]),
                                    model_max_length=TINY_LLAMA["max_position_embeddings"])
    cfg = dict(TINY_LLAMA, **overrides)
    config = LlamaConfig(
        **cfg,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.15)
            else:  # norm weights: around 1, not exactly 1, so a wrong norm shows
                p.uniform_(0.8, 1.2)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    save_tokenizer(tokenizer, out)
    return out
