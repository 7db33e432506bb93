"""``--target-itl-ms``: size the prompt share of a mixed step so that running decodes keep an inter-token latency.

A step that computes a whole long prompt stalls every decode in it: on 2 cores the 1B int4 engine's
inter-token latency p99 reached 5.6 s at 1 req/s with prompts of 45-700 tokens. The scheduler can cap
the prompt tokens of a step that also decodes (``SchedulerConfig.max_prefill_tokens_with_decodes``);
this sets that cap before every step from the measured cost of steps, ``seconds = a + b * tokens``
(the speculative decoder's :class:`~llmc.runtime.speculative.StepCost` fit over recent steps), so that
a step of ``D`` decodes and ``P`` prompt tokens takes at most the target:

    P = (target - a) / b - D,   at least ``min_prefill`` tokens

Until steps of two sizes were measured (no slope yet) the cap is four blocks. ``min_prefill`` (one KV
block by default) keeps prompts moving when the decodes alone already take the
target; then the target cannot be met at that load, and TTFT grows instead of ITL. Steps without decodes
keep the whole ``--max-num-tokens`` budget. The trade: a long prompt arriving among running decodes is
computed in chunks over several steps, so its TTFT grows by about one step time per chunk, while the
decodes around it keep their pace.
"""

from __future__ import annotations

from llmc.runtime.speculative import StepCost


class ItlGovernor:
    """Called by the step loop after each step (``EngineLoop.after_step``); owns the scheduler's prefill cap."""

    def __init__(self, engine, target_s: float, min_prefill: int | None = None) -> None:
        self.engine = engine
        self.target_s = target_s
        self.min_prefill = min_prefill or engine.block_size
        self.cost = StepCost()
        self.cap: int | None = None  # the cap set for the next step (None: not yet measured)

    def __call__(self, seconds: float) -> None:
        sched = self.engine.scheduler
        last = self.engine.last_schedule
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
            decodes = sum(1 for r in sched.running if r.num_remaining <= 1)
            room = (self.target_s - a) / b - decodes if b > 0 else budget
            self.cap = int(max(self.min_prefill, min(budget, room)))
        sched.config.max_prefill_tokens_with_decodes = self.cap
