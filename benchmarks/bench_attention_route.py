"""PagedAttention route: the native ONNX Runtime custom-op library vs the onnxruntime-extensions PyOp bridge.

The same checkpoint is built twice, once per route (``BuildOptions(attention="native" | "pyop")``;
the graphs differ only in the PagedAttention nodes' domain), both engines are loaded in one process,
and every workload runs on them alternately (native, pyop, native, pyop, ...), so the ratio is
measured side by side even though this machine's speed drifts. Workloads and rates are
``llmc.bench``'s (the ``llmc bench`` definitions): prefill tok/s = P / TTFT for one P-token
prompt; decode bB tok/s = B * (N - 1) / (t_N - t_1) for B prompts of 128 tokens and N = 128 new
tokens each. Each figure is the median of ``--repeats`` runs after a warm-up. Decode is also
timed step by step (the two engines' steps interleaved one by one, 128 steps each): the median
step time is the figure least disturbed by other processes on a shared machine.

Models: the bundled default model (assets/default-model, 4 layers) and a ~110M-parameter Llama
fixture with random weights (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
vocab 8192), the shape where per-layer overhead matters most.

    python benchmarks/bench_attention_route.py [--threads 2] [--repeats 3] [--models default llama-110m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("LLMC_BENCH_WORK", "/tmp/llmc-bench-attention-route"))
LLAMA_110M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=8192, max_position_embeddings=2048)
ROUTES = ("native", "pyop")


def checkpoint(name: str) -> Path:
    if name == "default":
        return REPO / "assets" / "default-model"
    from llmc.testing.checkpoints import write_tiny_llama

    ckpt = WORK / name / "ckpt"
    if ARGS.rebuild or not (ckpt / "config.json").is_file():
        write_tiny_llama(ckpt, seed=0, **LLAMA_110M)
    return ckpt


def engine(name: str, ckpt: Path, route: str) -> Path:
    from llmc.compiler.build import BuildOptions, build

    out = WORK / name / route
    if ARGS.rebuild or not (out / "manifest.json").is_file():
        if out.exists():
            shutil.rmtree(out)
        build(ckpt, out, BuildOptions(attention=route))
    manifest = json.loads((out / "manifest.json").read_text())
    want = {"native": "llmc_ort_ops", "pyop": "onnxruntime_extensions"}[route]
    if manifest["engine"].get("custom_ops") != want:
        raise SystemExit(f"{out}: engine.custom_ops is {manifest['engine'].get('custom_ops')!r}, not {want!r}; "
                         "pass --rebuild")
    return out


def step_times(engines: dict, prompts: list[list[int]], n: int) -> dict[str, list[float]]:
    """Seconds of each decode step of ``prompts`` (all sequences decoding together), the engines'
    steps interleaved one by one; the prompt pass is not timed."""
    from llmc.bench.workloads import _greedy

    rids = {r: [e.submit(p, _greedy(n + 1)) for p in prompts] for r, e in engines.items()}
    for e in engines.values():
        while e.scheduler.waiting or any(not r.tokens[r.prompt_len:] for r in e.scheduler.running):
            e.step()  # prefill (and any chunk) until every sequence has its first token
    times: dict[str, list[float]] = {r: [] for r in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for r, e in engines.items():
            if e.has_unfinished():
                t = time.perf_counter()
                e.step()
                times[r].append(time.perf_counter() - t)
    for r, e in engines.items():
        for rid in rids[r]:
            e.result(rid)  # read once so the engine forgets it
    return times


def measure(name: str) -> list[dict]:
    from llmc.bench.workloads import _prompts, decode_run, prefill_run
    from llmc.runtime import Engine

    ckpt = checkpoint(name)
    dirs = {r: engine(name, ckpt, r) for r in ROUTES}
    # No prefix caching: a repeated prefill prompt would time a cache hit.
    engines = {r: Engine.load(d, num_threads=ARGS.threads, kv_cache_tokens=8 * 256 + 1024, enable_prefix_caching=False)
               for r, d in dirs.items()}
    vocab = engines["native"].vocab_size
    cfg = json.loads((ckpt / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    workloads = [("prefill_512", 1), *[(f"decode_b{b}", b) for b in ARGS.batches]]
    rows = []
    for workload, b in workloads:
        if workload.startswith("prefill"):
            prompt = _prompts(vocab, 1, 512, 7)[0]

            def once(e, prompt=prompt):
                return prefill_run(e, prompt)
        else:
            prompts = _prompts(vocab, b, 128, 100 + b)

            def once(e, prompts=prompts):
                return decode_run(e, prompts, 128)

        for e in engines.values():  # warm-up: ORT's allocations for these shapes
            once(e)
        runs: dict[str, list[dict]] = {r: [] for r in ROUTES}
        for _ in range(ARGS.repeats):
            for r in ROUTES:  # alternate, so drift hits both routes alike
                runs[r].append(once(engines[r]))
        row = {"model": name, "layers": layers, "workload": workload, "batch": b}
        for r in ROUTES:
            row[f"{r}_tok_s"] = round(statistics.median(x["tok_s"] for x in runs[r]), 1)
            row[f"{r}_runs"] = [round(x["tok_s"], 1) for x in runs[r]]
        row["native_over_pyop"] = round(row["native_tok_s"] / row["pyop_tok_s"], 3)
        if workload.startswith("decode"):
            # Robust to a shared machine: single decode steps, alternating between the routes, median.
            steps = step_times(engines, prompts, 128)
            for r in ROUTES:
                row[f"{r}_step_ms_median"] = round(statistics.median(steps[r]) * 1e3, 3)
            row["native_over_pyop_step"] = round(row["pyop_step_ms_median"] / row["native_step_ms_median"], 3)
        if workload.startswith("decode"):
            # Per decode step (one token per sequence), the time the PyOp route adds over native.
            step = {r: b / row[f"{r}_tok_s"] for r in ROUTES}
            row["pyop_extra_ms_per_step"] = round((step["pyop"] - step["native"]) * 1e3, 3)
            row["pyop_extra_us_per_layer"] = round((step["pyop"] - step["native"]) / layers * 1e6, 1)
        rows.append(row)
        print(f"{name:11} {workload:12} native {row['native_tok_s']:>8} tok/s  pyop {row['pyop_tok_s']:>8} tok/s  "
              f"x{row['native_over_pyop']}", flush=True)
    return rows


def main() -> None:
    t0 = time.time()
    load_start = os.getloadavg()
    rows = []
    for name in ARGS.models:
        rows += measure(name)
    print("\n| model | layers | workload | native tok/s | PyOp tok/s | native / PyOp "
          "| PyOp extra per step (from tok/s) | median decode step native / PyOp |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = f"{r['pyop_extra_ms_per_step']} ms ({r['pyop_extra_us_per_layer']} µs/layer)" \
            if "pyop_extra_ms_per_step" in r else ""
        step = (f"{r['native_step_ms_median']} / {r['pyop_step_ms_median']} ms (x{r['native_over_pyop_step']})"
                if "native_step_ms_median" in r else "")
        print(f"| {r['model']} | {r['layers']} | {r['workload']} | {r['native_tok_s']} | {r['pyop_tok_s']} | "
              f"{r['native_over_pyop']} | {extra} | {step} |")
    import onnxruntime

    out = REPO / "benchmarks" / "results" / "bench_attention_route.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/bench_attention_route.py " + " ".join(ARGS.argv),
        "threads": ARGS.threads, "repeats": ARGS.repeats, "onnxruntime": onnxruntime.__version__,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_start": [round(x, 2) for x in load_start],
                    "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.time() - t0, 1), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "llama-110m"], choices=["default", "llama-110m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rebuild", action="store_true")
    ARGS = parser.parse_args()
    ARGS.argv = sys.argv[1:]
    main()
