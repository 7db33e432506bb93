"""One timed run of each ``llmc bench`` workload: prefill, decode of a batch, a Poisson request stream."""

from __future__ import annotations

import time

import numpy as np

from llmc.runtime import Engine, SamplingParams


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, length).tolist() for _ in range(count)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One decode run of ``prompts`` together: aggregate decode tok/s (prompt pass excluded), TTFT (s),
    and the tokens actually generated."""
    outs = engine.generate(prompts, _greedy(new_tokens))
    t_first = max(o.ttft for o in outs)
    t_end = max(o.latency for o in outs)
    made = sum(len(o.token_ids) for o in outs)
    return {"tok_s": len(prompts) * (new_tokens - 1) / (t_end - t_first), "ttft_s": t_first,
            "tokens": made, "seconds": t_end}


def prefill_run(engine: Engine, prompt: list[int]) -> dict:
    """One prefill of ``prompt``: tok/s = prompt tokens / TTFT."""
    out = engine.generate([prompt], _greedy(1))[0]
    return {"tok_s": len(prompt) / out.ttft, "ttft_s": out.ttft, "tokens": len(out.token_ids)}


def request_stream(engine: Engine, prompts: list[list[int]], new_tokens: int, rate_per_s: float,
                   seed: int = 0) -> dict:
    """Poisson arrivals of ``prompts``, each asking ``new_tokens``; TTFT and inter-token latency (ms)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, len(prompts)))
    params = _greedy(new_tokens)
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    pending = 0
    while pending < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending < len(prompts) and arrivals[pending] <= now:
            rid = engine.submit(prompts[pending], params)
            submitted[rid] = float(arrivals[pending])
            token_times[rid] = []
            pending += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            if o.new_token_ids and o.request_id in token_times:
                token_times[o.request_id].extend([t] * len(o.new_token_ids))
            if o.finished:
                engine.result(o.request_id)  # read once so the engine forgets it
    elapsed = time.perf_counter() - start
    ttft = [token_times[r][0] - submitted[r] for r in submitted if token_times[r]]
    itl = [b - a for r in submitted for a, b in zip(token_times[r], token_times[r][1:], strict=False)]

    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q) * 1000), 3) if xs else None

    made = sum(len(v) for v in token_times.values())
    return {"requests": len(prompts), "rate_per_s": rate_per_s, "tokens": made,
            "tok_s": round(made / elapsed, 2), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def _spec_figures(before, after) -> dict:
    """Speculative decoding's figures between two ``EngineStats`` (empty without speculation)."""
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    if not drafted:
        return {}
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    verifies = after.spec_num_verify_steps - before.spec_num_verify_steps
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4),
            "spec_mean_accepted_length": round(accepted / verifies, 4) if verifies else 0.0}
