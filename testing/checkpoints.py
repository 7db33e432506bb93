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


# Tiny configs of each supported family (fields the family's transformers config class takes).
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
    "mistral": dict(_COMMON, sliding_window=24),
    "qwen2": dict(_COMMON),
    "qwen3": dict(_COMMON, head_dim=16),
    "gemma2": dict(_COMMON, head_dim=16, sliding_window=24, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    "gemma3_text": dict(_COMMON, head_dim=16, sliding_window=24, query_pre_attn_scalar=16,
                        tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"]),
    # longrope switches to the long factors past original_max_position_embeddings (32): the architecture
    # tests' prompts (3, 20, 45 tokens + 32 generated) cross it during decoding, or start beyond it.
    "phi3": dict(_COMMON, num_key_value_heads=4, original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
                                  "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}),
    "gpt2": dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=512, tie_word_embeddings=True),
    "gpt_neox": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.5, use_parallel_residual=True,
                     tie_word_embeddings=False),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}


def write_tiny_model(model_type: str, out_dir: str | Path, *, dtype: str = "float32", seed: int = 0,
                     **overrides) -> Path:
    """Write a random tiny checkpoint of any family in :data:`TINY_CONFIGS` (with a pydoc BPE tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    cfg = dict(TINY_CONFIGS[model_type], **overrides)
    tokenizer = train_bpe_tokenizer(vocab_size=cfg["vocab_size"], model_max_length=512)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(model_type, **{**cfg, **ids})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if ("embed" in name or "wte" in name or "wpe" in name) else 0.15)
            elif "norm" in name or "ln" in name:
                p.uniform_(-0.2, 0.2) if model_type.startswith("gemma") else p.uniform_(0.8, 1.2)
            else:  # biases
                p.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(**ids, do_sample=False)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out
