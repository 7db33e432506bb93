"""The engine's speculation: proposes drafts for decoding requests before a step and verifies them after it.

The per-request number of drafts adapts to the request's acceptance rates and to what a step costs per extra
token, dropping to zero where speculation does not pay; an idle prompt-lookup request judges shadow proposals for
free, an idle draft-model request probes now and then; in a closed batch requests draft together or not at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.speculative import verification
from llmc.runtime.speculative.config import SpeculativeConfig
from llmc.runtime.speculative.cost import StepCost, step_costs
from llmc.runtime.speculative.draft_model import DraftProposer
from llmc.runtime.speculative.draft_source import DraftModel, DraftSource
from llmc.runtime.speculative.ngram import NgramIndex
from llmc.runtime.speculative.state import SpecState

if TYPE_CHECKING:
    from llmc.runtime.core.request import Request


class Speculator:
    """The engine's speculation: proposes drafts for decoding requests and verifies them after the step."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int,
                 draft: DraftModel | DraftSource | None = None) -> None:
        self.config = config
        if draft is not None and not isinstance(draft, DraftModel):
            draft = draft.draft_model()
        self.draft = DraftProposer(draft, vocab_size) if draft is not None else None
        self.plain_cost = StepCost()  # the target's decode steps without drafts
        self.verify_cost = StepCost()  # decode steps with drafts: proposal + verify step + verification
        self._verify_by_batch: dict[int, StepCost] = {}  # the same, per number of requests in the step
        self._costs_key: tuple | None = None
        self._costs: list[float] = []
        # Asleep: the steps propose() may skip, every decoding request of a draft model (_asleep_with) waiting for its
        # probe, while the running requests stay the same (_asleep_on); _slept: steps skipped, added to those
        # requests' idle counts on waking.
        self._asleep = 0
        self._asleep_on: tuple | None = None
        self._asleep_with: list[Request] = []
        self._slept = 0
        # Decayed first-draft kept / missed and later-draft kept / rejected counts over all requests' recent verify
        # steps (and shadow proposals): a new request's prior.
        self._recent = (SpecState.accepted, SpecState.rejected, SpecState.accepted, SpecState.rejected)

    def observe_step(self, tokens: int, seqs: int, seconds: float) -> None:
        """A decode-only step of ``seqs`` requests and ``tokens`` tokens took ``seconds`` (proposal and
        sampling included). Not while asleep: nothing reads the fits then, and a refit would cost the steps
        that sleeping spares."""
        if self._asleep:
            return
        if tokens == seqs:
            self.plain_cost.observe(tokens, seconds)
            return
        self.verify_cost.observe(tokens, seconds)
        if seqs not in self._verify_by_batch and len(self._verify_by_batch) >= 64:
            self._verify_by_batch.clear()  # bounded: continuous batching visits many batch sizes
        self._verify_by_batch.setdefault(seqs, StepCost(window=64)).observe(tokens, seconds)

    def _step_costs(self, batch: int) -> list[float]:
        """:func:`step_costs` for ``batch``, recomputed only when a fit it reads was refitted (computing them
        took 80 us a step, a quarter of a 5M-parameter model's decode step on these cores)."""
        verify = self.verify_fit(batch)
        plain = self.plain_cost
        key = (batch, id(verify), plain.version, verify.version)  # a first observation refits: version 0 is empty
        if self._costs_key != key:
            self._costs_key, self._costs = key, step_costs(plain, verify, batch, self.config.num_tokens)
        return self._costs

    def verify_fit(self, batch: int) -> StepCost:
        """The verify-step fit for ``batch`` requests: its own once it has a few steps, else all batches'.

        Per batch because the cost of a step's drafts depends on the batch: at batch 1 the first draft turns
        matrix-vector products into matrix products (dear), at batch 8 a step already has those and drafts
        add only their own work; a line through both would make drafts look cheap at batch 8.
        """
        own = self._verify_by_batch.get(batch)
        return own if own is not None and own.trusted() else self.verify_cost

    @property
    def draft_seconds(self) -> float:
        return self.draft.seconds if self.draft is not None else 0.0

    def new_state(self) -> SpecState:
        """A new request's state; its prior acceptance is the engine's recent one (2 in 3 at first).

        Requests of one workload tend to accept alike: starting from what recent drafts did spares each
        new request the first verify steps of a prior that does not hold (a tenth of a 128-token request's
        steps where drafts are rarely kept).
        """
        fk, fm, acc, rej = self._recent
        weight = SpecState.accepted + SpecState.rejected  # the prior counts as 3 observations, as before
        first, later = fk / (fk + fm), acc / (acc + rej)
        cfg = self.config
        index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max) if self.draft is None else None
        return SpecState(max_tokens=cfg.num_tokens, accepted=weight * later, rejected=weight * (1.0 - later),
                         first_kept=weight * first, first_missed=weight * (1.0 - first), index=index)

    def record(self, r: Request, proposed: int, kept: int) -> None:
        """A verify chunk of ``r`` kept ``kept`` of its ``proposed`` drafts."""
        r.spec.record(proposed, kept)
        self._learn_recent(proposed, kept)

    def _learn_recent(self, proposed: int, kept: int) -> None:
        fk, fm, acc, rej = self._recent
        fk, fm = 0.98 * fk + (1.0 if kept else 0.0), 0.98 * fm + (0.0 if kept else 1.0)
        if kept and proposed > 1:
            acc, rej = 0.98 * acc + (kept - 1), 0.98 * rej + (1.0 if kept < proposed else 0.0)
        self._recent = (fk, fm, acc, rej)

    def propose(self, running: list[Request], waiting: int = 0) -> None:
        """Set ``draft`` (and ``draft_probs``) of every decoding request that speculates this step.

        ``waiting``: requests queued behind the running ones. With none and more than one request decoding, the
        batch runs as long as its longest request: one request's kept drafts shorten no step, they only leave
        later steps one token smaller, which their rejected drafts cost as much as. So there the requests draft
        together or not at all: each as many as the fewest any of them would (measured on the default model at
        batch 8, drafting apart ran at 0.94x plain). With requests waiting, one that finishes early lets the next
        in, and each request drafts what pays for itself.
        """
        if (self._asleep or self._slept) and self._still_asleep(running, waiting):
            return
        decoding = [r for r in running if r.num_remaining == 1]
        cfg = self.config
        batch = max(1, len(decoding))
        together = cfg.adaptive and batch > 1 and not waiting
        picks = self._choose(decoding, self._step_costs(batch), together)
        wanted = self._assign(decoding, picks)
        if wanted:
            got = self.draft.propose(wanted, {r.seq_id for r in running})
            for sid, (r, _) in wanted.items():
                if sid in got:
                    r.draft, r.draft_probs = got[sid]
                else:
                    r.spec.probing = False
        elif self.draft is not None and cfg.adaptive and decoding and len(decoding) == len(running):
            self._sleep(decoding, together, self._batch_key(running, waiting))

    def _still_asleep(self, running: list[Request], waiting: int) -> bool:
        """Skip this step's proposal while asleep on the same batch; on waking, hand the requests the idle steps
        that choose() would have counted for them."""
        if self._asleep and self._batch_key(running, waiting) == self._asleep_on:
            self._asleep -= 1
            self._slept += 1
            return True
        for r in self._asleep_with:
            if r.spec is not None:
                r.spec.idle_steps += self._slept
        self._asleep = self._slept = 0
        self._asleep_with = []
        return False

    def _choose(self, decoding: list[Request], costs: list[float], together: bool) -> list[int]:
        """Drafts each decoding request proposes this step (in a closed batch, ``together``: all the same)."""
        cfg = self.config
        picks = []
        zero = False  # some request drafts nothing this step
        for r in decoding:
            s = r.spec
            if s is None:
                picks.append(0)
                zero = True
                continue
            if s.shadow and cfg.adaptive:
                judged = s.judge_shadow(r.tokens)
                if judged is not None:
                    self._learn_recent(*judged)
            if together and (zero or not s.learned):
                # Another request drafts nothing, so this one will not either: no choice to make. (Its probe timer
                # stands still, but in a closed batch a probe only runs when every request probes at once.) Nor
                # does one that has no evidence of its own yet: a batch of new requests would all draft on the
                # engine's recent rates alone, learned at other batch sizes (the default model at batch 8, after
                # batch-1 runs: a verify step of 8 x 3 tokens at every batch's start, all rejected).
                picks.append(0)
                zero = True
                continue
            # The adaptive choice (0 for most requests most steps: this loop is kept lean).
            k = s.choose(costs) if cfg.adaptive else cfg.num_tokens
            picks.append(k)
            zero = zero or k == 0
        if together:  # together or not at all
            common = min(picks)
            if common < max(picks):
                for r, k in zip(decoding, picks, strict=True):
                    if k and not common and r.spec.probing:  # a probe the others did not join was not made
                        r.spec.probing = False
                picks = [common] * len(picks)
        return picks

    def _assign(self, decoding: list[Request], picks: list[int]) -> dict[int, tuple[Request, int]]:
        """Set prompt-lookup drafts (and shadows of requests that draft nothing); returns what the draft model is
        asked for: seq_id -> (request, k)."""
        cfg = self.config
        wanted: dict[int, tuple[Request, int]] = {}
        for r, k in zip(decoding, picks, strict=True):
            s = r.spec
            if s is None:
                continue
            shadows = s.index is not None and cfg.adaptive
            if k == 0:
                # What it would draft now, judged by the tokens to come (one every shadow_gap tokens at most).
                if shadows and not s.shadow and len(r.tokens) - s.shadow_at >= s.shadow_gap:
                    s.shadow, s.shadow_at = s.index.propose(r.tokens, cfg.num_tokens), len(r.tokens)
                continue
            k = min(k, r.params.max_tokens - (len(r.tokens) - r.prompt_len) - 1)
            if k <= 0:
                continue
            if s.index is not None:
                s.shadow = None
                r.draft, r.draft_probs = s.index.propose(r.tokens, k), None
            else:
                wanted[r.seq_id] = (r, k)
        return wanted

    SLEEP_MAX = 32  # steps; a refit that would make drafts pay again is noticed this late at worst

    @staticmethod
    def _batch_key(running: list[Request], waiting: int) -> tuple | None:
        """What a sleep holds for: admissions, finishes and preemptions change it; so does a queue forming behind
        a closed batch (its requests then choose for themselves)."""
        return (len(running), id(running[0]), id(running[-1]), len(running) > 1 and not waiting) if running else None

    def _sleep(self, decoding: list[Request], together: bool, key: tuple | None) -> None:
        """Skip the next steps' proposals while every request (in a closed batch: one) is sure to draft nothing:
        an idle choice each step cost ~3 us of a 0.18 ms step (a 3M-parameter target at batch 1), where a draft
        model that does not pay sits idle for good. A request's choice stays 0 until its probe is due, as long as
        neither its acceptance (no verify step) nor the costs (a refit; hence SLEEP_MAX) change."""
        steps = self.SLEEP_MAX
        for r in decoding:
            s = r.spec
            if together and (s is None or not s.learned):
                break  # in a closed batch this one drafts nothing (it cannot learn while idle): nor do the others
            if s is None:
                continue
            if s._chosen_for is None or s._chosen or s.probing or s.probed:
                steps = 0
            else:
                steps = min(steps, s._wait - s.idle_steps - 2)
            if together and steps > 0:  # the others draft nothing while this one does not
                break
            if steps <= 0:
                return
        if steps > 0:
            self._asleep, self._asleep_with, self._asleep_on = steps, decoding, key

    def verify(self, chunk, logits: np.ndarray) -> list[int]:
        """Tokens emitted by verify chunk ``chunk`` (a ``ScheduledChunk`` with drafts) from its logits rows."""
        r = chunk.request
        return verification.verify(logits, chunk.draft, chunk.draft_probs, r.params, r.rng, r.tokens, r.prompt_len)

    def release(self, r: Request) -> None:
        """``r`` finished: free its draft sequence now (its blocks are the draft pool's)."""
        if self.draft is not None:
            self.draft.release(r.seq_id)

    def reset(self) -> None:
        if self.draft is not None:
            self.draft.reset()
