"""Layer-by-layer scoring (llmc.quant.layerwise): the accuracy report's runner, held to the whole engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from llmc.quant import evaluate, layerwise
from llmc.quant.stage import _engine_graph
from llmc.runtime import Engine


def _windows(engine: Engine, seed: int, sizes: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = engine.manifest["engine"]["vocab_size"]
    return [rng.integers(0, vocab, n).tolist() for n in sizes]


@pytest.mark.parametrize("fixture", ["tiny_engine", "default_engine"])
def test_layer_by_layer_logits_equal_the_whole_engines(fixture, request):
    """Random windows of several lengths through the stages give the whole engine's logits (the same kernels and
    session options: within 1e-5 of the logits' range), and the graph is cut into one stage per layer plus the
    embedding stage."""
    path = request.getfixturevalue(fixture)
    engine = Engine.load(path, kv_cache_tokens=1024)
    model, kv, custom_ops = _engine_graph(path)
    scorer = layerwise.LayerwiseScorer(model, custom_ops, kv)
    assert [s.index for s in scorer.stages] == list(range(-1, kv.num_layers))
    windows = _windows(engine, seed=len(fixture), sizes=[37, 256, 5, 130])
    got = scorer.run(windows)
    for ids, logits in zip(windows, got, strict=True):
        want = engine.score(ids)
        assert logits.shape == want.shape
        scale = float(np.abs(want).max())
        assert float(np.abs(logits - want).max()) <= 1e-5 * scale
        # Owned copies: a view of ONNX Runtime's output would keep its session's whole memory arena alive (with an
        # FP8 stage's dequantized weights, ~2 GB per 8B layer carried from stage to stage).
        assert logits.base is None and logits.flags.owndata
    # Each stage holds only its own layer's weights (and the embedding stage the table).
    for stage in scorer.stages[1:]:
        layers = {layerwise.layer_of(v.name) for v in stage.weights} - {None}
        assert layers <= {stage.index}, (stage.index, layers)


def test_partition_feeds_each_stage_only_from_earlier_ones(default_engine):
    model, _, _ = _engine_graph(default_engine)
    stages = layerwise.partition(model)
    produced: dict[str, int] = {}
    for i, stage in enumerate(stages):
        for v in stage.inputs:
            assert v.name in produced or v.is_graph_input(), v.name
            assert produced.get(v.name, -1) < i
        for node in stage.nodes:
            for out in node.outputs:
                produced[out.name] = i
    assert sum(len(s.nodes) for s in stages) == sum(1 for _ in model.graph)
    assert stages[-1].outputs[-1].name == "logits"
    # A node that reads only weights runs in the stage of its first user: its output is never carried.
    carried = {v.name for stage in stages for v in stage.inputs}
    for stage in stages:
        for node in stage.nodes:
            if all(v is None or v.name in model.graph.initializers for v in node.inputs):
                assert not any(out.name in carried for out in node.outputs), node.op_type


def test_layer_of_reads_the_first_index_in_a_weight_name():
    assert layerwise.layer_of("model.layers.12.mlp.down_proj.weight") == 12
    assert layerwise.layer_of("transformer.h.3.attn.c_attn.weight") == 3
    assert layerwise.layer_of("model.layers.3.mlp.experts.5.w1") == 3
    assert layerwise.layer_of("model.embed_tokens.weight") is None
    assert layerwise.layer_of("model.norm.weight") is None
    assert layerwise.layer_of("val_12") is None


@pytest.mark.parametrize("sizes", [[256] * 20, [256] * 3, [100, 7, 256, 256, 3] * 5, [2]])
def test_rounds_score_exactly_the_windows_one_by_one_scoring_reaches(sizes):
    """Rounds end where compare() checks first and where it stops at the limit, so scoring in rounds never
    needs a window past the limit and covers every window it can reach; a token cap splits rounds."""
    windows = [[0] * n for n in sizes]
    for precision in (evaluate.Precision(), evaluate.Precision(300, 300, 0.0), None):
        ends = evaluate.rounds(windows, precision)
        assert ends == sorted(set(ends)) and ends[-1] <= len(windows)
        cum = np.cumsum([0, *sizes])
        if precision is not None:
            reach = next((i for i in range(len(sizes) + 1) if cum[i] >= precision.max_tokens), len(sizes))
            assert ends[-1] == reach
        else:
            assert ends[-1] == len(sizes)
        capped = evaluate.rounds(windows, precision, round_tokens=600)
        assert set(ends) <= set(capped) and capped[-1] == ends[-1]
        start = 0
        for end in capped:
            assert end - start == 1 or cum[end] - cum[start] <= 600
            start = end


def test_streamed_report_equals_whole_engine_scoring(tmp_path, default_engine):
    """The report's figures from layer-by-layer scoring (reference and quantized engine) equal compare() over
    whole engines: the same windows, stopping point, perplexities and KL within 1e-5 relative."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe

    out = tmp_path / "int4"
    default_model = Path(__file__).resolve().parents[1] / "assets" / "default-model"
    result = build(default_model, out, BuildOptions(quant=QuantRecipe(quant="int4")))
    acc = result.report["accuracy"]
    quantized, reference = Engine.load(out, kv_cache_tokens=512), Engine.load(default_engine, kv_cache_tokens=512)
    windows = evaluate.heldout_windows(out / "tokenizer.json", 256, 65536)
    whole = evaluate.compare(lambda i, ids: evaluate.log_softmax(reference.score(ids)),
                             lambda i, ids: quantized.score(ids), windows, precision=evaluate.Precision())
    assert (acc["tokens"], acc["windows"], acc["stopped"]) == (whole.tokens, whole.windows, whole.stopped)
    for key in ("ppl", "ppl_reference", "kl_mean"):
        assert acc[key] == pytest.approx(getattr(whole, key), rel=1e-5), key
    assert acc["top1_agreement"] == pytest.approx(whole.top1_agreement, abs=2 / whole.tokens)
    assert json.loads((out / "report.json").read_text())["accuracy"]["tokens"] == whole.tokens


def test_initializers_of_numpy_dtypes_reach_ort_without_the_model_bytes(default_engine):
    # The default model is stored in bfloat16: its linears reach the engine as uint16 panels (Bf16MatMul).
    model, _, _ = _engine_graph(default_engine)
    stage = layerwise.partition(model)[1]
    blob, external = layerwise.stage_model(model, stage, {})
    big = [v for v in stage.weights if v.const_value.dtype in (ir.DataType.FLOAT, ir.DataType.UINT16)
           and layerwise._nbytes(v.const_value) >= layerwise.EMBED_BELOW]
    assert big and all(v.name in external for v in big)
    assert len(blob) < sum(layerwise._nbytes(v.const_value) for v in big)


def test_windows_run_together_give_each_windows_own_logits(default_engine):
    """Windows grouped into one step each (several sequences, each on blocks of its own) give the logits of the
    same windows run a window a step, within float32 rounding, and groups respect the token budget."""
    model, kv, custom_ops = _engine_graph(default_engine)
    rng = np.random.default_rng(11)
    vocab = int(model.graph.outputs[0].shape[-1])
    windows = [rng.integers(0, vocab, n).tolist() for n in (200, 64, 9, 256, 130)]
    from llmc.compiler import memory_plan

    assert memory_plan.GROUP_TOKENS == layerwise.LayerwiseScorer.BATCH_TOKENS  # the build's estimate counts them
    grouped = layerwise.LayerwiseScorer(model, custom_ops, kv, batch_tokens=300)
    assert grouped.batches(windows) == [[0, 1, 2], [3], [4]]
    got = grouped.run(windows)
    alone = layerwise.LayerwiseScorer(model, custom_ops, kv, batch_tokens=1)
    assert alone.batches(windows) == [[0], [1], [2], [3], [4]]
    want = alone.run(windows)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.flags.owndata
        assert float(np.abs(g - w).max()) <= 1e-5 * float(np.abs(w).max())


def test_kv_shared_layers_read_their_own_windows_keys(tmp_path):
    """Gemma 4's KV-shared layers read keys and values an earlier stage wrote: each window (alone in its group or
    grouped) reads its own, so the stages give the whole engine's logits; the layers' caches are dropped once their
    last reader has run."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.testing.tried_families import write_tried_family

    ckpt = write_tried_family("gemma4_text", tmp_path / "ckpt")
    build(ckpt, tmp_path / "engine", BuildOptions(target="cpu", dtype="float32", self_check=False))
    engine = Engine.load(tmp_path / "engine", kv_cache_tokens=1024)
    model, kv, custom_ops = _engine_graph(tmp_path / "engine")
    assert any("shares" in entry for entry in kv.layers)
    windows = _windows(engine, seed=4, sizes=[40, 23, 64])
    want = [engine.score(ids) for ids in windows]
    for batch_tokens in (1, None):
        scorer = layerwise.LayerwiseScorer(model, custom_ops, kv, batch_tokens=batch_tokens)
        for got, ref in zip(scorer.run(windows), want, strict=True):
            assert float(np.abs(got - ref).max()) <= 1e-5 * float(np.abs(ref).max())
