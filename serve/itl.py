"""``--target-itl-ms``: size the prompt share of a mixed step so that running decodes keep an inter-token latency.

A step that computes a whole long prompt stalls every decode in it: on 2 cores the 1B int4 engine's
inter-token latency p99 reached 5.6 s at 1 req/s with prompts of 45-700 tokens. The scheduler can cap
the prompt tokens of a step that also decodes (``SchedulerConfig.max_prefill_tokens_with_decodes``);
this sets that cap before every step from the measured cost of steps, ``seconds = a + b * tokens``
(the speculative decoder's :class:`~llmc.runtime.speculative.StepCost` fit over recent steps), so that
a step of ``D`` decodes and ``P`` prompt tokens takes at most the target:

    P = (target - a) / b - D,   at least ``min_prefill`` tokens

The fit goes through each step size's median, and what a decode waits for is more than the step: the
loop's work between steps (delivering tokens, the hooks) and steps slower than their median. So the
governor also watches what it promises: the period from one decoding step's end to the next's (the
inter-token latency those decodes got). Over the (up to 32) periods since the scale last changed, at least
8 of them, a 90th percentile above the target shrinks the time the fit is given (``scale``, in proportion),
one below 0.8x the target lets it grow back by 20% (up to the target itself). Measured on the 1B int4 engine
(2 cores, prompts 45-700 tokens, 0.2 and 0.35 req/s, a 100 ms target): ITL p99 0.13 and 0.27 s with the fit
alone, 0.13 and 0.25 s with this feedback; the periods' p90 stayed under the target, so the rarer long gaps
come from something the step cost does not see (README, Serving).

Until steps of two sizes were measured (no slope yet) the cap is four blocks. ``min_prefill`` (one KV
block by default) keeps prompts moving when the decodes alone already take the
target; then the target cannot be met at that load, and TTFT grows instead of ITL. Steps without decodes
keep the whole ``--max-num-tokens`` budget. The trade: a long prompt arriving among running decodes is
computed in chunks over several steps, so its TTFT grows by about one step time per chunk, while the
decodes around it keep their pace.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmc.runtime.speculative import StepCost

PERIODS = 32  # decoding steps' periods kept
ADJUST_EVERY = 8  # steps between changes of the scale


class ItlGovernor:
    """Called by the step loop after each step (``EngineLoop.after_step``); owns the scheduler's prefill cap."""

    def __init__(self, engine, target_s: float, min_prefill: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.target_s = target_s
        self.min_prefill = min_prefill or engine.block_size
        self.cost = StepCost()
        self.cap: int | None = None  # the cap set for the next step (None: not yet measured)
        self.scale = 1.0  # the share of the target the fitted step cost is given (see the module docstring)
        self.periods: deque[float] = deque(maxlen=PERIODS)  # seconds between decoding steps' ends
        self._clock = clock
        self._last_end: float | None = None
        self._decodes = 0  # decodes the step now ending was scheduled with
        self._since_adjust = 0

    def __call__(self, seconds: float) -> None:
        sched = self.engine.scheduler
        last = self.engine.last_schedule
        now = self._clock()
        if self._decodes and self._last_end is not None:  # the loop went straight on: decodes were waiting
            self.periods.append(max(seconds, now - self._last_end))
            self._adjust()
        self._last_end = now
        self._decodes = sum(1 for r in sched.running if r.num_remaining <= 1)
        if last is not None and last.chunks:
            self.cost.observe(sum(c.num_tokens + len(c.draft) for c in last.chunks), seconds)
        if not self.cost.trusted():
            return
        budget = self.engine.config.max_num_tokens
        if self.cost.slope() is None:
            # Steps of one size only so far: the cost per token is unknown. A few blocks per step, whose other
            # sizes give the fit its slope, rather than a whole long prompt at a guessed cost.
            self.cap = min(budget, 4 * self.min_prefill)
        else:
            a, b = self.cost.fit()
            room = (self.target_s * self.scale - a) / b - self._decodes if b > 0 else budget
            self.cap = int(max(self.min_prefill, min(budget, room)))
        sched.config.max_prefill_tokens_with_decodes = self.cap

    def _adjust(self) -> None:
        self._since_adjust += 1
        if len(self.periods) < ADJUST_EVERY or self._since_adjust < ADJUST_EVERY:
            return
        self._since_adjust = 0
        p90 = sorted(self.periods)[int(0.9 * (len(self.periods) - 1))]
        if p90 > self.target_s:
            self.scale = max(0.05, self.scale * self.target_s / p90)
        elif p90 < 0.8 * self.target_s:
            self.scale = min(1.0, self.scale * 1.2)
        else:
            return
        self.periods.clear()  # the next change is judged on periods under this scale only
