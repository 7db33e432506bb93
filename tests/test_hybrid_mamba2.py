"""Hybrid models with Mamba2 layers (Nemotron-H, Falcon-H1, Granite-4 hybrid, Bamba): the SSD scan held to transformers.

llmc's ``SsdScan`` op runs Mamba2's selective scan token by token on packed tokens with per-sequence state slots
(llmc.plugins.recurrent); the layers' causal conv1d is the ``CausalConv1d`` op LFM2 uses. The numpy reference is held
to transformers' own chunked (prefill) and recurrent (decode) torch functions, the native kernel to the reference on
a mixed step and chunked = token by token, and the engines of tiny random models of each family to transformers'
greedy tokens (batched, alone, chunked prefill, preemption).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.plugins.recurrent import reference

H, G, P, N = 4, 2, 3, 5


def _inputs(rng, t):
    x = rng.standard_normal((t, H * P), dtype=np.float32)
    b = rng.standard_normal((t, G * N), dtype=np.float32)
    c = rng.standard_normal((t, G * N), dtype=np.float32)
    dt = rng.standard_normal((t, H), dtype=np.float32)
    return x, b, c, dt


def _params(rng):
    a_log = np.log(rng.uniform(1, 8, H)).astype(np.float32)
    return a_log, rng.standard_normal(H, dtype=np.float32), rng.standard_normal(H, dtype=np.float32)


def test_reference_matches_transformers_chunked_and_recurrent_forms():
    import torch
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    rng = np.random.default_rng(5)
    x, b, c, dt = _inputs(rng, 37)  # more than two of transformers' 16-token chunks
    a_log, d, dt_bias = _params(rng)
    state = np.zeros((2, H, P, N), np.float32)
    got = reference.ssd_scan(x, b, c, dt, a_log, d, dt_bias, np.asarray([1]), np.asarray([37]), np.asarray([0, 37]),
                             state, H, G, 0.0, 5.0)
    th = torch.from_numpy
    a = -torch.exp(th(a_log))
    want, final = m.mamba2_chunk_scan(th(x).reshape(1, 37, H, P), th(dt)[None], a, th(b).reshape(1, 37, G, N),
                                      th(c).reshape(1, 37, G, N), chunk_size=16, D=th(d), dt_bias=th(dt_bias),
                                      dt_softplus=True, dt_limit=(0.0, 5.0), return_final_states=True)
    np.testing.assert_allclose(got, want.reshape(37, H * P).numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state[1], final[0].numpy(), rtol=1e-4, atol=1e-4)
    # decode two tokens from that state: transformers' selective_state_update
    hf_state = th(state[1].copy())[None]
    x2, b2, c2, dt2 = _inputs(rng, 2)
    for i in range(2):
        want = m.mamba2_selective_state_update(
            hf_state, th(x2[i]).reshape(1, H, P), th(dt2[i])[None, :, None].expand(1, H, P),
            a[:, None, None].expand(H, P, N), th(b2[i]).reshape(1, G, N), th(c2[i]).reshape(1, G, N),
            th(d)[:, None].expand(H, P), dt_bias=th(dt_bias)[:, None].expand(H, P), dt_softplus=True)
        got = reference.ssd_scan(x2[i:i + 1], b2[i:i + 1], c2[i:i + 1], dt2[i:i + 1], a_log, d, dt_bias,
                                 np.asarray([1]), np.asarray([38 + i]), np.asarray([0, 1]), state, H, G)
        np.testing.assert_allclose(got, want.reshape(1, H * P).numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state[1], hf_state[0].numpy(), rtol=1e-4, atol=1e-4)


def _ssd_session():
    from onnx import TensorProto, helper

    from llmc.plugins.recurrent import DOMAIN, SSD_INPUT_NAMES, SSD_OP_TYPE
    from llmc.runtime.workers.ort.session import OrtSession

    ints = {"state_slots", "context_lens", "query_start_loc"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in ints else TensorProto.FLOAT, None)
              for n in SSD_INPUT_NAMES]
    node = helper.make_node(SSD_OP_TYPE, list(SSD_INPUT_NAMES), ["out"], domain=DOMAIN, state_idx=0, num_heads=H,
                            n_groups=G, dt_min=0.0, dt_max=float("inf"))
    graph = helper.make_graph([node], "ssd", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])
    return OrtSession(model.SerializeToString(), num_threads=2, spin=False)


def test_native_op_matches_reference_mixed_step_and_chunks():
    rng = np.random.default_rng(6)
    sess = _ssd_session()
    kv = [(np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32))]
    state = rng.standard_normal((4, H, P, N), dtype=np.float32)
    a_log, d, dt_bias = _params(rng)
    rows = [6, 3, 1, 1]
    x, b, c, dt = _inputs(rng, sum(rows))
    feeds = {"x": x, "B": b, "C": c, "dt": dt, "A_log": a_log, "D": d, "dt_bias": dt_bias,
             "state_slots": np.asarray([2, 0, 3, 1]), "context_lens": np.asarray([6, 10, 21, 2]),
             "query_start_loc": np.cumsum([0, *rows])}
    want_state = state.copy()
    want = reference.ssd_scan(x, b, c, dt, a_log, d, dt_bias, feeds["state_slots"], feeds["context_lens"],
                              feeds["query_start_loc"], want_state, H, G)
    got = sess.run(feeds, kv, outputs=["out"], state=[state])[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-5)

    x, b, c, dt = _inputs(rng, 9)

    def run(lo, hi):
        return sess.run({**feeds, "x": x[lo:hi], "B": b[lo:hi], "C": c[lo:hi], "dt": dt[lo:hi],
                         "state_slots": np.asarray([1]), "context_lens": np.asarray([hi]),
                         "query_start_loc": np.asarray([0, hi - lo])}, kv, outputs=["out"], state=[state])[0]

    whole = run(0, 9)
    after = state[1].copy()
    state[1] = rng.standard_normal((H, P, N))
    parts = np.concatenate([run(0, 4)] + [run(t, t + 1) for t in range(4, 9)])
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state[1], after, rtol=1e-4, atol=1e-5)


NEW = 32


@pytest.fixture(scope="module", params=["nemotron_h", "falcon_h1", "granitemoehybrid", "bamba"])
def family(request, tmp_path_factory):
    """(model_type, engine dir, transformers model, greedy references); Nemotron-H built with the self-check."""
    import os

    from llmc.compiler.build import BuildOptions, build
    from llmc.testing.hybrids import PROMPTS, greedy, write_hybrid

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    hf = write_hybrid(model_type, root / "ckpt")
    old = os.environ.get("LLMC_SELF_CHECK")
    os.environ["LLMC_SELF_CHECK"] = "1" if model_type == "nemotron_h" else "0"
    try:
        result = build(root / "ckpt", root / "engine", BuildOptions())
    finally:
        if old is None:
            del os.environ["LLMC_SELF_CHECK"]
        else:
            os.environ["LLMC_SELF_CHECK"] = old
    if model_type == "nemotron_h":
        assert result.build_info["self_check"]["status"] in ("passed", "cached")
    return model_type, root / "engine", hf, greedy(hf, PROMPTS, NEW)


def test_engine_matches_transformers(family):
    """4 prompts x 32 greedy tokens: batched and alone with 16-token prefill chunks, batched without chunking and
    through preemption; every state slot given back."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS

    _, engine_dir, _, refs = family
    kinds = {a["kind"] for a in json.loads((engine_dir / "manifest.json").read_text())["state_cache"]["arrays"]}
    assert kinds == {"conv", "ssm"}
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    engine = Engine.load(engine_dir, kv_cache_tokens=512, max_num_tokens=16)
    assert [o.token_ids for o in engine.generate([list(p) for p in PROMPTS], params)] == refs
    if family[0] == "nemotron_h":  # batched = alone (once per file: the same step code runs for every family)
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            assert engine.generate([list(prompt)], params)[0].token_ids == ref
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
    np.testing.assert_allclose(Engine.load(engine_dir, kv_cache_tokens=512).score(seq), want, rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("model_type,fields,kinds", [
    ("lfm2", dict(num_hidden_layers=16, full_attn_idxs=[2, 5, 8, 10, 12, 14]), {"conv", "full_attention"}),
    ("qwen3_5_text", dict(num_hidden_layers=24), {"linear_attention", "full_attention"}),
    ("granitemoehybrid", dict(num_hidden_layers=8, layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 4),
     {"linear_attention", "full_attention"}),
    ("bamba", dict(num_hidden_layers=12, attn_layer_indices=[5, 11]), {"linear_attention", "full_attention"}),
])
def test_self_check_twins_keep_recurrent_and_attention_layers(model_type, fields, kinds):
    """The self-check's shrunk twin of a full-size hybrid config keeps a layer of each kind (Bamba: its attention
    layer indices renumbered, not dropped) and Mamba2 widths transformers' config validation accepts."""
    from transformers import AutoConfig

    from llmc.compiler.selfcheck import shrink_config

    config = {**AutoConfig.for_model(model_type, **fields).to_dict(), "model_type": model_type}
    twin = shrink_config(config)
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in twin.items() if k != "model_type"})
    assert set(cfg.layer_types if model_type != "bamba" else cfg.layers_block_type) == kinds
    assert cfg.num_hidden_layers < config["num_hidden_layers"]
