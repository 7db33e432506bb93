"""Issue 50's guard for the accuracy report's per-layer work: two llmc trees build the same checkpoint with the same
recipe side by side (fresh cache each, a subprocess each, rounds alternating which tree goes first).

Recorded per build: wall seconds, the child's peak RSS (``getrusage``), build_info.json's stage timings and per-stage
peaks; the report.json and engine files of the two trees are compared byte for byte. JSON to benchmarks/results/.

    python benchmarks/bench_quant_report.py --model $PEERS_ROOT/model-1b --before /tmp/before --after /tmp/after \\
        [--quant int4] [--rounds 2]

``--before`` / ``--after``: directories each holding a package ``llmc`` (a ``git worktree`` with the compiled
``.so`` files copied in).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _build(tree: Path, model: Path, out: Path, quant: str) -> dict:
    code = ("import sys; from llmc.cli.main import main; "
            f"sys.argv = ['llmc', 'build', {str(model)!r}, '-o', {str(out)!r}, '--force', '-q', '--quant', {quant!r}]; "
            "main()")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(tree), LLMC_CACHE_DIR=cache, LLMC_SELF_CHECK="0")
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code], env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"build in {tree} failed: status {status}")
    info = json.loads((out / "build_info.json").read_text())
    return {"wall_s": round(wall, 2), "peak_rss_gb": round(usage.ru_maxrss / (1 << 20), 3),
            "timings_s": info["timings_s"], "stage_peak_rss_gb": info["memory"].get("peak_rss_gb")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    work = Path(tempfile.mkdtemp(prefix="bench-quant-report-"))
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            runs[name].append(_build(trees[name], args.model, work / name, args.quant))
            row = runs[name][-1]
            t = row["timings_s"]
            print(f"round {r + 1} {name}: {row['wall_s']:.1f}s wall, peak {row['peak_rss_gb']:.2f} GB, evaluate "
                  f"{t.get('quant_evaluate', 0):.1f}s (reference run {t.get('quant_evaluate_reference_run', 0):.1f}, "
                  f"sessions {t.get('quant_evaluate_reference_sessions', 0):.1f}; quantized run "
                  f"{t.get('quant_evaluate_quantized_run', 0):.1f})", flush=True)
    same = {f: (work / "after" / f).read_bytes() == (work / "before" / f).read_bytes()
            for f in sorted(p.name for p in (work / "after").iterdir() if p.is_file()) if f != "build_info.json"}
    keys = ["wall_s", "peak_rss_gb"]
    stages = ["quant_evaluate", "quant_evaluate_reference_run", "quant_evaluate_reference_sessions",
              "quant_evaluate_quantized_run", "quant_evaluate_quantized_sessions", "quant_calibrate", "emit", "trace"]
    med = {k: {**{m: statistics.median(r[m] for r in rows) for m in keys},
               **{s: statistics.median(r["timings_s"].get(s, 0.0) for r in rows) for s in stages}}
           for k, rows in runs.items()}
    print(f"\n| {args.model.name} --quant {args.quant} | " + " | ".join(keys + stages) + " |")
    for k in trees:
        print(f"| {k} | " + " | ".join(f"{med[k][m]:.2f}" for m in keys + stages) + " |")
    print("identical files:", same)
    res = REPO / "benchmarks" / "results"
    out = res / f"bench_quant_report_{args.model.name}_{args.quant}{args.tag}.json"
    out.write_text(json.dumps({"model": str(args.model), "quant": args.quant, "cores": os.cpu_count(),
                               "machine": platform.processor() or platform.machine(),
                               "load_avg": os.getloadavg(), "runs": runs, "median": med, "identical_files": same,
                               "child_rusage_self_max_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                               / (1 << 20), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
