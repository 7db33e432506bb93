"""Speculative decoding on the CPU: plain decode vs prompt lookup (ngram) vs a draft model, one run.

Target: the bundled default model (14M parameters); draft: ``assets/default-draft-model`` (0.9M
parameters, same tokenizer, trained by ``scripts/train_default_model.py --hidden-size 128 --layers 2
--heads 2 --kv-heads 1 --intermediate-size 384 --steps 600``). Both are built with the real CLI (cache
hits after the first run). Greedy, ``--new-tokens`` (128) new tokens per request, EOS ignored.

Workloads (held-out pydoc text, never seen in training):

- ``repeat``: a passage, a blank line, then the passage's first line again: the answer repeats text
  from the prompt (the case prompt lookup is for).
- ``free``: the first 64 tokens of a held-out document; free continuation.

Batch 1 (each prompt alone, rate = new tokens / wall time over all prompts) and batch 8 (all
prompts in one ``generate``). Every speculative run's tokens are compared with the plain run's
(greedy speculation must be exact). Prints a table and writes ``benchmarks/results/bench_speculative.json``.

    python benchmarks/bench_speculative.py [--threads 2] [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_speculative.json"


def build(model: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(model), "-o", str(out), "-q"], check=True)
    return out


def workloads(tokenizer, n: int) -> dict[str, list[list[int]]]:
    """``repeat`` and ``free`` prompts (token ids) from held-out documents."""
    from llmc.testing.corpus import pydoc_texts

    docs = [d for d in pydoc_texts("heldout") if len(d) > 1500][:n]
    repeat, free = [], []
    for d in docs:
        passage = d[:900]
        first_line = passage.split("\n", 1)[0][:80] or passage[:80]
        repeat.append(tokenizer.encode(passage + "\n\n" + first_line))
        free.append(tokenizer.encode(d)[:64])
    return {"repeat": repeat, "free": free}


def run(engine, prompts: list[list[int]], batch: int, new_tokens: int):
    """Generate for ``prompts`` (alone each at batch 1, all together otherwise): (tokens, seconds, outputs)."""
    from llmc.runtime import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    t = time.perf_counter()
    if batch == 1:
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs), seconds, [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "assets" / "default-model")
    ap.add_argument("--draft-model", type=Path, default=REPO / "assets" / "default-draft-model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload at batch 1 (batch 8 uses 8)")
    ap.add_argument("--num-tokens", type=int, default=6, help="SpeculativeConfig.num_tokens (most drafts per step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from llmc.runtime import Engine
    from llmc.runtime.speculative import SpeculativeConfig

    work = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    target = build(args.model, work / "target")
    draft = build(args.draft_model, work / "draft")
    methods = {
        "plain": None,
        "ngram": SpeculativeConfig("ngram", args.num_tokens),
        "draft": SpeculativeConfig("draft", args.num_tokens, draft_model=draft),
    }
    engines = {m: Engine.load(target, num_threads=args.threads, speculative=c) for m, c in methods.items()}
    prompts = workloads(engines["plain"].tokenizer, max(8, args.prompts))
    for e in engines.values():  # warm-up: ORT's first runs allocate
        run(e, prompts["free"][:1], 1, 16)

    rows = []
    for wl, plist in prompts.items():
        for batch in (1, 8):
            chosen = plist[: args.prompts] if batch == 1 else plist[:8]
            base = None
            for m, e in engines.items():
                before = e.stats()
                toks, secs, ids = run(e, chosen, batch, args.new_tokens)
                after = e.stats()
                drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                verifies = after.spec_num_verify_steps - before.spec_num_verify_steps
                row = {"workload": wl, "batch": batch, "method": m, "new_tokens": toks, "seconds": round(secs, 4),
                       "tok_s": round(toks / secs, 1), "steps": after.num_steps - before.num_steps,
                       "draft_tokens": drafted, "accepted_tokens": accepted,
                       "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                       "mean_accepted_length": round(accepted / verifies, 3) if verifies else None}
                if e.speculator is not None:
                    a, b = e.speculator.target_cost.fit()
                    row["target_step_fit_ms"] = {"fixed": round(a * 1e3, 3), "per_token": round(b * 1e3, 4)}
                if base is None:
                    base = (row["tok_s"], ids)
                row["speedup"] = round(row["tok_s"] / base[0], 3)
                row["identical_to_plain"] = ids == base[1]
                rows.append(row)
                print(f"{wl:7s} b{batch}  {m:6s} {row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f}"
                      f"  steps {row['steps']:5d}"
                      f"  accept {row['acceptance_rate']}  mean_len {row['mean_accepted_length']}"
                      f"  identical {row['identical_to_plain']}  fit {row.get('target_step_fit_ms')}", flush=True)

    print("\n| workload | batch | method | tok/s | vs plain | acceptance | mean accepted | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "—" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']:.0f} | {r['speedup']:.2f}x | {acc} | "
              f"{mal} | {r['identical_to_plain']} |")
    result = {
        "benchmark": "bench_speculative", "model": str(args.model.relative_to(REPO)),
        "draft_model": str(args.draft_model.relative_to(REPO)), "new_tokens": args.new_tokens,
        "num_tokens": args.num_tokens, "threads": args.threads, "greedy": True,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "llama_cpp": "not measured: llama-cpp-python is not installed here and compiles for ~15 min on the 2 "
                     "shared cores (benchmarks/peers/setup.sh)",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
