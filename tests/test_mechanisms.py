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
CASES = {
    "bloom": (dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), "ALiBi position bias", "self-check failed"),
    "gpt_oss": (dict(BASE, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"]), "attention sinks", "self-check failed"),
    "falcon": (dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True),
               "parallel attention + MLP", "cannot be traced"),
    "mamba": (dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8), "state-space layers",
              "recurrent state"),
    "cohere": (BASE, "parallel attention + MLP, LayerNorm", "builds"),
    "olmo2": (BASE, "post-norm, Q/K norms", "builds"),
    "starcoder2": (BASE, "LayerNorm with biases, GELU", "builds"),
}


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
        assert (tmp_path / "e" / "manifest.json").is_file()
    else:
        assert proc.returncode == 3 and expected in last and model_type in last, f"{model_type}: {last}"
        assert last.startswith("error: ") and str(tmp_path / "cache") not in last
        assert not (tmp_path / "e").exists()
