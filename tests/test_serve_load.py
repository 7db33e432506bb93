"""`llmc serve` under pressure: many streaming clients through a KV pool that forces preemption, clients that
disconnect, a full queue, and shutdown (SIGTERM on the real CLI process, in a process that cannot import torch)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread
from tests.test_runtime_without_torch import BLOCKER as NO_COMPILER_STACK

MODEL = "tiny"


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


def _wait(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _slow_steps(engine: Engine, seconds: float) -> None:
    """Make every step take at least ``seconds`` (wraps the real step), so a request outlives a client's patience."""
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step


def test_64_streaming_clients_256_requests_through_a_preempting_pool(tiny_engine):
    rng = np.random.default_rng(11)
    n_req = 256
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 97, size=n_req)]
    max_tokens = [int(m) for m in rng.integers(2, 25, size=n_req)]
    offline = Engine.load(tiny_engine, num_threads=1)
    expected = [o.token_ids for o in offline.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                                                for m in max_tokens])]
    # 64 blocks of 16 tokens for 64 clients whose requests need up to 8 blocks each: preemption is certain.
    engine = Engine.load(tiny_engine, num_threads=1, kv_cache_tokens=1024)
    with serve_in_thread(engine, ServeConfig(model_name=MODEL, max_queue=1024)) as s:
        before = _metrics(s.url)

        async def main() -> dict[int, tuple[list[int], str, str, str]]:
            http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120)
            client = openai.AsyncOpenAI(base_url=s.v1, api_key="x", max_retries=0, http_client=http)
            todo: asyncio.Queue[int] = asyncio.Queue()
            for i in range(n_req):
                todo.put_nowait(i)
            results: dict[int, tuple[list[int], str, str, str]] = {}

            async def worker() -> None:
                while not todo.empty():
                    i = todo.get_nowait()
                    stream = await client.completions.create(
                        model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, stream=True,
                        extra_body={"ignore_eos": True, "return_token_ids": True})
                    ids, reasons, ids_seen = [], [], set()
                    async for chunk in stream:
                        ids_seen.add(chunk.id)
                        ids += chunk.choices[0].model_extra["token_ids"]
                        reasons.append(chunk.choices[0].finish_reason)
                    assert len(ids_seen) == 1 and i not in results
                    results[i] = (ids, reasons[-1], ids_seen.pop(), str(reasons[:-1]))

            try:
                await asyncio.gather(*(worker() for _ in range(64)))
            finally:
                await client.close()
            return results

        t0 = time.perf_counter()
        results = asyncio.run(main())
        elapsed = time.perf_counter() - t0
        assert sorted(results) == list(range(n_req))  # none lost
        assert len({r[2] for r in results.values()}) == n_req  # none answered twice
        for i, (ids, reason, _, earlier) in results.items():
            assert ids == expected[i], f"request {i} (prompt {len(prompts[i])}, max_tokens {max_tokens[i]}) differs"
            assert reason == "length" and "length" not in earlier
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
        assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
        after = _metrics(s.url)
        assert after["llmc:request_success_total[length]"] - before.get("llmc:request_success_total[length]", 0) == \
            n_req
        assert after["llmc:generation_tokens_total"] == stats.generated_tokens == sum(max_tokens)
        assert after["llmc:num_preemptions_total"] == stats.num_preemptions
        assert after["llmc:kv_cache_usage_perc"] == 0.0 and after["llmc:num_requests_running"] == 0
        print(f"256 streamed requests, 64 clients: {elapsed:.2f} s, {stats.num_preemptions} preemptions")


def test_client_disconnect_cancels_and_frees_blocks(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1)
    _slow_steps(engine, 0.01)
    with serve_in_thread(engine, ServeConfig(model_name=MODEL)) as s:
        body = {"model": MODEL, "prompt": [5] * 40, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", s.v1 + "/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]  # a few tokens in
                assert any(x.startswith("data: {") for x in got)
                assert engine.stats().kv_blocks_used > 0
            # leaving the block closed the connection mid-stream
        _wait(lambda: engine.stats().kv_blocks_used == 0, 2, "the cancelled request's blocks")
        stats = engine.stats()
        assert stats.num_running == 0 and stats.generated_tokens < 400
        m = _metrics(s.url)
        assert m["llmc:request_success_total[abort]"] == 1 and m["llmc:kv_cache_usage_perc"] == 0.0

        # A non-streaming client that gives up is cancelled too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.v1 + "/completions", json={**body, "stream": False}, timeout=0.3)
        _wait(lambda: _metrics(s.url)["llmc:request_success_total[abort]"] == 2, 5, "the second abort")
        assert engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0


def test_full_queue_answers_429_with_retry_after(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1, max_num_seqs=1)
    _slow_steps(engine, 0.01)
    with serve_in_thread(engine, ServeConfig(model_name=MODEL, max_queue=2, retry_after=3)) as s:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, contextlib.ExitStack() as streams:
            for k in range(3):  # one runs (max_num_seqs=1), two wait: the queue is full
                streams.enter_context(http.stream("POST", s.v1 + "/completions", json=body))
                _wait(lambda k=k: s.state.loop.snapshot.stats.num_waiting == k, 5, f"{k} waiting")
            assert engine.stats().num_running == 1
            r = httpx.post(s.v1 + "/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["Retry-After"] == "3"
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and "--max-queue 2" in err["message"]
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0).completions.create(model=MODEL, prompt="a")
            streams.close()
        _wait(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().num_waiting == 0, 5, "cancellations")
        ok = httpx.post(s.v1 + "/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        # n counts against the queue too: 3 choices never fit in a queue of 2, which no retry can change (400)
        r = httpx.post(s.v1 + "/completions", json={**body, "stream": False, "max_tokens": 3, "n": 3}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_drain_timeout_bounds_shutdown_and_nothing_leaks(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1)
    _slow_steps(engine, 0.02)
    with serve_in_thread(engine, ServeConfig(model_name=MODEL, drain_timeout=0.5)) as s:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", s.v1 + "/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            t0 = time.monotonic()
            s.terminate()
            try:
                rest = list(lines)
            except httpx.HTTPError:  # the connection was cut
                rest = []
            assert "data: [DONE]" not in rest  # cut when the drain timeout ended, long before 400 tokens (8 s)
            s.thread.join(10)
            assert not s.thread.is_alive() and 0.4 < time.monotonic() - t0 < 5
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


# The llmc CLI in a process where torch and the compiler stack cannot be imported (test_runtime_without_torch's).
BLOCKER = NO_COMPILER_STACK + """
from llmc.cli.main import main
sys.argv = ['llmc'] + sys.argv[1:]
main()
"""


def test_sigterm_during_load_finishes_running_requests_and_exits_0_without_torch(tiny_engine):
    proc = subprocess.Popen([sys.executable, "-c", BLOCKER, "serve", str(tiny_engine), "--port", "0",
                             "--served-model-name", MODEL, "--drain-timeout", "60", "--threads", "1"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        url = f"http://127.0.0.1:{m.group(1)}"
        _wait(lambda: _ready(url), 30, "the server to be ready")
        n, max_tokens = 16, 300
        started = threading.Barrier(n + 1, timeout=30)
        results: list[tuple[list[str], str | None]] = [([], None)] * n

        def client(i: int) -> None:
            body = {"model": MODEL, "prompt": [5 + i, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            tokens, reason, events = [], None, []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for raw in r.iter_lines():
                    if not raw:
                        continue
                    events.append(raw)
                    if len(events) == 2:
                        started.wait()
                    if raw != "data: [DONE]":
                        ch = json.loads(raw.removeprefix("data: "))["choices"][0]
                        tokens += ch["token_ids"]
                        reason = ch["finish_reason"] or reason
            results[i] = (events, reason if len(tokens) == max_tokens else f"{len(tokens)} tokens")

        def safe_client(i: int) -> None:
            try:
                client(i)
            except Exception as exc:  # recorded, so the assertion below shows it with the server's log
                results[i] = ([repr(exc)], None)

        threads = [threading.Thread(target=safe_client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        started.wait()  # every client has tokens
        proc.send_signal(signal.SIGTERM)
        running = sum(t.is_alive() for t in threads)
        assert running >= n // 2, f"only {running} requests were still running at SIGTERM: the test proves little"
        time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/health", timeout=5)
        for t in threads:
            t.join(60)
        code = proc.wait(60)
        log = proc.stderr.read()
        assert code == 0, log
        for events, reason in results:
            assert reason == "length" and events[-1] == "data: [DONE]", (reason, events[-2:], log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_server_answers_while_a_step_computes(tiny_engine):
    """A step holds the engine's lock for its whole forward pass; no endpoint may wait for it."""
    engine = Engine.load(tiny_engine, num_threads=1)
    real = engine.step
    in_step = threading.Event()

    def long_step():  # a long forward pass, as a big prefill on a real model (the lock held throughout)
        with engine._lock:
            in_step.set()
            time.sleep(0.5)
            return real()

    engine.step = long_step
    with serve_in_thread(engine, ServeConfig(model_name=MODEL)) as s, httpx.Client(timeout=30) as http:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True}
        with http.stream("POST", s.v1 + "/completions", json=body):
            assert in_step.wait(5)
            for method, path, payload in [("GET", "/health", None), ("GET", "/metrics", None),
                                          ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "abc"}),
                                          ("POST", "/v1/completions", {**body, "max_tokens": 10**6})]:
                t0 = time.perf_counter()
                r = http.request(method, s.url + path, json=payload)
                assert r.status_code in (200, 400) and time.perf_counter() - t0 < 0.25, (path, r.status_code)


def test_a_handler_cancelled_while_its_request_is_queued_neither_runs_it_nor_kills_the_loop(tiny_engine):
    from llmc.serve.loop import EngineLoop

    engine = Engine.load(tiny_engine, num_threads=1)
    real = engine.step

    def long_step():
        with engine._lock:
            time.sleep(0.3)
            return real()

    engine.step = long_step

    async def main() -> None:
        loop = EngineLoop(engine, max_queue=8)
        loop.start(asyncio.get_running_loop())
        try:
            sink = await loop.submit([[5, 6, 7]], [SamplingParams(max_tokens=2, ignore_eos=True)], ["a"],
                                     time.perf_counter())
            await asyncio.sleep(0.05)  # the loop is inside a step now; the next submission waits in its inbox
            late = asyncio.ensure_future(loop.submit([[8, 9]], [SamplingParams(max_tokens=50, ignore_eos=True)],
                                                     ["b"], time.perf_counter()))
            await asyncio.sleep(0.05)
            late.cancel()
            while not (await sink.get()).output.finished:
                pass
            await asyncio.sleep(0.4)  # a step later
            assert loop.alive and loop.error is None
            assert "b" not in engine.scheduler.requests and engine.stats().generated_tokens == 2
        finally:
            loop.stop()

    asyncio.run(main())


def test_retry_after_follows_the_rate_requests_finish():
    """A 429's Retry-After: how long until the overflow drains at the recent completion rate."""
    from llmc.serve.loop import RATE_WINDOW_S, drain_seconds

    rng = np.random.default_rng()
    now = 1000.0
    stale = [now - RATE_WINDOW_S - 5.0] * 50  # finished long ago: they say nothing about now
    for rate in [0.5, *rng.uniform(0.5, 20.0, 8)]:  # requests per second; 0.5: the fewest completions per window
        times = list(now - np.arange(0, RATE_WINDOW_S - 1, 1 / rate)[::-1])
        needed = int(rng.integers(1, 40))
        got = drain_seconds(stale + times, now, needed)
        assert got == pytest.approx(needed / rate, rel=0.05), rate
        assert drain_seconds(stale + times[-1:], now, needed) is None  # one completion is no rate
