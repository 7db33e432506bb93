"""Gemma 4 (``gemma4_text``): layers of other KV geometries and KV-shared layers, held to transformers.

The E2B/E4B-style fixture (per-layer input embeddings, KV-shared layers, double-wide MLPs) is built in
tests/test_mechanisms.py (``llmc.testing.tried_families``); here the 26B/31B-style one: full-attention layers
with twice the head size, fewer KV heads and keys reused as values (``attention_k_eq_v``), and the MoE block
beside the dense MLP. Plus the per-layer KV pool the runtime allocates for such models.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime.core.kv_cache import KVPool, layer_geometry

PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2])  # the second crosses the window (16)
GEMMA4_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, head_dim=16, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                  attention_k_eq_v=True, num_global_key_value_heads=1, global_head_dim=32, enable_moe_block=True,
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)


def test_layer_geometry_and_pool():
    layers = [{"num_kv_heads": 2, "head_size": 16}, {"num_kv_heads": 1, "head_size": 32}, {"shares": 0}]
    assert layer_geometry(3, 2, 16, layers) == [(0, 2, 16), (1, 1, 32), (0, 2, 16)]
    assert layer_geometry(2, 4, 8) == [(0, 4, 8), (1, 4, 8)]
    pool = KVPool.allocate(3, 5, 2, 4, 16, "float32", layers)
    assert pool.layers[1][0].shape == (5, 1, 4, 32) and pool.layers[2][0] is pool.layers[0][0]
    assert len(pool.owned()) == 2
    # bytes: K and V, per token (2*16 + 1*32) floats, 4 tokens a block; the shared layer costs nothing
    assert KVPool.bytes_per_block(3, 2, 4, 16, "float32", layers) == 2 * (32 + 32) * 4 * 4
    rng = np.random.default_rng(0)
    pool.layers[0][0][1] = rng.standard_normal((2, 4, 16))
    pool.copy_blocks([(1, 3)])
    np.testing.assert_array_equal(pool.layers[2][0][3], pool.layers[0][0][1])
    for bad in ([{"shares": 2}, {"num_kv_heads": 1, "head_size": 8}], [{"num_kv_heads": 0, "head_size": 8}] * 2,
                [{"num_kv_heads": 1, "head_size": 8}]):
        with pytest.raises(LlmcError):
            layer_geometry(2, 1, 8, bad)


def test_the_self_checks_twin_keeps_gemma4s_per_layer_geometry():
    """The twin of a 31B-shaped config: per-layer head sizes and KV heads scaled as the global ones, full-attention
    layers still wider than sliding ones; of an E2B-shaped one: KV-shared layers of both kinds kept."""
    from llmc.compiler.selfcheck import shrink_config

    big = dict(GEMMA4_MOE, hidden_size=5376, head_dim=256, num_attention_heads=32, num_key_value_heads=16,
               num_hidden_layers=60, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
               per_layer_config={str(i): {"head_dim": 512, "num_key_value_heads": 4} for i in range(5, 60, 6)},
               model_type="gemma4_text")
    twin = shrink_config(big)
    assert twin["num_hidden_layers"] == 6 and twin["layer_types"][-1] == "full_attention"
    assert twin["per_layer_config"] == {"5": {"head_dim": 2 * twin["head_dim"], "num_key_value_heads": 2}}
    assert twin["num_attention_heads"] % 2 == 0
    e2b = dict(num_hidden_layers=35, num_kv_shared_layers=20, hidden_size=1536, head_dim=256, num_attention_heads=8,
               num_key_value_heads=1, hidden_size_per_layer_input=256, model_type="gemma4_text",
               layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
               per_layer_config={str(i): {"head_dim": 512} for i in range(4, 35, 5)})
    twin = shrink_config(e2b)
    # layers 0-4 (both kinds) before the shared ones, then shared layers 15-19 (both kinds)
    assert twin["num_hidden_layers"] == 10 and twin["num_kv_shared_layers"] == 5
    assert twin["layer_types"] == e2b["layer_types"][:5] * 2
    assert set(twin["per_layer_config"]) == {"4", "9"} and twin["hidden_size_per_layer_input"] == 8


def test_gemma4_moe_k_eq_v_matches_transformers(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    ckpt = tmp_path / "ckpt"
    tokenizer = train_bpe_tokenizer(vocab_size=512, model_max_length=256)
    cfg = AutoConfig.for_model("gemma4_text", **GEMMA4_MOE, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    save_tokenizer(tokenizer, ckpt)
    engine_dir = tmp_path / "engine"
    build(ckpt, engine_dir, BuildOptions())  # (the self-check runs on the E2B-style family in test_mechanisms.py)
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["kv_cache"]["layers"] == [{"num_kv_heads": 2, "head_size": 16}, {"num_kv_heads": 1,
                                              "head_size": 32}] * 2

    engine = Engine.load(engine_dir, kv_cache_tokens=512)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    batched = engine.generate([list(p) for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (prompt, out.token_ids, ref)
        # alone, and again with the prompt's blocks in the prefix cache: the same tokens
        assert engine.generate([list(prompt)], params)[0].token_ids == ref


def test_gemma4_cuda_program_matches_transformers(tmp_path):
    """The E2B-style fixture's CUDA engine (built here with no GPU, float32), run by torch on the CPU: per-layer
    cache shapes and KV-shared layers in the torch pool too."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.tried_families import write_tried_family

    ckpt = write_tried_family("gemma4_text", tmp_path / "ckpt")
    build(ckpt, tmp_path / "engine", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    engine = Engine.load(tmp_path / "engine", device="cpu")
    assert engine.manifest["kv_cache"]["layers"][3:] == [{"shares": 1}, {"shares": 1}, {"shares": 2}]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (prompt, out.token_ids, ref)
