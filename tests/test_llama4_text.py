"""llama4_text end to end: chunked local attention (a query at p sees keys [floor(p/C)*C, p]) on its rotary layers,
global attention with temperature-tuned queries on its NoPE layers, and interleaved (complex) rotary, traced through
llmc's replacements of transformers' llama4 rotary and attention forwards (compiler/llama4_text.py). The tiny random
checkpoint (transformers' own config class: chunks of 16, one rotary + chunked layer, one NoPE layer with
floor_scale 8 so the temperature tuning changes queries, MoE with a shared expert) builds with the self-check on
(tests/test_mechanisms.py) and matches transformers in float32, 32 greedy tokens for each of 3 prompts longer than
32 tokens (every prompt and its continuation cross several chunk boundaries), on the CPU engine and as the CUDA
program (built for h100 with no GPU, float32) run by torch on the CPU."""

from __future__ import annotations

import json

from llmc.testing.greedy import LONG_PROMPTS as PROMPTS  # past the fixtures' 16-token windows and chunks
from llmc.testing.greedy import assert_greedy_matches_transformers


def test_llama4_text_matches_transformers(tmp_path, monkeypatch):
    import onnx

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine
    from llmc.testing.tried_families import write_tried_family

    ckpt = write_tried_family("llama4_text", tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["attention_chunk_size"] == 16 and config["layer_types"] == ["chunked_attention", "full_attention"]
    # The self-check of this fixture runs here (tests/test_mechanisms.py leaves llama4_text to this test).
    monkeypatch.setenv("LLMC_SELF_CHECK", "1")  # the suite turns it off
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    build(ckpt, tmp_path / "cpu", BuildOptions(target="cpu"))
    report = json.loads((tmp_path / "cpu" / "report.json").read_text())
    assert report["self_check"]["result"] == "passed", report["self_check"]
    graph = onnx.load(str(tmp_path / "cpu" / "model.onnx"), load_external_data=False).graph
    chunks = {}
    for node in graph.node:
        if node.op_type.endswith("PagedAttention"):
            attrs = {a.name: a for a in node.attribute}
            chunks[attrs["layer_idx"].i] = attrs["attention_chunk"].i if "attention_chunk" in attrs else 0
    assert chunks == {0: 16, 1: 0}  # the NoPE layer attends globally
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cpu"), ckpt, PROMPTS)

    build(ckpt, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False, self_check=False))
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cuda", device="cpu"), ckpt, PROMPTS)
