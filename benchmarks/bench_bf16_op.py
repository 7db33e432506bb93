#!/usr/bin/env python3
"""llmc.Bf16MatMul beside ONNX Runtime's float32 MatMul on the same bfloat16 weights, at gpt-oss-20b's
attention and LM-head shapes: time per call, side by side in one run.

qkv: [2880, 5120]; o: [4096, 2880]; lm_head: [2880, 8192] (vocab 8192 as make_model.py oss20b); rows 1 and 8
(decode batches) and 512 (a prefill). Random bfloat16 weights; one ONNX Runtime session per op and shape with
`--threads` intra-op threads; the two ops alternate within each repeat; medians of `--repeats` timed runs after
one warm-up each. The weights are far larger than the caches, as in a decode step.

    python benchmarks/bench_bf16_op.py [--threads 2] [--repeats 20] [--label NAME]

Prints a table and writes benchmarks/results/bench_bf16_op[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from llmc.plugins.bf16_matmul import pack, single_op_model
from llmc.testing.ort_sessions import native_session

SHAPES = {"qkv": (2880, 5120), "o": (4096, 2880), "lm_head": (2880, 8192)}
ROWS = (1, 8, 512)


def float_matmul_model(w: np.ndarray) -> bytes:
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "f32",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["S", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["S", n])], [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows_out = []
    for name, (k, n) in SHAPES.items():
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        w = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        sessions = {"bf16": native_session(single_op_model(pack(w), n), threads=args.threads),
                    "float32": native_session(float_matmul_model(w), threads=args.threads)}
        for m in ROWS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            outs = {op: s.run(None, {"X": x})[0] for op, s in sessions.items()}
            times: dict[str, list[float]] = {op: [] for op in sessions}
            for _ in range(args.repeats if m <= 8 else max(3, args.repeats // 5)):
                for op, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(None, {"X": x})
                    times[op].append(time.perf_counter() - t0)
            ms = {op: statistics.median(t) * 1e3 for op, t in times.items()}
            diff = float(np.abs(outs["bf16"] - outs["float32"]).max() / np.abs(outs["float32"]).max())
            rows_out.append({"matrix": name, "M": m, "K": k, "N": n, "bf16_ms": round(ms["bf16"], 3),
                             "float32_ms": round(ms["float32"], 3),
                             "speedup": round(ms["float32"] / ms["bf16"], 2), "max_rel_diff": diff})
    print(f"Bf16MatMul vs float32 MatMul, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print("| matrix | M | bf16 ms | float32 ms | float32 / bf16 | max rel. diff |\n|---|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['matrix']} | {r['M']} | {r['bf16_ms']:.2f} | {r['float32_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['max_rel_diff']:.1e} |")
    out = Path(__file__).parent / "results" / f"bench_bf16_op{'_' + args.label if args.label else ''}.json"
    out.write_text(json.dumps({"threads": args.threads, "load_avg": os.getloadavg(), "rows": rows_out}, indent=2)
                   + "\n")


if __name__ == "__main__":
    main()
