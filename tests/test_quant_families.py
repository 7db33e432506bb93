"""Quantization beyond Llama: calibration and the quantize pass on every supported family.

- Calibration drives each family's own transformers modules layer by layer; the input statistics of
  every linear layer must equal those of transformers' full forward pass (eager attention) on the same
  tokens, with only one decoder layer's weights resident at a time.
- The quantize pass rewrites GPT-2's ``Gemm`` linears (Conv1D), stores MoE experts' batched weights in
  INT4 (fp32 in the other formats) and keeps routers in fp32; the rewritten graph in ONNX Runtime must
  compute what the original graph computes with numpy-dequantized weights.
- fp8 (calibrated activations) builds through the CLI for every non-Llama family.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler.verify import KVShape, random_step, run_graph
from llmc.passes import quantize as graph
from llmc.passes.lazy import constant_of
from llmc.quant import int4
from llmc.quant.recipe import QuantRecipe
from llmc.testing.checkpoints import TINY_CONFIGS

FAMILIES = list(TINY_CONFIGS)
NON_LLAMA = [f for f in FAMILIES if f != "llama"]
MOE = ("mixtral", "qwen3_moe")


# -- calibration against transformers' own forward ----------------------------------------------------

def _reference_grams(ckpt, ids: np.ndarray) -> dict[str, np.ndarray]:
    """``X^T X`` of every linear layer's input (by parameter name) in transformers' full forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.quant.calibration import _linear_types

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    names = {id(m): f"{n}.weight" for n, m in hf.named_modules() if isinstance(m, _linear_types())}
    grams: dict[str, np.ndarray] = {}

    def hook(module, args, _out):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        assert names[id(module)] not in grams  # every linear runs once per forward
        grams[names[id(module)]] = (x.T @ x).numpy()

    handles = [m.register_forward_hook(hook) for m in hf.modules() if id(m) in names]
    with torch.no_grad():
        hf(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    return grams


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_statistics_equal_transformers_forward(family_checkpoint, family):
    from transformers import AutoConfig

    from llmc.compiler.binding import param_reader
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.quant.calibration import LayerwiseCalibration

    ckpt = family_checkpoint(family)
    # 40 tokens cross the fixtures' sliding window (24); batches of 2 leave a smaller last batch.
    ids = np.random.default_rng(17).integers(4, 500, (3, 40))
    expect = _reference_grams(ckpt, ids)
    run = LayerwiseCalibration(AutoConfig.from_pretrained(ckpt), param_reader(load_checkpoint(ckpt)), ids,
                               batch_size=2)
    got: dict[str, np.ndarray] = {}
    for stats in run.layers():
        resident = [i for i, layer in enumerate(run.blocks) if any(p.numel() for p in layer.parameters())]
        assert resident == [stats.index]  # one decoder layer's weights at a time
        assert stats.attention_layer == stats.index and min(stats.kv_amax) > 0
        for group in stats.groups:
            assert stats.inputs[group].rows == ids.size
            got.update(dict.fromkeys(group, stats.inputs[group].gram))
    head = run.head()
    (group,) = head.groups
    got[group[0]] = head.inputs[group].gram
    assert head.producers[group] is not None  # the model's final norm feeds the head (what AWQ folds into)
    run.release_head()
    assert not any(p.numel() for p in run.model.parameters())
    assert sorted(got) == sorted(expect)
    for name, gram in got.items():
        err = np.abs(gram - expect[name]).max() / np.abs(expect[name]).max()
        assert err < 1e-5, (name, err)


# -- the quantize pass on GPT-2 (Gemm) and MoE graphs -------------------------------------------------

@pytest.fixture(scope="module")
def traced_family(family_checkpoint):
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.frontend import trace
    from llmc.compiler.pipeline import passes_for, run_pipeline

    cache = {}

    def get(family: str):
        if family not in cache:
            ckpt = family_checkpoint(family)
            t = trace(load_checkpoint(ckpt))
            run_pipeline(t.model, passes_for("cpu"))
            feeds, pool = random_step(np.random.default_rng(1), t.vocab_size,
                                      KVShape(t.num_layers, t.num_kv_heads, t.head_size))
            cache[family] = (ckpt, t.model, feeds, pool)
        return cache[family]

    return get


def _weights(model: ir.Model):
    """``(value, feeds a router, stored as [N, K])`` of every 2-D float weight a MatMul or Gemm reads."""
    out = []
    for node in model.graph:
        if node.op_type not in ("MatMul", "Gemm") or node.domain != "":
            continue
        trans_b = node.attributes.get("transB")
        w, transposed = node.inputs[1], trans_b is not None and trans_b.value == 1
        producer = w.producer()
        if producer is not None and producer.op_type == "Transpose":
            w, transposed = producer.inputs[0], True
        t = constant_of(w)
        if t is None or len(t.shape) != 2 or t.dtype != ir.DataType.FLOAT:
            continue
        out.append((w, graph.feeds_router(node.outputs[0]), transposed))
    return out


def _with_weights(model: ir.Model, nk_of) -> ir.Model:
    """A clone whose non-router linear weights are ``nk_of(name, w_nk)`` (float32 ``[N, K]``)."""
    ref = model.clone()
    for value, router, transposed in _weights(ref):
        if router:
            continue
        stored = value.const_value.numpy()
        w = stored if transposed else stored.T
        new = np.asarray(nk_of(value.name, np.ascontiguousarray(w, np.float32)), np.float32)
        value.const_value = ir.tensor(np.ascontiguousarray(new if transposed else new.T), name=value.name)
    return ref


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _with_expert_weights(model: ir.Model, of) -> ir.Model:
    """``model`` with every batched ``[E, N, K]`` expert weight replaced by ``of(w)``, in place."""
    for node in model.graph:
        if node.op_type in ("Gather", "GatherND"):
            t = constant_of(node.inputs[0])
            if t is not None and len(t.shape) == 3:
                node.inputs[0].const_value = ir.tensor(np.asarray(of(t.numpy()), np.float32), name=node.inputs[0].name)
    return model


def _int4_experts_deq(w: np.ndarray, group: int) -> np.ndarray:
    e, n, k = w.shape
    padded = np.pad(w.reshape(e * n, k), ((0, 0), (0, -k % group)))
    return int4.quantize_rtn(padded, group, False).dequantize()[:, :k].reshape(e, n, k)


@pytest.mark.parametrize("family,group,linears,routers,experts", [
    ("gpt2", 32, 9, 0, 0), ("mixtral", 32, 5, 2, 4), ("qwen3_moe", 128, 5, 2, 4)])
def test_int4_rewrites_gemm_linears_and_moe_experts_and_keeps_routers(traced_family, family, group, linears,
                                                                      routers, experts):
    """GPT-2's Conv1D layers trace to Gemm (bias folded in): all 8 plus the LM head go to MatMulNBits.
    MoE: Q/K/V (packed), O and the LM head do; the batched ``[E, N, K]`` expert weights become INT4
    behind GatherBlockQuantized (qwen3_moe with group 128: K = 64 is padded to one group and sliced
    back); the routers (Gemm → Softmax) stay fp32."""
    _, model, feeds, pool = traced_family(family)
    recipe = QuantRecipe(quant="int4", group_size=group, embeddings="none", lm_head="int4", int4_kernel="mlas")
    q = model.clone()
    stats = graph.quantize_model(q, recipe, None)
    assert stats["matches"] == stats["rtn"] == linears
    assert stats.get("routers_kept", 0) == routers and stats.get("expert_weights_int4", 0) == experts
    assert "expert_weights_kept" not in stats
    ops = [n.op_type for n in q.graph]
    assert ops.count("MatMulNBits") == linears and ops.count("Gemm") == routers
    assert ops.count("GatherBlockQuantized") == experts and not any(graph._expert_gather(n) for n in q.graph)
    left = _weights(q)
    assert len(left) == routers and all(router for _, router, _ in left)
    ref = _with_weights(model, lambda _n, w: int4.quantize_rtn(w, group, False).dequantize())
    ref = _with_expert_weights(ref, lambda w: _int4_experts_deq(w, group))
    out, expect = run_graph(q, feeds, pool), run_graph(ref, feeds, pool)
    assert _rel(out, expect) < 2e-5
    assert _rel(out, run_graph(model, feeds, pool)) > 1e-4  # and it did quantize


def test_fp8_weights_of_gemm_linears_match_numpy(traced_family):
    from llmc.quant import fp8

    _, model, feeds, pool = traced_family("gpt2")
    q = model.clone()
    stats = graph.quantize_model(q, QuantRecipe(quant="fp8"), None)  # no calibration: weights only
    assert stats["matches"] == 9 and stats["gemm_rewritten"] == 8 and not _weights(q)
    ref = _with_weights(model, lambda _n, w: fp8.quantize(w, axis=0).dequantize())
    assert _rel(run_graph(q, feeds, pool), run_graph(ref, feeds, pool)) < 2e-5


@pytest.mark.parametrize("family,quant", [("gpt2", "int4-awq"), ("mixtral", "int4-gptq")])
def test_calibrated_int4_on_gemm_and_moe_graphs_matches_numpy(traced_family, family, quant):
    """Real calibration (AWQ on GPT-2: LayerNorm cannot absorb the scales, so every one is an explicit
    Mul; GPTQ on Mixtral): the graph computes what the original does with the calibrated INT4 weights,
    dequantized in numpy (and divided by AWQ's input scale where the graph divides the input); expert
    weights are RTN (no per-expert statistics)."""
    from llmc.compiler.binding import param_reader
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.quant.stage import QuantStage

    ckpt, model, feeds, pool = traced_family(family)
    # MatMulNBits at accuracy level 0 computes in fp32 (the defaults, llmc's kernel or level 4, round
    # activations to int8)
    recipe = QuantRecipe(quant=quant, group_size=32, embeddings="none", lm_head="int4", calib_samples=4,
                         calib_seq_len=32, int4_accuracy_level=0, int4_kernel="mlas")
    checkpoint = load_checkpoint(ckpt)
    stage = QuantStage(checkpoint, recipe, params=param_reader(checkpoint))
    q = model.clone()
    stage._run(q)
    stats, calib = stage.stats, stage.calibration
    linears = 9 if family == "gpt2" else 5
    assert stats["matches"] == stats["calibrated"] == linears and "rtn" not in stats
    if quant == "int4-awq":
        assert stats["awq_mul"] == linears and "awq_folded_norms" not in stats

    def expected(name, _w):
        parts = [calib.linears[m] for m in graph.members_of(name)]
        w = np.concatenate([p.weights.dequantize() for p in parts])
        s = parts[0].input_scale
        return w if s is None or parts[0].fold == "previous-linear" else w / s

    ref = _with_expert_weights(_with_weights(model, expected), lambda w: _int4_experts_deq(w, 32))
    assert stats.get("expert_weights_int4", 0) == (4 if family == "mixtral" else 0)  # experts: RTN
    assert _rel(run_graph(q, feeds, pool), run_graph(ref, feeds, pool)) < 2e-5


# -- builds -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NON_LLAMA)
def test_fp8_builds_for_every_family(tmp_path, family_checkpoint, family):
    """The calibrated fp8 build (static activation ranges for every rewritten linear, K/V ranges for every
    attention layer's FP8 cache) succeeds, and its own held-out check against the unquantized graph is
    recorded."""
    out = tmp_path / "fp8"
    result = CliRunner().invoke(cli, ["build", str(family_checkpoint(family)), "-o", str(out), "--quant", "fp8",
                                      "--kv-cache-dtype", "fp8", "--calib-samples", "4", "--calib-seq-len", "32",
                                      "--no-cache"])
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    rewritten = report["quantization"]["graph"]
    expect = 5 if family in MOE else 9  # MoE: Q/K/V, O per layer and the head; the experts stay fp32
    assert rewritten["matches"] == rewritten["fp8_activations"] == expect
    if family in MOE:
        assert rewritten["routers_kept"] == 2 and rewritten["expert_weights_kept"] == 4
    assert rewritten["kv_fp8_layers"] == 2
    amax = report["quantization"]["kv_cache_amax"]
    assert sorted(amax) == ["0", "1"] and min(min(v) for v in amax.values()) > 0
    accuracy = report["accuracy"]
    assert 0.5 < accuracy["top1_agreement"] <= 1.0 and np.isfinite(accuracy["kl_mean"])
