"""Quantized builds in bounded memory: --max-memory, per-stage peaks, the guard, the up-front refusal."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc import memory

GB = 1 << 30
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default-model"


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
    # Fresh anonymous mappings, touched: malloc could serve the arrays from heap pages an earlier test in this
    # worker freed but kept resident, and then neither stage would raise the resident size at all.
    for name, size in (("big", 400 << 20), ("small", 10 << 20)):
        peaks.start(name)
        with mmap.mmap(-1, size) as region:
            view = np.frombuffer(region, np.uint8)
            view[:] = 1
            del view
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


def test_cgroup_room_reads_v1_and_v2_limits_and_their_ancestors(tmp_path):
    """The tightest limit wins, page cache the kernel would reclaim counts as free, "no limit" is ignored."""
    v1 = tmp_path / "memory" / "job" / "step"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # unlimited
    (v1 / "memory.usage_in_bytes").write_text(str(3 * GB))
    parent = v1.parent
    (parent / "memory.limit_in_bytes").write_text(str(4 * GB))
    (parent / "memory.usage_in_bytes").write_text(str(3 * GB))
    (parent / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GB // 2}\n")
    text = "9:pids:/\n4:memory:/job/step\n0::/\n"
    assert memory.cgroup_room(text, tmp_path) == GB + GB // 2
    v2 = tmp_path / "ci" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text(str(GB))
    (v2.parent / "memory.max").write_text(str(2 * GB))
    (v2.parent / "memory.current").write_text(str(GB + GB // 4))
    assert memory.cgroup_room("0::/ci/job\n", tmp_path) == GB - GB // 4
    assert memory.cgroup_room(text + "0::/ci/job\n", tmp_path) == GB - GB // 4  # both hierarchies: the tighter
    assert memory.cgroup_room("0::/elsewhere\n", tmp_path / "nothing") is None


def _memory_cgroup(limit: int) -> Path | None:
    """A child of this process's memory cgroup (v1, or v2 with the memory controller delegated) limited to
    ``limit`` bytes; None where this machine does not let us make one."""
    import uuid

    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            parent, limit_file = memory.CGROUP_ROOT / "memory" / path.strip("/"), "memory.limit_in_bytes"
        elif hid == "0" and controllers == "":
            parent, limit_file = memory.CGROUP_ROOT / path.strip("/"), "memory.max"
            try:
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        child = parent / f"llmc-test-{uuid.uuid4().hex[:8]}"
        try:
            child.mkdir()
            (child / limit_file).write_text(str(limit))
            return child
        except OSError:
            if child.is_dir():
                child.rmdir()
    return None


def test_a_build_nearing_its_cgroup_limit_stops_in_one_line_not_by_the_oom_killer(tmp_path):
    """No --max-memory: the default model's build runs in a memory cgroup (as in a container or a CI job) of 1.4 GB
    and grows past it after tracing (1.5 GB more held there, in steps, by a test hook). The kernel would kill it
    with no message at the limit; the guard sees the cgroup's room fall under its reserve first and stops the build
    with exit 5 and one line, leaving nothing behind."""
    import os

    group = _memory_cgroup(int(1.4 * GB))
    if group is None:
        pytest.skip("cannot make a memory cgroup on this machine (needs cgroup v1 or a delegated v2 controller)")
    out, cache = tmp_path / "never", tmp_path / "cache"
    try:
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("llmc")), "build", str(DEFAULT_MODEL), "-o", str(out), "--cache-dir",
             str(cache), "--quant", "int4"], capture_output=True, text=True, timeout=900,
            env={**os.environ, "LLMC_TEST_HOLD_AT": "after-trace:1500"},
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert proc.returncode == 5, (proc.returncode, proc.stderr[-2000:])  # not -9 (the OOM killer)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory: the build held") and "resident" not in last, last
    assert "in trace" in last and "cgroup" in last and "llmc's estimate for this build" in last, last
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".never.tmp-*"))
    assert not list(cache.rglob("manifest.json"))
