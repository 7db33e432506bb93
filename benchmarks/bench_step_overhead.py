"""Per-step overhead of the CPU engine: one change at a time, before vs after, side by side.

A comparison names two variants of one engine (a build option, or a session setting read when the
engine loads). Both variants are built from the same ~110M-parameter Llama fixture (hidden 576,
30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 8192, random weights; the shape of
issue 9's peers table), loaded into one process, and decoded step by step with their steps
interleaved (before, after, before, ...), so the machine's drift hits both alike. For batch B:
B random 128-token prompts are prefilled, then every decode step (one token for each of the B
sequences) is timed; decode tok/s = B / median step time. Each figure is the median over
``--repeats`` rounds of ``--steps`` steps each.

Comparisons (``--compare``, default: all):

- ``head-layout``: the graph pass that folds the per-head Reshape/Transpose/Gather chains around
  attention and rotary (before: ``--disable-pass head-layout``).
- ``group-size``: int4 only, MatMulNBits blocks of 128 (before) vs 32 (after) input channels.
- ``int4-kernel``: int4 only, ONNX Runtime's MatMulNBits at accuracy level 4 (before,
  ``--int4-kernel mlas``) vs llmc's Int4MatMul (after, the default); both g128.
- ``spin``: ONNX Runtime's intra-op threads spinning (after, ``LLMC_ORT_SPIN=1``) vs waiting passively
  (before, ``LLMC_ORT_SPIN=0``); same engine (the default, ``auto``, spins only on idle cores). Spinning
  threads of one engine keep spinning into the other's steps, so on a shared machine this ratio is only
  indicative.
- ``threads``: ONNX Runtime's intra-op threads, 2 (before) vs 1 (after); same engine.
- ``attention-threads``: the PagedAttention kernel on one thread (before) vs on ONNX Runtime's intra-op
  pool (after, ``Engine.load``'s default, 0); same engine.

    python benchmarks/bench_step_overhead.py [--compare head-layout] [--precisions fp32 int4] [--batches 1 8]
                                             [--threads 2] [--repeats 5] [--steps 32] [--rebuild]

Prints a table and writes benchmarks/results/bench_step_overhead[_<compare>].json. Builds are cached
under $LLMC_BENCH_WORK (default /tmp/llmc-bench-step-overhead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("LLMC_BENCH_WORK", "/tmp/llmc-bench-step-overhead"))
LLAMA_110M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=8192, max_position_embeddings=2048)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One side of a comparison: build options (``disabled`` passes, int4 ``group_size``), the
    environment the engine loads under, and the PagedAttention kernel's OpenMP threads (a process-wide
    setting, so it is applied before each of this variant's steps)."""

    label: str
    disabled: tuple[str, ...] = ()
    group_size: int = 128
    int4_kernel: str = "llmc"
    env: tuple[tuple[str, str], ...] = ()
    attention_threads: int = 0
    threads: int | None = None  # ONNX Runtime intra-op threads (None: --threads)

    def build_key(self, precision: str) -> str:
        parts = [precision]
        if precision == "int4":
            parts.append(f"g{self.group_size}")
            if self.int4_kernel != "llmc":
                parts.append(self.int4_kernel)
        parts += [f"no-{p}" for p in self.disabled]
        return "_".join(parts)


COMPARISONS: dict[str, tuple[Variant, Variant, tuple[str, ...]]] = {
    # name: (before, after, precisions it applies to)
    "head-layout": (Variant("without", disabled=("head-layout",)), Variant("with"), ("fp32", "int4")),
    "group-size": (Variant("g128", int4_kernel="mlas"), Variant("g32", group_size=32, int4_kernel="mlas"),
                   ("int4",)),
    "int4-kernel": (Variant("mlas", int4_kernel="mlas"), Variant("llmc"), ("int4",)),
    "spin": (Variant("passive", env=(("LLMC_ORT_SPIN", "0"),)), Variant("spinning", env=(("LLMC_ORT_SPIN", "1"),)),
             ("fp32", "int4")),
    "threads": (Variant("ort-2-threads", threads=2), Variant("ort-1-thread", threads=1), ("fp32", "int4")),
    "attention-threads": (Variant("attn-1-thread", attention_threads=1), Variant("attn-ort-pool"),
                          ("fp32", "int4")),
}


def checkpoint() -> Path:
    from llmc.testing.checkpoints import write_tiny_llama

    ckpt = WORK / "ckpt"
    if not (ckpt / "config.json").is_file():
        write_tiny_llama(ckpt, seed=0, **LLAMA_110M)
    return ckpt


def engine_dir(precision: str, variant: Variant) -> Path:
    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe

    out = WORK / variant.build_key(precision)
    if ARGS.rebuild or not (out / "manifest.json").is_file():
        if out.exists():
            shutil.rmtree(out)
        quant = (QuantRecipe(quant="int4", group_size=variant.group_size, int4_kernel=variant.int4_kernel)
                 if precision == "int4" else QuantRecipe())
        t = time.perf_counter()
        build(checkpoint(), out, BuildOptions(quant=quant, disabled_passes=variant.disabled))
        print(f"[built {out.name} in {time.perf_counter() - t:.0f} s]", flush=True)
    return out


@contextlib.contextmanager
def environment(pairs: tuple[tuple[str, str], ...]):
    old = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interleaved_steps(engines: list, variants: tuple[Variant, ...], prompts: list[list[int]],
                      steps: int) -> list[list[float]]:
    """Seconds of each of ``steps`` decode steps of ``prompts`` (decoding together) on every engine,
    the engines' steps interleaved one by one; the prompt pass is not timed."""
    from llmc.bench.workloads import _greedy

    rids = [[e.submit(p, _greedy(steps + 1)) for p in prompts] for e in engines]
    for e, v in zip(engines, variants, strict=True):
        e._session.set_attention_threads(v.attention_threads)
        while e.scheduler.waiting or any(not r.tokens[r.prompt_len:] for r in e.scheduler.running):
            e.step()  # prefill until every sequence has its first token
    times: list[list[float]] = [[] for _ in engines]
    while any(e.has_unfinished() for e in engines):
        for i, e in enumerate(engines):
            if e.has_unfinished():
                e._session.set_attention_threads(variants[i].attention_threads)
                t = time.perf_counter()
                e.step()
                times[i].append(time.perf_counter() - t)
    for e, ids in zip(engines, rids, strict=True):
        for rid in ids:
            e.result(rid)
    return times


def compare(name: str) -> list[dict]:
    from llmc.bench.workloads import _prompts
    from llmc.runtime import Engine

    before, after, precisions = COMPARISONS[name]
    rows = []
    for precision in ARGS.precisions:
        if precision not in precisions:
            continue
        engines = []
        for v in (before, after):
            path = engine_dir(precision, v)
            with environment(v.env):
                engines.append(Engine.load(path, num_threads=v.threads or ARGS.threads, kv_cache_tokens=8 * 256 + 1024))
        vocab = engines[0].vocab_size
        for b in ARGS.batches:
            prompts = _prompts(vocab, b, 128, 100 + b)
            interleaved_steps(engines, (before, after), prompts, 4)  # warm-up: ORT's allocations for these shapes
            medians: list[list[float]] = [[], []]
            for _ in range(ARGS.repeats):
                times = interleaved_steps(engines, (before, after), prompts, ARGS.steps)
                for i in range(2):
                    medians[i].append(statistics.median(times[i]))
            ms = [statistics.median(m) * 1e3 for m in medians]
            row = {"compare": name, "precision": precision, "batch": b,
                   "before": before.label, "after": after.label,
                   "before_step_ms": round(ms[0], 3), "after_step_ms": round(ms[1], 3),
                   "before_tok_s": round(b / ms[0] * 1e3, 1), "after_tok_s": round(b / ms[1] * 1e3, 1),
                   "speedup": round(ms[0] / ms[1], 3),
                   "before_round_ms": [round(x * 1e3, 3) for x in medians[0]],
                   "after_round_ms": [round(x * 1e3, 3) for x in medians[1]]}
            rows.append(row)
            print(f"{name:12} {precision:5} b{b:<3} {before.label} {row['before_tok_s']:>8} tok/s  "
                  f"{after.label} {row['after_tok_s']:>8} tok/s  x{row['speedup']}", flush=True)
        del engines
    return rows


def main() -> None:
    t0 = time.time()
    load_start = os.getloadavg()
    rows = []
    for name in ARGS.compare:
        rows += compare(name)
    print("\n| change | precision | batch | before | tok/s | after | tok/s | after / before |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['compare']} | {r['precision']} | {r['batch']} | {r['before']} | {r['before_tok_s']} | "
              f"{r['after']} | {r['after_tok_s']} | {r['speedup']} |")
    import onnxruntime

    suffix = "" if len(ARGS.compare) != 1 else f"_{ARGS.compare[0].replace('-', '_')}"
    out = Path(ARGS.out) if ARGS.out else REPO / "benchmarks" / "results" / f"bench_step_overhead{suffix}.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/bench_step_overhead.py " + " ".join(sys.argv[1:]),
        "threads": ARGS.threads, "repeats": ARGS.repeats, "steps": ARGS.steps, "onnxruntime": onnxruntime.__version__,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "shared": "other processes ran on these cores during the run (see load averages)",
                    "load_avg_start": [round(x, 2) for x in load_start],
                    "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.time() - t0, 1), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs="+", default=list(COMPARISONS), choices=list(COMPARISONS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int4"], choices=["fp32", "int4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--out", default=None, help="where to write the JSON (default: benchmarks/results/)")
    ARGS = parser.parse_args()
    main()
