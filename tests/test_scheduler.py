"""Scheduling decisions, checked on the real scheduler and block manager without a model.

A small driver plays the engine: it runs each step's chunks (marking them computed), appends a
token for every chunk that reaches its request's last token, and finishes requests at max_tokens.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.request import Request, RequestStatus
from llmc.runtime.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmc.runtime.sampling.sampler import SamplingParams

VOCAB = 500


class Driver:
    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True, **config) -> None:
        self.cfg = SchedulerConfig(enable_prefix_caching=prefix_caching, **config)
        self.sched = Scheduler(self.cfg, BlockManager(num_blocks, block_size, prefix_caching))
        self.ids = itertools.count()
        self.log: list[SchedulerOutput] = []

    def add(self, prompt: list[int], max_tokens: int, rid: str | None = None) -> Request:
        sid = next(self.ids)
        r = Request(request_id=rid or f"r{sid}", seq_id=sid, prompt_len=len(prompt), tokens=list(prompt),
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=float(sid),
                    rng=np.random.default_rng(sid))
        self.sched.add(r)
        return r

    def step(self) -> SchedulerOutput:
        bm = self.sched.blocks
        out = self.sched.schedule()
        assert out.num_tokens <= self.cfg.max_num_tokens
        for c in out.chunks:  # the slots the step writes are reserved and start where the KV ends
            assert bm.num_computed(c.request.seq_id) == c.start
            assert len(bm.block_table(c.request.seq_id)) * bm.block_size >= c.start + c.num_tokens
        self.sched.complete(out)
        for c in out.chunks:
            r = c.request
            if c.samples:
                # A deterministic "model": the next token is a function of the sequence so far.
                self.sched.append_token(r, (sum(r.tokens) * 31 + len(r.tokens)) % VOCAB)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    self.sched.finish(r, "length")
        self.log.append(out)
        return out

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not finish")


def _prompt(rng, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


@pytest.mark.parametrize("budget", [64, 256])
def test_decodes_stay_in_every_step_while_a_long_prompt_prefills(budget):
    rng = np.random.default_rng()
    d = Driver(num_blocks=400, max_num_tokens=budget)
    decoders = [d.add(_prompt(rng, int(rng.integers(16, 40))), max_tokens=200) for _ in range(8)]
    while any(r.num_remaining != 1 for r in decoders):  # until all 8 are decoding
        d.step()
    long = d.add(_prompt(rng, 2000), max_tokens=4)
    steps = []
    while long.num_computed < long.prompt_len:
        out = d.step()
        steps.append(out)
        by_req = {id(c.request): c for c in out.chunks}
        assert all(id(r) in by_req and by_req[id(r)].num_tokens == 1 for r in decoders)
        assert by_req[id(long)].num_tokens == min(budget - 8, 2000 - by_req[id(long)].start)
    assert len(steps) == -(-2000 // (budget - 8))


def test_prefill_cap_applies_only_to_steps_with_decodes():
    rng = np.random.default_rng()
    d = Driver(num_blocks=400, max_num_tokens=2048, max_prefill_tokens_with_decodes=24)
    # Alone, a prompt takes the whole budget: the cap is for steps that carry decodes.
    first = d.add(_prompt(rng, 1500), max_tokens=300)
    assert [c.num_tokens for c in d.step().chunks] == [1500]
    long = d.add(_prompt(rng, 1000), max_tokens=4)
    while long.num_computed < long.prompt_len:
        out = d.step()
        by_req = {id(c.request): c.num_tokens for c in out.chunks}
        assert by_req[id(first)] == 1
        assert by_req[id(long)] == min(24, 1000 - (long.num_computed - by_req[id(long)]))
    with pytest.raises(LlmcError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=8, enable_chunked_prefill=False)
    with pytest.raises(LlmcError, match="at least 1"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)


def test_chunked_prefill_off_computes_a_prompt_in_one_step():
    rng = np.random.default_rng()
    d = Driver(num_blocks=400, max_num_tokens=4096, enable_chunked_prefill=False)
    decoders = [d.add(_prompt(rng, 20), max_tokens=50) for _ in range(8)]
    d.step()
    long = d.add(_prompt(rng, 2000), max_tokens=4)
    out = d.step()
    sizes = sorted(c.num_tokens for c in out.chunks)
    assert sizes == [1] * 8 + [2000] and long.num_computed == 2000 and all(r.num_remaining == 1 for r in decoders)
    # The same prompt with a budget below it is refused when chunking is off.
    small = Driver(num_blocks=400, max_num_tokens=1024, enable_chunked_prefill=False)
    with pytest.raises(LlmcError, match="chunked prefill is off"):
        small.add(_prompt(rng, 2000), max_tokens=4)


def test_continuous_batching_fcfs_and_budget():
    rng = np.random.default_rng()
    d = Driver(num_blocks=2000, max_num_tokens=128, max_num_seqs=6)
    reqs = [d.add(_prompt(rng, int(rng.integers(1, 300))), int(rng.integers(1, 30))) for _ in range(40)]
    admitted: list[Request] = []
    while d.sched.has_work():
        out = d.step()
        assert len(d.sched.running) <= 6
        admitted += [r for r in out.admitted if r not in admitted]
        # Requests join between steps: seats freed by finished requests are taken by waiting ones
        # unless the step's budget ran out.
        seated = len(d.sched.running) + sum(c.request.finished for c in out.chunks)
        assert seated == 6 or not d.sched.waiting or out.num_tokens == 128
    assert admitted == reqs  # first come, first served
    assert all(r.finished and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert d.sched.blocks.num_used_blocks == 0


def test_preemption_recomputes_latest_and_everything_finishes():
    rng = np.random.default_rng()
    # 24 requests of up to ~40 blocks each through a pool of 60 blocks.
    d = Driver(num_blocks=60, block_size=8, max_num_tokens=256)
    reqs = [d.add(_prompt(rng, int(rng.integers(16, 250))), int(rng.integers(5, 60))) for _ in range(24)]
    expected = {}
    for r in reqs:  # what each request produces alone, by the same deterministic "model"
        toks = list(r.tokens)
        for _ in range(r.params.max_tokens):
            toks.append((sum(toks) * 31 + len(toks)) % VOCAB)
        expected[r.request_id] = toks[r.prompt_len :]
    while d.sched.has_work():
        running_before = list(d.sched.running)
        out = d.step()
        for victim in out.preempted:
            # Only the most recently admitted requests are preempted, never the oldest running one.
            assert victim is not running_before[0]
            assert running_before.index(victim) >= len(running_before) - len(out.preempted)
            assert not d.sched.blocks.has_sequence(victim.seq_id) and victim.num_computed == 0
    assert d.sched.counters.num_preemptions > 0
    assert all(r.output_token_ids == expected[r.request_id] for r in reqs)
    assert d.sched.blocks.num_used_blocks == 0


def test_request_that_can_never_fit_is_rejected_with_its_block_count():
    d = Driver(num_blocks=10, block_size=16)
    with pytest.raises(LlmcError, match=r"need 14 KV blocks of 16 tokens but the pool has 10"):
        d.add(list(range(200)), max_tokens=10)  # 209 tokens need slots
    d.add(list(range(150)), max_tokens=11)  # 160 tokens: exactly 10 blocks
    d.run()


def test_waiting_queue_is_bounded():
    d = Driver(num_blocks=100, max_waiting=3)
    for _ in range(3):
        d.add([1, 2, 3], max_tokens=2)
    with pytest.raises(LlmcError, match="waiting queue is full"):
        d.add([1, 2, 3], max_tokens=2)
    d.step()  # admitted: the queue has room again
    d.add([1, 2, 3], max_tokens=2)
    with pytest.raises(LlmcError, match="already in use"):
        d.add([4], max_tokens=2, rid="r0")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix_is_computed_once(prefix_caching):
    rng = np.random.default_rng()
    d = Driver(num_blocks=1000, prefix_caching=prefix_caching, max_num_tokens=2048)
    prefix = _prompt(rng, 256)
    suffixes = [_prompt(rng, int(rng.integers(1, 60))) for _ in range(16)]
    reqs = [d.add(prefix + s, max_tokens=4) for s in suffixes]  # all arrive together
    d.run()
    computed = d.sched.counters.prompt_tokens_computed
    if prefix_caching:
        assert computed == 256 + sum(map(len, suffixes))
        assert d.sched.counters.cached_prompt_tokens == 15 * 256
        assert [r.num_cached_tokens for r in reqs] == [0] + [256] * 15
    else:
        assert computed == sum(256 + len(s) for s in suffixes)


def test_preempted_request_reuses_its_own_cached_blocks():
    rng = np.random.default_rng()
    d = Driver(num_blocks=40, block_size=8, max_num_tokens=512)
    old = d.add(_prompt(rng, 100), max_tokens=100)
    d.step()
    young = d.add(_prompt(rng, 120), max_tokens=80)
    while young.num_preemptions == 0:
        d.step()
    d.run()
    # Recompute went through the prefix cache: far fewer tokens computed again than were generated.
    assert d.sched.counters.recomputed_tokens + d.sched.counters.prompt_tokens_computed < 100 + 120 + 80
    assert old.finished and young.finished


def test_cancel_returns_blocks_at_once():
    rng = np.random.default_rng()
    d = Driver(num_blocks=100)
    a = d.add(_prompt(rng, 90), max_tokens=30)
    b = d.add(_prompt(rng, 40), max_tokens=30)
    d.step()
    used = d.sched.blocks.num_used_blocks
    assert used == 6 + 3
    d.sched.finish(a, "cancelled")
    assert d.sched.blocks.num_used_blocks == 3 and a.status is RequestStatus.FINISHED
    d.sched.finish(b, "cancelled")
    assert d.sched.blocks.num_used_blocks == 0 and not d.sched.has_work()
