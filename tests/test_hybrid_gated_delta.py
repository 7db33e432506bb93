"""Hybrid models with Gated DeltaNet layers (Qwen3.5, Qwen3-Next): the gated delta rule held to transformers.

llmc's ``GatedDeltaRule`` op runs the recurrence token by token on packed tokens with per-sequence state slots
(llmc.plugins.recurrent). Its numpy reference is held to transformers' own chunked (prefill) and recurrent (decode)
torch functions; the native ONNX Runtime kernel to the reference on a step that packs fresh prefills, a continued
chunk and decodes, and chunked = token by token; then the engines of tiny random Qwen3.5 and Qwen3-Next models to
transformers' greedy tokens (batched, alone, chunked prefill, preemption).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.plugins.recurrent import reference

HK, HV, DK, DV = 2, 4, 8, 6


def _inputs(rng, t):
    q = rng.standard_normal((t, HK * DK), dtype=np.float32)
    k = rng.standard_normal((t, HK * DK), dtype=np.float32)
    v = rng.standard_normal((t, HV * DV), dtype=np.float32)
    g = -rng.uniform(0.01, 1.0, (t, HV)).astype(np.float32)  # log decays, <= 0
    beta = rng.uniform(0.0, 1.0, (t, HV)).astype(np.float32)
    return q, k, v, g, beta


def _hf(fn, q, k, v, g, beta, state=None):
    import torch

    t = q.shape[0]

    def th(x, *shape):
        return torch.from_numpy(x.copy()).reshape(1, t, *shape)

    out, final = fn(th(q, HK, DK), th(k, HK, DK), th(v, HV, DV), g=th(g, HV), beta=th(beta, HV),
                    initial_state=None if state is None else torch.from_numpy(state.copy())[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0].reshape(t, HV * DV).numpy(), final[0].numpy()


def test_reference_matches_transformers_chunked_and_recurrent_forms():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    rng = np.random.default_rng(3)
    q, k, v, g, beta = _inputs(rng, 70)  # more than one of transformers' 64-token chunks
    state = np.zeros((2, HV, DK, DV), np.float32)
    out = reference.gated_delta_rule(q, k, v, g, beta, np.asarray([1]), np.asarray([70]), np.asarray([0, 70]), state,
                                     HK, HV)
    want, final = _hf(m.torch_chunk_gated_delta_rule, q, k, v, g, beta)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state[1], final, rtol=2e-4, atol=2e-4)
    # decode three tokens from that state: transformers' recurrent form
    q2, k2, v2, g2, b2 = _inputs(rng, 3)
    want, final = _hf(m.torch_recurrent_gated_delta_rule, q2, k2, v2, g2, b2, state[1])
    got = np.concatenate([reference.gated_delta_rule(q2[i:i + 1], k2[i:i + 1], v2[i:i + 1], g2[i:i + 1], b2[i:i + 1],
                                                     np.asarray([1]), np.asarray([71 + i]), np.asarray([0, 1]), state,
                                                     HK, HV) for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state[1], final, rtol=2e-4, atol=2e-4)


def _delta_session():
    from onnx import TensorProto, helper

    from llmc.plugins.recurrent import DELTA_INPUT_NAMES, DELTA_OP_TYPE, DOMAIN
    from llmc.runtime.workers.ort.session import OrtSession

    ints = {"state_slots", "context_lens", "query_start_loc"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in ints else TensorProto.FLOAT, None)
              for n in DELTA_INPUT_NAMES]
    node = helper.make_node(DELTA_OP_TYPE, list(DELTA_INPUT_NAMES), ["out"], domain=DOMAIN, state_idx=0,
                            num_k_heads=HK, num_v_heads=HV, use_qk_l2norm=1)
    graph = helper.make_graph([node], "gdn", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])
    return OrtSession(model.SerializeToString(), num_threads=2, spin=False)


def test_native_op_matches_reference_mixed_step_and_chunks():
    rng = np.random.default_rng(4)
    sess = _delta_session()
    kv = [(np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32))]
    slots = 5
    state = rng.standard_normal((slots, HV, DK, DV), dtype=np.float32)
    rows = [9, 4, 1, 1]
    q, k, v, g, beta = _inputs(rng, sum(rows))
    feeds = {"query": q, "key": k, "value": v, "g": g, "beta": beta, "state_slots": np.asarray([3, 0, 4, 1]),
             "context_lens": np.asarray([9, 12, 30, 2]), "query_start_loc": np.cumsum([0, *rows])}
    want_state = state.copy()
    want = reference.gated_delta_rule(q, k, v, g, beta, feeds["state_slots"], feeds["context_lens"],
                                      feeds["query_start_loc"], want_state, HK, HV)
    got = sess.run(feeds, kv, outputs=["out"], state=[state])[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-5)

    # chunked = token by token, in slot 2 (garbage in it: a fresh sequence must not read it)
    q, k, v, g, beta = _inputs(rng, 12)

    def run(a, b):
        return sess.run({"query": q[a:b], "key": k[a:b], "value": v[a:b], "g": g[a:b], "beta": beta[a:b],
                         "state_slots": np.asarray([2]), "context_lens": np.asarray([b]),
                         "query_start_loc": np.asarray([0, b - a])}, kv, outputs=["out"], state=[state])[0]

    whole = run(0, 12)
    after = state[2].copy()
    state[2] = rng.standard_normal((HV, DK, DV))
    parts = np.concatenate([run(0, 5)] + [run(t, t + 1) for t in range(5, 12)])
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state[2], after, rtol=1e-4, atol=1e-5)


NEW = 32


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"])
def family(request, tmp_path_factory):
    """(model_type, engine dir, transformers model, greedy references). (The build's self-check runs on the LFM2 and
    Nemotron-H fixtures; test_hybrid_mamba2.py checks that twins of Qwen3.5-sized configs keep their layer kinds.)"""
    from llmc.compiler.build import BuildOptions, build
    from llmc.testing.hybrids import PROMPTS, greedy, write_hybrid

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    hf = write_hybrid(model_type, root / "ckpt")
    build(root / "ckpt", root / "engine", BuildOptions())
    return model_type, root / "engine", hf, greedy(hf, PROMPTS, NEW)


def test_engine_matches_transformers(family):
    """4 prompts x 32 greedy tokens: batched and alone with 16-token prefill chunks, batched without chunking,
    batched through preemption; every state slot given back; prefix caching off, saying why."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS

    _, engine_dir, _, refs = family
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["kv_cache"]["num_layers"] == 1
    assert [(a["layer"], a["kind"]) for a in manifest["state_cache"]["arrays"]] == [
        (i, kind) for i in (0, 2, 3) for kind in ("conv", "gated_delta")]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    engine = Engine.load(engine_dir, kv_cache_tokens=512, max_num_tokens=16)
    assert [o.token_ids for o in engine.generate([list(p) for p in PROMPTS], params)] == refs
    if family[0] == "qwen3_5_text":  # batched = alone (once per file: the same step code runs for every family)
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            assert engine.generate([list(prompt)], params)[0].token_ids == ref
    stats = engine.stats()
    assert stats.state_slots_used == 0 and "not snapshotted" in stats.prefix_caching_disabled_reason
    engine = Engine.load(engine_dir, kv_cache_tokens=512, enable_chunked_prefill=False, max_num_tokens=256)
    assert [o.token_ids for o in engine.generate([list(p) for p in PROMPTS], params)] == refs
    engine = Engine.load(engine_dir, kv_cache_tokens=160, max_num_tokens=32)
    assert [o.token_ids for o in engine.generate([list(p) for p in PROMPTS], params)] == refs
    assert engine.stats().num_preemptions > 0 and engine.stats().state_slots_used == 0


def test_score_matches_transformers_logits(family):
    import torch

    from llmc.runtime import Engine
    from llmc.testing.hybrids import PROMPTS

    _, engine_dir, hf, refs = family
    seq = PROMPTS[3] + refs[3]
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].numpy()
    # transformers' prefill is its chunked form, llmc's the recurrence: equal up to float32 rounding
    np.testing.assert_allclose(Engine.load(engine_dir, kv_cache_tokens=512).score(seq), want, rtol=1e-2, atol=5e-3)
