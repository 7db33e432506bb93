"""Families outside the tested list, built as a new user would (tiny random checkpoints from transformers' own
config classes): each either builds an engine that the self-check holds to transformers, or is refused (exit 3,
one line, nothing left behind), never an internal error and never a silently wrong engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# model_type -> (config overrides, mechanism, expected: "builds" or a phrase of the refusal)
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
CASES = {
    "bloom": (dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), "ALiBi position bias", "ALiBi"),
    "gpt_oss": (dict(BASE, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"]), "attention sinks", "attention sinks"),
    "llama4_text": (dict(BASE, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
                         attention_chunk_size=16, no_rope_layers=[1, 0], interleave_moe_layer_step=2),
                    "chunked local attention, layers without rotary, complex rotary", "chunked local attention"),
    "falcon": (dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True),
               "parallel attention + MLP, attention without keyword pass-through", "builds"),
    "mamba": (dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8), "state-space layers",
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
}
PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2])


def _checkpoint(model_type: str, overrides: dict, out):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_family_builds_correctly_or_is_refused(model_type, tmp_path):
    overrides, mechanism, expected = CASES[model_type]
    ckpt = _checkpoint(model_type, overrides, tmp_path / "ckpt")
    env = dict(os.environ, LLMC_SELF_CHECK="1", LLMC_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(ckpt), "-o", str(tmp_path / "e"),
                           "-q"], capture_output=True, text=True, env=env)
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr[-3000:]
    if expected == "builds":
        assert proc.returncode == 0, f"{model_type} ({mechanism}): {last}"
        _assert_greedy_matches_transformers(tmp_path / "e", ckpt)
    else:
        assert proc.returncode == 3 and expected in last and model_type in last, f"{model_type}: {last}"
        assert last.startswith("error: ") and str(tmp_path / "cache") not in last
        assert not (tmp_path / "e").exists()


def _assert_greedy_matches_transformers(engine_dir, ckpt):
    """32 greedy tokens for each of 3 prompts, the engine against transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.runtime import Engine, SamplingParams

    engine = Engine.load(engine_dir)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (prompt, out.token_ids, ref)
