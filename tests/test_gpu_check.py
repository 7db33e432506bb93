"""scripts/gpu_check.py: its CPU-runnable parts (--cpu-smoke: Triton interpreter, tiny shapes, PTX compiled
but not launched) run here; the GPU parts run on a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: pip install '.[test]' (Linux wheels)")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _run(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script chooses the mode itself
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_cpu_smoke_runs_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    proc = _run(["--cpu-smoke", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-smoke" and report["ok"] is True
    cases = report["correctness"]["cases"]
    assert len(cases) >= 5 and all(c["ok"] for c in cases)
    assert {c["cache"] for c in cases} >= {"fp16", "fp8"}
    kernels = report["aot"]["kernels"]
    assert [k["target"] for k in kernels] == ["sm_90a", "sm_90a"] and all(k["ptx_bytes"] > 10_000 for k in kernels)
    assert "skipped" in report["bandwidth"] and "skipped" in report["tensorrt"]
    rec = report["recurrent"]  # the hybrid models' kernels: interpreter vs torch reference, chunked, AOT PTX
    assert rec["ok"] and {r["op"] for r in rec["kernels"]} == {"causal_conv1d", "gated_delta_rule", "ssd_scan"}
    assert all(r["target"] == "sm_90a" for r in rec["aot"]) and "engines" not in rec
    # The attention variants (sinks, ALiBi, chunked local attention) are among the kernel's cases.
    assert {"smoke sinks", "smoke alibi 6 heads", "smoke chunked"} <= {c["case"] for c in cases}
    lora = report["lora"]  # the multi-LoRA shrink/expand kernels: interpreter vs torch reference, AOT PTX
    assert lora["ok"] and len(lora["kernels"]) == 8 and all(r["untouched"] for r in lora["kernels"])
    assert all(t == "sm_90a" for r in lora["aot"] for t in r["targets"]) and "speed" not in lora
    assert "== correctness" in proc.stdout and "PASS" in proc.stdout


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present: the GPU mode would run")
def test_gpu_mode_without_a_gpu_says_what_to_do(tmp_path):
    proc = _run(["--out", str(tmp_path / "r.json"), "--skip", "aot"], tmp_path)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr
