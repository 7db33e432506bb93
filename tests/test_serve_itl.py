"""``--target-itl-ms``: the prompt share of steps that also decode follows the measured step cost.

Four requests decode while a 600-token prompt arrives. With the governor, every step that decodes computes
at most the cap it set, and that cap is what the measured step costs say fits the target; the outputs are the
same tokens as without it (chunking a prompt changes when it is computed, not what comes out). Step times
themselves are not asserted: the test machine's 2 cores are shared.
"""

from __future__ import annotations

import time

import pytest

from llmc.runtime import Engine, SamplingParams
from llmc.serve.itl import BACKLOG_STEPS, MEASURE_TOKENS, RESUME_STEPS, ItlGovernor, split_chunks


def test_governor_caps_prompt_tokens_in_steps_that_decode(default_engine):
    engine = Engine.load(default_engine, num_threads=1)
    tok = engine.tokenizer
    text = open(__file__, encoding="utf-8").read() * 4
    long_prompt = tok.encode(text)[:600]
    short = [tok.encode(p) for p in ("The for statement", "def f(x):", "A class", "Python's with")]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in engine.generate([*short, long_prompt], params)]
    engine.reset_prefix_cache()  # the long prompt is computed again below, not served from the cache

    target = 0.05
    gov = ItlGovernor(engine, target)
    ids = [engine.submit(p, params) for p in short]
    mixed: list[tuple[int, int, int | None]] = []  # (decodes, prompt tokens, cap) of steps that decode
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 6:
            ids.append(engine.submit(long_prompt, params))
        cap = engine.scheduler.config.max_prefill_tokens_with_decodes
        t0 = time.perf_counter()
        outs = engine.step()
        gov(time.perf_counter() - t0)
        steps += 1
        chunks = engine.last_schedule.chunks
        decodes = sum(1 for c in chunks if c.num_tokens == 1)
        prompt = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if decodes and prompt:
            mixed.append((decodes, prompt, cap))
        for o in outs:
            if o.finished:
                done[o.request_id] = engine.result(o.request_id).token_ids
    assert [done[i] for i in ids] == want
    assert len(mixed) >= 3, mixed  # the long prompt went in chunks beside the decodes
    assert all(cap is not None and prompt <= cap for _, prompt, cap in mixed), mixed
    # The last cap is the measured costs' room for prompt tokens (at least MEASURE_TOKENS).
    costs = gov.costs()
    assert costs is not None and costs[1] > 0
    base, per_token = costs
    assert base == sorted(gov.base)[int(0.9 * (len(gov.base) - 1))]
    assert 0.05 <= gov.scale <= 1.0
    want_cap = int(max(MEASURE_TOKENS, min(engine.config.max_num_tokens, (target * gov.scale - base) / per_token)))
    assert gov.cap == want_cap


def test_governor_shrinks_the_costs_time_when_mixed_steps_run_over_the_target_and_recovers(default_engine):
    """The periods decodes wait across steps that also compute prompt tokens are what the cap promises: a p95
    over 90% of the target scales the time given to the costs down in proportion (so the cap shrinks), and
    periods well under it let it grow back, up to the target. Decode-only steps, however slow, are not the cap's
    doing."""
    engine = Engine.load(default_engine, num_threads=1)
    tok = engine.tokenizer
    text = open(__file__, encoding="utf-8").read() * 8
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for p in ("The for statement", "def f(x):", "A class"):
        engine.submit(tok.encode(p), params)
    now = [0.0]
    target = 0.05
    gov = ItlGovernor(engine, target, clock=lambda: now[0])
    mixed_steps = [0]

    def step(period: float) -> None:
        engine.step()
        now[0] += period
        _, prompt = split_chunks(engine.last_schedule.chunks)
        if prompt and any(c.num_tokens == 1 for c in engine.last_schedule.chunks):
            mixed_steps[0] += 1
        gov(0.03 if prompt else 0.01)  # what the step itself took; the rest of the period is the loop's

    for _ in range(4):  # prefill, then decodes (the base cost)
        step(0.01)
    for _ in range(6):  # decode-only steps over the target: not the cap's doing, the scale stays
        step(0.2)
    assert gov.scale == 1.0
    ids = tok.encode(text)
    # 500 tokens: over 100 steps of the smallest cap, not of a block (saturation counts capped steps in blocks)
    prompts = [ids[i * 500:(i + 1) * 500] for i in range(6)]

    def feed() -> None:  # one long prompt at a time: a backlog the capped steps clear (no saturation)
        sched = engine.scheduler
        if not sched.waiting and not any(r.num_remaining > 1 for r in sched.running):
            engine.submit(prompts.pop(), params)

    while mixed_steps[0] < 32:
        feed()
        step(0.2)  # decodes wait 4x the target across each mixed step
    # 16 mixed periods at 0.2 s (p95 0.2 s): scale 0.9 x 0.05 / 0.2; 16 more: again x 0.225
    assert not gov.saturated
    assert gov.scale == pytest.approx(0.225**2)
    base, per_token = gov.costs()
    room = (target * gov.scale - base) / per_token
    assert gov.cap == int(max(MEASURE_TOKENS, min(engine.config.max_num_tokens, room)))
    while mixed_steps[0] < 64:
        feed()
        step(0.005)  # well under the target
    assert gov.scale == pytest.approx(0.225**2 * 1.2**2)  # two windows of fast periods: +20% each
    assert len(gov.periods) <= 32


def test_governor_lifts_the_cap_while_the_prompt_backlog_is_beyond_what_capped_steps_clear(default_engine):
    """Saturation: prompts waiting beyond BACKLOG_STEPS capped steps get the whole budget (throughput as without
    the governor); the cap holds again once the backlog is down to RESUME_STEPS capped steps (hysteresis). A
    budget of 128 tokens a step, so that the lifted steps take the backlog down in several steps."""
    engine = Engine.load(default_engine, num_threads=1, max_num_tokens=128)
    tok = engine.tokenizer
    ids = tok.encode(open(__file__, encoding="utf-8").read() * 12)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for p in ("The for statement", "def f(x):"):
        engine.submit(tok.encode(p), SamplingParams(max_tokens=300, ignore_eos=True))
    gov = ItlGovernor(engine, 0.05)
    for _ in range(3):
        engine.step()
        gov(0.01)
    long = [ids[i * 500:(i + 1) * 500] for i in range(5)]
    assert sum(map(len, long)) > BACKLOG_STEPS * engine.block_size
    for p in long:
        engine.submit(p, params)
    seen: list[tuple[bool, int | None, int]] = []  # (saturated, cap then in force, prompt tokens of a mixed step)
    lifted_backlogs: list[int] = []  # prompt tokens left before each lifted step
    resumed_at: list[int] = []  # ... before the first capped step after lifted ones
    was_lifted = False
    while any(r.num_remaining > 1 for r in [*engine.scheduler.waiting, *engine.scheduler.running]):
        in_force = engine.scheduler.config.max_prefill_tokens_with_decodes
        backlog = sum(r.num_remaining for r in [*engine.scheduler.waiting, *engine.scheduler.running]
                      if r.num_remaining > 1)
        if in_force is None:
            lifted_backlogs.append(backlog)
        elif was_lifted:
            resumed_at.append(backlog)
        was_lifted = in_force is None
        engine.step()
        decodes, prompt = split_chunks(engine.last_schedule.chunks)
        # 2 ms a prompt token under the cap (a cap of 20 at the 50 ms target), 20 ms in a lifted step
        gov(0.01 + (0.02 if in_force is None else 0.002) * prompt)
        if decodes and prompt:
            seen.append((in_force is None, in_force, prompt))
    assert any(lifted and prompt > gov.cap for lifted, _, prompt in seen), seen  # whole budget while saturated
    assert any(not lifted for lifted, _, _ in seen), seen  # and capped again once the backlog fell
    assert all(lifted or prompt <= cap for lifted, cap, prompt in seen), seen
    # Hysteresis: lifted on through backlogs under BACKLOG_STEPS blocks, capped again only near RESUME_STEPS.
    unit = max(gov.cap, engine.block_size)
    assert any(b < BACKLOG_STEPS * unit for b in lifted_backlogs), (lifted_backlogs, unit)
    assert resumed_at and all(b <= RESUME_STEPS * unit for b in resumed_at), (resumed_at, unit)
    # The lifted steps promised nothing: their cost per prompt token is not the capped steps'.
    assert max(gov.per_token) < 0.005, gov.per_token


def test_governor_does_not_enforce_a_target_the_decodes_alone_miss(default_engine):
    """Decode-only steps at or over the target: no cap meets it, so none is held (it would only delay prompts)."""
    engine = Engine.load(default_engine, num_threads=1)
    tok = engine.tokenizer
    for p in ("The for statement", "def f(x):"):
        engine.submit(tok.encode(p), SamplingParams(max_tokens=80, ignore_eos=True))
    gov = ItlGovernor(engine, 0.05)
    engine.step()
    gov(0.01)
    engine.submit(tok.encode(open(__file__, encoding="utf-8").read())[:20], SamplingParams(max_tokens=40))
    for seconds in (0.04, 0.02, 0.3, 0.3, 0.3):  # a 16-token prompt chunk, its last 4, then decodes at 6x the target
        engine.step()
        gov(seconds)
    assert gov.costs()[0] >= 0.05 and gov.unattainable and not gov.saturated
    assert engine.scheduler.config.max_prefill_tokens_with_decodes is None
    for _ in range(32):  # decodes back under the target (their p90 too): the cap holds again
        engine.step()
        gov(0.001)
    assert not gov.unattainable and engine.scheduler.config.max_prefill_tokens_with_decodes == gov.cap
