"""Quantized builds in bounded memory: --max-memory, per-stage peaks, the guard, the up-front refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc import memory

GB = 1 << 30


def _llmc(*args) -> subprocess.CompletedProcess:
    # A process of its own: its resident memory is the build's alone (not the test runner's).
    return subprocess.run([str(Path(sys.executable).with_name("llmc")), *map(str, args)], capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """A 16-layer Llama of 0.36 B parameters in bfloat16: 1.4 GB of weights in float32, 88 MB per layer."""
    from llmc.testing.checkpoints import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("wide") / "ckpt", dtype="bfloat16", hidden_size=1024,
                            intermediate_size=6144, num_hidden_layers=16, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=512, max_position_embeddings=512)


def test_an_int4_build_completes_under_a_limit_below_its_model_in_float32(tmp_path, wide_llama):
    """--max-memory 1.3G on a model whose float32 weights alone are 1.4 GB: the accuracy report's reference, run as
    one session (the build before layer-by-layer scoring: 1.4 GB of weights and ONNX Runtime's pre-packed copy on
    top of the toolchain), cannot fit; the build completes, and every stage's exact peak is under the limit."""
    from llmc.compiler.checkpoint import load_checkpoint

    fp32 = sum(4 * int(np.prod(e.shape)) for e in load_checkpoint(wide_llama).tensors.values())
    limit = 1.3 * GB
    assert fp32 > limit
    out = tmp_path / "int4"
    proc = _llmc("build", wide_llama, "-o", out, "--cache-dir", tmp_path / "cache", "--quant", "int4",
                 "--eval-tokens", "512", "--max-memory", "1.3G", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["accuracy"]["tokens"] >= 512
    info = json.loads((out / "build_info.json").read_text())["memory"]
    assert info["max_memory_gb"] == pytest.approx(1.3)
    peaks = info["peak_rss_gb"]
    assert {"trace", "passes", "emit", "write", "evaluate"} <= set(peaks), peaks
    if info["exact"]:
        assert max(peaks.values()) <= 1.3, peaks
    assert info["estimate"]["need_gb"] <= 1.3 + 1.0 and info["estimate"]["largest"] == "layer 0"


def test_max_memory_below_the_estimate_is_refused_before_any_work(tmp_path, wide_llama):
    out = tmp_path / "never"
    proc = _llmc("build", wide_llama, "-o", out, "--cache-dir", tmp_path / "cache", "--quant", "int4-awq",
                 "--max-memory", "600M")
    assert proc.returncode == 5, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --max-memory 0.59 GB: this build needs about") and "layer 0" in last
    assert "raise --max-memory to at least" in last and "Traceback" not in proc.stderr
    assert "[2/5]" not in proc.stderr  # refused before tracing
    assert not out.exists() and not list(tmp_path.glob(".never.tmp-*"))


@pytest.mark.parametrize("text, expect", [("8G", 8 * GB), ("512M", 512 << 20), ("1.5g", int(1.5 * GB)),
                                          ("4096", 4096), ("2GiB", 2 * GB)])
def test_sizes_parse(text, expect):
    assert memory.parse_size(text) == expect


def test_a_bad_size_is_one_line_exit_2(tmp_path, wide_llama):
    proc = _llmc("build", wide_llama, "-o", tmp_path / "x", "--max-memory", "lots")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --max-memory 'lots' is not a size; write it like 8G, 512M "
                                                "or 1.5G"]


def test_the_guard_stops_the_main_thread_past_its_limit():
    """Allocating past the limit raises MemoryExceeded in the main thread, naming the stage; memory is freed."""
    if memory.rss() is None:
        pytest.skip("no /proc/self/status here")
    limit = memory.rss() + 300 * (1 << 20)
    held = []
    with pytest.raises(memory.MemoryExceeded, match=r"--max-memory .* resident in the test stage"):
        with memory.Guard(limit, lambda: "the test stage", interval=0.01):
            for _ in range(200):  # up to 2 GB, 10 MB at a time, touched so that it is resident
                held.append(np.ones(10 << 20, np.uint8))
                import time

                time.sleep(0.002)
    assert sum(a.nbytes for a in held) < 2 * GB
    held.clear()


def test_stage_peaks_are_the_high_water_mark_of_each_stage():
    peaks = memory.StagePeaks()
    if not peaks.exact:
        pytest.skip("the kernel does not let the high-water mark be reset here")
    peaks.start("big")
    big = np.ones(400 << 20, np.uint8)
    del big
    peaks.stop()
    peaks.start("small")
    small = np.ones(10 << 20, np.uint8)
    del small
    peaks.stop()
    assert peaks.figures["big"] - peaks.figures["small"] > 0.3


def test_a_build_past_max_memory_stops_in_one_line_and_leaves_nothing(tmp_path, wide_llama):
    """The guard in a real build: past --max-memory after tracing (600 MB more held there, a test hook), the build
    stops with exit 5 and one line naming the limit and the stage; no output, no cache entry, no staging."""
    import os

    env_hold = {"LLMC_TEST_HOLD_AT": "after-trace:900"}
    out, cache = tmp_path / "never", tmp_path / "cache"
    proc = subprocess.run([str(Path(sys.executable).with_name("llmc")), "build", str(wide_llama), "-o", str(out),
                           "--cache-dir", str(cache), "--quant", "int4", "--max-memory", "1.3G"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, **env_hold})
    assert proc.returncode == 5, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --max-memory 1.3 GB: the build reached") and "resident in trace" in last
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".never.tmp-*"))
    assert not [p for p in cache.rglob("*") if p.is_dir() and p.parent.name == "tmp"]
    assert not list(cache.rglob("manifest.json"))
