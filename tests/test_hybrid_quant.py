"""Quantized hybrid engines (recurrent state beside attention): ``--quant int4 / int4-awq / fp8`` on the CPU target.

Calibration runs transformers' own layers (their recurrent forms with no cache: a zero start state per sample), and
the accuracy report scores the graphs layer by layer with one state slot that every window starts afresh
(llmc.quant.layerwise). Held here, for a Gated DeltaNet family (Qwen3.5) and a Mamba2 family (Nemotron-H):

- the quantized engines' next-token distributions against transformers' fp32 logits (KL and top-1, the bounds of
  tests/test_quant_build.py and tests/test_quant_families.py), batched greedy tokens = alone;
- the layer-by-layer scorer = the engine's own ``score`` (state carried through each window as in a prefill);
- only the linears are quantized: the recurrent ops' own weights (conv kernels, A_log, dt bias, norms) stay fp32.

The fixtures draw their matrices as the dense families' quantization fixtures do (std 0.15, not the fp32 tests' 0.2)
and Qwen3.5's ``1 + weight`` norms around 0: on these random 64-wide models int4's error grows fast with the
sharpness of the next-token distributions (with norms around 1, each doubling its input, transformers' own RTN int4
copy of the Qwen3.5 fixture is at KL 1.35 from fp32, its FP8 copy at 0.23).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

FAMILIES = ("qwen3_5_text", "nemotron_h")
CALIB = ("--calib-samples", "4", "--calib-seq-len", "32", "--eval-tokens", "512")
LENGTHS = (20, 45, 70)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, checkpoint, transformers model, token sequences, their fp32 logits from transformers)."""
    import torch

    from llmc.testing.hybrids import write_hybrid

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    hf = write_hybrid(model_type, root / "ckpt", tokenizer=True, std=0.15, centred_norms=True)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(4, hf.config.vocab_size, n).tolist() for n in LENGTHS]
    with torch.no_grad():
        logits = [hf(torch.tensor([s])).logits[0].numpy() for s in seqs]
    return model_type, root / "ckpt", seqs, logits


def _build(ckpt, out, quant: str) -> dict:
    from click.testing import CliRunner

    from llmc.cli.main import cli

    result = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(out), "--target", "cpu", "--quant", quant,
                                      *CALIB, "--no-cache", "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_top1(engine, seqs, refs) -> tuple[float, float]:
    """Mean KL(transformers fp32 || engine) of every position's next-token distribution, and top-1 agreement."""
    kls, agree, total = [], 0, 0
    for seq, ref in zip(seqs, refs, strict=True):
        got = engine.score(seq)
        p, q = _log_softmax(ref.astype(np.float64)), _log_softmax(got.astype(np.float64))
        kls.append((np.exp(p) * (p - q)).sum(-1))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(seq)
    return float(np.concatenate(kls).mean()), agree / total


# (max KL, min top-1). int4 as tests/test_quant_build.py holds its int4 build (KL < 1; no top-1 bound: the coverage
# matrix's dense families agree at 0.34-0.49 on their fixtures); fp8 as tests/test_quant_families.py holds every
# family's fp8 build (top-1 > 0.5), and four times tighter on KL than int4 (transformers' own FP8 copy of the Qwen3.5
# fixture, weights per channel and activations per tensor from their own range, is at KL 0.125).
BOUNDS = {"int4": (1.0, 0.0), "fp8": (0.25, 0.5)}
# The int4 build of the Mamba2 family runs AWQ (calibrated, scales folded into the norms), the Gated DeltaNet one RTN.
INT4 = {"qwen3_5_text": "int4", "nemotron_h": "int4-awq"}


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_quantized_engine_close_to_transformers(family, tmp_path, kind):
    import onnx_ir as ir

    from llmc.quant import layerwise
    from llmc.quant.stage import _engine_graph
    from llmc.runtime import Engine, SamplingParams

    model_type, ckpt, seqs, refs = family
    quant = INT4[model_type] if kind == "int4" else kind
    out = tmp_path / quant
    result = _build(ckpt, out, quant)
    acc = result["accuracy"]  # the build's own report: quantized vs unquantized graph, layer by layer
    assert acc["tokens"] >= 512 and np.isfinite(acc["kl_mean"]) and 0 < acc["top1_agreement"] <= 1
    report = json.loads((out / "report.json").read_text())
    assert report["quantization"]["graph"]["matches"] > 0

    engine = Engine.load(out, kv_cache_tokens=512)
    kl, top1 = _kl_top1(engine, seqs, refs)
    max_kl, min_top1 = BOUNDS[kind]
    assert kl < max_kl and top1 > min_top1, (model_type, quant, kl, top1)

    # batched = alone (greedy; prompts longer than the 16-token step budget go in chunks)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    small = Engine.load(out, kv_cache_tokens=512, max_num_tokens=16)
    batched = [o.token_ids for o in small.generate([list(s) for s in seqs], params)]
    assert batched == [small.generate([list(s)], params)[0].token_ids for s in seqs]
    assert small.stats().state_slots_used == 0

    # The layer-by-layer scorer (a state slot per window of a group, each window from a zero state) = the engine's
    # own score(), windows grouped and (state slots capped at one) a window a group.
    graph, kv, custom_ops = _engine_graph(out)
    assert kv.state is not None
    for cap in (None, 1):
        scorer = layerwise.LayerwiseScorer(graph, custom_ops, kv)
        if cap is not None:
            scorer.BATCH_STATE_BYTES = 1
        assert len(scorer.batches(seqs[:3])) == (1 if cap is None else 3)
        for seq, logits in zip(seqs, scorer.run(seqs[:3]), strict=False):
            np.testing.assert_allclose(logits, engine.score(seq), rtol=1e-5, atol=1e-5)

    # Only the linears are quantized: every weight the recurrent ops read is fp32.
    from llmc.plugins.recurrent import CONV_OP_TYPE, DELTA_OP_TYPE, DOMAIN, SSD_OP_TYPE

    model = ir.load(out / json.loads((out / "manifest.json").read_text())["engine"]["model_file"])
    recurrent = [n for n in model.graph
                 if n.domain == DOMAIN and n.op_type in (CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE)]
    assert recurrent
    for node in recurrent:
        for v in node.inputs:
            if v is not None and v.const_value is not None:
                assert v.const_value.dtype == ir.DataType.FLOAT, (node.op_type, v.name)
