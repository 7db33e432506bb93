"""Per-request speculation state: acceptance statistics, probes and shadow proposals, and the choice of drafts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmc.runtime.speculative.ngram import NgramIndex


@dataclass
class SpecState:
    """Per-request speculation state: the acceptance statistics the number of drafts follows.

    Two rates, as decayed counts: how often the first draft is kept, and how often a later draft is kept given
    the one before it was. Drafts come in runs (a copied passage is either being followed or not), so one rate
    for all drafts priced first drafts wrongly: where 6-token runs were kept now and then, it said 1 in 2 while
    the first draft was kept 1 time in 5, and single drafts went on at a loss (the default model at batch 8:
    0.95x plain, measured).
    """

    max_tokens: int
    accepted: float = 2.0  # later drafts kept / not kept (decayed); the prior says "kept 2 times in 3"
    rejected: float = 1.0
    first_kept: float | None = None  # first drafts kept / not kept (decayed); None: the prior above
    first_missed: float | None = None
    idle_steps: int = 0  # steps since the last proposal while adaptation chose 0 drafts
    probe_every: int = 16  # idle steps between probes; doubles after each probe that does not pay
    probing: bool = False  # the last proposal was a probe, not yet verified
    probed: bool = False  # a probe was verified: the next choice judges it (its outcome sets probe_every)
    num_draft: int = 0  # totals for this request
    num_accepted: int = 0
    num_verify: int = 0
    decay: float = field(default=0.8, repr=False)
    # Prompt lookup (adaptive): the request's n-gram index, and while it drafts nothing, its shadow proposal (the
    # drafts it would have verified) with the sequence length it was made at. Shadows are judged against the
    # tokens that come, for free, so such requests never probe.
    index: NgramIndex | None = field(default=None, repr=False)
    shadow: list[int] | None = field(default=None, repr=False)
    shadow_at: int = field(default=0, repr=False)
    shadow_gap: int = field(default=4, repr=False)  # tokens between shadow starts (see SHADOW_GAP)
    learned: int = 0  # verify steps and shadows learned from (its own evidence, beyond the prior)
    # The last choice's inputs and outcome: the choice changes only when the costs or the acceptance do, and
    # recomputing it for every request every step was ~4 us a request, 2% of a 3M-parameter model's step.
    _chosen_for: tuple | None = field(default=None, repr=False)
    _chosen: int = field(default=0, repr=False)
    _wait: int = field(default=0, repr=False)  # the idle steps before a probe, as the last choice of 0 found them

    PROBE_MIN = 16
    PROBE_MAX = 256
    # Probes may cost this share of the plain steps between them: a probe that keeps nothing costs a verify
    # step's excess over a plain one, so where that excess is large (a draft model at batch 8: ~0.9 of a step,
    # its catch-up over the idle tokens included) probes wait longer than PROBE_MIN.
    PROBE_BUDGET = 0.02
    PROBE_NEVER = 1 << 62
    # Tokens between the starts of two shadow proposals: SHADOW_GAP, doubled by each shadow that keeps nothing up to
    # SHADOW_GAP_MAX (where short matches abound and are rarely followed, a shadow a step, judged after one token,
    # cost ~10 us a request a step: 2% of the default model's step at batch 8), back to SHADOW_GAP when one keeps some.
    SHADOW_GAP = 4
    SHADOW_GAP_MAX = 32

    def __post_init__(self) -> None:
        if self.first_kept is None:
            self.first_kept = self.accepted
        if self.first_missed is None:
            self.first_missed = self.rejected

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft after the first is kept, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    @property
    def first_acceptance(self) -> float:
        """Estimated probability that a step's first draft is kept."""
        return self.first_kept / (self.first_kept + self.first_missed)

    def learn(self, proposed: int, kept: int) -> None:
        """The acceptance statistics only: ``kept`` of ``proposed`` drafts were (or would have been) kept."""
        d = self.decay
        self.learned += 1
        self.first_kept = d * self.first_kept + (1.0 if kept else 0.0)
        self.first_missed = d * self.first_missed + (0.0 if kept else 1.0)
        if kept and proposed > 1:  # the later drafts were tried only because the first was kept
            self.accepted = d * self.accepted + (kept - 1)
            self.rejected = d * self.rejected + (1.0 if kept < proposed else 0.0)
        self._chosen_for = None

    def judge_shadow(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Compare the shadow proposal with the tokens emitted since; once it is decided (a token differs, or
        all matched) learn from it as from a verify step and drop it. Returns (proposed, kept) once decided."""
        sh, at = self.shadow, self.shadow_at
        if not sh or len(tokens) <= at:
            return None
        got = tokens[at: at + len(sh)]
        kept = 0
        while kept < len(got) and got[kept] == sh[kept]:
            kept += 1
        if kept == len(got) < len(sh):  # all matched so far, more to come
            return None
        self.learn(len(sh), kept)
        self.shadow = None
        self.shadow_gap = min(2 * self.shadow_gap, self.SHADOW_GAP_MAX) if kept == 0 else self.SHADOW_GAP
        return len(sh), kept

    def record(self, proposed: int, kept: int) -> None:
        self.learn(proposed, kept)
        self.num_draft += proposed
        self.num_accepted += kept
        self.num_verify += 1
        if self.probing:  # judged by the next choice: did it make speculation pay?
            self.probing = False
            self.probed = True

    def choose(self, step_costs: Sequence[float], margin: float = 1.02) -> int:
        """Drafts to propose next: maximises expected tokens per unit of step time.

        ``step_costs[k]`` is the expected time of a step in which requests carry ``k`` drafts, relative
        to a plain decode step (``step_costs[0] == 1``). With first-draft acceptance ``p`` and later-draft
        acceptance ``a``, ``k`` drafts emit ``1 + p (1 - a^k) / (1 - a)`` tokens on average (each draft is kept
        only if those before it were, plus the target's own token). Speculating must beat plain decode by
        ``margin`` (the cost estimates are noisy; a marginal win is not worth a possible loss). When 0 wins, the
        most drafts (``max_tokens``) are still proposed after ``probe_every`` idle steps so that a request whose text
        starts to repeat is noticed: a probe of one draft could never show it, as one kept draft moves the
        acceptance too little to pay for a step whose first draft is dear (a tiny model whose verify step's
        fixed cost is twice a plain step's, measured), while a run of kept drafts does. Each probe after
        which 0 still wins doubles the wait (up to ``PROBE_MAX``: text that never repeats, or a draft model
        whose drafts are kept too rarely to pay, costs ~nothing), one after which speculation pays resets
        it. The wait is also at least ``(step_costs[max_tokens] - 1) / PROBE_BUDGET`` steps (at most
        ``PROBE_MAX``), so that probes cost at most ``PROBE_BUDGET`` of the plain steps between them.
        A prompt-lookup state (``index`` set) never probes: its shadow proposals tell the same for free.
        """
        cached = self._chosen_for is not None and self._chosen_for[0] == margin and self._chosen_for[1] == step_costs
        if cached and self._chosen == 0 and not self.probed and self.idle_steps + 1 < self._wait:
            self.idle_steps += 1  # what the rest would do, in a fifth of the time: most requests, most steps
            return 0
        probe = min(self.max_tokens, len(step_costs) - 1)
        if cached:
            best_k = self._chosen
        else:
            a, p = self.acceptance, self.first_acceptance
            best_k, best = 0, margin
            kept, run = 0.0, p  # expected_tokens(a, k, p) - 1, summed term by term
            for k in range(1, probe + 1):
                kept += run
                run *= a
                gain = (1.0 + kept) / max(step_costs[k], 1e-9)
                if gain > best * 1.0001:
                    best_k, best = k, gain
            self._chosen_for, self._chosen = (margin, list(step_costs)), best_k
        if self.probed:  # a kept draft alone is no success: 1 in 2 are kept where drafts do not pay
            self.probed = False
            self.probe_every = self.PROBE_MIN if best_k else min(2 * self.probe_every, self.PROBE_MAX)
        if best_k == 0:
            self.idle_steps += 1
            if self.index is not None:  # shadow proposals tell when drafts would pay: no probes
                self._wait = self.PROBE_NEVER
                return 0
            excess = step_costs[probe] - 1.0 if probe > 0 else 0.0
            wait = self._wait = min(max(self.probe_every, math.ceil(excess / self.PROBE_BUDGET)), self.PROBE_MAX)
            if self.idle_steps >= wait and probe > 0:
                self.idle_steps = 0
                self.probing = True
                return probe
        else:
            self.idle_steps = 0
            self.probing = False
            self.probe_every = self.PROBE_MIN
        return best_k
