"""``--target-itl-ms``: the prompt share of steps that also decode follows the measured step cost.

Four requests decode while a 600-token prompt arrives. With the governor, every step that decodes computes
at most the cap it set, and that cap is what the fitted step cost says fits the target; the outputs are the
same tokens as without it (chunking a prompt changes when it is computed, not what comes out). Step times
themselves are not asserted: the test machine's 2 cores are shared.
"""

from __future__ import annotations

import time

import pytest

from llmc.runtime import Engine, SamplingParams
from llmc.serve.itl import ItlGovernor


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
    # The last cap is the fit's room for prompt tokens beside the decodes then running (at least one block).
    a, b = gov.cost.fit()
    assert gov.cost.slope() is not None
    assert 0.05 <= gov.scale <= 1.0
    assert gov.cap == max(engine.block_size, min(engine.config.max_num_tokens, int((target * gov.scale - a) / b)))


def test_governor_shrinks_the_fits_time_when_decodes_wait_longer_than_the_target_and_recovers(default_engine):
    """The periods between decoding steps are what the decodes get: a p90 over the target scales the fit's time
    down in proportion (so the cap shrinks), and periods well under it let it grow back, up to the target."""
    engine = Engine.load(default_engine, num_threads=1)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for p in ("The for statement", "def f(x):", "A class"):
        engine.submit(engine.tokenizer.encode(p), params)
    now = [0.0]
    gov = ItlGovernor(engine, 0.05, clock=lambda: now[0])

    def step(period: float) -> None:
        engine.step()
        now[0] += period
        gov(0.01)  # the step itself took 10 ms: the rest of the period is the loop's own work

    for _ in range(3):  # prefill, then decodes
        step(0.01)
    for _ in range(3):  # and steps of a second size (40 tokens) give the fit its slope
        gov.cost.observe(40, 0.03)
    for _ in range(16):
        step(0.2)  # decodes wait 4x the target
    # 8 periods (two fast, six slow): p90 0.2 s, scale 0.05 / 0.2; the next 8 (slow): again x 0.25
    assert gov.scale == pytest.approx(0.0625)
    assert gov.cost.slope() is not None
    a, b = gov.cost.fit()
    want = int((0.05 * gov.scale - a) / b - 3)  # three decodes running
    assert gov.cap == max(engine.block_size, min(engine.config.max_num_tokens, want))
    for _ in range(40):
        step(0.005)  # well under the target
    # the two slow periods left in the window pull it down once more (to the floor, 0.05), then four windows of
    # fast periods grow it by 20% each
    assert gov.scale == pytest.approx(0.05 * 1.2**4)
    assert len(gov.periods) <= 32
