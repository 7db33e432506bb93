"""Hybrid models, first family: LFM2 (short-convolution layers between attention layers), held to transformers.

The short convolution is llmc's ``CausalConv1d`` op on packed tokens with a per-sequence state slot
(llmc.plugins.recurrent): its numpy reference against transformers' own torch functions, the native ONNX Runtime
kernel against the reference (fresh prefills, continued chunks and decodes in one step; chunked = token by
token), then the engine against transformers' greedy tokens: batched and alone, chunked prefill on and off,
a prompt longer than the step budget, through preemption, with prefix caching off (and saying why).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.plugins.recurrent import reference

LFM2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, conv_L_cache=3, block_auto_adjust_ff_dim=False,
            layer_types=["conv", "full_attention", "conv", "conv"])
# The last prompt is longer than the chunked-prefill budget used below (16 tokens a step). No prompt holds the pad
# id 0, which transformers' generate would mask out.
PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2], [(i * 37) % 255 + 1 for i in range(70)])
NEW = 32


def _torch_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, state: np.ndarray | None):
    """transformers' LFM2 path on one sequence ``x`` [n, C]: causal_conv1d_fn from scratch, or, with a conv state
    [C, K] (its cache's layout), causal_conv1d_update token by token. Returns (out [n, C], new state)."""
    import torch
    from transformers.models.lfm2 import modeling_lfm2 as m

    w, b = torch.from_numpy(weight), None if bias is None else torch.from_numpy(bias)
    xs = torch.from_numpy(x.T.copy())[None]  # [1, C, n]
    if state is None:
        return m.causal_conv1d_fn(xs, w, b)[0].T.numpy(), None
    st = torch.from_numpy(state.copy())[None]
    outs = [m.causal_conv1d_update(xs[..., t:t + 1], st, w, b)[0, :, 0].numpy() for t in range(x.shape[0])]
    return np.stack(outs), st[0].numpy()


def test_reference_matches_transformers_conv():
    rng = np.random.default_rng(1)
    C, K, n = 24, 4, 9
    x = rng.standard_normal((n, C), dtype=np.float32)
    w = rng.standard_normal((C, K), dtype=np.float32)
    b = rng.standard_normal(C, dtype=np.float32)
    state = np.zeros((3, C, K - 1), np.float32)
    one = np.asarray([2])
    out = reference.causal_conv1d(x, w, b, one, np.asarray([n]), np.asarray([0, n]), state)
    want, _ = _torch_conv(x, w, b, None)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state[2], x[-(K - 1):].T)  # the slot: the last K-1 inputs, oldest first
    # decode from that state, token by token, against transformers' update on its own [C, K] cache
    more = rng.standard_normal((3, C), dtype=np.float32)
    hf_state = np.concatenate([np.zeros((C, 1), np.float32), x[-(K - 1):].T], axis=1)
    want, _ = _torch_conv(more, w, b, hf_state)
    got = np.concatenate([reference.causal_conv1d(more[t:t + 1], w, b, one, np.asarray([n + 1 + t]),
                                                  np.asarray([0, 1]), state) for t in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # SiLU
    silu = reference.causal_conv1d(x, w, None, one, np.asarray([n]), np.asarray([0, n]), state, activation=1)
    plain = reference.causal_conv1d(x, w, None, one, np.asarray([n]), np.asarray([0, n]), state)
    np.testing.assert_allclose(silu, plain / (1 + np.exp(-plain)), rtol=1e-6)


def _conv_session():
    from onnx import TensorProto, helper

    from llmc.plugins.recurrent import CONV_INPUT_NAMES, CONV_OP_TYPE, DOMAIN
    from llmc.runtime.workers.ort.session import OrtSession

    ints = {"state_slots", "context_lens", "query_start_loc"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in ints else TensorProto.FLOAT, None)
              for n in CONV_INPUT_NAMES]
    node = helper.make_node(CONV_OP_TYPE, list(CONV_INPUT_NAMES), ["out"], domain=DOMAIN, state_idx=1, activation=1)
    graph = helper.make_graph([node], "conv", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])
    return OrtSession(model.SerializeToString(), num_threads=2, spin=False)


def test_native_op_matches_reference_mixed_step_and_chunks():
    """One step packing a fresh prefill, a continued prefill chunk and two decodes (slots out of order), on fresh
    random inputs; then a whole sequence computed in one step equals the same sequence token by token."""
    from llmc.plugins.recurrent import ort_native

    rng = np.random.default_rng(2)
    C, K, slots = 130, 4, 6  # 130 channels: more than one parallel block of 64
    sess = _conv_session()
    kv = [(np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32))]
    other = np.zeros((slots, 5), np.float32)  # array 0: another layer's state, must stay untouched
    state = rng.standard_normal((slots, C, K - 1), dtype=np.float32)
    w = rng.standard_normal((C, K), dtype=np.float32)
    b = rng.standard_normal(C, dtype=np.float32)
    rows = [7, 5, 1, 1]
    x = rng.standard_normal((sum(rows), C), dtype=np.float32)
    feeds = {"x": x, "weight": w, "bias": b, "state_slots": np.asarray([4, 0, 5, 2]),
             "context_lens": np.asarray([7, 20, 9, 3]), "query_start_loc": np.cumsum([0, *rows])}
    want_state = state.copy()
    want = reference.causal_conv1d(x, w, b, feeds["state_slots"], feeds["context_lens"], feeds["query_start_loc"],
                                   want_state, activation=1)
    calls = ort_native.call_count()
    got = sess.run(feeds, kv, outputs=["out"], state=[other, state])[0]
    assert ort_native.call_count() == calls + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-6, atol=1e-6)
    assert not other.any()

    # chunked = token by token: 11 tokens in one step vs a 4-token chunk then 7 decodes, in another slot
    seq = rng.standard_normal((11, C), dtype=np.float32)
    whole = sess.run({**feeds, "x": seq, "state_slots": np.asarray([1]), "context_lens": np.asarray([11]),
                      "query_start_loc": np.asarray([0, 11])}, kv, outputs=["out"], state=[other, state])[0]
    after = state[1].copy()
    state[1] = rng.standard_normal((C, K - 1))  # garbage: a fresh sequence must not read it
    parts = [sess.run({**feeds, "x": seq[:4], "state_slots": np.asarray([1]), "context_lens": np.asarray([4]),
                       "query_start_loc": np.asarray([0, 4])}, kv, outputs=["out"], state=[other, state])[0]]
    for t in range(4, 11):
        parts.append(sess.run({**feeds, "x": seq[t:t + 1], "state_slots": np.asarray([1]),
                               "context_lens": np.asarray([t + 1]), "query_start_loc": np.asarray([0, 1])},
                              kv, outputs=["out"], state=[other, state])[0])
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state[1], after, rtol=1e-6)


def test_native_op_refuses_bad_slots():
    sess = _conv_session()
    kv = [(np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32))]
    state = np.zeros((2, 8, 2), np.float32)
    feeds = {"x": np.ones((2, 8), np.float32), "weight": np.ones((8, 3), np.float32), "bias": np.ones(8, np.float32),
             "state_slots": np.asarray([0, 0]), "context_lens": np.asarray([1, 1]),
             "query_start_loc": np.asarray([0, 1, 2])}
    with pytest.raises(Exception, match="cannot share a state slot"):
        sess.run(feeds, kv, outputs=["out"], state=[state, state])
    with pytest.raises(Exception, match="outside the bound state pool"):
        sess.run({**feeds, "state_slots": np.asarray([0, 7])}, kv, outputs=["out"], state=[state, state])
    with pytest.raises(Exception, match="values per slot"):
        sess.run(feeds | {"state_slots": np.asarray([0, 1])}, kv, outputs=["out"],
                 state=[state, np.zeros((2, 3), np.float32)])


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """(checkpoint, engine dir, transformers model, greedy references) of a random LFM2 with conv layers both before
    and after its attention layer; built with the self-check (its twin has conv layers too)."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.build import BuildOptions, build

    root = tmp_path_factory.mktemp("lfm2")
    cfg = AutoConfig.for_model("lfm2", **LFM2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger than the default init, so that greedy tokens are not one repeated token
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name else 0.2)
            else:
                p.uniform_(0.8, 1.2)
    hf.save_pretrained(root / "ckpt")
    old = os.environ.get("LLMC_SELF_CHECK")
    os.environ["LLMC_SELF_CHECK"] = "1"
    try:
        result = build(root / "ckpt", root / "engine", BuildOptions())
    finally:
        if old is None:
            del os.environ["LLMC_SELF_CHECK"]
        else:
            os.environ["LLMC_SELF_CHECK"] = old
    assert result.build_info["self_check"]["status"] in ("passed", "cached")
    refs = []
    for p in PROMPTS:
        with torch.no_grad():
            refs.append(hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    return root / "ckpt", root / "engine", hf, refs


def test_lfm2_manifest_has_state_arrays_and_attention_only_kv(lfm2):
    _, engine_dir, _, _ = lfm2
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["kv_cache"]["num_layers"] == 1  # only layer 1 attends
    assert manifest["state_cache"] == {"dtype": "float32", "arrays": [
        {"layer": i, "kind": "conv", "shape": [64, 2]} for i in (0, 2, 3)]}
    assert manifest["engine"]["inputs"][-1] == "state_slots"


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_tokens=512),
    dict(kv_cache_tokens=512, max_num_tokens=16),  # chunked prefill: the long prompts over several steps
    dict(kv_cache_tokens=512, enable_chunked_prefill=False, max_num_tokens=256),
], ids=["plain", "chunked16", "no-chunking"])
def test_lfm2_engine_matches_transformers(lfm2, kwargs):
    from llmc.runtime import Engine, SamplingParams

    _, engine_dir, _, refs = lfm2
    engine = Engine.load(engine_dir, **kwargs)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    batched = engine.generate([list(p) for p in PROMPTS], params)
    assert [o.token_ids for o in batched] == refs
    for prompt, ref in zip(PROMPTS, refs, strict=True):  # alone: the same tokens
        assert engine.generate([list(prompt)], params)[0].token_ids == ref
    stats = engine.stats()
    assert stats.state_slots_used == 0 and stats.state_slots_total == 257  # every slot given back
    assert stats.kv_blocks_cached == 0 and stats.cached_prompt_tokens == 0
    assert "not snapshotted" in stats.prefix_caching_disabled_reason
    assert stats.state_bytes == 257 * 3 * 64 * 2 * 4


def test_lfm2_through_preemption(lfm2):
    from llmc.runtime import Engine, SamplingParams

    _, engine_dir, _, refs = lfm2
    engine = Engine.load(engine_dir, kv_cache_tokens=160, max_num_tokens=32)
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == refs
    assert engine.stats().state_slots_used == 0


def test_lfm2_score_matches_transformers_logits(lfm2):
    import torch

    from llmc.runtime import Engine

    _, engine_dir, hf, refs = lfm2
    engine = Engine.load(engine_dir, kv_cache_tokens=512)
    seq = PROMPTS[3] + refs[3]
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].numpy()
    np.testing.assert_allclose(engine.score(seq), want, rtol=1e-4, atol=1e-4)
    assert engine.stats().state_slots_used == 0


def test_lfm2_refusals(lfm2):
    from llmc.compiler.build import BuildOptions, build
    from llmc.errors import UnsupportedError
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine
    from llmc.runtime.speculative.config import SpeculativeConfig

    ckpt, engine_dir, _, _ = lfm2
    with pytest.raises(UnsupportedError, match="short-convolution layers.*--verify-passes"):
        build(ckpt, engine_dir.parent / "v", BuildOptions(verify_passes=True))
    # --quant builds for the CPU engine (tests/test_hybrid_quant.py), not yet for the CUDA engine (which builds these
    # models in fp32: tests/test_hybrid_cuda.py)
    with pytest.raises(UnsupportedError, match="short-convolution layers.*--gpu h100 --quant"):
        build(ckpt, engine_dir.parent / "q", BuildOptions(target="h100", quant=QuantRecipe(quant="fp8")))
    assert not any((engine_dir.parent / d).exists() for d in ("v", "q"))
    with pytest.raises(UnsupportedError, match="speculative decoding"):
        Engine.load(engine_dir, kv_cache_tokens=256, speculative=SpeculativeConfig())
    with pytest.raises(UnsupportedError, match="draft model with recurrent layers"):
        Engine.load(engine_dir, kv_cache_tokens=256).new_speculator(
            SpeculativeConfig(method="draft", draft_model=str(engine_dir)))


@pytest.mark.parametrize("model_type,fields,mechanism", [
    ("kimi_linear", dict(linear_conv_kernel_dim=4), "Kimi Delta Attention"),
    ("jamba", dict(mamba_d_state=8), "Mamba/Mamba2"),
    ("zamba2", dict(mamba_d_state=8), "Mamba/Mamba2"),
    ("mamba2", dict(state_size=8), "Mamba/Mamba2"),
])
def test_other_hybrids_refused_naming_the_mechanism(tmp_path, model_type, fields, mechanism):
    """Families whose recurrent layers are not lowered yet stop before any work (exit 3), naming what is missing."""
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.errors import UnsupportedError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    with pytest.raises(UnsupportedError, match=f"recurrent state.*{mechanism}.*does not lower these") as exc:
        load_checkpoint(tmp_path)
    assert exc.value.exit_code == 3


def test_state_pool_is_held_to_its_budget(lfm2):
    """With a state budget of three slots' real size (``state_cache_bytes``), fewer sequences run at once (never more
    than there are slots, one kept for score()), and the output is the same."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.core.state_cache import StatePool

    _, engine_dir, _, refs = lfm2
    import json

    per_slot = StatePool.bytes_per_slot(json.loads((engine_dir / "manifest.json").read_text())["state_cache"])
    engine = Engine.load(engine_dir, kv_cache_tokens=512, max_num_seqs=8, state_cache_bytes=3 * per_slot)
    assert engine.config.max_num_seqs == 2 and engine.stats().state_slots_total == 3
    assert engine.stats().state_bytes == 3 * per_slot
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:4] for r in refs]


def test_lfm2_moe_matches_transformers(tmp_path, monkeypatch):
    """LFM2-MoE: the same short convolutions beside MoE blocks (a dense first layer, then experts)."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS as HYBRID_PROMPTS
    from llmc.testing.hybrids import greedy, write_hybrid

    hf = write_hybrid("lfm2_moe", tmp_path / "ckpt")
    monkeypatch.setenv("LLMC_SELF_CHECK", "0")  # the LFM2 fixture above runs the self-check
    build(tmp_path / "ckpt", tmp_path / "engine", BuildOptions())
    refs = greedy(hf, HYBRID_PROMPTS, NEW)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for kwargs in (dict(kv_cache_tokens=512, max_num_tokens=16), dict(kv_cache_tokens=160, max_num_tokens=32)):
        engine = Engine.load(tmp_path / "engine", **kwargs)
        assert [o.token_ids for o in engine.generate([list(p) for p in HYBRID_PROMPTS], params)] == refs
    assert engine.stats().num_preemptions > 0


def test_lfm2_of_attention_layers_only_is_a_plain_model(tmp_path):
    """An LFM2 config without conv layers (transformers' default) builds with no state pool and no state_slots input."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams

    cfg = AutoConfig.for_model("lfm2", **{**LFM2, "num_hidden_layers": 2, "layer_types": None})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    build(tmp_path / "ckpt", tmp_path / "engine", BuildOptions())
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert "state_cache" not in manifest and "state_slots" not in manifest["engine"]["inputs"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    engine = Engine.load(tmp_path / "engine", kv_cache_tokens=256)
    assert engine.generate([list(PROMPTS[0])], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids == ref
    assert engine.stats().state_slots_total == 0 and engine.stats().prefix_caching_disabled_reason == ""
