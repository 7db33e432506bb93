#!/usr/bin/env python3
"""llmc.Mxfp4MoEMatMul alone, at gpt-oss-20b's expert shapes: time per call and multiply-adds per second.

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

from llmc.plugins.mxfp4 import single_op_model
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
        sess = native_session(single_op_model(blocks, scales), threads=args.threads)
        for tag, m in ROWS.items():
            x = rng.standard_normal((m, 1, K)).astype(np.float32)
            ids = rng.integers(0, E, m).astype(np.int64)
            sess.run(None, {"X": x, "ids": ids})
            times = []
            for _ in range(args.repeats if m <= 32 else max(3, args.repeats // 5)):
                t0 = time.perf_counter()
                sess.run(None, {"X": x, "ids": ids})
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows_out.append({"matrix": name, "rows": tag, "M": m, "N": n, "K": K, "ms": round(ms, 3),
                             "gmac_s": round(m * n * K / (ms * 1e-3) / 1e9, 2),
                             "experts_touched": int(len(set(ids.tolist())))})
    print(f"Mxfp4MoEMatMul, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print("| matrix | rows | M | ms / call | GMAC/s | experts touched |\n|---|---|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['matrix']} | {r['rows']} | {r['M']} | {r['ms']:.2f} | {r['gmac_s']:.1f} | "
              f"{r['experts_touched']} |")
    out = Path(__file__).parent / "results" / f"bench_mxfp4_op{'_' + args.label if args.label else ''}.json"
    result = {"threads": args.threads, "load_avg": os.getloadavg(), "rows": rows_out}
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
