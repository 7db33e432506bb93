#!/usr/bin/env python3
"""Serving benchmark: Poisson arrivals against an OpenAI-compatible server, at a sweep of request rates.

For each rate R (requests/s) the same seeded workload is sent: ``--num-requests`` requests whose arrival
gaps are exponential with mean 1/R, prompt lengths uniform in ``--prompt-len`` and output lengths uniform
in ``--output-len`` (token ids, EOS ignored, greedy), every request streamed. Per rate it reports TTFT,
inter-token latency (the gaps between streamed tokens) and end-to-end latency, p50 and p99; output
throughput (tokens/s over the whole run); and goodput: requests/s that met the SLO (TTFT <= --slo-ttft and
time per output token <= --slo-tpot). A rate is *sustained* when every request completed and the p99 TTFT and
p99 time per output token met the SLO (use enough requests that an overloaded server shows in the p99s).

Servers:
    python benchmarks/bench_serve.py --engine engines/m --threads 2      # starts `llmc serve` itself
    python benchmarks/bench_serve.py --engine engines/m --threads 1 --replicas 2 --routing prefix
        # two engines on Ray Serve (llmc serve --replicas; pip install 'llmc[ray]') behind one front
    python benchmarks/bench_serve.py --url http://127.0.0.1:8080 --model m --label llamacpp
        # any OpenAI-compatible server that accepts token-id prompts and ignore_eos, e.g. llama.cpp's:
        # llama-server -m model-q4_0.gguf --port 8080 -t 2 -np 32 -c 32768 --cont-batching
With ``--docs N --questions Q`` the prompts are N documents of ``--prompt-len`` tokens, each asked Q
questions (a short distinct suffix), interleaved one question per document in turn: the workload a
prefix-cache-aware router is for. Each rate reports the prefix-cache hit rate (usage's cached_tokens over
prompt tokens).
Prompts are token ids of CPython's pydoc text (``pydoc_data.topics``) in the engine's tokenizer
(``--tokenizer``, default ENGINE/tokenizer.json), so two servers of one checkpoint get identical prompts.

Prints a table and writes benchmarks/results/bench_serve_<label>.json and .md (or --out FILE.json and FILE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    prompt_len: int
    max_tokens: int
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None
    cached: int = 0  # prompt tokens the server's prefix cache served (usage.prompt_tokens_details)

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0


def prompt_pool(tokenizer: Path | None, vocab: int, rng: np.random.Generator) -> list[int]:
    """A long stream of token ids to cut prompts from: pydoc text in the engine's tokenizer, else random ids."""
    if tokenizer is not None and tokenizer.is_file():
        from pydoc_data.topics import topics

        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        return tok.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False).ids
    return rng.integers(3, vocab, size=200_000).tolist()


def workload(args, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    pool = prompt_pool(args.tokenizer, args.vocab_size, rng)
    lo, hi = args.prompt_len
    olo, ohi = args.output_len
    out = []
    if args.docs:
        docs = []
        for _ in range(args.docs):
            n = int(rng.integers(lo, hi + 1))
            start = int(rng.integers(0, len(pool) - n))
            docs.append(pool[start:start + n])
        for _ in range(args.questions):
            for d in docs:
                at = int(rng.integers(0, len(pool) - 8))
                out.append((d + pool[at:at + 8], int(rng.integers(olo, ohi + 1))))  # a question of its own
        return out[: args.num_requests]
    for _ in range(args.num_requests):
        n = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(pool) - n))
        out.append((pool[start:start + n], int(rng.integers(olo, ohi + 1))))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
              r: Result) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            last = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue
                # A chunk is one token on both llmc and llama.cpp (llmc may send an empty text while a
                # character is incomplete: still a token).
                r.tokens += 1
                if r.first is None:
                    r.first = now
                else:
                    r.gaps.append(now - last)
                last = now
        r.end = time.perf_counter()
        if usage and usage.get("completion_tokens"):
            r.tokens = int(usage["completion_tokens"])
        if usage and usage.get("prompt_tokens_details"):
            r.cached = int(usage["prompt_tokens_details"].get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        r.error = f"{type(exc).__name__}: {exc}"


async def run_rate(args, url: str, model: str, reqs: list[tuple[list[int], int]], rate: float,
                   seed: int) -> list[Result]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(reqs)))
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        results, tasks = [], []
        for (prompt, mt), at in zip(reqs, arrivals, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            r = Result(len(prompt), mt, time.perf_counter())
            results.append(r)
            tasks.append(asyncio.create_task(one(client, url, model, prompt, mt, r)))
        await asyncio.gather(*tasks)
    return results


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarise(rate: float, results: list[Result], args) -> dict:
    ok = [r for r in results if r.error is None and r.first is not None]
    span = max(r.end for r in ok) - min(r.sent for r in results) if ok else float("nan")
    gaps = [g for r in ok for g in r.gaps]
    good = [r for r in ok if r.ttft <= args.slo_ttft and r.tpot <= args.slo_tpot]
    row = {
        "rate": rate, "requests": len(results), "completed": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": span,
        "req_per_s": len(ok) / span if ok else 0.0,
        "output_tok_per_s": sum(r.tokens for r in ok) / span if ok else 0.0,
        "goodput_req_per_s": len(good) / span if ok else 0.0,
        "ttft_p50": pct([r.ttft for r in ok], 50), "ttft_p99": pct([r.ttft for r in ok], 99),
        "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
        "tpot_p50": pct([r.tpot for r in ok], 50), "tpot_p99": pct([r.tpot for r in ok], 99),
        "e2e_p50": pct([r.end - r.sent for r in ok], 50), "e2e_p99": pct([r.end - r.sent for r in ok], 99),
        "short_outputs": sum(r.tokens != r.max_tokens for r in ok),
        "prefix_hit_rate": sum(r.cached for r in ok) / max(1, sum(r.prompt_len for r in ok)),
    }
    # Kept up: nothing failed and the p99s met the SLO. TTFT alone is not enough: a server that admits every
    # request at once (llmc, up to --max-num-seqs) keeps TTFT low when overloaded and slows every decode
    # instead; one with fixed slots (llama.cpp's -np) queues, and its TTFT grows. Completed req/s alone
    # understates short runs, whose tail adds to the span.
    row["sustained"] = bool(ok and len(ok) == len(results) and row["ttft_p99"] <= args.slo_ttft
                            and row["tpot_p99"] <= args.slo_tpot)
    return row


def start_llmc(args) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "llmc.cli.main", "serve", str(args.engine), "--port", "0", "--log-level", "warning",
           "--max-queue", str(max(4096, args.num_requests)), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.replicas > 1:
        cmd += ["--replicas", str(args.replicas), "--routing", args.routing]
    if args.target_itl_ms is not None:  # 0: off (the server's default is on)
        cmd += ["--target-itl-ms", str(args.target_itl_ms)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    # Keep reading the server's stderr (Ray logs a lot under --replicas): a full pipe would stop the server.
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    m = re.search(r"'(.+)' on (http://[\d.]+:\d+)/v1", line)
    if not m:
        proc.kill()
        raise SystemExit(f"llmc serve did not start: {line}{proc.stderr.read()}")
    url = m.group(2)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return proc, url, m.group(1)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("llmc serve never became ready")
        time.sleep(0.2)


def table(rows: list[dict]) -> str:
    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    head = ("| rate | done | req/s | out tok/s | goodput | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p99 "
            "| E2E p50 | E2E p99 | prefix hits | sustained |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['completed']}/{r['requests']} | {f(r['req_per_s'])} | "
                     f"{f(r['output_tok_per_s'], 1)} | {f(r['goodput_req_per_s'])} | {f(r['ttft_p50'], 3)} | "
                     f"{f(r['ttft_p99'], 3)} | {f(r['itl_p50'], 4)} | {f(r['itl_p99'], 4)} | {f(r['tpot_p99'], 4)} | "
                     f"{f(r['e2e_p50'])} | "
                     f"{f(r['e2e_p99'])} | {f(r.get('prefix_hit_rate'))} | {'yes' if r['sustained'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, help="an llmc engine: start `llmc serve` on it")
    p.add_argument("--url", help="an OpenAI-compatible server already running (instead of --engine)")
    p.add_argument("--model", help="model name to send (default: the served one)")
    p.add_argument("--label", default=None, help="results file suffix (default: llmc or the host:port)")
    p.add_argument("--rates", default="1,2,4,8", help="request rates to sweep (requests/s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token after the first")
    p.add_argument("--max-concurrency", type=int, default=512, help="open connections at most")
    p.add_argument("--threads", type=int, default=None, help="llmc serve --threads")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="llmc serve --kv-cache-tokens")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json for the prompts")
    p.add_argument("--vocab-size", type=int, default=512, help="random prompt ids below this without a tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1, help="llmc serve --replicas (Ray Serve)")
    p.add_argument("--routing", default="prefix", choices=["prefix", "round_robin", "pow2"],
                   help="llmc serve --routing, with --replicas")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="llmc serve --target-itl-ms (0: off; default: the server's)")
    p.add_argument("--docs", type=int, default=0, help="shared-prefix workload: this many documents ...")
    p.add_argument("--questions", type=int, default=8, help="... each asked this many questions, interleaved")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if (args.engine is None) == (args.url is None):
        p.error("give exactly one of --engine or --url")
    if args.tokenizer is None and args.engine is not None:
        args.tokenizer = args.engine / "tokenizer.json"
    proc = None
    if args.engine is not None:
        proc, url, served = start_llmc(args)
        model, label = args.model or served, args.label or "llmc"
    else:
        url = args.url.rstrip("/")
        model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        label = args.label or re.sub(r"\W+", "_", url.split("//")[-1])
    rows = []
    try:
        # One short warm-up so the first rate does not pay for lazy initialisation.
        asyncio.run(run_rate(args, url, model, workload(args, np.random.default_rng(args.seed))[:4], 100.0, 0))
        for i, rate in enumerate(float(x) for x in args.rates.split(",")):
            # Prompts of their own per rate: a server's prefix cache must not serve one rate from the previous.
            reqs = workload(args, np.random.default_rng(args.seed + 1 + i))
            results = asyncio.run(run_rate(args, url, model, reqs, rate, args.seed + 1 + i))
            rows.append(summarise(rate, results, args))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    setup = f", {args.replicas} replicas ({args.routing} routing)" if args.replicas > 1 else ""
    if args.target_itl_ms is not None:
        setup += f", --target-itl-ms {args.target_itl_ms:g}"
    if args.docs:
        setup += f", {args.docs} documents x {args.questions} questions interleaved"
    title = (f"{label} ({model}, engine {args.engine}{setup}) at {url}: {args.num_requests} requests per rate, prompts "
             f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]}, "
             f"SLO TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s; {os.cpu_count()} cores, load average "
             f"{os.getloadavg()[0]:.1f} at the end")
    print(f"\n{title}\n")
    print(table(rows))
    out = args.out or REPO / "benchmarks" / "results" / f"bench_serve_{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(f"# bench_serve: {title}\n\n{table(rows)}\n")
    out.write_text(json.dumps({
        "label": label, "model": model, "url": url, "engine": str(args.engine) if args.engine else None,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_end": os.getloadavg()},
        "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
