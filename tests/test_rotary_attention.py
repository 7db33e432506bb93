"""``llmc.RotaryPagedAttention``: packed QKV + rotary + PagedAttention in one native node.

Differential, on fresh random inputs (normal draws for Q/K/V and the caches' prior contents, real
rotary angles of random positions):

- the native op against the same computation unfused in ONNX Runtime (Split, ONNX's own
  ``RotaryEmbedding`` kernel, Reshape, the native ``PagedAttention``): caches bit-identical, outputs
  bit-identical (same arithmetic on the same values);
- the native op against the numpy reference (``reference.rotary_paged_attention``);
- the backend fusion on a traced engine: the fused and the unfused build of the same checkpoint give
  the same logits, and the fused graph has one attention node per layer and no RotaryEmbedding.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from llmc.compiler.backends import onnxruntime as ort_backend
from llmc.plugins.paged_attention import INPUT_NAMES, ROTARY_OP_TYPE, ort_native, reference
from llmc.testing.ort_sessions import native_session
from llmc.testing.paged_attention import make_case

F, I64 = TensorProto.FLOAT, TensorProto.INT64
SEQ = INPUT_NAMES[3:]  # slot_mapping, block_tables, context_lens, query_start_loc


def _attrs(hq, hkv, d, **extra):
    return dict(layer_idx=0, num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d ** -0.5, **extra)


def _seq_inputs():
    return [helper.make_tensor_value_info(n, I64, None) for n in SEQ]


def _model(graph) -> bytes:
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("llmc", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _fused_graph(hq, hkv, d, typed_shapes=True, **extra) -> bytes:
    w = (hq + 2 * hkv) * d if typed_shapes else "W"
    node = helper.make_node(ROTARY_OP_TYPE, ["qkv", "cos", "sin", *SEQ], ["out"], domain="llmc",
                            **_attrs(hq, hkv, d, **extra))
    g = helper.make_graph([node], "fused", [helper.make_tensor_value_info("qkv", F, [1, "T", w]),
                                            helper.make_tensor_value_info("cos", F, None),
                                            helper.make_tensor_value_info("sin", F, None),
                                            *_seq_inputs()],
                          [helper.make_tensor_value_info("out", F, ["T", hq * d])])
    return _model(g)


def _unfused_graph(hq, hkv, d) -> bytes:
    """What the traced graph does: Split, ONNX RotaryEmbedding (ORT's kernel) on Q and K, Reshapes, PagedAttention."""
    w = (hq + 2 * hkv) * d
    sizes = helper.make_tensor("sizes", I64, [3], [hq * d, hkv * d, hkv * d])
    shape_q = helper.make_tensor("shape_q", I64, [2], [-1, hq * d])
    shape_kv = helper.make_tensor("shape_kv", I64, [2], [-1, hkv * d])
    nodes = [
        helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
        helper.make_node("RotaryEmbedding", ["q", "cos", "sin"], ["qr"], num_heads=hq, interleaved=0),
        helper.make_node("RotaryEmbedding", ["k", "cos", "sin"], ["kr"], num_heads=hkv, interleaved=0),
        helper.make_node("Reshape", ["qr", "shape_q"], ["q2"]),
        helper.make_node("Reshape", ["kr", "shape_kv"], ["k2"]),
        helper.make_node("Reshape", ["v", "shape_kv"], ["v2"]),
        helper.make_node("PagedAttention", ["q2", "k2", "v2", *SEQ], ["out"], domain="llmc", **_attrs(hq, hkv, d)),
    ]
    g = helper.make_graph(nodes, "unfused", [helper.make_tensor_value_info("qkv", F, [1, "T", w]),
                                             helper.make_tensor_value_info("cos", F, [1, "T", d // 2]),
                                             helper.make_tensor_value_info("sin", F, [1, "T", d // 2]),
                                             *_seq_inputs()],
                          [helper.make_tensor_value_info("out", F, ["T", hq * d])],
                          initializer=[sizes, shape_q, shape_kv])
    return _model(g)


def _case(rng, *, hq, hkv, d, bs, seqs, cache_dtype=np.float32):
    inputs, caches, _ = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, cache_dtype=cache_dtype)
    t = inputs["query"].shape[0]
    qkv = np.concatenate([inputs["query"], inputs["key"], inputs["value"]], axis=1)[None]
    # Real rotary angles: each row's position (random, up to 4K) times Llama's inverse frequencies.
    pos = rng.integers(0, 4096, t).astype(np.float32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d))
    angles = (pos[:, None] * inv_freq[None, :])[None]
    feeds = dict(qkv=qkv.astype(np.float32), cos=np.cos(angles).astype(np.float32),
                 sin=np.sin(angles).astype(np.float32), **{n: inputs[n] for n in SEQ})
    return feeds, caches


DECODE = [(37, 1), (5, 1), (64, 1), (100, 1)]
MIXED = [(40, 40), (75, 1), (19, 7), (1, 1), (130, 2)]
CASES = {
    "decode_gqa": dict(hq=9, hkv=3, d=64, bs=16, seqs=DECODE),
    "mixed_prefill_gqa": dict(hq=8, hkv=2, d=64, bs=16, seqs=MIXED),
    "mha_odd_sizes": dict(hq=4, hkv=4, d=18, bs=4, seqs=MIXED),  # per-row path (D % 8 != 0)
    "float16_cache": dict(hq=8, hkv=2, d=32, bs=8, seqs=MIXED, cache_dtype=np.float16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_op_equals_unfused_ort_graph_and_reference(name):
    spec = CASES[name]
    hq, hkv, d = spec["hq"], spec["hkv"], spec["d"]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    feeds, (kc, vc) = _case(rng, **spec)
    pools = {tag: [(kc.copy(), vc.copy())] for tag in ("fused", "unfused", "reference")}
    outs = {}
    for tag, model in (("fused", _fused_graph(hq, hkv, d)), ("unfused", _unfused_graph(hq, hkv, d))):
        with ort_native.bound_pool(pools[tag]):
            (outs[tag],) = native_session(model).run(None, feeds)
    # Same arithmetic as ORT's RotaryEmbedding kernel on the same values: identical bits.
    np.testing.assert_array_equal(outs["fused"], outs["unfused"])
    np.testing.assert_array_equal(pools["fused"][0][0], pools["unfused"][0][0])
    np.testing.assert_array_equal(pools["fused"][0][1], pools["unfused"][0][1])
    k_ref, v_ref = pools["reference"][0]
    expected = reference.rotary_paged_attention(**feeds, k_cache=k_ref, v_cache=v_ref, num_heads=hq,
                                                num_kv_heads=hkv, scale=d ** -0.5)
    # float16 cache: the reference rotates K without FMA, so now and then a rotated K element rounds to the
    # neighbouring float16 (2^-11 relative), which moves that position's scores: up to ~4e-5 seen.
    atol = 1e-4 if kc.dtype == np.float16 else 2e-5
    np.testing.assert_allclose(outs["fused"], expected, rtol=1e-4, atol=atol)
    # The reference rotates without FMA: K may differ in the last bit (fp32), or round to the next float16.
    tol = dict(rtol=1e-6, atol=1e-6) if kc.dtype == np.float32 else dict(rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(pools["fused"][0][0].astype(np.float32), k_ref.astype(np.float32), **tol)
    np.testing.assert_array_equal(pools["fused"][0][1], v_ref)  # V is copied, never rotated
    assert np.abs(expected).max() > 0.05  # real attention outputs, not a degenerate case


def test_fused_op_errors_name_the_input():
    rng = np.random.default_rng(1)
    feeds, caches = _case(rng, hq=4, hkv=2, d=16, bs=8, seqs=[(20, 3)])
    session = native_session(_fused_graph(4, 2, 16, typed_shapes=False))
    with ort_native.bound_pool([caches]):
        with pytest.raises(Exception, match=r"qkv must have shape \(\.\.\., T, 128\)"):
            session.run(None, dict(feeds, qkv=feeds["qkv"][..., :-16]))
        with pytest.raises(Exception, match=r"cos must have one row per row of qkv \(3\)"):
            session.run(None, dict(feeds, cos=feeds["cos"][:, :2]))
    with pytest.raises(Exception, match="rotary_interleaved=1 is not supported"):
        native_session(_fused_graph(4, 2, 16, rotary_interleaved=1))


def _op_counts(engine) -> dict[str, int]:
    model = ir.load(engine / "model.onnx")
    counts: dict[str, int] = {}
    for n in model.graph:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def test_engine_fusion_keeps_logits(tiny_llama, tiny_engine, tmp_path):
    """The default build fuses every layer; ``--disable-pass rotary-attention`` keeps the seven nodes; both
    score a random prompt to the same logits (within 1e-6 relative) and generate the same greedy tokens."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams

    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    layers = manifest["kv_cache"]["num_layers"]
    fused = _op_counts(tiny_engine)
    assert fused.get(ROTARY_OP_TYPE) == layers and "RotaryEmbedding" not in fused and "PagedAttention" not in fused
    assert "rotary-attention" in manifest["recipe"]["passes"]
    assert json.loads((tiny_engine / "report.json").read_text())["backend_fusions"]["rotary-attention"] == layers

    plain_dir = tmp_path / "plain"
    build(tiny_llama, plain_dir, BuildOptions(disabled_passes=("rotary-attention",)))
    plain = _op_counts(plain_dir)
    assert plain.get("PagedAttention") == layers and plain.get("RotaryEmbedding") == 2 * layers
    assert ROTARY_OP_TYPE not in plain
    assert sum(fused.values()) <= sum(plain.values()) - 6 * layers

    rng = np.random.default_rng()
    prompt = rng.integers(4, 512, 60).tolist()
    a, b = Engine.load(tiny_engine), Engine.load(plain_dir)
    la, lb = a.score(prompt), b.score(prompt)
    assert np.abs(la - lb).max() <= 1e-6 * np.abs(lb).max()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [rng.integers(4, 512, n).tolist() for n in (3, 17, 40)]
    assert [o.token_ids for o in a.generate(prompts, params)] == [o.token_ids for o in b.generate(prompts, params)]


def test_lowering_leaves_other_routes_and_patterns_alone(tiny_engine):
    """The Python-op route and an empty fusion set keep PagedAttention; a layer whose pattern differs is left."""
    from llmc.passes.ort.rotary_attention import fuse_rotary_attention

    def traced_like() -> ir.Model:
        return ir.from_proto(__import__("onnx").load_model_from_string(_unfused_graph(4, 2, 16)))

    m = traced_like()
    assert fuse_rotary_attention(m) == 1
    assert [n.op_type for n in m.graph] == [ROTARY_OP_TYPE]
    for kwargs in (dict(attention="pyop"), dict(fusions=frozenset())):
        m = traced_like()
        ort_backend.lower(m, **kwargs)
        assert ROTARY_OP_TYPE not in {n.op_type for n in m.graph}
    m = traced_like()  # interleaved rotary: not this op's form
    rot = next(n for n in m.graph if n.op_type == "RotaryEmbedding")
    rot.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    assert fuse_rotary_attention(m) == 0


def test_biased_qkv_projections_are_packed_and_fused(family_build):
    """Qwen2 adds a bias to each of Q, K, V: pack-projections packs the biases into one Add before the Split,
    so the backend fuses those layers too (test_architectures checks the engine against transformers)."""
    _, engine = family_build("qwen2")
    layers = json.loads((engine / "manifest.json").read_text())["kv_cache"]["num_layers"]
    counts = _op_counts(engine)
    assert counts.get(ROTARY_OP_TYPE) == layers and "RotaryEmbedding" not in counts
    assert json.loads((engine / "report.json").read_text())["backend_fusions"]["rotary-attention"] == layers
