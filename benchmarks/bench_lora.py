"""Multi-LoRA decode on the CPU: an int4 engine with LoRA slots serving four adapters at batch 8, side by side
with the same engine serving the base model and with the int4 engine built without slots.

Runs (greedy, ``--new-tokens`` new tokens per request, EOS ignored, 8 requests of 16-token prompts in one
``generate``; rate = new tokens / wall time, prefill included):

- ``plain``: ``llmc build --quant int4`` (no LoRA slots), base requests;
- per configuration ``R:TARGETS`` (``--configs``; default PEFT's own default, rank 8 on q,v, and rank 16 on all
  seven linears): ``R:TARGETS base``, the checkpoint built with ``--quant int4 --lora-slots 4 --max-lora-rank R
  --lora-targets TARGETS``, base requests; ``R:TARGETS 4 adapters``, that engine with the 8 requests spread over
  four PEFT adapters of rank R on those targets (two requests each).

Each round runs them all in an order that rotates by round, after one untimed round; a row reports the median
tok/s over rounds, the median per-round ratio to ``plain`` (with its min and max), and the best run's tok/s over
the best plain run's (on a shared machine the fastest run of each is the least disturbed). ``--clock cpu`` rates
by this process's CPU time instead of wall time: on cores that other processes load (a load average of 20 on two
cores turned wall-clock ratios into 0.2x-7x noise) it moves little, and with ``--threads 1`` there is no pool
spinning in it. The load average before and after the rounds is recorded. Adapters are random
(PEFT's layout, written by PEFT); the model is the bundled default model (14M parameters, 4-bit; ``--model``
another checkpoint), on which
LoRA's share of the bytes a step reads is far larger than on a real model. Adapters are float32 (the CPU engine's
dtype): four of rank 16 on all seven linears hold 1.6x the bytes of this int4 base (four of rank 8 on q,v:
0.15x); on Llama-3-8B four of rank 16 on all seven are 0.15x of its int4 weights.

    python benchmarks/bench_lora.py [--rounds 6] [--configs 8:q,v 16:q,k,v,o,gate,up,down] [--threads 2]
        [--clock wall|cpu] [--model CKPT] [--out FILE]

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
MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--configs", nargs="+", default=["8:q,v", "16:q,k,v,o,gate,up,down"], metavar="R:TARGETS")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="rate per wall-clock second, or per CPU second of this process (shared, loaded cores)")
    ap.add_argument("--model", type=Path, default=MODEL, help="the checkpoint (default: the bundled default model)")
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
    model = args.model
    # The build's accuracy report at its smallest: this benchmark measures speed (test_lora_quant, accuracy).
    quant = QuantRecipe(quant="int4", eval_tokens=256)
    t0 = time.perf_counter()
    if not (work / "int4" / "manifest.json").is_file():
        build(model, work / "int4", BuildOptions(quant=quant, force=True))
    plain = Engine.load(work / "int4", num_threads=args.threads)
    vocab = plain.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 100) + 50 for j in range(16)] for i in range(8)]

    def params(lora):
        return SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, lora=lora)

    runs = {"plain": (plain, [params(None)] * 8)}
    for config in args.configs:
        rank_text, _, targets_text = config.partition(":")
        rank, targets = int(rank_text), tuple(targets_text.split(","))
        tag = f"r{rank}-{'-'.join(targets)}"
        path = work / f"int4-lora{args.slots}-{tag}"
        if not (path / "manifest.json").is_file():
            build(model, path, BuildOptions(quant=quant, force=True, lora_slots=args.slots, max_lora_rank=rank,
                                            lora_targets=targets))
        adapters = {}
        for i in range(4):
            ad = work / f"adapter{i}-{tag}"
            if not (ad / "adapter_model.safetensors").is_file():
                write_peft_adapter(model, ad, r=rank, alpha=2.0 * rank, targets=tuple(MODULES[t] for t in targets),
                                   seed=10 + i, std=0.02)
            adapters[f"a{i}"] = ad
        engine = Engine.load(path, num_threads=args.threads, lora_adapters=adapters)
        runs[f"{config} base"] = (engine, [params(None)] * 8)
        runs[f"{config} 4 adapters"] = (engine, [params(f"a{i % 4}") for i in range(8)])
    setup_s = time.perf_counter() - t0

    def run(name: str) -> tuple[float, list]:
        engine, ps = runs[name]
        engine.reset_prefix_cache()
        t, c = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, ps)
        # --clock cpu: this process's CPU time, which other processes' load on shared cores barely moves (with
        # --threads 1 there is no pool spinning in it either); wall: elapsed time.
        dt = time.process_time() - c if args.clock == "cpu" else time.perf_counter() - t
        return sum(len(o.token_ids) for o in outs) / dt, [o.token_ids for o in outs]

    names = list(runs)
    load_before = os.getloadavg()
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
    for name in names:
        if name.endswith(" base"):
            assert tokens[name] == tokens["plain"], f"{name}: base requests on a LoRA engine must match plain"
    rows = [{"run": n, "tok_s": round(statistics.median(rates[n]), 1),
             "ratio_to_plain": round(statistics.median(ratios[n]), 3),
             "ratio_min": round(min(ratios[n]), 3), "ratio_max": round(max(ratios[n]), 3),
             "best_tok_s": round(max(rates[n]), 1), "best_ratio": round(max(rates[n]) / max(rates["plain"]), 3)}
            for n in names]
    print(f"{'run':<36} {'tok/s':>8} {'x plain':>8} {'min':>6} {'max':>6} {'best':>8} {'x best':>7}")
    for row in rows:
        print(f"{row['run']:<36} {row['tok_s']:>8} {row['ratio_to_plain']:>8} {row['ratio_min']:>6} "
              f"{row['ratio_max']:>6} {row['best_tok_s']:>8} {row['best_ratio']:>7}")
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before the rounds {load_before}, after {load_after}")
    shown = str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model)
    result = {"benchmark": "bench_lora", "model": shown, "quant": "int4", "batch": 8,
              "slots": args.slots, "configs": args.configs, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "threads": args.threads, "clock": args.clock, "rows": rows,
              "setup_s": round(setup_s, 1),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_avg_before": [round(v, 2) for v in load_before],
                          "load_avg_after": [round(v, 2) for v in load_after]},
              "lora_op": "llmc.LoraApply (native, float32 slots, AVX-512/AVX2 FMA; each token's own slot, tokens "
                         "grouped by slot; one node per packed projection, gate|up's SwiGLU in it)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
