#!/usr/bin/env python3
"""llmc.Mxfp4MoEMatMul alone, at gpt-oss-20b's expert shapes: time per call and multiply-adds per second; beside it
in the same run, the opt-in Mxfp4MoEMatMulQ8 (rows quantized to 8 bits per 32-block) on the same codes.

gate_up: 32 experts of [5760, 2880]; down: 32 experts of [2880, 2880]; rows = tokens x top-4 (4 at decode batch 1,
32 at batch 8, 512 for a 128-token prefill), routed to random experts (seeded). Random E2M1 codes with E8M0 scales
2^-8..2^-7 as make_model.py writes them. One ONNX Runtime session per shape with the op alone, `--threads` intra-op
threads; the median of `--repeats` timed runs after one warm-up.

    python benchmarks/bench_mxfp4_op.py [--threads 2] [--repeats 20] [--label NAME]

Prints a table and writes benchmarks/results/bench_mxfp4_op[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from llmc.plugins.mxfp4 import reference, single_op_model, single_op_model_q8
from llmc.testing.ort_sessions import native_session

E, K = 32, 2880
SHAPES = {"gate_up": 5760, "down": 2880}
ROWS = {"b1": 4, "b8": 32, "prefill128": 512}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows_out = []
    for name, n in SHAPES.items():
        blocks = rng.integers(0, 256, (E, n, K // 32, 16), dtype=np.uint8)
        scales = rng.integers(119, 121, (E, n, K // 32)).astype(np.uint8)
        codes, sc = reference.repack_q8(blocks, scales)
        sessions = {"exact": native_session(single_op_model(blocks, scales), threads=args.threads),
                    "q8": native_session(single_op_model_q8(codes, sc, n), threads=args.threads)}
        for tag, m in ROWS.items():
            x = rng.standard_normal((m, 1, K)).astype(np.float32)
            ids = rng.integers(0, E, m).astype(np.int64)
            outs = {op: s.run(None, {"X": x, "ids": ids})[0] for op, s in sessions.items()}
            times: dict[str, list[float]] = {op: [] for op in sessions}
            for _ in range(args.repeats if m <= 32 else max(3, args.repeats // 5)):
                for op, sess in sessions.items():
                    t0 = time.perf_counter()
                    sess.run(None, {"X": x, "ids": ids})
                    times[op].append(time.perf_counter() - t0)
            ms = {op: statistics.median(t) * 1e3 for op, t in times.items()}
            err = float(np.abs(outs["q8"] - outs["exact"]).max() / np.abs(outs["exact"]).max())
            rows_out.append({"matrix": name, "rows": tag, "M": m, "N": n, "K": K, "ms": round(ms["exact"], 3),
                             "gmac_s": round(m * n * K / (ms["exact"] * 1e-3) / 1e9, 2),
                             "q8_ms": round(ms["q8"], 3), "q8_speedup": round(ms["exact"] / ms["q8"], 2),
                             "q8_max_rel_err": err, "experts_touched": int(len(set(ids.tolist())))})
    print(f"Mxfp4MoEMatMul (exact) and Mxfp4MoEMatMulQ8, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| matrix | rows | M | exact ms / call | GMAC/s | Q8 ms / call | exact / Q8 | Q8 max rel. err | experts |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['matrix']} | {r['rows']} | {r['M']} | {r['ms']:.2f} | {r['gmac_s']:.1f} | {r['q8_ms']:.2f} | "
              f"{r['q8_speedup']:.2f}x | {r['q8_max_rel_err']:.1e} | {r['experts_touched']} |")
    out = Path(__file__).parent / "results" / f"bench_mxfp4_op{'_' + args.label if args.label else ''}.json"
    result = {"threads": args.threads, "load_avg": os.getloadavg(), "rows": rows_out}
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
