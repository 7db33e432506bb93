"""``--target-itl-ms``: size the prompt share of a mixed step so that running decodes keep an inter-token latency.

A step that computes a whole long prompt stalls every decode in it: on 2 cores the 1B int4 engine's
inter-token latency p99 reached 5.6 s at 1 req/s with prompts of 45-700 tokens. The scheduler can cap
the prompt tokens of a step that also decodes (``SchedulerConfig.max_prefill_tokens_with_decodes``);
this sets that cap before every step from two costs measured on the running server:

- ``base``: what a step of decodes alone takes (the 90th percentile of the last 64 such steps);
- ``per_token``: what each prompt token adds to a step (the 90th percentile of the last 32 capped steps that
  computed at least ``MEASURE_TOKENS`` (4) prompt tokens beside decodes, each ``(seconds - median base) /
  prompt tokens``): only those, because a step of hundreds of prompt tokens costs less per token (2 threads,
  1B int4: steps of 24-40 prompt tokens and 1-2 decodes ran p50 91 ms, p90 123 ms, against a cap computed with
  such steps counted, so over the 100 ms target as often as not),

so that a step of decodes and ``P`` prompt tokens takes at most the target:

    P = (target * scale - base) / per_token,   at least MEASURE_TOKENS

High percentiles rather than a fit through medians, and the prompt tokens' own cost rather than a line over
every step: a line through each step size's median (what the speculative decoder's ``StepCost`` fits) is
dominated by the many small decode steps, whose slope per token is a third of a prompt chunk's on the 1B int4
engine (24 ms at 1 token, 72 ms at 16-24, 98 ms at 32-40), and half the steps at the cap it gives run over the
target; measured with it, ITL p99 was 0.13-0.25 s at a 100 ms target (README, Serving).

``scale`` is feedback on what the cap promises: the period from one decoding step's end to the next's, over
the capped steps that computed prompt tokens beside decodes (the only ones the cap governs). Every 8 of them,
over the (at least 16, up to 32) since the scale last changed, a 95th percentile above 90% of the target
(``FEEDBACK_AIM``) shrinks the time the costs are given (in proportion), one below 0.8x that lets it grow back
by 20% (up to the target itself).

Saturation: when the prompt tokens waiting (queued, or admitted and not yet computed) would take more than
``BACKLOG_STEPS`` (100) capped steps to compute (steps of at least ``min_prefill`` tokens), the rate is not
one the server sustains, no cap can hold the target for long, and each capped step pays the decodes' fixed
cost for a few prompt tokens: the cap is lifted until the backlog falls under ``RESUME_STEPS`` (10) capped
steps, so that output throughput at saturation stays what it is without the governor (measured: 16% lower with
the cap held throughout, 12% with it back as soon as the backlog fell under 100 steps).

A target the decodes alone miss (the decode-only steps' p90 at or over it: a large model on few cores) is not
enforced: no cap would meet it, and holding one would only lengthen TTFT.

Until both costs were measured the cap is ``min_prefill`` (one KV block by default). Once they are, it may go
below a block (down to ``MEASURE_TOKENS``): on one thread the 1B int4 engine's decode-only steps took 52 ms and
each prompt token added ~4 ms, so at a 100 ms target a block of 16 prompt tokens (121 ms a step) was already
over it, and a floor of one block had left ITL p99 at 0.15-0.16 s; the prompt then moves in smaller chunks,
and TTFT grows instead of ITL. Steps without decodes keep the whole ``--max-num-tokens`` budget. The trade: a long
prompt arriving among running decodes is computed in chunks over several steps, so its TTFT grows by about one
step time per chunk, while the decodes around it keep their pace.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

PERIODS = 32  # mixed steps' periods kept
ADJUST_EVERY = 8  # mixed steps between changes of the scale
BASE_STEPS = 64  # decode-only steps kept
TOKEN_STEPS = 32  # steps with prompt tokens kept
QUANTILE = 0.9
# The mixed steps' periods held under the target at this quantile: they are a fifth of the decoding steps at
# moderate load, so the decodes' p99 is about their p95. (0.97 measured no better: the tail is steps that ran
# twice their usual time at the same size; not garbage collection (traced: none coincided), nor the benchmark's
# client (with the server alone on its core they came as well); cause not found.)
FEEDBACK_QUANTILE = 0.95
# ... held at 90% of the target: the scale moves in steps around where it aims, and aimed at the target itself
# the decodes' p99 settled 1-12% over it (1B int4, 2 threads: 0.112 / 0.106 / 0.103 s at 0.2 / 0.35 / 0.5 req/s).
FEEDBACK_AIM = 0.9
BACKLOG_STEPS = 100  # prompt tokens waiting beyond this many capped steps: the load is not sustainable
RESUME_STEPS = 10  # ... and the cap is lifted until they are down to this many
# The smallest prompt share: steps with fewer prompt tokens do not measure their cost (the base's noise would
# dominate), and a one-token chunk cannot be told from a decode.
MEASURE_TOKENS = 4


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank below) of a non-empty sequence."""
    s = sorted(values)
    return s[int(q * (len(s) - 1))]


def split_chunks(chunks) -> tuple[int, int]:
    """(decodes, prompt tokens) of a step's chunks: a chunk that computes one known token (and any drafts) is a
    decode (a prompt's last token alone counts as one too), any other computes that many prompt tokens."""
    decodes = prompt = 0
    for c in chunks:
        n = c.num_tokens - len(c.draft)
        if n == 1:
            decodes += 1
        else:
            prompt += n
    return decodes, prompt


class ItlGovernor:
    """Called by the step loop after each step (``EngineLoop.after_step``); owns the scheduler's prefill cap."""

    def __init__(self, engine, target_s: float, min_prefill: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.target_s = target_s
        self.min_prefill = min_prefill or engine.block_size
        self.base: deque[float] = deque(maxlen=BASE_STEPS)  # seconds of steps that only decoded
        self.per_token: deque[float] = deque(maxlen=TOKEN_STEPS)  # seconds a prompt token added to a step
        self.cap: int | None = None  # the cap set for the next step (None: nothing measured yet)
        self.saturated = False  # prompts waiting beyond BACKLOG_STEPS capped steps: the cap is lifted
        self.unattainable = False  # decode-only steps (p90) take the target or longer: the cap is lifted
        self.scale = 1.0  # the share of the target the costs are given (see the module docstring)
        self.periods: deque[float] = deque(maxlen=PERIODS)  # seconds decodes waited across mixed steps
        self._clock = clock
        self._last_end: float | None = None
        self._decodes = 0  # decodes running when the step now ending was scheduled
        self._since_adjust = 0
        self._lifted = False  # the cap was lifted for the step now ending

    def costs(self) -> tuple[float, float] | None:
        """(base, per_token) seconds at the governor's percentile, or None until both were measured."""
        if not self.base or not self.per_token:
            return None
        return quantile(self.base, QUANTILE), quantile(self.per_token, QUANTILE)

    def __call__(self, seconds: float) -> None:
        sched = self.engine.scheduler
        last = self.engine.last_schedule
        now = self._clock()
        decodes, prompt = split_chunks(last.chunks) if last is not None else (0, 0)
        # Decodes waited on a step with prompt tokens, under the cap (a lifted step promised nothing: counted, its
        # periods of seconds at saturation had left the scale at its floor, and prompts crawled after it).
        if self._decodes and prompt and self._last_end is not None and not self._lifted:
            self.periods.append(max(seconds, now - self._last_end))
            self._adjust()
        self._last_end = now
        # One pass over the running requests: the decodes the next step waits on, and the prompt tokens left.
        self._decodes = prefilling = 0
        for r in sched.running:
            if r.num_remaining <= 1:
                self._decodes += 1
            else:
                prefilling += r.num_remaining
        if decodes and not prompt:
            self.base.append(seconds)
        elif decodes and prompt >= MEASURE_TOKENS and not self._lifted:
            fixed = statistics.median(self.base) if self.base else 0.0
            self.per_token.append(max(seconds - fixed, 0.0) / prompt)
        costs = self.costs()
        budget = self.engine.config.max_num_tokens
        if costs is None:
            self.cap = min(budget, self.min_prefill)
        else:
            base, per_token = costs
            room = (self.target_s * self.scale - base) / per_token if per_token > 0 else budget
            self.cap = int(max(MEASURE_TOKENS, min(budget, room)))
        backlog = prefilling + sum(r.num_remaining for r in sched.waiting)
        # In blocks at least: a cap under a block (a tight target on a slow engine) must not make one long prompt
        # look like saturation (measured: 4-token caps lifted for 500-875-token prompts at 0.1 req/s, 2.6-4.2 s
        # steps that stalled the decodes).
        # Hysteresis: once lifted, the cap stays off until the backlog is down to RESUME_STEPS capped steps (at a
        # burst, capping the backlog's last 100 steps had cost 12% of output throughput: 51.7 vs 58.7 tok/s).
        steps = RESUME_STEPS if self.saturated else BACKLOG_STEPS
        self.saturated = backlog > steps * max(self.cap, self.min_prefill)
        # Decodes alone already over the target: no cap meets it, and one would only lengthen TTFT.
        self.unattainable = costs is not None and costs[0] >= self.target_s
        lifted = self._lifted = self.saturated or self.unattainable
        sched.config.max_prefill_tokens_with_decodes = None if lifted else self.cap

    def _adjust(self) -> None:
        self._since_adjust += 1
        if len(self.periods) < 2 * ADJUST_EVERY or self._since_adjust < ADJUST_EVERY:
            return
        self._since_adjust = 0
        high = quantile(self.periods, FEEDBACK_QUANTILE)
        aim = FEEDBACK_AIM * self.target_s
        if high > aim:
            self.scale = max(0.05, self.scale * aim / high)
        elif high < 0.8 * aim:
            self.scale = min(1.0, self.scale * 1.2)
        else:
            return
        self.periods.clear()  # the next change is judged on periods under this scale only
