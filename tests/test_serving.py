"""Serving through the real engine: continuous batching, preemption, prefix caching, streaming, cancellation.

Uses a tiny random Llama with a 4,096-token context (built once per test session) so that prompts
of up to 2,000 tokens fit. Token outputs are compared with runs of each request alone.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

from llmc.errors import LlmcError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.sampling.sampler import apply_repetition_penalty, sample, token_logprobs


def _once(tmp_path_factory, name: str, make) -> Path:
    # Same sharing scheme as tests/conftest.py: one build per test run, shared by xdist workers.
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "llmc-shared"
    shared.mkdir(exist_ok=True)
    target = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (target / ".done").exists():
            make(target)
            (target / ".done").touch()
    return target


@pytest.fixture(scope="session")
def engine_4k(tmp_path_factory) -> Path:
    def make(target: Path) -> None:
        from llmc.compiler.build import build
        from llmc.testing.checkpoints import write_tiny_llama

        write_tiny_llama(target / "ckpt", seed=3, max_position_embeddings=4096)
        build(target / "ckpt", target / "engine")

    return _once(tmp_path_factory, "engine-tiny-4k", make) / "engine"


def _prompts(rng, lengths) -> list[list[int]]:
    return [rng.integers(3, 500, size=int(n)).tolist() for n in lengths]


def _alone(engine_dir: Path, prompts, params) -> list[list[int]]:
    """Each request run by itself on a fresh engine without prefix caching."""
    solo = Engine.load(engine_dir, kv_cache_tokens=2304, enable_prefix_caching=False)
    return [solo.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def test_32_requests_through_a_quarter_sized_pool_match_solo_runs(engine_4k):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 1001, size=32)
    lengths[:2] = [16, 1000]
    prompts = _prompts(rng, lengths)
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(2, 41, size=32)]
    total = sum(map(len, prompts)) + sum(p.max_tokens for p in params)
    # A 512-token budget chunks the long prompts, whose later chunks then need blocks the pool lacks.
    engine = Engine.load(engine_4k, kv_cache_tokens=total // 4, max_num_tokens=512)
    assert engine.stats().kv_blocks_total * engine.block_size <= total // 4 + engine.block_size
    outs = engine.generate(prompts, params)
    expected = _alone(engine_4k, prompts, params)
    for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
        assert o.token_ids == e, f"request {i} (prompt {len(prompts[i])} tokens, seed {seed}) differs from its solo run"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and sum(o.num_preemptions for o in outs) == stats.num_preemptions
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.generated_tokens == sum(p.max_tokens for p in params) and stats.tokens_per_s > 0


def test_shared_prefix_prefill_drops_by_80_percent(engine_4k):
    rng = np.random.default_rng()
    prefix = _prompts(rng, [256])[0]
    prompts = [prefix + s for s in _prompts(rng, rng.integers(4, 40, size=16))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        engine = Engine.load(engine_4k, enable_prefix_caching=caching)
        runs[caching] = ([o.token_ids for o in engine.generate(prompts, params)], engine.stats())
    (off, off_stats), (on, on_stats) = runs[False], runs[True]
    assert on == off
    assert on_stats.prompt_tokens_computed <= 0.2 * off_stats.prompt_tokens_computed
    assert off_stats.prompt_tokens_computed == sum(map(len, prompts))
    assert on_stats.cached_prompt_tokens == 15 * 256 and on_stats.prefix_cache_hit_rate > 0.8


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompt_arriving_while_8_decode(engine_4k, chunked):
    """Scheduling decisions, not timings (timings: benchmarks/bench_serving.py)."""
    rng = np.random.default_rng()
    budget = 128 if chunked else 2048 + 32
    engine = Engine.load(engine_4k, max_num_tokens=budget, enable_chunked_prefill=chunked)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short = _prompts(rng, [32] * 8)
    ids = [engine.submit(p, params) for p in short]
    got: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(3):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    long_id = engine.submit(_prompts(rng, [2000])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    prefill_steps = 0
    while engine.result(long_id).token_ids == []:
        outs = engine.step()
        sched = engine.last_schedule
        sizes = {c.request.request_id: c.num_tokens for c in sched.chunks}
        # Every step of the long prefill still carries one decode token for each of the 8.
        assert all(sizes.get(i) == 1 for i in ids)
        assert sum(sizes.values()) <= budget
        prefill_steps += 1
        for o in outs:
            if o.request_id in got:
                got[o.request_id] += o.new_token_ids
    assert prefill_steps == (-(-2000 // (budget - 8)) if chunked else 1)
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in got:
                got[o.request_id] += o.new_token_ids
    assert [got[i] for i in ids] == _alone(engine_4k, short, [params] * 8)


def test_cancelling_a_stream_returns_all_its_blocks(engine_4k):
    rng = np.random.default_rng()
    engine = Engine.load(engine_4k, kv_cache_tokens=4096)
    total = engine.stats().kv_blocks_total
    stream = engine.stream(_prompts(rng, [300, 50]), SamplingParams(max_tokens=100, ignore_eos=True))
    seen = {0: 0, 1: 0}
    cancelled = None
    for ev in stream:
        if ev.token_id is not None:
            seen[ev.index] += 1
        if ev.index == 0 and seen[0] == 5 and cancelled is None:
            used = engine.stats().kv_blocks_used
            assert engine.cancel(ev.request_id)
            cancelled = ev.request_id
            # At once, before any further step: its 19 blocks (304 computed tokens) are free again.
            assert engine.stats().kv_blocks_used == used - 19 > 0
        if ev.index == 0 and ev.finished:
            assert ev.finish_reason == "cancelled" and ev.token_id is None
            break
    assert seen[0] == 5
    stream.close()  # closing the iterator cancels request 1 as well
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == total and stats.num_running == 0
    assert not engine.cancel(cancelled)


def test_async_streams_batch_together_and_cancel_independently(engine_4k):
    rng = np.random.default_rng()
    prompts = _prompts(rng, [40, 70, 25])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = Engine.load(engine_4k)

    async def consume(i: int, stop_after: int | None) -> list[int]:
        toks: list[int] = []
        async with aclosing(engine.astream(prompts[i], params)) as events:
            async for ev in events:
                toks.append(ev.token_id)
                if stop_after is not None and len(toks) == stop_after:
                    break
        return toks

    async def main():
        return await asyncio.gather(consume(0, None), consume(1, 6), consume(2, None))

    a, b, c = asyncio.run(main())
    expected = _alone(engine_4k, prompts, [params] * 3)
    assert a == expected[0] and c == expected[2] and b == expected[1][:6]
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    # The three ran in shared steps, not one after the other.
    assert stats.num_steps < 24 + 24 + 6


def test_requests_join_a_running_batch(engine_4k):
    rng = np.random.default_rng()
    prompts = _prompts(rng, [30, 60])
    params = [SamplingParams(max_tokens=80, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)]
    engine = Engine.load(engine_4k)
    first = engine.submit(prompts[0], params[0])
    for _ in range(10):
        engine.step()
    assert engine.stats().num_running == 1
    second = engine.generate([prompts[1]], params[1])[0]  # joins while `first` decodes
    so_far = engine.result(first)
    assert so_far.finish_reason == "length" and 40 <= len(so_far.token_ids) < 80  # still running
    tail = []
    while engine.has_unfinished():
        tail += [o for o in engine.step() if o.request_id == first]
    assert tail[-1].finished and tail[-1].finish_reason == "length"
    final = engine.result(first)
    assert engine.result(first) is None  # returned once, then forgotten
    expected = _alone(engine_4k, prompts, params)
    assert second.token_ids == expected[1] and final.token_ids == expected[0]


def test_back_pressure_and_requests_that_never_fit(engine_4k):
    engine = Engine.load(engine_4k, kv_cache_tokens=512, max_waiting=2)
    engine.submit([5, 6, 7])
    engine.submit([5, 6, 7])
    with pytest.raises(LlmcError, match="waiting queue is full"):
        engine.submit([5, 6, 7])
    with pytest.raises(LlmcError, match=r"need 38 KV blocks of 16 tokens but the pool has 32"):
        engine.generate([list(range(3, 500)) + list(range(3, 103))], SamplingParams(max_tokens=8))
    with pytest.raises(LlmcError, match="context of 4096 tokens"):
        Engine.load(engine_4k, kv_cache_tokens=8192).submit(list(range(3, 400)) * 10, SamplingParams(max_tokens=200))
    # generate() is all-or-nothing: a bad prompt leaves nothing queued.
    other = Engine.load(engine_4k)
    with pytest.raises(LlmcError, match="outside the vocabulary"):
        other.generate([[5, 6], [5, 100000]])
    assert other.stats().num_waiting == 0


def test_seeded_sampling_is_independent_of_the_batch(engine_4k):
    rng = np.random.default_rng()
    prompts = _prompts(rng, [20, 35, 50])
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=11,
                             ignore_eos=True)
    others = [SamplingParams(max_tokens=20, temperature=1.2, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    engine = Engine.load(engine_4k)
    batched = engine.generate(prompts, [sampled, *others])[0].token_ids
    alone = engine.generate([prompts[0]], sampled)[0].token_ids
    assert batched == alone and len(alone) == 20


def test_logprobs_and_repetition_penalty_against_score(engine_4k):
    rng = np.random.default_rng()
    prompt = _prompts(rng, [40])[0]
    engine = Engine.load(engine_4k)
    out = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=3, repetition_penalty=1.4,
                                                   ignore_eos=True))[0]
    logits = engine.score(prompt + out.token_ids)  # [positions, vocab]
    seq = list(prompt)
    for i, tok in enumerate(out.token_ids):
        row = logits[len(prompt) - 1 + i]
        # The token is the argmax of the penalised logits; logprobs are those of the raw model.
        assert tok == int(np.argmax(apply_repetition_penalty(row, seq, 1.4)))
        want = token_logprobs(row, tok, 3)
        got = out.logprobs[i]
        assert got.keys() == want.keys() and len(got) in (3, 4)
        assert np.allclose([got[k] for k in want], [want[k] for k in want], atol=1e-4)
        seq.append(tok)
    plain = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert plain[0] == int(np.argmax(logits[len(prompt) - 1]))


def test_stop_strings_cut_the_text(engine_4k):
    engine = Engine.load(engine_4k)
    free = engine.generate(["The for statement"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    cut = engine.generate(["The for statement"], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.text.startswith(cut.text + stop)
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < 30
    # Streaming delivers the same text, piece by piece.
    pieces = [ev.text for ev in engine.stream("The for statement", SamplingParams(max_tokens=30, ignore_eos=True))]
    assert "".join(pieces) == free.text


def test_sampler_filters():
    rng = np.random.default_rng()
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    # min_p = 0.4 keeps tokens with p >= 0.2: ids 0 and 1.
    draws = {sample(logits, SamplingParams(temperature=1.0, min_p=0.4), rng) for _ in range(300)}
    assert draws == {0, 1}
    x = rng.standard_normal(50).astype(np.float32)
    pen = apply_repetition_penalty(x, [3, 3, 7], 2.0)
    for i in (3, 7):
        assert pen[i] == (x[i] / 2 if x[i] > 0 else x[i] * 2)
    assert np.array_equal(np.delete(pen, [3, 7]), np.delete(x, [3, 7]))
    with pytest.raises(LlmcError):
        SamplingParams(min_p=1.5)
    with pytest.raises(LlmcError):
        SamplingParams(repetition_penalty=0)
