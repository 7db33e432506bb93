#!/usr/bin/env python3
"""How close Mxfp4MoEMatMulQ8's kernel is to memory-bound at gpt-oss-20b's decode shapes.

Compiles benchmarks/csrc/mxfp4_q8_stream.cc (the kernel header as the op library builds it, with g++) and runs it
at 1 and 2 threads: 4 layers of 32 experts (gate_up [5760, 2880] and down [2880, 2880], ~1.1 GB of codes touched
at 32 routed rows, far past any L3), each repeat timed right beside a plain AVX-512 read of the same bytes, so
their ratio holds even when a neighbour on the host changes the bandwidth between runs. Needs AVX-512 VNNI + VBMI.

    python benchmarks/bench_mxfp4_stream.py [--rows 32] [--repeats 10] [--label NAME]

Prints a table and writes benchmarks/results/bench_mxfp4_stream[_NAME].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="routed rows per call (decode batch x top-4)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "mxfp4_q8_stream"
        # the op library's flags (setup.py): the kernels pick AVX-512 by target attributes at run time
        subprocess.run(["g++", "-std=c++17", "-O3", "-fopenmp", "-march=x86-64-v2", "-Wno-psabi", f"-I{ROOT}",
                        "-o", str(exe), str(HERE / "csrc" / "mxfp4_q8_stream.cc")], check=True)
        rows = []
        for threads in (1, 2):
            out = subprocess.run([str(exe), str(threads), str(args.rows), str(args.repeats)], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out))
    if "error" in rows[0]:
        raise SystemExit(f"error: {rows[0]['error']}")
    print(f"Mxfp4MoEMatMulQ8 kernel beside a plain read of the same bytes, {rows[0]['mb']:.0f} MB a pass, "
          f"{args.rows} routed rows, load average {os.getloadavg()[0]:.2f}")
    print("| threads | kernel ms (median) | read ms (median) | kernel / read (median of pairs) | kernel GB/s (best) "
          "| read GB/s (best) |\n|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['threads']} | {r['kernel_ms_median']:.1f} | {r['read_ms_median']:.1f} | "
              f"{r['kernel_over_read_median']:.2f} | {r['kernel_gb_s_best']:.1f} | {r['read_gb_s_best']:.1f} |")
    name = f"bench_mxfp4_stream{'_' + args.label if args.label else ''}.json"
    (HERE / "results" / name).write_text(json.dumps({"load_avg": os.getloadavg(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
