"""The self-check's twins keep what each family's modules assume (issue 48): heads x head_dim equal to the width
where a projection is hidden x hidden (Helium), linear-attention head geometry, Mamba2's d_ssm = heads x head_dim,
MoE sizes. Real-world-shaped configs shrink into twins transformers runs; a tiny Helium whose heads x head_dim is
its width builds with the self-check on and matches; a twin transformers cannot run is llmc's bug (exit 70), a
config transformers itself cannot run one line (exit 2)."""

from __future__ import annotations

import json

import pytest

from llmc.compiler import selfcheck, twin_fault

_GDN_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 8
# The geometry of released checkpoints, written from their config.json files (Falcon-H1: transformers' model doc
# table), into transformers' own config classes; sizes that do not shape a layer are left at the class defaults.
REAL_WORLD = {
    "helium-2b": ("HeliumConfig", dict(vocab_size=48000, hidden_size=2560, intermediate_size=7040,
                                       num_hidden_layers=24, num_attention_heads=20, num_key_value_heads=20,
                                       head_dim=128)),
    "qwen3.5-9b-text": ("Qwen3_5TextConfig", dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                                                  num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                                                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                                                  linear_key_head_dim=128, linear_value_head_dim=128,
                                                  linear_conv_kernel_dim=4, layer_types=_GDN_LAYERS)),
    "falcon-h1-1.5b": ("FalconH1Config", dict(vocab_size=65537, hidden_size=2048, intermediate_size=4096,
                                              num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                              head_dim=128, mamba_n_heads=48, mamba_d_head=64, mamba_d_ssm=3072,
                                              mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4)),
    "llama-3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, tie_word_embeddings=True,
                                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192))),
    "gemma-3-4b-text": ("Gemma3TextConfig", dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                                                 num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                                 head_dim=256, sliding_window=1024, query_pre_attn_scalar=256)),
}
# The one size the twin keeps is the vocabulary; these tests cut it (and the token ids in it) to stay light.
_SMALL_VOCAB = 512


def _released(name: str) -> dict:
    import transformers

    cls, fields = REAL_WORLD[name]
    return getattr(transformers, cls)(**fields).to_dict()


@pytest.mark.parametrize("name", sorted(REAL_WORLD))
def test_real_world_configs_shrink_into_twins_transformers_runs(name, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    config = _released(name)
    twin = selfcheck.shrink_config(config)
    width, heads, dim = twin["hidden_size"], twin["num_attention_heads"], twin["head_dim"]
    assert width <= 256 and dim <= 32 and twin["num_hidden_layers"] < config["num_hidden_layers"]
    tied = config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]
    assert (heads * dim == width) == tied, twin
    if "linear_num_key_heads" in twin:
        assert twin["linear_num_value_heads"] % twin["linear_num_key_heads"] == 0
        assert twin["linear_num_key_heads"] <= 2 and twin["linear_key_head_dim"] <= 16
        assert set(twin["layer_types"]) == {"linear_attention", "full_attention"}
    if "mamba_d_ssm" in twin:
        assert twin["mamba_d_ssm"] == twin["mamba_n_heads"] * twin["mamba_d_head"] <= 128
        assert twin["mamba_n_heads"] % twin["mamba_n_groups"] == 0
    light = {k: v for k, v in twin.items() if not k.endswith("_token_id")}
    selfcheck.write_twin(dict(light, vocab_size=_SMALL_VOCAB), tmp_path / "twin")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([[5, 17, 33, 90, 7, 250]])).logits
    assert logits.shape == (1, 6, _SMALL_VOCAB) and torch.isfinite(logits).all()


HELIUM = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, head_dim=16, max_position_embeddings=512)


def test_helium_whose_heads_times_head_dim_is_its_width_builds_and_matches(monkeypatch, tmp_path):
    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS, greedy, write_hybrid

    monkeypatch.setenv("LLMC_SELF_CHECK", "1")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    hf = write_hybrid("helium", tmp_path / "ckpt", fields=HELIUM)
    twin = selfcheck.shrink_config(json.loads((tmp_path / "ckpt" / "config.json").read_text()))
    assert twin["num_attention_heads"] * twin["head_dim"] == twin["hidden_size"]
    result = build(tmp_path / "ckpt", tmp_path / "engine", BuildOptions())
    assert result.build_info["self_check"]["status"] == "passed"
    engine = Engine.load(tmp_path / "engine", kv_cache_tokens=512)
    got = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == greedy(hf, PROMPTS, 8)


def test_a_twin_transformers_cannot_run_is_llmcs_bug_and_a_config_it_cannot_run_is_one_line():
    config = _released("helium-2b")
    cut = selfcheck.cut_like_twin(config)
    assert cut["num_hidden_layers"] == 2 and cut["hidden_size"] == 2560
    broken_twin = dict(selfcheck.shrink_config(config), hidden_size=32)  # what the old shrinking made
    failed = twin_fault.TransformersFailed("forward", RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    verdict = twin_fault.blame(failed, config, cut, broken_twin, "helium")
    assert isinstance(verdict, twin_fault.TwinBug) and '"hidden_size": 32' in str(verdict)
    # Qwen3.5 with linear-attention layers only: transformers' own forward cannot size its attention mask
    only_linear = dict(_released("qwen3.5-9b-text"), layer_types=["linear_attention"] * 32)
    cut = selfcheck.cut_like_twin(only_linear)
    failed = twin_fault.TransformersFailed("forward", ValueError("get_mask_sizes"))
    verdict = twin_fault.blame(failed, only_linear, cut, selfcheck.shrink_config(only_linear), "qwen3_5_text")
    assert type(verdict) is twin_fault.LlmcError and verdict.exit_code == 2, verdict
    assert "itself cannot run" in str(verdict) and "'layer_types'" in str(verdict) and "\n" not in str(verdict)


def test_a_linear_attention_only_qwen3_5_is_refused_in_one_line_naming_transformers(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from llmc.cli.main import cli
    from llmc.testing.hybrids import HYBRID_CONFIGS, write_hybrid

    monkeypatch.setenv("LLMC_SELF_CHECK", "1")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    write_hybrid("qwen3_5_text", tmp_path / "ckpt",
                 fields=dict(HYBRID_CONFIGS["qwen3_5_text"], layer_types=["linear_attention"] * 4))
    result = CliRunner().invoke(cli, ["build", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")])
    err = result.stderr if hasattr(result, "stderr") else result.output
    assert result.exit_code == 2, err
    last = [line for line in err.strip().splitlines() if line.strip()][-1]
    assert last.startswith("error: transformers ") and "itself cannot run this qwen3_5_text config" in last
    assert "'layer_types'" in last and "Traceback" not in err and not (tmp_path / "out").exists()
