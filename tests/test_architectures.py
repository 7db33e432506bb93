"""Every supported architecture, end to end on the CPU target, against transformers.

Coverage comes from the generality of the tracer (transformers' own model classes) and of the
passes; these tests are what makes a model_type "supported" (compiler.checkpoint.SUPPORTED_MODEL_TYPES).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from llmc.compiler.checkpoint import SUPPORTED_MODEL_TYPES
from llmc.runtime import Engine, SamplingParams

# Which fusions must fire (>= 1 match) and which must not (0) for each family: a pass that misses a
# family's standard block is a lost optimisation; one that fires on a variant is a wrong answer.
EXPECT = {
    "llama": {"rms-norm": True, "rotary-embedding": True, "pack-projections": True, "swiglu": True},
    "mistral": {"rms-norm": True, "rotary-embedding": True, "pack-projections": True, "swiglu": True},
    "qwen2": {"rms-norm": True, "rotary-embedding": True, "pack-projections": True, "swiglu": True},
    "qwen3": {"rms-norm": True, "rotary-embedding": True, "pack-projections": True, "swiglu": True},
    "gemma2": {"rms-norm": True, "rotary-embedding": True, "swiglu": False},  # GELU-tanh gating
    "gemma3_text": {"rms-norm": True, "rotary-embedding": True, "swiglu": False},
    # q/k/v and gate/up already packed in the checkpoint. (Not asserted either way, lost optimisations
    # rather than variants: rotary-embedding, whose pattern has no cos/sin scaling (longrope scales
    # them), and swiglu, which does not match the chunked gate_up form.)
    "phi3": {"rms-norm": True, "skip-rms-norm": True, "pack-projections": False},
    "gpt2": {"rms-norm": False, "skip-rms-norm": False, "rotary-embedding": False, "swiglu": False},  # LayerNorm, GELU
    "gpt_neox": {"rms-norm": False, "rotary-embedding": True, "swiglu": False},  # partial rotary, LayerNorm
    "mixtral": {"rms-norm": True, "rotary-embedding": True},
    "qwen3_moe": {"rms-norm": True, "rotary-embedding": True},
}


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_every_supported_type_is_tested():
    assert set(EXPECT) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(EXPECT))
def test_family_matches_transformers(model_type, family_build):
    ckpt, engine_dir = family_build(model_type)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = Engine.load(engine_dir)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    # Lengths cross the fixtures' sliding window (24) so local attention layers are exercised.
    prompts = [rng.integers(4, 512, n).tolist() for n in (3, 20, 45)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    single = [engine.generate([p], params)[0].token_ids for p in prompts]
    for p, got in zip(prompts, single, strict=True):
        assert got == _greedy(hf, p, 32), f"{model_type}: seed {seed}, prompt length {len(p)}"
    batched = [o.token_ids for o in engine.generate(prompts, params)]
    assert batched == single, f"{model_type}: packed batch differs from single-prompt runs (seed {seed})"

    report = json.loads((engine_dir / "report.json").read_text())
    matches = {p["pass"]: p["matches"] for p in report["passes"]}
    for name, fires in EXPECT[model_type].items():
        assert (matches[name] > 0) == fires, f"{model_type}: pass {name} matched {matches[name]} times"
    with open(ckpt / "config.json") as fh:
        assert json.load(fh)["model_type"] == model_type


def test_longrope_recompute_chunked_preempted_and_scored(family_build):
    """Phi-3 longrope: factors switch past original_max_position_embeddings (32 in the fixture), where
    transformers recomputes the cache. Through chunked prefill (8-token budget) and a pool small enough
    to preempt, the engine must still equal transformers; score() must equal one full forward."""
    ckpt, engine_dir = family_build("phi3")
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    threshold = hf.config.rope_parameters["original_max_position_embeddings"]
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["engine"]["rope_recompute_at"] == threshold
    assert "rope_lengths" in manifest["engine"]["inputs"]

    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    # Below the threshold (crosses while decoding), at it, just past it, and well past it.
    prompts = [rng.integers(4, 512, n).tolist() for n in (5, threshold, threshold + 1, 40)]
    engine = Engine.load(engine_dir, max_num_tokens=8, kv_cache_tokens=96)
    # Cached blocks are keyed by tokens alone, but their keys depend on the factors: no prefix caching.
    assert not engine.scheduler.blocks.enable_prefix_caching
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _greedy(hf, p, 32), f"seed {seed}, prompt length {len(p)}"
    counters = engine.scheduler.counters
    assert counters.rope_recomputes == 2  # the prompts of 5 and 32 tokens crossed it
    assert counters.num_preemptions > 0  # the pool of 6 blocks cannot hold four sequences

    ids = rng.integers(4, 512, 45).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = engine.score(ids)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
