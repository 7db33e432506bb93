"""Speculative decoding: propose a few tokens cheaply, verify them in one packed step of the target.

A decoding request that speculates feeds its last token plus ``k`` proposed (draft) tokens to the
target in one chunk; the chunk's ``k + 1`` logits rows decide how many drafts are kept (see
:func:`verify`), and one more token is always sampled, so a step emits 1 to ``k + 1`` tokens. The
scheduler schedules such chunks beside ordinary decodes and prefills and rewinds the KV of rejected
drafts (``BlockManager.rewind``); this module holds what is specific to speculation:

- :class:`SpeculativeConfig`: the method and its limits, given to ``Engine.load``.
- Proposers: :class:`NgramIndex` (prompt lookup: the tokens that followed the latest earlier
  occurrence of the sequence's last n-gram, over prompt and output, from an index kept up to date
  per request; :func:`ngram_propose` is the same by a scan, its reference) and :class:`DraftProposer`
  (a second, smaller llmc engine with the same tokenizer, its own KV pool, driven step by step).
- :func:`verify`: greedy verification (exact: keeps drafts while they equal the target's choice) and
  rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for ``temperature > 0``, which makes
  the emitted tokens' distribution exactly the target's (after penalties, temperature, top-k/p, min-p).
- :class:`SpecState`, :class:`StepCost` and :class:`Speculator`: the per-request number of drafts adapts
  to the request's acceptance rates and to what a step costs per extra token, dropping to zero where
  speculation does not pay; an idle prompt-lookup request judges shadow proposals for free, an idle
  draft-model request probes now and then; in a closed batch requests draft together or not at all.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.sampler import SamplingParams, apply_penalties, probabilities

if TYPE_CHECKING:
    from llmc.runtime.engine import Engine
    from llmc.runtime.scheduler import Request

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """How an engine speculates. ``num_tokens`` is the most draft tokens per request per step.

    ``method="ngram"`` (prompt lookup): the draft is what followed the latest earlier occurrence of
    the sequence's last n-gram, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
    ``method="draft"``: ``draft_model`` is an llmc CPU engine with the target's vocabulary (a smaller
    model trained with the same tokenizer), loaded beside the target with ``draft_kv_cache_tokens`` of
    KV pool of its own (default: the target's). With ``adaptive`` (default) each request's number of
    drafts follows its acceptance rate and the measured cost of a step's extra tokens (0 when it does
    not pay); without it every step proposes ``num_tokens`` when it can.
    """

    method: str = "ngram"
    num_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: str | Path | None = None
    draft_kv_cache_tokens: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LlmcError(f"SpeculativeConfig.method={self.method!r}: must be one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= 32:
            raise LlmcError(f"SpeculativeConfig.num_tokens={self.num_tokens}: must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise LlmcError(f"SpeculativeConfig.prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                            f"{self.prompt_lookup_max}: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and self.draft_model is None:
            raise LlmcError("SpeculativeConfig.draft_model: method 'draft' needs the path of a draft llmc engine "
                            "(llmc build SMALL_CHECKPOINT -o DRAFT), or use method 'ngram'")
        if self.method == "ngram" and self.draft_model is not None:
            raise LlmcError("SpeculativeConfig.draft_model is set but method is 'ngram'; use method='draft'")

    @classmethod
    def parse(cls, spec: str, num_tokens: int = 4) -> SpeculativeConfig:
        """``"ngram"`` or ``"draft:PATH"`` (the ``--speculative`` option of ``llmc bench`` / ``llmc serve``)."""
        if spec == "ngram":
            return cls("ngram", num_tokens)
        if spec.startswith("draft:") and len(spec) > len("draft:"):
            return cls("draft", num_tokens, draft_model=spec[len("draft:"):])
        raise LlmcError(f"--speculative {spec!r}: must be 'ngram' or 'draft:PATH' (PATH: a draft llmc engine)")


# -- target distribution and verification ----------------------------------------------------------


# The target's distribution is exactly the sampler's (one function, so they cannot drift apart).
target_probs = probabilities


def greedy_token(logits: np.ndarray, params: SamplingParams, context: Sequence[int], prompt_len: int) -> int:
    """The token ``sample`` picks at ``temperature == 0`` (penalties applied)."""
    return int(np.argmax(apply_penalties(logits, params, context, prompt_len)))


def accept_or_resample(p: np.ndarray, q: np.ndarray | None, draft: int, rng: np.random.Generator) -> int | None:
    """One step of speculative sampling: ``None`` keeps ``draft``, else the replacement token.

    ``p`` ``[vocab]`` is the target's distribution, ``q`` the draft's (``None``: a point mass on
    ``draft``, as for prompt lookup). The draft is kept with probability ``min(1, p[d] / q[d])``;
    otherwise a token is drawn from ``norm(max(p - q, 0))``. Whatever ``q`` is, the result is
    distributed exactly as ``p`` (Leviathan et al. 2023, theorem 3.5).
    """
    qd = 1.0 if q is None else float(q[draft])
    pd = float(p[draft])
    if qd > 0.0 and rng.random() * qd < pd:  # u < p/q, without dividing by a tiny q
        return None
    if q is None:
        residual = p.copy()
        residual[draft] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q: rejection had probability 0; numerically, fall back to p
        residual, total = p, p.sum()
    return int(rng.choice(residual.size, p=residual / total))


def verify(logits: np.ndarray, draft: Sequence[int], draft_probs: np.ndarray | None, params: SamplingParams,
           rng: np.random.Generator, context: list[int], prompt_len: int) -> list[int]:
    """The tokens a verify step emits: the kept drafts, then one token from the target.

    ``logits`` ``[k + 1, vocab]`` are the target's rows for the last known token and the ``k`` drafts;
    ``draft_probs`` ``[k, vocab]`` the draft's distributions (``None``: point masses). ``context`` is the
    sequence so far (prompt + output), extended here by the emitted tokens for the penalties. Greedy:
    a draft is kept while it is the target's argmax, so the output is the non-speculative one.
    """
    k = len(draft)
    out: list[int] = []
    ctx = list(context)
    for i in range(k + 1):
        if params.greedy:
            tok = greedy_token(logits[i], params, ctx, prompt_len)
            out.append(tok)
            if i == k or tok != draft[i]:
                return out
        else:
            p = target_probs(logits[i], params, ctx, prompt_len)
            if i == k:  # every draft kept: the bonus token comes straight from the target
                out.append(int(rng.choice(p.size, p=p)))
                return out
            q = draft_probs[i] if draft_probs is not None else None
            tok = accept_or_resample(p, q, int(draft[i]), rng)
            if tok is not None:
                out.append(tok)
                return out
            out.append(int(draft[i]))
        ctx.append(out[-1])
    return out


# -- proposers -------------------------------------------------------------------------------------


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the last n-gram.

    The longest match wins (``n = max_n .. min_n``; longer matches predict better), the latest among
    equally long ones; ``[]`` without a match of at least ``min_n`` tokens. One vectorised comparison
    over the sequence finds where its last token occurred, then each longer n only filters those
    candidates: ~20 us for a 1000-token sequence, where ``n`` sliding-window scans cost ~0.5 ms, a
    quarter of a small model's decode step.
    """
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    ends = np.flatnonzero(arr[: size - 1] == arr[size - 1])  # earlier matches of the last 1-gram, by end
    best, n = (ends if min_n <= 1 else None), 1
    while ends.size and n < max_n:
        n += 1
        ends = ends[ends >= n - 1]
        ends = ends[arr[ends - (n - 1)] == arr[size - n]]
        if ends.size and n >= min_n:
            best = ends
    if best is None or not best.size:
        return []
    start = int(best[-1]) + 1
    return arr[start: start + k].tolist()


class NgramIndex:
    """Prompt lookup over one append-only sequence, kept up to date as its tokens arrive.

    For each ``n`` in ``[min_n, max_n]`` a dict maps every n-gram that ends before the last token to its
    latest end position; :meth:`propose` indexes the tokens that arrived since its last call, then looks
    the last n-gram up, longest first. It returns exactly what :func:`ngram_propose` returns for the same
    sequence, in ~2 us a step where that scan costs 10-20 us (300-1000 tokens): per decoding request per
    step, that scan was a tenth of a 3M-parameter model's step at batch 1 and a fifth at batch 8.
    Memory: ``max_n - min_n + 1`` dict entries per token (~0.4 KB per token at the default 1..4).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._indexed = 0  # the n-grams ending before this position are in the dicts

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching last n-gram.

        ``tokens`` must extend the sequence of the previous calls (tokens are only ever appended).
        """
        size = len(tokens)
        lo, hi = self.min_n, self.max_n
        start, stop = self._indexed, size - 1  # n-grams ending in [start, stop) became earlier ones: index them
        if stop - start > 8:  # a prompt: per n, zip builds the n-grams and dict.update keeps each one's latest end
            for n in range(lo, hi + 1):
                first = max(start, n - 1)
                if first < stop:
                    grams = zip(*(tokens[first - n + 1 + i: stop - n + 1 + i] for i in range(n)), strict=True)
                    self._ends[n - lo].update(zip(grams, range(first, stop), strict=True))
        else:
            for e in range(start, stop):
                gram = tuple(tokens[max(0, e - hi + 1): e + 1])
                for n in range(lo, min(hi, e + 1) + 1):
                    self._ends[n - lo][gram[len(gram) - n:]] = e
        self._indexed = max(start, stop)
        if k < 1:
            return []
        for n in range(min(hi, size - 1), lo - 1, -1):
            e = self._ends[n - lo].get(tuple(tokens[size - n:]))
            if e is not None:
                return list(tokens[e + 1: e + 1 + k])
        return []


class DraftProposer:
    """Proposes tokens with a draft engine: one sequence per target request in the draft's own KV pool.

    Each call first catches every draft sequence up with its request's tokens (rewinding what the
    target rejected, then computing the new tokens in one packed step), then runs one step per further
    draft token. Draft sequences of requests that stopped running are freed; a request the draft pool
    has no room for just gets no proposal (speculation never preempts anything).
    """

    def __init__(self, draft: Engine, target_vocab: int) -> None:
        if draft.vocab_size != target_vocab:
            raise LlmcError(f"SpeculativeConfig.draft_model {draft.path}: vocabulary of {draft.vocab_size} tokens, "
                            f"the target has {target_vocab}; the draft must use the target's tokenizer")
        self.engine = draft
        self.blocks = draft._blocks
        self.seconds = 0.0  # time in draft steps
        self.steps = 0
        self._known: set[int] = set()  # seq ids with a draft sequence

    def _run(self, seq_ids: list[int], counts: list[int]) -> np.ndarray:
        e = self.engine
        ids, pos, slots, tables, ctx, qsl = self.blocks.prepare_step(seq_ids, counts)
        feeds = {"input_ids": ids, "positions": pos, "slot_mapping": slots, "block_tables": tables,
                 "context_lens": ctx, "query_start_loc": qsl, "logits_indices": qsl[1:] - 1}
        if e._rope_lengths:
            feeds["rope_lengths"] = np.repeat(ctx, counts)
        t0 = time.perf_counter()
        logits = e._session.run(feeds, e._pool)
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.steps += 1
        for sid, n in zip(seq_ids, counts, strict=True):
            self.blocks.mark_computed(sid, n)
        return logits

    def _sync(self, r: Request) -> bool:
        """Make the draft sequence of ``r`` a prefix-consistent copy of ``r.tokens``; False if no room."""
        sid, b = r.seq_id, self.blocks
        if b.has_sequence(sid):
            have = b.sequence_tokens(sid)
            n = min(len(have), len(r.tokens))
            same = np.asarray(have[:n]) == np.asarray(r.tokens[:n])
            common = n if same.all() else int(np.argmin(same))
            if common == len(r.tokens) and b.num_computed(sid) >= common:
                # Nothing new since its last proposal (the step did not schedule the request): its last token is
                # computed again, for the logits that the first draft comes from.
                common -= 1
            if common == 0:
                b.free_sequence(sid)
            else:
                if common < len(have):
                    b.rewind(sid, common)
                for t in r.tokens[common:]:
                    b.append_token(sid, t)
                if b.append_slots(sid, len(r.tokens) - b.num_computed(sid)) is None:
                    b.free_sequence(sid)
                    return False
                return True
        return b.add_sequence(sid, list(r.tokens), len(r.tokens) - b.cached_prefix_tokens(r.tokens)) >= 0

    def propose(self, wanted: dict[int, tuple[Request, int]], running_ids: set[int]
                ) -> dict[int, tuple[list[int], np.ndarray | None]]:
        """Drafts for ``wanted`` (seq_id -> (request, k)): seq_id -> (tokens, probs ``[k, vocab]`` or None).

        ``probs`` are the draft's sampling distributions (for requests with ``temperature > 0``).
        """
        if not wanted:  # sequences of stopped requests are freed at the next proposal, when room is needed
            return {}
        b = self.blocks
        for sid in [s for s in self._known if s not in running_ids]:  # finished, cancelled or preempted
            if b.has_sequence(sid):
                b.free_sequence(sid)
            self._known.discard(sid)
        active = []
        for sid, (r, k) in wanted.items():
            if k > 0 and self._sync(r):
                self._known.add(sid)
                active.append((r, k))
            elif b.has_sequence(sid):
                b.free_sequence(sid)
                self._known.discard(sid)
        out: dict[int, tuple[list[int], list[np.ndarray]]] = {r.seq_id: ([], []) for r, _ in active}
        counts = [len(r.tokens) - b.num_computed(r.seq_id) for r, _ in active]
        while active:
            logits = self._run([r.seq_id for r, _ in active], counts)
            nxt = []
            for row, (r, k) in enumerate(active):
                toks, probs = out[r.seq_id]
                p = r.params
                ctx = r.tokens + toks
                if p.greedy:
                    tok = greedy_token(logits[row], p, ctx, r.prompt_len)
                else:
                    q = target_probs(logits[row], p, ctx, r.prompt_len)
                    tok = int(r.rng.choice(q.size, p=q))
                    probs.append(q)
                toks.append(tok)
                b.append_token(r.seq_id, tok)
                if len(toks) < k and b.append_slots(r.seq_id, 1) is not None:
                    nxt.append((r, k))
            active, counts = nxt, [1] * len(nxt)
        return {sid: (toks, np.stack(probs) if probs else None) for sid, (toks, probs) in out.items()}

    def release(self, seq_id: int) -> None:
        if self.blocks.has_sequence(seq_id):
            self.blocks.free_sequence(seq_id)
        self._known.discard(seq_id)

    def reset(self) -> None:
        """Free every draft sequence (the target's prefix cache was reset, or the engine is idle)."""
        for sid in list(self._known):
            if self.blocks.has_sequence(sid):
                self.blocks.free_sequence(sid)
        self._known.clear()


# -- adapting the number of drafts ------------------------------------------------------------------


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


class Speculator:
    """The engine's speculation: proposes drafts for decoding requests and verifies them after the step."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, draft: Engine | None = None) -> None:
        self.config = config
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
        if self._asleep or self._slept:
            if self._asleep and self._batch_key(running, waiting) == self._asleep_on:
                self._asleep -= 1
                self._slept += 1
                return
            for r in self._asleep_with:  # what choose() would have counted for them
                if r.spec is not None:
                    r.spec.idle_steps += self._slept
            self._asleep = self._slept = 0
            self._asleep_with = []
        decoding = [r for r in running if r.num_remaining == 1]
        cfg = self.config
        batch = max(1, len(decoding))
        costs = self._step_costs(batch)
        wanted: dict[int, tuple[Request, int]] = {}
        together = cfg.adaptive and batch > 1 and not waiting
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
        if wanted:
            got = self.draft.propose(wanted, {r.seq_id for r in running})
            for sid, (r, _) in wanted.items():
                if sid in got:
                    r.draft, r.draft_probs = got[sid]
                else:
                    r.spec.probing = False
        elif self.draft is not None and cfg.adaptive and decoding and len(decoding) == len(running):
            self._sleep(decoding, together, self._batch_key(running, waiting))

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
        return verify(logits, chunk.draft, chunk.draft_probs, r.params, r.rng, r.tokens, r.prompt_len)

    def release(self, r: Request) -> None:
        """``r`` finished: free its draft sequence now (its blocks are the draft pool's)."""
        if self.draft is not None:
            self.draft.release(r.seq_id)

    def reset(self) -> None:
        if self.draft is not None:
            self.draft.reset()
