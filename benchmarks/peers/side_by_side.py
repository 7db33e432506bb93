#!/usr/bin/env python3
"""llmc beside llama.cpp on one checkpoint: prefill and decode at each batch, in alternating rounds, as ratios.

Each round runs ``llmc bench ENGINE --workloads prefill,decode`` and then ``bench_llamacpp.py --model GGUF``
(the order swaps every round, so neither engine always draws the later, warmer or cooler minutes), each in its
own process with the same thread count, prompt length (128), new tokens (128) and prefill length (512). A
round's ratio is llmc's tok/s over llama.cpp's from that round; the table gives the median over rounds and
the range, beside each engine's median. Used for the models that interleave.py (Llama shapes only) does not
cover: the Qwen3.5-shaped hybrid (issue 31) and the gpt-oss-shaped MXFP4 model (issue 32).

usage: side_by_side.py --engine [NAME=]DIR [--engine NAME=DIR ...] --gguf FILE --label NAME [--batches 1,8]
       [--rounds 2] [--threads 2] [--title TEXT] [--out-dir benchmarks/results]
With several --engine (two builds of the same checkpoint, e.g. exact and 8-bit activations), each round runs every
llmc engine and llama.cpp once, the order rotating, and each engine gets its own ratios to the same llama.cpp runs.
env:   PEERS_ROOT (the peers venv and prompts), LLMC_PYTHON (the Python that has llmc; default this one)
Writes <out-dir>/peers_<label>_side_by_side.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = os.environ.get("PEERS_ROOT", os.path.expanduser("~/.cache/llmc-peers"))


def run_llmc(engine: str, batches: str, threads: int, out: Path) -> dict:
    py = os.environ.get("LLMC_PYTHON", sys.executable)
    cmd = [py, "-m", "llmc.cli.main", "bench", engine, "--workloads", "prefill,decode", "--batch", batches,
           "--threads", str(threads), "--input-len", "128", "--output-len", "128", "--prefill-len", "512",
           "--repeats", "2", "--warmup", "1", "--json", "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = {r["workload"]: r for r in json.loads(out.read_text())["rows"]}
    res = {"prefill": rows["prefill_512"]["tok_s"]}
    for b in batches.split(","):
        res[f"decode_b{b}"] = rows[f"decode_b{b}"]["tok_s"]
    return res


def run_llamacpp(gguf: str, batches: str, threads: int, out: Path) -> dict:
    env = dict(os.environ, BENCH_THREADS=str(threads), BENCH_REPEATS="2", BENCH_WARMUP="1")
    cmd = [f"{ROOT}/venv/bin/python", str(HERE / "bench_llamacpp.py"), "--model", gguf, "--precision", "gguf",
           "--out", str(out), "--batches", batches]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    res = {"prefill": round(r["prefill_tps"], 2)}
    for b in batches.split(","):
        if f"b{b}_error" in r:
            raise SystemExit(f"error: llama.cpp batch {b}: {r[f'b{b}_error']}")
        res[f"decode_b{b}"] = round(r[f"decode_b{b}_tps"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, action="append",
                    help="llmc engine directory (built for the CPU), NAME=DIR to name it; repeat for several")
    ap.add_argument("--gguf", required=True, help="llama.cpp model file of the same checkpoint")
    ap.add_argument("--label", required=True, help="results file name part, e.g. qwen35_int4")
    ap.add_argument("--title", default="", help="one line saying what the model and precisions are")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", default=str(HERE.parent / "results"))
    args = ap.parse_args()
    engines = {}
    for spec in args.engine:
        name, _, path = spec.rpartition("=")
        engines[name or "llmc"] = path
    if len(engines) != len(args.engine):
        raise SystemExit("error: --engine: give each engine its own NAME=DIR")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"side_by_side_{args.label}"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rounds = []
    who_all = [*engines, "llama.cpp"]
    for i in range(args.rounds):
        shift = i % len(who_all)  # rotate: every participant runs first in some round
        order = who_all[shift:] + who_all[:shift]
        got = {}
        for who in order:
            print(f"round {i + 1}/{args.rounds}: {who} ...", flush=True)
            if who == "llama.cpp":
                got[who] = run_llamacpp(args.gguf, args.batches, args.threads, tmp / f"llamacpp_{i}.json")
            else:
                got[who] = run_llmc(engines[who], args.batches, args.threads, tmp / f"{who}_{i}.json")
        ratios = {name: {k: round(got[name][k] / got["llama.cpp"][k], 3) for k in got[name]} for name in engines}
        rounds.append({"order": order, **got, **({"ratio": ratios["llmc"]} if list(engines) == ["llmc"] else
                                                 {"ratios": ratios}), "load_avg": os.getloadavg()})
        print(f"  {json.dumps(rounds[-1])}", flush=True)

    def ratio(r: dict, name: str) -> dict:
        return r["ratio"] if "ratio" in r else r["ratios"][name]

    keys = list(rounds[0]["llama.cpp"])
    summaries = {name: {k: {"llmc_tok_s": statistics.median(r[name][k] for r in rounds),
                            "llamacpp_tok_s": statistics.median(r["llama.cpp"][k] for r in rounds),
                            "ratio_median": round(statistics.median(ratio(r, name)[k] for r in rounds), 3),
                            "ratio_min": min(ratio(r, name)[k] for r in rounds),
                            "ratio_max": max(ratio(r, name)[k] for r in rounds)} for k in keys}
                 for name in engines}
    single = list(engines) == ["llmc"]
    result = {"label": args.label, "title": args.title,
              **({"engine": engines["llmc"]} if single else {"engines": engines}), "gguf": args.gguf,
              "threads": args.threads, "batches": args.batches, "rounds": rounds,
              **({"summary": summaries["llmc"]} if single else {"summaries": summaries}),
              "wall_s": round(time.time() - t0, 1), "cpu_count": os.cpu_count()}
    out = Path(args.out_dir) / f"peers_{args.label}_side_by_side"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# peers side by side: {args.label}", "", args.title, "",
             f"{args.rounds} rotating rounds, {args.threads} threads each, prompts 128 tokens + 128 new "
             f"(decode), 512 (prefill); load average at each round's end: "
             + ", ".join(f"{r['load_avg'][0]:.2f}" for r in rounds), ""]
    for name, summary in summaries.items():
        head = "llmc" if single else f"llmc {name}"
        lines += [f"| workload | {head} tok/s | llama.cpp tok/s | {head} / llama.cpp (median) | range |",
                  "|---|---:|---:|---:|---|"]
        for k, sm in summary.items():
            lines.append(f"| {k} | {sm['llmc_tok_s']:.2f} | {sm['llamacpp_tok_s']:.2f} | "
                         f"**{sm['ratio_median']:.2f}x** | {sm['ratio_min']:.2f}-{sm['ratio_max']:.2f} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
