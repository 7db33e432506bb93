"""Tiny random hybrid checkpoints (layers with recurrent state beside attention) and their greedy references.

Weights are drawn wider than transformers' default init so that greedy tokens differ from step to step; the
recurrent layers' own parameters that set their decay (``A_log``, ``dt_bias``) keep transformers' init.
"""

from __future__ import annotations

from pathlib import Path

# The last prompt is longer than the 16-token step budget the tests use; no prompt holds the pad id 0, which
# transformers' generate would mask out.
PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2], [(i * 37) % 255 + 1 for i in range(70)])

_GDN = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
HYBRID_CONFIGS = {
    "qwen3_5_text": _GDN,
    "qwen3_next": dict(_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "qwen3_5_moe_text": dict(_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
    "lfm2_moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     conv_L_cache=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                     layer_types=["conv", "full_attention", "conv", "conv"]),
    # Mamba2 (SSD) hybrids: Mamba2 layers beside attention (Nemotron-H: also an MLP-only layer; Falcon-H1: attention
    # and Mamba2 in parallel in every layer; Granite-4 hybrid and Bamba: Mamba2 or attention per layer).
    "nemotron_h": dict(vocab_size=256, hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       intermediate_size=128, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                       conv_kernel=4, chunk_size=16),
    "falcon_h1": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, mamba_d_ssm=64,
                      mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                      mamba_chunk_size=16),
    "granitemoehybrid": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
                             mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
    "bamba": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, attn_layer_indices=[1], mamba_n_heads=8,
                  mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16),
    "lfm2": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, conv_L_cache=3, block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention", "conv", "conv"]),
}


# The layouts of the released checkpoints, tiny: Qwen3.5 and Qwen3-Next repeat three Gated DeltaNet layers then one
# full-attention layer; Falcon-H1 as its config class sets Mamba2 up (one group, 8-wide heads, d_ssm = heads x
# head_dim), sized down; LFM2 as above. The families whose lowering leans on transformers' internals, built at both
# ends of the declared transformers range (llmc.testing.hybrid_match).
_RELEASED_GDN = dict(_GDN, layer_types=["linear_attention"] * 3 + ["full_attention"])
RELEASED_LAYOUTS = {
    "qwen3_5_text": _RELEASED_GDN,
    "qwen3_next": dict(HYBRID_CONFIGS["qwen3_next"], layer_types=_RELEASED_GDN["layer_types"]),
    "falcon_h1": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, mamba_n_heads=8,
                      mamba_d_ssm=64, mamba_d_state=16, mamba_chunk_size=16),
    "lfm2": HYBRID_CONFIGS["lfm2"],
}


# Vocabulary of a fixture written with a tokenizer (llmc.testing.corpus's BPE needs at least 260 entries).
TOKENIZER_VOCAB = 512


def write_hybrid(model_type: str, out: Path, seed: int = 0, *, tokenizer: bool = False, std: float = 0.2,
                 centred_norms: bool = False, fields: dict | None = None):
    """Write a random tiny ``model_type`` checkpoint to ``out``; returns the transformers model (float32, eval).

    ``tokenizer``: also write the pydoc BPE tokenizer (vocabulary :data:`TOKENIZER_VOCAB`, its special ids), which
    quantized builds need (calibration and the accuracy report run on text). ``std``: the matrices' init spread
    (0.15 is what ``llmc.testing.checkpoints.write_tiny_model`` draws; wider makes sharper next-token
    distributions). ``centred_norms``: norms that scale by ``1 + weight`` (Qwen3.5, Qwen3-Next) get weights around 0,
    as ``write_tiny_model`` draws Gemma's (else around 1: every such norm doubles its input). ``fields``: the config's
    fields instead of :data:`HYBRID_CONFIGS`' (e.g. :data:`RELEASED_LAYOUTS`')."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(HYBRID_CONFIGS[model_type] if fields is None else fields, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if tokenizer:
        from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

        tok = train_bpe_tokenizer(vocab_size=TOKENIZER_VOCAB, model_max_length=512)
        fields.update(vocab_size=TOKENIZER_VOCAB, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    centred = {id(m.weight) for m in hf.modules() if centred_norms and _scales_by_one_plus_weight(m)}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name else std)
            elif id(p) in centred:
                p.uniform_(-0.2, 0.2)
            elif not name.endswith(("A_log", "dt_bias")):
                p.uniform_(0.8, 1.2)
    hf.save_pretrained(out)
    if tokenizer:
        save_tokenizer(tok, out)
    return hf


def _scales_by_one_plus_weight(module) -> bool:
    """A norm whose forward multiplies by ``1 + weight`` (read from transformers' own source)."""
    import inspect

    if list(module.children()) or getattr(module, "weight", None) is None:
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "1.0 + self.weight" in source or "1 + self.weight" in source


def greedy(hf, prompts, new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (alone, no EOS)."""
    import torch

    refs = []
    for p in prompts:
        with torch.no_grad():
            refs.append(hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    return refs
