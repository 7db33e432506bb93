"""Where a step's time goes: ONNX Runtime's per-node profile of one engine, aggregated by op type.

    python benchmarks/profile_engine.py ENGINE [--batch 8] [--input-len 128] [--new-tokens 32] [--threads 2]
    python benchmarks/profile_engine.py ENGINE --prefill 512

Runs one workload of ``llmc bench`` (greedy, prefix caching off) with ORT profiling on
(LLMC_ORT_PROFILE), then prints, per op type, the summed kernel time, its share of all node time,
and the share of the wall-clock time of the timed steps that no node accounts for (Python, feeds,
session overhead). Decode: only steps after the prompt pass are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also save the table here")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="llmc-prof-")
    os.environ["LLMC_ORT_PROFILE"] = str(Path(tmp) / "ort")
    import numpy as np

    from llmc.runtime import Engine, SamplingParams

    engine = Engine.load(args.engine, num_threads=args.threads, enable_prefix_caching=False)
    vocab = engine.manifest["engine"]["vocab_size"]
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1 if args.prefill else args.new_tokens, temperature=0.0, ignore_eos=True)
    if args.prefill:
        prompts = [rng.integers(4, vocab, args.prefill).tolist()]
    else:
        prompts = [rng.integers(4, vocab, args.input_len).tolist() for _ in range(args.batch)]
    engine.generate(prompts, params)  # warm-up (first-run allocations)

    def timed(p: SamplingParams) -> tuple[float, float, float]:
        a = time.time_ns() / 1e3
        t = time.perf_counter()
        engine.generate(prompts, p)
        return a, time.time_ns() / 1e3, time.perf_counter() - t

    # Decode steps = a run to N tokens minus a run to 1 token (the prompt pass); prefill = one run.
    windows = [timed(params)]
    if not args.prefill:
        windows.append(timed(SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    origin_us = engine._session._session.get_profiling_start_time_ns() / 1e3
    trace = engine._session.end_profiling()
    events = json.loads(Path(trace).read_text())

    def collect(lo: float, hi: float) -> tuple[dict, dict, float, int]:
        per, cnt, run_us, nruns = defaultdict(float), defaultdict(int), 0.0, 0
        for e in events:
            if not lo <= origin_us + e.get("ts", -1e18) <= hi:
                continue
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                run_us += e["dur"]
                nruns += 1
            elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                op = e.get("args", {}).get("op_name", "?")
                per[op] += e["dur"]
                cnt[op] += 1
        return per, cnt, run_us, nruns

    per_op, counts, run_us, steps = collect(*windows[0][:2])
    wall_us = windows[0][2] * 1e6
    if not args.prefill:
        p1, c1, r1, s1 = collect(*windows[1][:2])
        for op in p1:
            per_op[op] -= p1[op]
            counts[op] -= c1[op]
        run_us -= r1
        steps -= s1
        wall_us -= windows[1][2] * 1e6
    node_us = sum(per_op.values())
    print(f"engine {args.engine}  ({'prefill ' + str(args.prefill) if args.prefill else f'decode b{args.batch}'}, "
          f"{args.threads} threads): {steps} steps, wall {wall_us / 1e3:.1f} ms, in session.run {run_us / 1e3:.1f} ms, "
          f"in nodes {node_us / 1e3:.1f} ms")
    print(f"{'op':28s} {'calls/step':>10s} {'µs/step':>10s} {'% nodes':>8s} {'% wall':>8s}")
    rows = []
    for op, us in sorted(per_op.items(), key=lambda kv: -kv[1]):
        row = {"op": op, "calls_per_step": counts[op] / steps, "us_per_step": us / steps,
               "pct_nodes": 100 * us / node_us, "pct_wall": 100 * us / wall_us}
        rows.append(row)
        print(f"{op:28s} {row['calls_per_step']:10.1f} {row['us_per_step']:10.1f} {row['pct_nodes']:8.1f} "
              f"{row['pct_wall']:8.1f}")
    other = {"session.run outside nodes": run_us - node_us, "outside session.run": wall_us - run_us}
    for k, us in other.items():
        print(f"{k:28s} {'':10s} {us / steps:10.1f} {'':8s} {100 * us / wall_us:8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"engine": str(args.engine), "batch": args.batch, "prefill": args.prefill,
                                         "threads": args.threads, "steps": steps, "rows": rows,
                                         "other_us_per_step": {k: v / steps for k, v in other.items()}}, indent=1))


if __name__ == "__main__":
    main()
