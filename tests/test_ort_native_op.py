"""llmc's native ONNX Runtime custom-op library (PagedAttention with no Python per call).

Differential: graphs of one or more ``llmc::PagedAttention`` nodes run in a real ONNX Runtime session
with the library registered, on fresh random inputs (normal draws everywhere: queries, keys, values
and the caches' prior contents), against the numpy reference run on copies of the same caches.
Caches must end bit-identical (rows are copied verbatim; float16 rounds to nearest even, as numpy);
outputs agree to float32 accuracy (tolerances as in test_paged_attention_kernel.py, whose module
docstring explains them).

Then the ABI facts the library relies on, and the engine: the default build lowers to the native op,
the manifest says so, the runtime never imports the Python bridge, and the library's call counter
shows one call per layer per step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from llmc.plugins.paged_attention import INPUT_NAMES, ort_native, reference
from llmc.runtime.workers.ort.session import NATIVE, OrtSession
from llmc.testing.ort_sessions import native_session
from llmc.testing.paged_attention import make_case

RTOL, ATOL = 1e-4, 2e-5


def _graph(layers: list[dict], hq: int, hkv: int, d: int, chain: bool) -> bytes:
    """``len(layers)`` PagedAttention nodes (attributes from ``layers``); chained (output feeds the next
    query) or side by side on the same inputs, every output a graph output."""
    nodes, outputs, x = [], [], "query"
    for i, attrs in enumerate(layers):
        nodes.append(helper.make_node("PagedAttention", [x, "key", "value", *INPUT_NAMES[3:]], [f"out{i}"],
                                      domain="llmc", layer_idx=i, num_heads=hq, num_kv_heads=hkv, head_size=d,
                                      **attrs))
        outputs.append(helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, ["T", hq * d]))
        if chain:
            x = f"out{i}"
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("query", f, ["T", hq * d]),
              helper.make_tensor_value_info("key", f, ["T", hkv * d]),
              helper.make_tensor_value_info("value", f, ["T", hkv * d])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in INPUT_NAMES[3:]]
    g = helper.make_graph(nodes, "paged_attention", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1)])
    return m.SerializeToString()


def _case(rng, *, hq, hkv, d, bs, seqs, layers=1, pad_rows=0, cache_dtype=np.float32):
    """Sequences as (context_len after this step, new tokens), on randomly permuted blocks; one pool per layer."""
    feeds, first, _ = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, pad_rows=pad_rows, cache_dtype=cache_dtype)
    shape = first[0].shape
    pool = [first] + [(rng.standard_normal(shape).astype(cache_dtype), rng.standard_normal(shape).astype(cache_dtype))
                      for _ in range(layers - 1)]
    return feeds, pool


DECODE = [(37, 1), (5, 1), (64, 1), (100, 1)]
MIXED = [(40, 40), (75, 1), (19, 7), (1, 1), (130, 2)]

CASES = {
    "decode_gqa": dict(hq=8, hkv=2, d=64, bs=16, seqs=DECODE),
    "mixed_prefill_gqa": dict(hq=8, hkv=2, d=64, bs=16, seqs=MIXED),
    "mha_small_blocks": dict(hq=4, hkv=4, d=32, bs=4, seqs=MIXED),
    "mqa_pad_rows": dict(hq=6, hkv=1, d=16, bs=8, seqs=[(33, 5), (9, 1)], pad_rows=3),
    "long_context_split": dict(hq=9, hkv=3, d=64, bs=16, seqs=[(700, 1), (513, 3)]),
    "sliding_window": dict(hq=8, hkv=2, d=32, bs=8, seqs=MIXED, attrs=dict(sliding_window=13)),
    "softcap": dict(hq=8, hkv=2, d=32, bs=8, seqs=MIXED, attrs=dict(softcap=2.5), q_scale=6.0),
    "window_and_softcap": dict(hq=4, hkv=2, d=16, bs=16, seqs=[(90, 30), (17, 1)],
                               attrs=dict(sliding_window=20, softcap=10.0)),
    "float16_cache": dict(hq=8, hkv=2, d=64, bs=16, seqs=MIXED, cache_dtype=np.float16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_native_op_matches_reference(name):
    spec = dict(CASES[name])
    attrs = {"scale": float(spec["d"]) ** -0.5, **spec.pop("attrs", {})}
    q_scale = spec.pop("q_scale", 1.0)
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    feeds, pool = _case(rng, **spec)
    feeds["query"] *= q_scale
    hq, hkv, d = spec["hq"], spec["hkv"], spec["d"]
    ref_pool = [(k.copy(), v.copy()) for k, v in pool]
    session = native_session(_graph([attrs], hq, hkv, d, chain=False))
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, feeds)
    expected = reference.paged_attention(**feeds, k_cache=ref_pool[0][0], v_cache=ref_pool[0][1], num_heads=hq,
                                         num_kv_heads=hkv, **attrs)
    np.testing.assert_array_equal(pool[0][0], ref_pool[0][0])
    np.testing.assert_array_equal(pool[0][1], ref_pool[0][1])
    atol = 1e-4 if q_scale > 1 else ATOL  # peaked softmax: see test_paged_attention_kernel.py
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=atol)


def test_layers_read_their_own_caches_and_chain():
    """Three chained nodes, one pool of three layers: node i uses layer i's caches (attribute layer_idx)."""
    rng = np.random.default_rng(7)
    hq, hkv, d = 8, 2, 32
    feeds, pool = _case(rng, hq=hq, hkv=hkv, d=d, bs=8, seqs=MIXED, layers=3)
    ref_pool = [(k.copy(), v.copy()) for k, v in pool]
    session = native_session(_graph([{"scale": 0.2}] * 3, hq, hkv, d, chain=True))
    before = ort_native.call_count()
    with ort_native.bound_pool(pool):
        outs = session.run(None, feeds)
    assert ort_native.call_count() - before == 3
    x = feeds["query"]
    meta = {n: feeds[n] for n in INPUT_NAMES[1:]}
    for i, (k, v) in enumerate(ref_pool):
        x = reference.paged_attention(x, **meta, k_cache=k, v_cache=v, num_heads=hq, num_kv_heads=hkv, scale=0.2)
        np.testing.assert_allclose(outs[i], x, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(pool[i][0], k)
        np.testing.assert_array_equal(pool[i][1], v)


def test_binding_is_shared_with_onnxruntime_and_errors_reach_python():
    """ctypes and ONNX Runtime load one library: what ctypes binds is what the kernel reads. Kernel
    errors come back as ORT failures carrying the kernel's message, with the caches untouched."""
    rng = np.random.default_rng(11)
    feeds, pool = _case(rng, hq=4, hkv=2, d=16, bs=8, seqs=[(20, 3), (9, 1)])
    session = native_session(_graph([{"scale": 0.25}], 4, 2, 16, chain=False))
    with ort_native.lock:
        ort_native.unbind()
        with pytest.raises(Exception, match="no KV pool is bound"):
            session.run(None, feeds)
        ort_native.bind(pool)
        session.run(None, feeds)  # the same library state: now it runs
        bad = dict(feeds, slot_mapping=np.append(feeds["slot_mapping"][:-1], 10**6))
        k0 = pool[0][0].copy()
        with pytest.raises(Exception, match=r"slot_mapping\[3\] = 1000000 is out of range"):
            session.run(None, bad)
        np.testing.assert_array_equal(pool[0][0], k0)
        # Same input widths (2 heads x 32 = 4 x 16, 1 KV head x 32 = 2 x 16), other head layout.
        wrong_heads = native_session(_graph([{"scale": 0.25}], 2, 1, 32, chain=False))
        with pytest.raises(Exception, match="the bound KV pool.s layer 0 has 2 KV heads of size 16"):
            wrong_heads.run(None, feeds)


def test_bind_refuses_caches_it_cannot_use_in_place():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, 2, 8, 16)).astype(np.float32)
    with ort_native.lock:
        with pytest.raises(ValueError, match="C-contiguous"):
            ort_native.bind([(k, np.asfortranarray(k))])
        with pytest.raises(ValueError, match="float32 or float16"):
            ort_native.bind([(k.astype(np.float64), k.astype(np.float64))])
        ro = k.copy()
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writeable"):
            ort_native.bind([(k, ro)])
    with pytest.raises(ValueError):
        ort_native.set_num_threads(-1)


def test_abi_version_and_threads():
    """The library asks for a C API version the installed ONNX Runtime serves; threads are settable."""
    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    assert major == 1 and ort_native.load().llmc_ort_api_version() <= minor
    before = ort_native.get_num_threads()
    try:
        ort_native.set_num_threads(1)
        assert ort_native.get_num_threads() == 1
        ort_native.set_num_threads(0)
        assert ort_native.get_num_threads() == 0
        assert ort_native.uses_ort_pool()  # ONNX Runtime >= 1.17 serves KernelContext_ParallelFor
    finally:
        ort_native.set_num_threads(before)


def test_thread_count_does_not_change_results():
    """One thread, three OpenMP threads and ONNX Runtime's pool (0) give bit-identical outputs. The case is
    big enough (~6M multiply-adds) for the kernel to go parallel."""
    rng = np.random.default_rng(5)
    feeds, pool = _case(rng, hq=8, hkv=2, d=64, bs=16, seqs=[(600, 1), (300, 40)])
    session = native_session(_graph([{"scale": 0.125}], 8, 2, 64, chain=False))
    before = ort_native.get_num_threads()
    outs = []
    try:
        for n in (1, 3, 0):
            ort_native.set_num_threads(n)
            layers = [(k.copy(), v.copy()) for k, v in pool]
            with ort_native.bound_pool(layers):
                outs.append(session.run(None, feeds)[0])
    finally:
        ort_native.set_num_threads(before)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    expected = reference.paged_attention(**{k: feeds[k] for k in feeds}, k_cache=pool[0][0].copy(),
                                         v_cache=pool[0][1].copy(), num_heads=8, num_kv_heads=2, scale=0.125)
    np.testing.assert_allclose(outs[2], expected, rtol=1e-4, atol=2e-5)


# -------------------------------------------------------------------------------------------
# Engines


def test_engine_runs_native_without_python_per_layer(tiny_engine):
    """The default build lowers to the native op; serving it imports no Python bridge and the
    library counts exactly one kernel call per layer per step (a fresh process, torch blocked)."""
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert manifest["engine"]["custom_ops"] == NATIVE
    layers = manifest["kv_cache"]["num_layers"]
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxruntime_extensions'):\n"
        "            raise ImportError(name + ' is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from llmc.runtime import Engine, SamplingParams\n"
        "from llmc.plugins.paged_attention import ort_native\n"
        f"e = Engine.load({str(tiny_engine)!r})\n"
        "before = ort_native.call_count()\n"
        "o = e.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True))\n"
        "import json\n"
        "print(json.dumps({'calls': ort_native.call_count() - before, 'steps': e.stats().num_steps,\n"
        "    'pyop': 'llmc.plugins.paged_attention.ort_op' in sys.modules,\n"
        "    'bridge': 'llmc.plugins.paged_attention.kv_binding' in sys.modules,\n"
        "    'tokens': [len(x.token_ids) for x in o]}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == [6, 6] and not out["pyop"] and not out["bridge"]
    assert out["steps"] > 0 and out["calls"] == layers * out["steps"]


def test_native_and_pyop_engines_agree(tiny_llama, tiny_engine_plain, tmp_path):
    """The same checkpoint built for both routes: identical logits position by position (same C++
    kernel behind both), identical greedy tokens; the PyOp engine still loads and says what it needs. The native
    engine is the session's build of the checkpoint with the default options (tests/conftest.py)."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams

    build(tiny_llama, tmp_path / "pyop", BuildOptions(attention="pyop"))
    pyop_manifest = json.loads((tmp_path / "pyop" / "manifest.json").read_text())
    assert pyop_manifest["engine"]["custom_ops"] == "onnxruntime_extensions"
    engines = [Engine.load(tiny_engine_plain), Engine.load(tmp_path / "pyop")]
    assert [e._session.custom_ops for e in engines] == [NATIVE, "onnxruntime_extensions"]
    rng = np.random.default_rng(21)
    tokens = rng.integers(3, engines[0].vocab_size, 70).tolist()
    native, pyop = (e.score(tokens) for e in engines)
    np.testing.assert_allclose(native, pyop, rtol=1e-5, atol=1e-5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [tokens[:9], tokens[20:23], tokens[40:70]]
    outs = [[o.token_ids for o in e.generate(prompts, params)] for e in engines]
    assert outs[0] == outs[1]


def test_session_from_bytes_runs_unoptimised_graph():
    """OrtSession (what --verify-passes uses) takes serialized bytes and a plain per-layer pool list."""
    rng = np.random.default_rng(2)
    feeds, pool = _case(rng, hq=4, hkv=2, d=16, bs=8, seqs=[(12, 4)])
    nodes = [helper.make_node("PagedAttention", ["query", "key", "value", *INPUT_NAMES[3:]], ["attn"], domain="llmc",
                              layer_idx=0, num_heads=4, num_kv_heads=2, head_size=16, scale=0.25),
             helper.make_node("Identity", ["attn"], ["logits"])]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("query", f, None), helper.make_tensor_value_info("key", f, None),
              helper.make_tensor_value_info("value", f, None)]
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in INPUT_NAMES[3:]]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("logits", f, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1)])
    ref = [(k.copy(), v.copy()) for k, v in pool]
    got = OrtSession(m.SerializeToString(), custom_ops=NATIVE, optimize=False).run(feeds, pool)
    expected = reference.paged_attention(**feeds, k_cache=ref[0][0], v_cache=ref[0][1], num_heads=4, num_kv_heads=2,
                                         scale=0.25)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
