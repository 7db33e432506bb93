"""Multi-LoRA decode on the CPU: an int4 engine with LoRA slots serving four adapters at batch 8, side by side
with the same engine serving the base model and with the int4 engine built without slots.

Runs (greedy, ``--new-tokens`` new tokens per request, EOS ignored, 8 requests of 16-token prompts in one
``generate``; rate = new tokens / wall time, prefill included):

- ``plain``: ``llmc build --quant int4`` (no LoRA slots), base requests;
- ``slots-base``: the same checkpoint built with ``--quant int4 --lora-slots 4 --max-lora-rank R`` (all seven
  linears), base requests;
- ``slots-4-adapters``: that engine, the 8 requests spread over four PEFT adapters (two each), rank R.

Each round runs the three in an order that rotates by round, after one untimed round; a row reports the median
tok/s over rounds and the median per-round ratio to ``plain``. Adapters are random (PEFT's layout, written by
PEFT), the model the bundled default model (14M parameters: LoRA's share of the work is larger on a model this
small than on a real one).

    python benchmarks/bench_lora.py [--rounds 6] [--rank 16] [--new-tokens 64] [--threads 2]

Prints a table and writes ``benchmarks/results/bench_lora.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "assets" / "default-model"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None, help="keep engines and adapters here (reused)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_lora.json")
    args = ap.parse_args()
    os.environ.setdefault("LLMC_SELF_CHECK", "0")

    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.lora import write_peft_adapter

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    quant = QuantRecipe(quant="int4")
    engines = {"plain": work / "int4", "slots": work / f"int4-lora{args.slots}x{args.rank}"}
    t0 = time.perf_counter()
    for key, path in engines.items():
        if not (path / "manifest.json").is_file():
            lora = dict(lora_slots=args.slots, max_lora_rank=args.rank) if key == "slots" else {}
            build(MODEL, path, BuildOptions(quant=quant, force=True, **lora))
    adapters = {}
    for i in range(4):
        path = work / f"adapter{i}-r{args.rank}"
        if not (path / "adapter_model.safetensors").is_file():
            write_peft_adapter(MODEL, path, r=args.rank, alpha=2.0 * args.rank, targets=TARGETS, seed=10 + i,
                               std=0.02)
        adapters[f"a{i}"] = path
    setup_s = time.perf_counter() - t0

    plain = Engine.load(engines["plain"], num_threads=args.threads)
    slots = Engine.load(engines["slots"], num_threads=args.threads, lora_adapters=adapters)
    prompts = [[(7 * i + 13 * j) % 4000 + 50 for j in range(16)] for i in range(8)]

    def params(lora):
        return SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, lora=lora)

    runs = {
        "plain": (plain, [params(None)] * 8),
        "slots-base": (slots, [params(None)] * 8),
        "slots-4-adapters": (slots, [params(f"a{i % 4}") for i in range(8)]),
    }

    def run(name: str) -> tuple[float, list]:
        engine, ps = runs[name]
        engine.reset_prefix_cache()
        t = time.perf_counter()
        outs = engine.generate(prompts, ps)
        dt = time.perf_counter() - t
        return sum(len(o.token_ids) for o in outs) / dt, [o.token_ids for o in outs]

    names = list(runs)
    for name in names:  # untimed: ORT's first step of each shape costs more
        run(name)
    rates: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    tokens = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        got = {}
        for name in order:
            got[name], tokens[name] = run(name)
            rates[name].append(got[name])
        for name in names:
            ratios[name].append(got[name] / got["plain"])
    assert tokens["plain"] == tokens["slots-base"], "base requests on the LoRA engine must match the plain engine"
    rows = [{"run": n, "tok_s": round(statistics.median(rates[n]), 1),
             "ratio_to_plain": round(statistics.median(ratios[n]), 3),
             "ratio_min": round(min(ratios[n]), 3), "ratio_max": round(max(ratios[n]), 3)} for n in names]
    print(f"{'run':<18} {'tok/s':>8} {'x plain':>8} {'min':>6} {'max':>6}")
    for row in rows:
        print(f"{row['run']:<18} {row['tok_s']:>8} {row['ratio_to_plain']:>8} {row['ratio_min']:>6} "
              f"{row['ratio_max']:>6}")
    result = {"benchmark": "bench_lora", "model": "assets/default-model", "quant": "int4", "batch": 8,
              "slots": args.slots, "rank": args.rank, "targets": list(TARGETS), "new_tokens": args.new_tokens,
              "rounds": args.rounds, "threads": args.threads, "rows": rows, "setup_s": round(setup_s, 1),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
              "lora_graph": "standard ONNX ops (all-slot shrink GEMM, per-token slot mask, expand GEMM)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
