"""The family sweep (scripts/family_sweep.py) on a subset of transformers' causal-LM types, one per mechanism: each
family's tiny random checkpoint from its own config class's defaults, built by ``llmc build`` with the self-check
on, must end in its expected outcome (a match with transformers' greedy tokens, or a refusal naming its mechanism),
never an internal error. docs/family_sweep.md holds the sweep over every type."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "family_sweep.py"

# model_type -> (outcome, a phrase (or phrases) its reason must contain); one family per mechanism.
SUBSET = {
    "qwen2": ("match", ""),  # the reference family: defaults (biases on Q/K/V, GQA)
    "gpt2": ("match", ""),  # learned positions, LayerNorm, Conv1D projections
    # caught by the self-check, which names the mechanism and where it first sees it
    "diffllama": ("refused", ("llmc does not lower differential attention", "seen in decoder layer 0's self_attn")),
    "deepseek_v2": ("refused", "llmc does not lower complex-valued tensors"),
    "bloom": ("refused", "ALiBi"),  # named from config.json before any work
    "mamba": ("refused", "recurrent state"),
    "gpt_oss": ("refused", "attention sinks"),
}


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_sweep_outcome(model_type, tmp_path):
    outcome, phrase = SUBSET[model_type]
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--families", model_type, "--json", str(out),
                           "--md", str(tmp_path / "sweep.md"), "--timeout", "240"],
                          capture_output=True, text=True)
    row = json.loads(out.read_text())["rows"][model_type]
    assert row["outcome"] not in ("internal error", "timeout", "mismatch"), (row, proc.stderr[-2000:])
    phrases = (phrase,) if isinstance(phrase, str) else phrase
    assert row["outcome"] == outcome and all(p in row["reason"] for p in phrases), row
    assert proc.returncode == 0, proc.stderr[-2000:]
    if outcome == "refused":
        assert row["exit_code"] == 3 and "\n" not in row["reason"]
    table = (tmp_path / "sweep.md").read_text()
    assert f"| {model_type} | {outcome} |" in table and "1 of" in table


def test_mechanisms_are_named_from_config_fields_and_module_classes():
    from transformers import AutoConfig

    from llmc.compiler.mechanisms import name_mechanism

    def defaults(model_type):
        return AutoConfig.for_model(model_type).to_dict()

    assert name_mechanism(defaults("llama")) is None
    assert "differential attention" in name_mechanism(defaults("diffllama"))
    assert "learned indexer" in name_mechanism(defaults("deepseek_v32"))
    assert "per-layer input embeddings" in name_mechanism(defaults("gemma3n_text"))
    assert "LSH" in name_mechanism({}, ["ReformerLSHSelfAttention"])
    assert "complex-valued" in name_mechanism({}, [], "No decompositions registered for the complex-valued input")
    # a field that is present but off names nothing
    assert name_mechanism({"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0}) is None
