"""Issue 47's guard: the restructured build and runtime against the code before the move, side by side in one run.

Two llmc trees (``--before``: a directory holding the package ``llmc`` as it was; ``--after``: this checkout) build
the same checkpoint with the same recipe through the real CLI (fresh cache each, subprocess each, rounds
alternating which tree goes first) and decode with ``llmc bench`` (batch 1 and 8, the same prompts); the engines'
files are compared too. Prints a table and writes JSON to benchmarks/results/.

    python benchmarks/bench_restructure.py --model $PEERS_ROOT/model-1b --before /work/llmc_base [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _env(tree: Path, cache: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree), LLMC_CACHE_DIR=str(cache), LLMC_SELF_CHECK="0")


def _llmc(tree: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    code = f"import sys; from llmc.cli.main import main; sys.argv = ['llmc', *{list(args)!r}]; main()"
    return subprocess.run([sys.executable, "-c", code], env=_env(tree, cache), check=True, capture_output=True,
                          text=True)


def _build(tree: Path, model: Path, out: Path, quant: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        _llmc(tree, Path(cache), "build", str(model), "-o", str(out), "--force", "-q", "--quant", quant)
        return time.perf_counter() - t


def _decode(tree: Path, engine: Path, threads: int) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as cache:
        got = _llmc(tree, Path(cache), "bench", str(engine), "--workloads", "decode", "-b", "1,8", "--json", "-q",
                    "--repeats", "3", "--threads", str(threads))
    result = json.loads(got.stdout)
    rows = [row for value in result.values() if isinstance(value, list) for row in value if isinstance(row, dict)]
    return {int(row["batch"]): float(row["tok_s"]) for row in rows
            if str(row.get("workload", "")).startswith("decode_b")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--before", type=Path, required=True, help="a directory holding the package llmc before")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": REPO.parent / ".bench-after"}
    trees["after"].mkdir(exist_ok=True)
    link = trees["after"] / "llmc"
    if not link.exists():
        link.symlink_to(REPO)
    runs: dict[str, dict[str, list[float]]] = {k: {"build_s": [], "b1": [], "b8": []} for k in trees}
    work = Path(tempfile.mkdtemp(prefix="bench-restructure-"))
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            engine = work / name
            runs[name]["build_s"].append(_build(trees[name], args.model, engine, args.quant))
        for name in order:
            rates = _decode(trees[name], work / name, args.threads)
            runs[name]["b1"].append(rates[1])
            runs[name]["b8"].append(rates[8])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['build_s'][-1]:.1f}s b1 {v['b1'][-1]:.1f} b8 {v['b8'][-1]:.1f}"
                                             for k, v in runs.items()), flush=True)
    same = {}
    for f in sorted(p.name for p in (work / "after").iterdir() if p.is_file()):
        if f != "build_info.json":
            same[f] = (work / "after" / f).read_bytes() == (work / "before" / f).read_bytes()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in runs.items()}
    print(f"\n| {args.model.name} --quant {args.quant} | build s | decode b1 tok/s | decode b8 tok/s |")
    print("|---|---:|---:|---:|")
    for k in trees:
        print(f"| {k} | {med[k]['build_s']:.1f} | {med[k]['b1']:.1f} | {med[k]['b8']:.1f} |")
    print(f"| after / before | {med['after']['build_s'] / med['before']['build_s']:.3f} | "
          f"{med['after']['b1'] / med['before']['b1']:.3f} | {med['after']['b8'] / med['before']['b8']:.3f} |")
    print("identical files:", {k: v for k, v in same.items()})
    out = REPO / "benchmarks" / "results" / f"bench_restructure_{args.model.name}_{args.quant}.json"
    out.write_text(json.dumps({"model": str(args.model), "quant": args.quant, "threads": args.threads,
                               "machine": platform.processor() or platform.machine(), "runs": runs,
                               "median": med, "identical_files": same,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
