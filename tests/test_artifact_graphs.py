"""An artifact may hold several graphs (issue 47): a language model and, beside it, further graphs (an encoder, a
projector) under one manifest, one cache key and one verify; the runtime opens each by name.

The further graph here is a real ONNX model (MatMul + bias + Gelu, random weights) standing where a vision
projector will: the build emits it through the backend, seals its files, and the runtime's session computes what
numpy computes on fresh random inputs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime import artifact as runtime_artifact
from llmc.runtime.graphs import graph_entries, load_graph


def _projector(path, rng, d_in=48, d_out=32):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    b = rng.standard_normal(d_out).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
         helper.make_node("Gelu", ["hb"], ["embeddings"])],
        "projector",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", d_in])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", d_out])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return w, b


def _gelu(x):
    from math import erf, sqrt

    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


def test_a_second_graph_is_emitted_sealed_and_loaded(tiny_llama, tiny_engine_plain, tmp_path):
    rng = np.random.default_rng()
    w, b = _projector(tmp_path / "projector.onnx", rng)
    plain_dir = tiny_engine_plain  # the same checkpoint with the same options but the graph (tests/conftest.py)
    both = build(tiny_llama, tmp_path / "both",
                 BuildOptions(extra_graphs=(("projector", str(tmp_path / "projector.onnx")),)))

    entry = graph_entries(both.manifest)["projector"]
    assert entry["inputs"] == ["features"] and entry["outputs"] == ["embeddings"]
    assert entry["model_file"] in both.manifest["files"]
    # The language model is untouched by the graph beside it.
    for f in ("model.onnx", "model.onnx.data"):
        assert (hashlib.sha256((plain_dir / f).read_bytes()).digest()
                == hashlib.sha256((tmp_path / "both" / f).read_bytes()).digest())
    assert graph_entries(runtime_artifact.read_manifest(plain_dir)) == {}
    assert runtime_artifact.verify(tmp_path / "both") == []

    x = rng.standard_normal((5, w.shape[0])).astype(np.float32)
    (got,) = load_graph(tmp_path / "both", both.manifest, "projector").run({"features": x})
    np.testing.assert_allclose(got, _gelu(x @ w + b), rtol=1e-5, atol=1e-5)

    # The language model's engine loads from the artifact that holds both, and decodes as without the graph beside.
    from llmc.runtime import Engine, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = [int(t) for t in rng.integers(3, 200, 5)]
    engine = Engine.load(tmp_path / "both")
    assert engine.generate([prompt], params)[0].token_ids == Engine.load(plain_dir).generate(
        [prompt], params)[0].token_ids
    assert engine.graphs == ["projector"] and Engine.load(plain_dir).graphs == []
    (again,) = engine.graph("projector").run({"features": x})
    np.testing.assert_array_equal(again, got)

    # One verify covers every graph's files.
    with open(tmp_path / "both" / entry["model_file"], "ab") as f:
        f.write(b"\0")
    assert runtime_artifact.verify(tmp_path / "both")



def test_bad_further_graphs_are_refused_before_any_work(tiny_llama, tmp_path):
    _projector(tmp_path / "p.onnx", np.random.default_rng())
    with pytest.raises(LlmcError, match="no such ONNX file"):
        build(tiny_llama, tmp_path / "o", BuildOptions(extra_graphs=(("enc", str(tmp_path / "missing.onnx")),)))
    with pytest.raises(LlmcError, match="lowercase"):
        build(tiny_llama, tmp_path / "o", BuildOptions(extra_graphs=(("Model", str(tmp_path / "p.onnx")),)))
    with pytest.raises(UnsupportedError, match="further graphs"):
        build(tiny_llama, tmp_path / "o",
              BuildOptions(target="h100", extra_graphs=(("enc", str(tmp_path / "p.onnx")),)))
    assert not (tmp_path / "o").exists()
    with pytest.raises(LlmcError, match="holds no graph"):
        load_graph(tmp_path, {"graphs": {}}, "enc")
