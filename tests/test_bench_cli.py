"""`llmc bench` end to end on the tiny engine: JSON fields, token counts, and the roofline arithmetic
checked against the onnx package's own reading of the engine's graph and the checkpoint's config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli

BATCHES = (1, 3)
INPUT_LEN, OUTPUT_LEN, PREFILL_LEN = 12, 6, 40


@pytest.fixture(scope="module")
def bench_json(tiny_engine, tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("bench") / "sub" / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llmc.cli.main", "bench", str(tiny_engine), "--repeats", "1", "--warmup", "0",
         "--batch", ",".join(map(str, BATCHES)), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
         "--prefill-len", str(PREFILL_LEN), "--stream-requests", "3", "--stream-rate", "200", "--threads", "1",
         "--json", "--out", str(out), "-q"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), json.loads(out.read_text())


def _graph_bytes(engine: Path) -> tuple[int, int]:
    """(streamed, gathered) bytes per the onnx package: initializers only Gather-like ops consume are gathered."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(engine / "model.onnx"))
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    streamed = gathered = 0
    for t in model.graph.initializer:
        nbytes = numpy_helper.to_array(t).nbytes
        ops = consumers.get(t.name, set())
        if ops and ops <= {"Gather", "GatherND", "GatherElements", "GatherBlockQuantized"}:
            gathered += nbytes
        else:
            streamed += nbytes
    return streamed, gathered


def test_bench_json_end_to_end(bench_json, tiny_engine):
    printed, saved = bench_json
    assert printed == saved  # --out holds what --json printed
    rows = {r["workload"]: r for r in printed["rows"]}
    assert set(rows) == {f"prefill_{PREFILL_LEN}", "stream", *(f"decode_b{b}" for b in BATCHES)}
    assert printed["config"]["repeats"] == 1 and printed["config"]["threads"] == 1

    # Bytes: the runtime's own protobuf reading agrees with the onnx package, and with the files on disk.
    streamed, gathered = _graph_bytes(tiny_engine)
    w = printed["weights"]
    assert (w["streamed"], w["gathered"]) == (streamed, gathered)
    data_file = tiny_engine / "model.onnx.data"
    assert w["files"] == data_file.stat().st_size
    # External weights live in the .data file; only small constants are stored inside model.onnx.
    assert w["files"] <= streamed + gathered <= w["files"] + (tiny_engine / "model.onnx").stat().st_size
    hf = json.loads((tiny_engine / "hf_config.json").read_text())
    assert w["row"] == hf["hidden_size"] * 4  # one fp32 embedding row per token
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    assert printed["kv_bytes_per_token"] == 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4

    machine = printed["machine"]["read_GBps"]
    assert machine > 0 and all(s > 0 for s in printed["machine"]["probe"]["samples"])
    for b in BATCHES:
        r = rows[f"decode_b{b}"]
        assert r["tokens_requested"] == r["tokens_generated"] == b * OUTPUT_LEN
        assert r["tok_s"] > 0 and r["ttft_ms"] > 0 and r["achieved_GBps"] > 0 and r["roofline_fraction"] > 0
        assert r["ms_per_step"] == pytest.approx(1000 * b / r["tok_s"], rel=1e-3, abs=1e-3)  # both rounded
        step_bytes = streamed + b * (w["row"] + printed["kv_bytes_per_token"] * (INPUT_LEN + OUTPUT_LEN / 2))
        assert r["bytes_per_token"] == int(step_bytes / b)
        assert r["achieved_GBps"] == pytest.approx(r["bytes_per_token"] * r["tok_s"] / 1e9, rel=1e-2, abs=2e-3)
        assert r["roofline_fraction"] == pytest.approx(r["achieved_GBps"] / r["machine_read_GBps"], rel=1e-2,
                                                       abs=1e-3)
        # machine_read_GBps is rounded to 2 decimals in the JSON.
        assert r["machine_read_GBps"] == pytest.approx(np.mean(r["machine_read_GBps_before_after"]), abs=0.0051)
    pre = rows[f"prefill_{PREFILL_LEN}"]
    assert pre["tok_s"] == pytest.approx(PREFILL_LEN / (pre["ttft_ms"] / 1000), rel=1e-2)
    assert pre["tokens_generated"] == pre["tokens_requested"] == 1
    s = rows["stream"]
    assert s["tokens_generated"] == s["tokens_requested"] == 3 * OUTPUT_LEN
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and 0 < s["itl_p50_ms"] <= s["itl_p99_ms"]


def test_bench_table(tiny_engine):
    res = CliRunner().invoke(cli, ["bench", str(tiny_engine), "--workloads", "decode", "--batch", "2",
                                   "--repeats", "1", "--warmup", "0", "--input-len", "8", "--output-len", "4",
                                   "--threads", "1", "-q"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("decode_b2"))
    assert line.split()[-1] == "8/8" and line.split()[-2].endswith("%")
    assert "prefill" not in res.output and "request stream" not in res.output


@pytest.mark.parametrize("args, names", [
    (["--batch", "0"], "--batch"),
    (["--batch", "1,x"], "--batch"),
    (["--workloads", "decode,warp"], "--workloads"),
    (["--output-len", "1"], "--output-len"),
    (["--input-len", "500", "--output-len", "100"], "max_position_embeddings"),
])
def test_bench_bad_options(tiny_engine, args, names):
    res = CliRunner().invoke(cli, ["bench", str(tiny_engine), "--repeats", "1", "-q", *args])
    assert res.exit_code == 2, res.output
    assert names in res.output and "error:" in res.output


def test_bench_bad_engine_and_out(tmp_path, tiny_engine):
    res = CliRunner().invoke(cli, ["bench", str(tmp_path / "nope"), "-q"])
    assert res.exit_code == 2 and "no such engine directory" in res.output
    res = CliRunner().invoke(cli, ["bench", str(tiny_engine), "--out", str(tmp_path), "-q"])
    assert res.exit_code == 2 and "--out" in res.output and "is a directory" in res.output


def test_read_bandwidth_probe_is_native_and_consistent():
    """llmc bench's probe runs in C++ (the method of benchmarks/peers/bw_read.c; how close it reads to that
    probe is measured by benchmarks/peers, not timed here) and reports the median of real timed passes."""
    from llmc.bench.machine import measure_read_bandwidth
    from llmc.runtime import _membench

    probe = measure_read_bandwidth(nbytes=1 << 26, repeats=3, threads=2)
    assert probe.method.startswith("C++") and probe.threads == 2 and probe.nbytes == 1 << 26
    assert len(probe.samples) == 3 and probe.read_GBps == sorted(probe.samples)[1]
    assert all(0.5 < s < 10_000 for s in probe.samples)  # 64 MiB in > 6 µs and < 0.13 s per pass
    small = np.ones(64, dtype=np.float32)
    with pytest.raises(ValueError, match="repeats and threads"):
        _membench.read_bandwidth(small, 0, 1)
    with pytest.raises(ValueError, match="too small"):
        _membench.read_bandwidth(small, 1, 4)
