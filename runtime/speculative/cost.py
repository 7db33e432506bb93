"""What a step costs per extra token (:class:`StepCost`), and what drafts are expected to bring and cost."""

from __future__ import annotations

import statistics
from collections import deque


class StepCost:
    """Fits ``seconds = a + b * tokens`` to recent steps of one kind (through per-size medians, over a window).

    ``a`` is the fixed cost of a step (weights read once, launch and framework overhead), ``b`` the
    cost of each token in it. While the window holds steps of one size only, the two cannot be
    separated: :meth:`predict` then extrapolates from that size's median with a slope given by the
    caller (another kind of step's), else with the prior ratio ``b / a``.

    The fit is recomputed every ``refit_every`` observations (4x that once the window is full), not every
    step: a least-squares fit over the window costs ~0.1 ms, a tenth of a 14M-parameter decode step on a CPU
    and half of a 3M-parameter one.
    """

    MIN_COUNT = 3  # steps of one size before its own median is trusted

    def __init__(self, window: int = 256, prior_ratio: float = 0.05, refit_every: int = 16) -> None:
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._medians: dict[int, float] = {}  # step size -> median seconds, sizes seen MIN_COUNT times
        self.prior_ratio = prior_ratio
        self.refit_every = refit_every
        self._stale = 0  # observations since the last fit
        self.version = 0  # counts refits: what is derived from the fit holds until it changes
        self._fit: tuple[float, float, int | None] = (0.0, 0.0, None)  # (a, b, the one size seen or None)

    def __len__(self) -> int:
        return len(self._obs)

    def observe(self, tokens: int, seconds: float) -> None:
        self._obs.append((tokens, seconds))
        self._stale += 1
        # Refitted here when due, so that reading the fit (every step, by every request) costs nothing.
        # Every refit_every steps while the window fills, every 4 x refit_every once it is full: a refit costs
        # ~0.1 ms, which every 16 steps was 6 us of a 3M-parameter model's 0.17 ms step.
        every = self.refit_every * (4 if len(self._obs) == self._obs.maxlen else 1)
        if self._stale >= every or len(self._obs) <= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        # In plain Python: over a window of a few sizes, np.unique + np.median per size + np.polyfit took
        # ~0.2 ms, which every 64 steps was still 3 us of a 3M-parameter model's 0.18 ms step.
        self._stale = 0
        self.version += 1
        by_size: dict[int, list[float]] = {}
        for n, t in self._obs:
            by_size.setdefault(n, []).append(t)
        # Each step size's median time (a few steps stalled by another process do not move it); sizes
        # seen fewer than MIN_COUNT times are left out while others were seen more: one stalled step of
        # a rare size would otherwise tilt the line through all of them.
        stats = [(n, statistics.median(ts), len(ts)) for n, ts in sorted(by_size.items())]
        kept = [st for st in stats if st[2] >= self.MIN_COUNT]
        stats = kept or stats
        self._medians = {n: t for n, t, _ in kept}
        if len(stats) == 1:  # one step size: its median, the slope left to predict()
            n, t, _ = stats[0]
            self._fit = (t, 0.0, n)
            return
        # Least squares through the medians, each weighted by its count squared (np.polyfit's w = counts).
        w = [c * c for _, _, c in stats]
        total = sum(w)
        xm = sum(wi * n for wi, (n, _, _) in zip(w, stats, strict=True)) / total
        ym = sum(wi * t for wi, (_, t, _) in zip(w, stats, strict=True)) / total
        sxx = sum(wi * (n - xm) ** 2 for wi, (n, _, _) in zip(w, stats, strict=True))
        sxy = sum(wi * (n - xm) * (t - ym) for wi, (n, t, _) in zip(w, stats, strict=True))
        b = sxy / sxx
        self._fit = (max(ym - b * xm, 1e-6), max(b, 0.0), None)

    def trusted(self) -> bool:
        """Whether some step size ran ``MIN_COUNT`` times: before that the fit is a line through single steps,
        one of which may have stalled (a first step of a new shape: 11 ms where 0.4 are usual, measured)."""
        return bool(self._medians)

    def slope(self) -> float | None:
        """Seconds per token, or ``None`` while steps of only one size (or none) were seen."""
        a, b, single = self._fit
        return None if single is not None or not self._obs else b

    def fit(self) -> tuple[float, float]:
        """``(a, b)`` in seconds and seconds per token (prior split for one size); ``(0, 0)`` before any step."""
        if not self._obs:
            return 0.0, 0.0
        t, b, single = self._fit
        if single is None:
            return t, b
        a = t / (1.0 + self.prior_ratio * single)
        return a, a * self.prior_ratio

    def predict(self, tokens: int, slope: float | None = None) -> float:
        """Expected seconds of a step of ``tokens`` tokens (0 before any step): that size's own median
        where it ran ``MIN_COUNT`` times, else the line."""
        if not self._obs:
            return 0.0
        t, b, single = self._fit
        if tokens in self._medians:
            return self._medians[tokens]
        if single is None:
            return t + b * tokens
        if slope is None:
            a, slope = self.fit()
        return max(t + slope * (tokens - single), 1e-6)


def expected_tokens(acceptance: float, k: int, first: float | None = None) -> float:
    """Mean tokens a verify step with ``k`` drafts emits when its first draft is kept with probability ``first``
    (default: ``acceptance``) and each later one, given the one before it was, with ``acceptance``."""
    p = acceptance if first is None else first
    if k == 0:
        return 1.0
    if acceptance >= 1.0:
        return 1.0 + p * k
    return 1.0 + p * (1.0 - acceptance ** k) / (1.0 - acceptance)


def step_costs(plain: StepCost, verify: StepCost, batch: int, max_k: int) -> list[float]:
    """Expected time of a decode step of ``batch`` requests with ``k`` drafts each, over a plain step's.

    Measured, not modelled: ``plain`` fits steps without drafts, ``verify`` steps with drafts (the
    proposal, draft-model steps and verification included). The two are fitted apart because a step's
    cost is not one line through both: on a CPU the first extra token per sequence turns the
    matrix-vector products of a 1-token step into matrix products, which cost more than the per-token
    slope of larger steps predicts (+33% for a 2-token step of the default model, then ~+8% per token).
    Until ``verify`` holds ``StepCost.MIN_COUNT`` steps of one size (:meth:`StepCost.trusted`), drafts cost what
    ``plain``'s line says (nearly free), so that speculation gets measured at all, and one stalled first verify
    step (ORT allocating for a new shape: 30 ms where 3 are usual) does not price drafts out for good: a line
    through three single steps of three sizes, one stalled, priced a 7-token step at 57 plain ones.
    """
    bp, bv = plain.slope(), verify.slope()
    if len(plain):
        base = plain.predict(batch, bp if bp is not None else bv)
    else:  # no plain step seen yet: extrapolate the verify fit down to one token per request
        base = verify.predict(batch, bv if bv is not None else None)
    if base <= 0.0:
        return [1.0 + plain.prior_ratio * k for k in range(max_k + 1)]
    costs = [1.0]
    for k in range(1, max_k + 1):
        n = batch * (1 + k)
        if verify.trusted():
            t = verify.predict(n, bv if bv is not None else bp)
        else:
            t = plain.predict(n, bp)
        costs.append(max(t / base, 1.0))  # a verify step never really costs less than a plain one
    return costs
