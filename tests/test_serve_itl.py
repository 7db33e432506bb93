"""``--target-itl-ms``: the prompt share of steps that also decode follows the measured step cost.

Four requests decode while a 600-token prompt arrives. With the governor, every step that decodes computes
at most the cap it set, and that cap is what the fitted step cost says fits the target; the outputs are the
same tokens as without it (chunking a prompt changes when it is computed, not what comes out). Step times
themselves are not asserted: the test machine's 2 cores are shared.
"""

from __future__ import annotations

import time

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
    assert gov.cap == max(engine.block_size, min(engine.config.max_num_tokens, int((target - a) / b)))
