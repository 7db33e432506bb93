"""ALiBi families end to end: bloom and mpt compute attention inline (not through transformers' AttentionInterface), so
llmc replaces their attention forward with one that emits its PagedAttention op with ALiBi
(compiler/alibi_attention.py). Their tiny random checkpoints (transformers' own config classes; 6 and 12 heads,
neither a power of two, so some heads take the odd-indexed slopes of twice as many) build with the architecture
self-check on (mpt here, bloom in tests/test_mechanisms.py) and match transformers in float32, 32 greedy tokens for
each of 3 prompts longer than 32 tokens, on the CPU engine and as the CUDA program (built for h100 with no GPU,
float32) run by torch on the CPU. ALiBi elsewhere (falcon's alibi=True) is still refused from config.json, naming
it."""

from __future__ import annotations

import json

import pytest

from llmc.testing.greedy import LONG_PROMPTS as PROMPTS  # past the fixtures' 16-token windows and chunks
from llmc.testing.greedy import assert_greedy_matches_transformers


# Both with the self-check on: tests/test_mechanisms.py leaves bloom's fixture to this test.
@pytest.mark.parametrize("model_type,self_check", [("bloom", True), ("mpt", True)])
def test_alibi_family_matches_transformers(model_type, self_check, tmp_path, monkeypatch):
    import onnx

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine
    from llmc.testing.tried_families import write_tried_family

    assert all(len(p) > 32 for p in PROMPTS)
    ckpt = write_tried_family(model_type, tmp_path / "ckpt")
    monkeypatch.setenv("LLMC_SELF_CHECK", "1" if self_check else "0")  # the suite turns it off
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    build(ckpt, tmp_path / "cpu", BuildOptions(target="cpu"))
    if self_check:
        report = json.loads((tmp_path / "cpu" / "report.json").read_text())
        assert report["self_check"]["result"] == "passed", report["self_check"]
    graph = onnx.load(str(tmp_path / "cpu" / "model.onnx"), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type.endswith("PagedAttention")]
    assert attention and all(
        any(a.name == "alibi_max_bias" and a.f == 8.0 for a in n.attribute) for n in attention)
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cpu"), ckpt, PROMPTS)

    # The CUDA engine's program (the self-check above already held this architecture to transformers).
    build(ckpt, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False, self_check=False))
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cuda", device="cpu"), ckpt, PROMPTS)


def test_other_alibi_attention_is_refused_from_config(tmp_path):
    from llmc.compiler.mechanisms import refuse_unlowered
    from llmc.errors import UnsupportedError

    refuse_unlowered({"model_type": "bloom"}, "bloom", tmp_path / "config.json")
    refuse_unlowered({"model_type": "mpt", "attn_config": {"alibi": True}}, "mpt", tmp_path / "config.json")
    with pytest.raises(UnsupportedError, match="ALiBi position bias in an attention module llmc does not replace"):
        refuse_unlowered({"model_type": "falcon", "alibi": True}, "falcon", tmp_path / "config.json")
