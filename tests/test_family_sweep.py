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
# trace and build (tens of seconds each); QUICK ones end before tracing. All of them, and VARIANTS, share one sweep
# run (the ``sweep`` fixture).
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


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One run of the sweep over every family this file expects an outcome of (BUILT, QUICK and VARIANTS below),
    two at a time, each in a process of its own as the sweep always runs them: one start of the sweep itself, not
    six. Each test checks its families' rows, the table and the sweep's exit status."""
    families = sorted({**BUILT, **QUICK, **VARIANTS})
    rows, table, proc = _sweep(families, tmp_path_factory.mktemp("sweep"), jobs=2)
    assert set(rows) == set(families) and f"**{len(families)} of" in table, (sorted(rows), proc.stderr[-2000:])
    return rows, table, proc


@pytest.mark.parametrize("model_type", sorted(BUILT))
def test_sweep_outcome(model_type, sweep):
    rows, table, proc = sweep
    _check(model_type, rows[model_type], BUILT[model_type], table)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_sweep_outcomes_before_tracing(sweep):
    rows, table, proc = sweep
    for model_type, expected in QUICK.items():
        _check(model_type, rows[model_type], expected, table)
    assert proc.returncode == 0, proc.stderr[-2000:]


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
    # the self-check's diagnosis passes the classes of every module inside the first differing layer
    assert "compressed convolutional attention" in name_mechanism(defaults("zaya"))
    assert "compressed convolutional attention" in name_mechanism({}, ["ZayaAttention", "ZayaCCAProjection"])
    assert "dynamic mask attention" in name_mechanism(defaults("doge"))


# Small enough for every family below (each reads the fields it has).
SMALL = dict(vocab_size=64, d_model=32, hidden_size=32, decoder_layers=1, num_hidden_layers=1,
             decoder_attention_heads=2, num_attention_heads=2, decoder_ffn_dim=32, intermediate_size=32, ffn_dim=32,
             max_position_embeddings=64, max_target_positions=64, word_embed_proj_dim=32, pad_token_id=1,
             bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, is_decoder=True)


@pytest.mark.parametrize("model_type", ["mbart", "pegasus", "whisper", "opt", "roberta"])
def test_position_tables_read_the_steps_positions(model_type):
    """A step's tokens at positions 6..8, run alone (as in llmc's trace: no cache), get the position rows transformers
    gives them in the whole sequence: cache-length tables (mbart's offset 2, pegasus' [T, D] sinusoids, whisper, opt)
    and RoBERTa's padding_idx + 1 offset (compiler/positions.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler import positions

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL), dtype=torch.float32).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)  # fresh rows, sinusoid tables too, so a wrong row shows
    table_name = next(n for n, m in hf.named_modules() if n.endswith(("embed_positions", "embeddings")))
    table = hf.get_submodule(table_name)
    seen = []
    table.register_forward_hook(lambda m, a, out: seen.append(out))
    ids = torch.randint(3, 64, (1, 9))
    with torch.no_grad():
        hf(ids)
        want = seen.pop()[..., 6:, :]
        assert positions.install(hf) == [table_name]
        positions.STEP["positions"] = torch.arange(6, 9)
        try:
            hf(ids[:, 6:], position_ids=torch.arange(6, 9)[None])
        finally:
            positions.STEP.clear()
    got = seen.pop()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_attention_outside_attention_interface_is_refused_naming_it(tmp_path):
    """openai-gpt (like megatron-bert, xglm, ...) computes attention in its own module, never calling transformers'
    AttentionInterface: the trace would have no KV cache, so the build stops, naming the module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.frontend import trace
    from llmc.errors import UnsupportedError

    cfg = AutoConfig.for_model("openai-gpt", vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedError) as exc:
        trace(load_checkpoint(tmp_path))
    msg = str(exc.value)
    assert "llmc does not lower attention computed inside the family's own attention modules" in msg, msg
    assert "seen in layer 0's attn (Attention)" in msg and "\n" not in msg


def test_refusals_name_what_the_sweep_proves():
    """The count refusals give (compiler.checkpoint.supported_text) is docs/family_sweep.json's, and no refusal
    lists a fixed set of "supported model types" any more."""
    from llmc.compiler.checkpoint import SWEEP_MATCHES, supported_text

    root = SCRIPT.parent.parent
    rows = json.loads((root / "docs" / "family_sweep.json").read_text())["rows"]
    assert SWEEP_MATCHES == sum(r["outcome"] == "match" for r in rows.values())
    assert f"{SWEEP_MATCHES} model types match transformers" in supported_text()
    assert "docs/family_sweep.md" in supported_text()
    for path in (root / "compiler").rglob("*.py"):
        assert "supported model types" not in path.read_text().lower(), path


# Knob variants (scripts/family_sweep.py --variants): the family with a knob its released configs set.
VARIANTS = {
    "helium+head_dim": ("match", ""),  # explicit head_dim = width / heads, as Helium-2B's config writes it
    "llama+bias": ("match", ""),  # attention and MLP biases on
}


def test_sweep_knob_variants(sweep):
    rows, table, proc = sweep
    for name, expected in VARIANTS.items():
        _check(name, rows[name], expected, table)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_knob_the_family_lacks_is_named():
    import importlib.util

    spec = importlib.util.spec_from_file_location("family_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    with pytest.raises(sweep.CannotInstantiate, match="no bias knob"):
        sweep._apply_variant("bias", {"hidden_size": 64}, {})
    assert sweep._apply_variant("head_dim", {"head_dim": None, "num_attention_heads": 4, "hidden_size": 64},
                                {})["head_dim"] == 16
