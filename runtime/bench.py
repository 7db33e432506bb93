"""``llmc bench``: the standard workloads on one engine, with a roofline report.

Definitions match ../shared/peers (so figures compare with llama.cpp and ONNX Runtime GenAI):

- prefill tok/s = 512 / TTFT for one 512-token prompt;
- decode bB tok/s = B * (N - 1) / (t_N - t_1) for B different 128-token prompts decoded together,
  N = 128 new tokens, t_i = when token i of the batch became available (prompt pass excluded);
- a request stream: requests with Poisson arrivals; TTFT and inter-token latency p50/p99.

Each figure is the median of ``repeats`` runs after one warm-up. The roofline column divides the
bytes a decode step must read (all weights once, plus the KV cache of every sequence) by the
step time, and reports it against this machine's measured read bandwidth.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from llmc.runtime.engine import Engine
from llmc.runtime.sampler import SamplingParams


@dataclass
class BenchResult:
    engine: str
    threads: int
    weights_bytes: int
    machine_read_GBps: float
    rows: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def measure_read_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: a float32 sum over ``nbytes`` (median of ``repeats``)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, length).tolist() for _ in range(count)]


def _kv_bytes_per_token(manifest: dict) -> int:
    kv = manifest["kv_cache"]
    itemsize = np.dtype(kv["dtype"]).itemsize
    return 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_size"] * itemsize


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate decode tok/s of ``prompts`` decoded together (prompt pass excluded)."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    t_first = max(o.ttft for o in outs)
    t_end = max(o.latency for o in outs)
    return len(prompts) * (new_tokens - 1) / (t_end - t_first)


def prefill_rate(engine: Engine, prompt: list[int]) -> float:
    out = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return len(prompt) / out.ttft


def request_stream(engine: Engine, vocab: int, num_requests: int, rate_per_s: float, seed: int = 0) -> dict:
    """Poisson arrivals of 128-token prompts asking 64 tokens; TTFT and inter-token latency percentiles (ms)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    prompts = _prompts(vocab, num_requests, 128, seed + 1)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    pending = 0
    while pending < num_requests or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending < num_requests and arrivals[pending] <= now:
            rid = engine.submit(prompts[pending], params)
            submitted[rid] = arrivals[pending]
            token_times[rid] = []
            pending += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            if o.new_token_ids and o.request_id in token_times:
                token_times[o.request_id].append(t)
    ttft = [token_times[r][0] - submitted[r] for r in submitted if token_times[r]]
    itl = [b - a for r in submitted for a, b in zip(token_times[r], token_times[r][1:], strict=False)]
    pct = lambda xs, q: float(np.percentile(xs, q) * 1000) if xs else None  # noqa: E731
    return {"requests": num_requests, "rate_per_s": rate_per_s, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def run(engine_dir: str | Path, *, threads: int = 2, repeats: int = 3, batches: tuple[int, ...] = (1, 8, 32),
        prompt_len: int = 128, new_tokens: int = 128, prefill_len: int = 512, stream_requests: int = 16,
        stream_rate: float = 4.0, progress=None) -> BenchResult:
    """Run every workload on the engine at ``engine_dir``; returns the table rows."""
    say = progress or (lambda msg: None)
    engine_dir = Path(engine_dir)
    engine = Engine.load(engine_dir, num_threads=threads, kv_cache_tokens=max(batches) * (prompt_len + new_tokens)
                         + prefill_len + 64)
    manifest = engine.manifest
    vocab = int(manifest["engine"]["vocab_size"])
    weights = sum(f.stat().st_size for f in engine_dir.glob("*.data"))
    kv_per_token = _kv_bytes_per_token(manifest)
    say("measuring machine read bandwidth")
    bandwidth = measure_read_bandwidth()
    result = BenchResult(str(engine_dir), threads, weights, round(bandwidth, 2))
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm-up

    say(f"prefill {prefill_len}")
    long_prompt = _prompts(vocab, 1, prefill_len, 7)[0]
    rates = [prefill_rate(engine, long_prompt) for _ in range(repeats)]
    result.rows.append({"workload": f"prefill_{prefill_len}", "tok_s": round(statistics.median(rates), 1)})
    for b in batches:
        say(f"decode batch {b}")
        prompts = _prompts(vocab, b, prompt_len, 100 + b)
        rates = [decode_rate(engine, prompts, new_tokens) for _ in range(repeats)]
        tok_s = statistics.median(rates)
        # One step reads every weight once and each sequence's KV (mean context over the run).
        step_bytes = weights + b * kv_per_token * (prompt_len + new_tokens / 2)
        achieved = step_bytes * tok_s / b / 1e9
        result.rows.append({"workload": f"decode_b{b}", "tok_s": round(tok_s, 1),
                            "achieved_GBps": round(achieved, 2),
                            "roofline_fraction": round(achieved / bandwidth, 3)})
    if stream_requests:
        say(f"request stream: {stream_requests} requests at {stream_rate}/s")
        result.rows.append({"workload": "stream", **request_stream(engine, vocab, stream_requests, stream_rate)})
    return result
