"""Families outside llmc's tested list, as a new user would try them: tiny random checkpoints from transformers'
own config classes, one per mechanism current models use. Each is expected to build an engine that matches
transformers or to be refused with its reason (tests/test_mechanisms.py; the coverage matrix lists them)."""

from __future__ import annotations

from pathlib import Path

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
# model_type -> (config overrides, mechanism, expected: "builds" or a phrase of the refusal)
TRIED_FAMILIES = {
    # 6 heads: ALiBi's slopes for a head count that is not a power of two (the last two take 8 heads' odd ones).
    "bloom": (dict(vocab_size=512, hidden_size=96, n_layer=2, n_head=6), "ALiBi position bias, attention computed "
              "inline (not through AttentionInterface), fused QKV", "builds"),
    "gpt_oss": (dict(BASE, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"]),
                "attention sinks, sliding + full layers, clamped SwiGLU experts with biases, router bias, YaRN",
                "builds"),
    # floor_scale 8: the NoPE layer's temperature tuning changes queries from position 7 on (8192 would not here).
    "llama4_text": (dict(BASE, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
                         attention_chunk_size=16, no_rope_layers=[1, 0], interleave_moe_layer_step=2, floor_scale=8),
                    "chunked local attention, layers without rotary (temperature-tuned), complex rotary", "builds"),
    "falcon": (dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True),
               "parallel attention + MLP, attention without keyword pass-through", "builds"),
    "mamba": (dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, state_size=8), "state-space layers",
              "recurrent state"),
    "cohere": (BASE, "parallel attention + MLP, LayerNorm", "builds"),
    "olmo2": (BASE, "post-norm, Q/K norms", "builds"),
    "starcoder2": (BASE, "LayerNorm with biases, GELU", "builds"),
    "deepseek_v3": (dict(BASE, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                         first_k_dense_replace=1, **MLA),
                    "multi-head latent attention, shared experts, grouped routing", "builds"),
    "qwen2_moe": (dict(BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64), "MoE with a gated shared expert", "builds"),
    "smollm3": (dict(BASE, no_rope_layers=[1, 0], no_rope_layer_interval=2), "layers without rotary (NoPE)",
                "builds"),
    "nemotron": (BASE, "LayerNorm1p, squared-ReLU MLP, partial rotary", "builds"),
    "apertus": (BASE, "xIELU activation, Q/K norms", "builds"),
    "glm4_moe": (dict(BASE, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                      n_group=2, topk_group=1, first_k_dense_replace=1),
                 "sigmoid grouped routing with a shared expert, partial rotary", "builds"),
    # 5 layers (3 sliding, 1 full, 1 sliding): the self-check's twin keeps 4, so its per-layer lists are cut.
    "cohere2_moe": (dict(BASE, head_dim=16, num_hidden_layers=5, num_experts=4, num_experts_per_tok=2,
                         sliding_window=16),
                    "per-layer MLP kinds (mlp_layer_types), sliding + full layers, MoE, parallel attention + MLP",
                    "builds"),
    "hunyuan_v1_moe": (dict(BASE, head_dim=16, num_experts=4, moe_topk=2),
                       "query/key RMSNorm after rotary (a norm over 4-D per-head tensors), MoE", "builds"),
    # Gemma 4 E2B/E4B-style: 4 sliding + 2 full layers, the full ones with twice the head size; the last 3 layers
    # read the caches of the last earlier layer of their type; per-layer input embeddings; double-wide MLPs.
    "gemma4_text": (dict(BASE, head_dim=16, global_head_dim=32, num_hidden_layers=6, sliding_window=16,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, num_kv_shared_layers=3,
                         use_double_wide_mlp=True, final_logit_softcapping=30.0),
                    "per-layer head sizes, KV-shared layers, per-layer input embeddings", "builds"),
}

# Tried the same way and listed in the coverage matrix, but not in tests/test_mechanisms.py: each built and
# passed the self-check, and their mechanisms are covered above; a CI run need not pay for them all.
MATRIX_ONLY_FAMILIES = {
    # ALiBi again, through mpt's own attention and model code (tests/test_alibi_models.py builds it).
    "mpt": (dict(vocab_size=512, d_model=96, n_layers=2, n_heads=12, max_seq_len=256, expansion_ratio=2),
            "ALiBi position bias (12 heads), attention computed inline, no biases", "builds"),
    "phi": (BASE, "partial rotary, parallel attention + MLP, LayerNorm", "builds"),
    "granite": (BASE, "embedding / residual / attention / logit multipliers", "builds"),
    "glm4": (BASE, "partial interleaved rotary, post-sublayer norms", "builds"),
    "exaone4": (BASE, "post-norm, Q/K norms, sliding + global layers", "builds"),
    "arcee": (BASE, "squared-ReLU MLP without gate", "builds"),
    "ernie4_5": (BASE, "interleaved rotary", "builds"),
    "ernie4_5_moe": (BASE, "MoE with shared experts", "builds"),
    "stablelm": (BASE, "partial rotary, LayerNorm", "builds"),
    "seed_oss": (BASE, "attention biases, Q/K/V bias only", "builds"),
    "olmo3": (BASE, "sliding + full layers, Q/K norms, post-norm", "builds"),
    "gemma": (BASE, "GeGLU, (1 + w) RMSNorm, scaled embeddings", "builds"),
    "minimax_m2": (BASE, "MoE with sigmoid routing and expert bias, Q/K norms", "builds"),
}


def write_tried_family(model_type: str, out: Path) -> Path:
    """Write the tiny random checkpoint of ``model_type`` (``TRIED_FAMILIES`` or ``MATRIX_ONLY_FAMILIES``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    overrides = {**TRIED_FAMILIES, **MATRIX_ONLY_FAMILIES}[model_type][0]
    # A tokenizer as real checkpoints have one (quantized builds calibrate on text).
    tokenizer = train_bpe_tokenizer(vocab_size=overrides["vocab_size"], model_max_length=256)
    cfg = AutoConfig.for_model(model_type, **overrides, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out
