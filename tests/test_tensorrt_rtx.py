"""GPU targets without a GPU: the target table, refusals before any work, the TensorRT lowering of
PagedAttention (run in ONNX Runtime against the CPU graph), and real TensorRT-for-RTX engines built
ahead of time from the tiny Llama fixture (fp16 and FP8 for the RTX 4090, NVFP4 for the RTX 5090).

Executing the engines needs an RTX GPU and llmc's GPU runtime; neither is here, so the engines are
checked through their manifest, the builder's network statistics and the runtime's refusal.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.errors import UnsupportedError

TRT_RTX_MISSING = ("tensorrt_rtx is not importable (pip install tensorrt-rtx-cu13==1.7.1.116, part of the test "
                   "extras): TensorRT-for-RTX engine builds cannot be tested")
SHAPES = ("--max-batch-size", "4", "--max-num-tokens", "64", "--max-seq-len", "128")
CALIB = ("--calib-samples", "8", "--calib-seq-len", "64")


def _llmc(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _trt_rtx():
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip(TRT_RTX_MISSING)
    import tensorrt_rtx

    return tensorrt_rtx


# -- refusals, before any work --------------------------------------------------------------------

@pytest.mark.parametrize("args,code,needles", [
    (("--gpu", "h100", "--quant", "nvfp4"), 3,
     ("--quant nvfp4", "sm_100", "--gpu h100", "sm_90", "--quant fp8", "--gpu b200 / rtx5090")),
    (("--gpu", "a100", "--quant", "fp8"), 3, ("--quant fp8", "sm_89", "--gpu a100", "sm_80", "--quant int4",
                                             "--gpu h100 / l40s")),
    (("--gpu", "rtx4090", "--engine", "tensorrt", "--kv-cache-dtype", "fp8"), 3,
     ("--kv-cache-dtype fp8", "TensorRT for RTX", "float16")),
    (("--gpu", "rtx4090", "--engine", "tensorrt", "--quant", "int4"), 3,
     ("--quant int4", "symmetric", "--symmetric")),
    (("--gpu", "rtx4090", "--engine", "tensorrt", "--max-num-tokens", "2", "--max-batch-size", "8"), 2,
     ("--max-num-tokens 2",
                                                                                 "--max-batch-size 8")),
    (("--gpu", "v100"), 2, ("--gpu 'v100'", "rtx4090", "auto")),
    (("--gpu", "rtx4090", "--target", "h100"), 2, ("--gpu", "--target h100")),
])
def test_gpu_requests_a_target_cannot_honour_are_refused_before_any_work(tmp_path, tiny_llama, args, code, needles):
    rc, _, err = _llmc("build", tiny_llama, "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache", *args)
    assert rc == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in last, (needle, last)
    assert "[2/5]" not in err and not (tmp_path / "out").exists()


def test_full_tensorrt_target_says_what_to_install(tmp_path, tiny_llama):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the missing-TensorRT message cannot be observed")
    rc, _, err = _llmc("build", tiny_llama, "-o", tmp_path / "out", "--gpu", "h100", "--engine", "tensorrt")
    last = err.strip().splitlines()[-1]
    assert rc == 3 and "--gpu h100" in last and "pip install tensorrt-cu13==" in last and "GPU" in last, err
    assert "[2/5]" not in err and not (tmp_path / "out").exists()


def test_gpu_auto_without_a_gpu(tmp_path, tiny_llama):
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is present: --gpu auto would detect a GPU")
    rc, _, err = _llmc("build", tiny_llama, "-o", tmp_path / "out", "--gpu", "auto")
    assert rc == 3 and "--gpu auto: no NVIDIA GPU" in err and "--gpu rtx4090" in err, err


def test_detect_gpu_maps_nvidia_smi_names_to_targets():
    from llmc.compiler.targets import detect_gpu

    cases = {"NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA GeForce RTX 5090": "rtx5090",
             "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA GB200": "gb200", "NVIDIA B200": "b200",
             "NVIDIA A100-SXM4-80GB": "a100", "NVIDIA L40S": "l40s"}
    for name, target in cases.items():
        assert detect_gpu([(name, "0.0")]).name == target, name
    with pytest.raises(UnsupportedError, match="Tesla T4.*not in llmc's target table"):
        detect_gpu([("Tesla T4", "7.5")])
    with pytest.raises(UnsupportedError, match="no NVIDIA GPU"):
        detect_gpu([])


def test_targets_table():
    rc, out, err = _llmc("targets", "--json")
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {"cpu", "a100", "l40s", "h100", "h200", "b200", "gb200", "rtx4090", "rtx5090"}
    assert {n for n, r in rows.items() if r["builder"] == "tensorrt_rtx"} == {"rtx4090", "rtx5090"}
    assert rows["h100"]["sm"] == "9.0" and "fp8" in rows["h100"]["native_formats"]
    assert "nvfp4" not in rows["h100"]["native_formats"] and "nvfp4" in rows["rtx5090"]["native_formats"]
    assert "fp8" not in rows["a100"]["native_formats"] and rows["h200"]["memory_gib"] == 141
    rc, text, _ = _llmc("targets")
    assert rc == 0 and "rtx5090" in text and "tensorrt_rtx" in text


# -- the lowering, run in ONNX Runtime ------------------------------------------------------------

@pytest.fixture(scope="module")
def traced_graph(tiny_llama):
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.frontend import trace
    from llmc.compiler.pipeline import passes_for, run_pipeline

    traced = trace(load_checkpoint(tiny_llama), compute_dtype="float32")
    run_pipeline(traced.model, passes_for("cpu"))
    return traced


def test_lowered_graph_matches_the_paged_graph(traced_graph):
    """The graph TensorRT parses (slot KV caches, TensorScatter + Attention, fp16 GEMMs) against the CPU
    graph (block pool, llmc's kernel) on a mixed step: a prefill, a chunk after cached context, a decode."""
    import onnx_ir as ir
    import onnxruntime as ort

    from llmc.compiler.verify import KVShape, random_step, run_graph
    from llmc.passes.tensorrt import lowering as trt_lowering

    t = traced_graph
    block, s_max = 16, 64
    feeds, pool = random_step(np.random.default_rng(7), t.vocab_size,
                              KVShape(t.num_layers, t.num_kv_heads, t.head_size, block))
    reference = run_graph(t.model, feeds, pool)
    lowered = t.model.clone()
    info = trt_lowering.lower(lowered, s_max)
    assert info.stats["paged_attention"] == t.num_layers and info.kv_dtype == "float16"
    assert not [n for n in lowered.graph if n.domain == "llmc"]
    assert "block_tables" not in info.inputs and "past_key.0" in info.inputs and "present_value.1" in info.outputs
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(ir.serde.serialize_model(lowered).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    ctx, qsl, tables = feeds["context_lens"], feeds["query_start_loc"], feeds["block_tables"]
    cached = ctx - np.diff(qsl)
    slot_feeds = {k: v for k, v in feeds.items() if k in info.inputs}
    rng = np.random.default_rng(8)
    for layer, (k_pool, v_pool) in enumerate(pool):
        for kind, blocks in (("key", k_pool), ("value", v_pool)):
            # Slot s holds sequence s's cached positions; the rest is noise the engine must not read.
            cache = rng.standard_normal((len(ctx), t.num_kv_heads, s_max, t.head_size)).astype(np.float16)
            for s in range(len(ctx)):
                for p in range(cached[s]):
                    cache[s, :, p] = blocks[tables[s, p // block], :, p % block]
            slot_feeds[trt_lowering.KV_INPUT.format(kind=kind, layer=layer)] = cache
    outputs = dict(zip(info.outputs, session.run(info.outputs, slot_feeds), strict=True))
    err = np.abs(outputs["logits"] - reference).max() / np.abs(reference).max()
    assert err < 1e-2, err  # float16 GEMMs and KV cache against float32
    for layer in range(t.num_layers):
        past = slot_feeds[f"past_key.{layer}"]
        present = outputs[f"present_key.{layer}"]
        for s in range(len(ctx)):  # cached positions kept, new ones written
            assert np.array_equal(present[s, :, : cached[s]], past[s, :, : cached[s]])
            assert not np.array_equal(present[s, :, cached[s]: ctx[s]], past[s, :, cached[s]: ctx[s]])


# -- real engines ---------------------------------------------------------------------------------

def _check_engine(out: Path, trt, target: str, sm: str, quant: str | None) -> dict:
    from llmc.runtime import Engine, artifact

    manifest = json.loads((out / "manifest.json").read_text())
    engine = manifest["engine"]
    plan = out / engine["engine_file"]
    assert plan.is_file() and plan.stat().st_size > 100_000
    assert manifest["files"][engine["engine_file"]] == artifact.sha256_file(plan)
    assert artifact.verify(out) == []
    assert engine["backend"] == "tensorrt_rtx" and engine["builder"]["version"] == trt.__version__
    assert manifest["toolchain"]["tensorrt_rtx"] == trt.__version__
    assert engine["sm"] == sm and manifest["target"] == {"name": target, "backend": "tensorrt_rtx", "sm": sm}
    assert engine["hardware_compatibility_level"] == "none" and engine["strongly_typed"]
    kv = manifest["kv_cache"]
    assert kv["layout"] == "slots_bhsd" and kv["max_seq_len"] == 128 and kv["max_slots"] == 4
    assert kv["num_layers"] == 2 and kv["num_kv_heads"] == 2 and kv["head_size"] == 16 and kv["dtype"] == "float16"
    (profile,) = engine["profiles"]
    assert profile["input_ids"] == {"min": [1], "opt": [4], "max": [64]}
    assert profile["query_start_loc"]["max"] == [5] and profile["past_key.0"]["max"] == [4, 2, 128, 16]
    io = {d["name"]: d for d in engine["io"]}
    assert io["past_key.1"]["shape"] == [-1, 2, 128, 16] and io["present_key.1"]["mode"] == "output"
    assert io["logits"]["dtype"] == "float" and engine["aliased_outputs"]["present_value.0"] == "past_value.0"
    assert manifest["recipe"]["quant"] == "none" if quant is None else manifest["recipe"]["quant"]["quant"] == quant
    rc, text, err = _llmc("inspect", out)
    assert rc == 0 and "slots_bhsd 4 slots × 128 tokens" in text and f"sm_{sm.replace('.', '')}" in text, err
    # This machine cannot run it, and says why.
    rc, _, err = _llmc("verify", out)
    assert rc == 1 and f"target {target!r}" in err and f"compute capability {sm}" in err, err
    with pytest.raises(UnsupportedError, match=f"TensorRT for RTX {trt.__version__}"):
        Engine.load(out)
    return json.loads((out / "build_info.json").read_text())["engine_build"]


def test_rtx4090_fp16_and_fp8_engines(tmp_path, tiny_llama):
    trt = _trt_rtx()
    cache = tmp_path / "cache"
    rc, out, err = _llmc("build", tiny_llama, "-o", tmp_path / "fp16", "--gpu", "rtx4090", "--engine", "tensorrt",
                         "--cache-dir", cache,
                         "--json", *SHAPES)
    assert rc == 0, err
    fp16 = _check_engine(tmp_path / "fp16", trt, "rtx4090", "8.9", None)
    assert json.loads(out)["target"] == "rtx4090"
    assert fp16["network"]["attention"] == 2 and fp16["network"]["kv_updates_packed"] == 4
    assert not any(k.startswith(("quantize_", "dequantize_")) for k in fp16["network"])
    # TensorRT for RTX compiles kernels on the device and keeps no timing cache (its calls are no-ops).
    assert fp16["timing_cache"]["used"] is False and not (cache / "trt-timing").exists()

    rc, out, err = _llmc("build", tiny_llama, "-o", tmp_path / "fp8", "--gpu", "rtx4090", "--engine", "tensorrt",
                         "--cache-dir", cache,
                         "--json", "--quant", "fp8", *CALIB, *SHAPES)
    assert rc == 0, err
    fp8 = _check_engine(tmp_path / "fp8", trt, "rtx4090", "8.9", "fp8")
    n_linear = 2 * 4 + 1  # packed qkv, o, packed gate/up, down per layer; lm_head
    assert fp8["network"]["quantize_fp8"] == n_linear and fp8["network"]["dequantize_fp8"] == 2 * n_linear
    accuracy = json.loads(out)["accuracy"]  # scored on the CPU from the same quantized graph
    assert accuracy["tokens"] > 1000 and 0 < accuracy["kl_mean"] < 1


def test_rtx5090_nvfp4_engine(tmp_path, tiny_llama):
    trt = _trt_rtx()
    rc, out, err = _llmc("build", tiny_llama, "-o", tmp_path / "nvfp4", "--gpu", "rtx5090", "--engine", "tensorrt",
                         "--cache-dir",
                         tmp_path / "cache", "--json", "--quant", "nvfp4", *CALIB, *SHAPES)
    assert rc == 0, err
    nvfp4 = _check_engine(tmp_path / "nvfp4", trt, "rtx5090", "12.0", "nvfp4")
    n_linear = 2 * 4 + 1
    # FP4 weights and dynamically FP4-quantized activations, each behind an FP8 block-scale DQ.
    assert nvfp4["network"]["dynamic_quantize_fp4"] == n_linear
    assert nvfp4["network"]["dequantize_fp4"] == 2 * n_linear and nvfp4["network"]["dequantize_fp8"] == 2 * n_linear
    assert json.loads(out)["accuracy"]["tokens"] > 1000


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_timing_cache_file_is_kept_and_reused(tmp_path):
    """The full-TensorRT timing-cache path (load, build, save atomically under a lock), driven by the RTX
    builder, whose timing-cache calls are accepted (as no-ops) with the same API."""
    trt = _trt_rtx()
    from llmc.compiler.backends import tensorrt as trt_backend

    log = trt_backend._Logger(trt, lambda msg: None)
    builder = trt.Builder(log.logger)
    network = builder.create_network(0)
    x = network.add_input("x", trt.float16, (-1, 32))
    w = network.add_constant((32, 32), trt.Weights(np.random.default_rng(0).standard_normal((32, 32)).astype(
        np.float16)))
    network.mark_output(network.add_matrix_multiply(x, trt.MatrixOperation.NONE, w.get_output(0),
                                                    trt.MatrixOperation.NONE).get_output(0))
    cache_file = tmp_path / "timing" / "t.cache"
    runs = []
    for _ in range(2):
        config = builder.create_builder_config()
        config.num_compute_capabilities = 1
        config.set_compute_capability(trt.ComputeCapability.SM89, 0)
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (1, 32), (4, 32), (8, 32))
        config.add_optimization_profile(profile)
        plan, _, info = trt_backend._build_with_timing_cache(builder, network, config, log,
                                                             trt_backend.BUILDERS["tensorrt_rtx"], cache_file)
        assert plan is not None and cache_file.is_file()
        runs.append(info)
    assert runs[0]["reused"] is False and runs[1]["reused"] is True
    assert runs[1]["bytes_before"] == cache_file.stat().st_size and not list(cache_file.parent.glob(".t.cache.*"))
