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

# model_type -> (outcome, a phrase (or phrases) its reason must contain); one family per mechanism. BUILT families
# trace and build (tens of seconds each); QUICK ones end before tracing and share one sweep run.
BUILT = {
    "qwen2": ("match", ""),  # the reference family at its defaults (Q/K/V biases, grouped-query attention)
    # caught by the self-check, which names the mechanism and where it first sees it
    "diffllama": ("refused", ("llmc does not lower differential attention", "seen in decoder layer 0's self_attn")),
    "deepseek_v2": ("refused", "llmc does not lower complex-valued tensors"),  # the exporter's error, mapped
    "cpmant": ("refused", "fixed input_ids"),  # was an internal error at the first step of another size
}
QUICK = {
    "mamba": ("refused", "recurrent state"),
    # a hybrid whose recurrent layers llmc does not lower yet, recognised by its fields and named (qwen3_next builds)
    "kimi_linear": ("refused", ("recurrent state", "Kimi Delta Attention")),
    "hrm_text": ("refused", "splits into several weights"),  # was exit 2 on a valid checkpoint
}


def _sweep(families: list[str], tmp_path: Path, jobs: int = 1) -> tuple[dict, str, subprocess.CompletedProcess]:
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--families", ",".join(families), "--json", str(out),
                           "--md", str(tmp_path / "sweep.md"), "--timeout", "240", "--jobs", str(jobs)],
                          capture_output=True, text=True)
    return json.loads(out.read_text())["rows"], (tmp_path / "sweep.md").read_text(), proc


def _check(model_type: str, row: dict, expected: tuple, table: str) -> None:
    outcome, phrase = expected
    assert row["outcome"] not in ("internal error", "timeout", "mismatch"), row
    phrases = (phrase,) if isinstance(phrase, str) else phrase
    assert row["outcome"] == outcome and all(p in row["reason"] for p in phrases), row
    if outcome == "refused":
        assert row["exit_code"] == 3 and "\n" not in row["reason"]
    assert f"| {model_type} | {outcome} |" in table


@pytest.mark.parametrize("model_type", sorted(BUILT))
def test_sweep_outcome(model_type, tmp_path):
    rows, table, proc = _sweep([model_type], tmp_path)
    _check(model_type, rows[model_type], BUILT[model_type], table)
    assert proc.returncode == 0 and "1 of" in table, proc.stderr[-2000:]


def test_sweep_outcomes_before_tracing(tmp_path):
    rows, table, proc = _sweep(sorted(QUICK), tmp_path, jobs=2)
    for model_type, expected in QUICK.items():
        _check(model_type, rows[model_type], expected, table)
    assert proc.returncode == 0 and f"{len(QUICK)} of" in table, proc.stderr[-2000:]


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
