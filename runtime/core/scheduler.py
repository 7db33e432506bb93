"""The scheduler: which requests compute which tokens in each step.

Policy (continuous batching with chunked prefill, as in vLLM's scheduler):

- Each step has a token budget (``max_num_tokens``). Running requests are served first, those
  decoding (one token to compute) before those still prefilling, each group in admission order,
  so a long prompt never takes the budget away from running decodes. Prefills take what is left
  of the budget, in chunks (``enable_chunked_prefill``); with chunking off, a prompt is computed
  in one step or waits. ``max_prefill_tokens_with_decodes`` optionally caps the prefill tokens of
  a step that also carries decodes, so a long prompt cannot stretch the running requests'
  inter-token latency (a 2k-token prompt chunked into 2k-token steps stalls every decode by a
  whole prefill); steps without decodes still use the whole budget.
- Waiting requests are admitted first-come-first-served between steps while budget, sequence
  slots (``max_num_seqs``) and KV blocks allow; finished and cancelled requests leave at once.
  The waiting queue is bounded (``max_waiting``): a full queue rejects new requests with an
  ``LlmcError`` instead of growing without limit.
- Multi-LoRA engines (``Scheduler.lora``): a request for an adapter takes one of the engine's adapter slots when
  admitted and gives it back when it leaves the running list. When every slot is held by running requests for
  other adapters, it keeps its place in the queue and the requests behind it are admitted past it (as vLLM's
  scheduler skips them); it is tried first again at every step.
- Prefix caching: an admitted request reuses every cached full block of its tokens (see the
  block manager), and computes only the rest. When the next block of a waiting request's prefix
  is being computed right now by a running request (requests sharing a system prompt arrive
  together), the queue waits for it instead of computing the same block twice.
- Preemption by recompute: when a running request needs a block and none is free, the most
  recently admitted running request is preempted (its blocks are freed; it goes back to the front
  of the waiting queue keeping its generated tokens, and is recomputed when readmitted — cheaply,
  when its blocks are still in the prefix cache). The oldest request is never preempted by a
  younger one, so it always progresses. Nothing is admitted in a step that preempted.
- A request that cannot fit even alone in the pool is rejected when submitted, saying how many
  blocks it needs.
- Speculative decoding (``runtime/speculative/``): a decoding request that carries draft tokens
  (``Request.draft``, proposed by the engine before the step) computes its last token and the drafts
  in one chunk, within the same budget as everything else; drafts are trimmed to the budget and
  dropped when their slots would need a preemption (speculation never preempts). After the step,
  :meth:`Scheduler.accept_draft` keeps the accepted drafts and rewinds the rest out of the sequence.
- Rotary recompute (``rope_recompute_at``, engines with ``longrope`` rotary factors): a sequence's
  factors depend on its length, short up to ``rope_recompute_at`` tokens and long beyond. When a
  running request whose KV was computed with the short factors grows past it, its blocks are freed
  and it goes back to the front of the waiting queue, to be recomputed with the long factors, as
  transformers drops the cache at that point. This is not a preemption: it does not block admission.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.core.block_manager import BlockManager, hash_block
from llmc.runtime.core.request import Request, RequestStatus
from llmc.runtime.sampling.sampler import SamplingParams


@dataclass
class SchedulerConfig:
    """Limits of the scheduler. Token counts are tokens of all requests together."""

    max_num_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running requests at most
    max_waiting: int = 1024  # waiting requests at most (back-pressure); preempted requests always requeue
    enable_chunked_prefill: bool = True
    # Prefill tokens allowed in a step that also decodes (None: the whole budget). Needs chunking.
    max_prefill_tokens_with_decodes: int | None = None
    enable_prefix_caching: bool = True  # the block manager's setting; kept here for reporting
    # Blocks kept free when admitting a request while others run, so running decodes do not have to
    # preempt the newcomer at once (a fraction of the pool).
    admission_watermark: float = 0.01
    # Engines with length-dependent rotary factors (manifest engine.rope_recompute_at): recompute a
    # sequence's KV when it grows past this many tokens. None: never.
    rope_recompute_at: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "max_num_seqs", "max_waiting"):
            if getattr(self, name) < 1:
                raise LlmcError(f"SchedulerConfig.{name}={getattr(self, name)}: must be at least 1")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and (cap < 1 or not self.enable_chunked_prefill):
            raise LlmcError(
                f"SchedulerConfig.max_prefill_tokens_with_decodes={cap}: must be at least 1 and needs "
                "enable_chunked_prefill=True (or pass None to let prefills use the whole step budget)"
            )


@dataclass
class ScheduledChunk:
    """``request`` computes its tokens ``[start, start + num_tokens)`` in this step."""

    request: Request
    start: int
    num_tokens: int
    # Draft tokens computed after the last known token (speculative decoding), and their distributions.
    draft: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last known token, whose logits pick the next token."""
        return self.start + self.num_tokens - len(self.draft) == len(self.request.tokens)


@dataclass
class SchedulerOutput:
    """What one step computes. ``copies`` are (src, dst) KV block copies to do first (copy-on-write)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerCounters:
    """Cumulative counts since the scheduler was created."""

    num_preemptions: int = 0
    num_steps: int = 0
    prompt_tokens_computed: int = 0  # prompt positions computed (not served by the prefix cache)
    recomputed_tokens: int = 0  # output positions computed again after a preemption or a rotary recompute
    rope_recomputes: int = 0  # requests whose KV was recomputed on crossing rope_recompute_at
    decode_tokens: int = 0
    spec_draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of which accepted
    spec_verify_steps: int = 0  # verify chunks (one per speculating request per step)
    admitted_prompt_tokens: int = 0  # prompt tokens of first admissions
    cached_prompt_tokens: int = 0  # of which served by the prefix cache


class Scheduler:
    """Decides each step's chunks; owns the waiting queue and the running list."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        if config.rope_recompute_at is not None and blocks.enable_prefix_caching:
            # Cached blocks are keyed by tokens alone, but their K depends on the rotary factors in use.
            raise LlmcError("SchedulerConfig.rope_recompute_at needs a block manager without prefix caching: "
                            "a cached block's keys depend on whether its sequence used short or long rotary factors")
        self.config = config
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        # Hash of a full prompt block -> the running request that is computing it (prefix caching).
        self._inflight: dict[int, Request] = {}
        # Multi-LoRA engines: the adapter slots (llmc.runtime.lora.slots.LoraSlots). A request for an adapter takes a
        # slot when admitted and gives it back when it leaves the running list; with every slot held it waits.
        self.lora = None

    # -- requests in and out ---------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` computed tokens occupies."""
        return -(-num_tokens // self.block_size)

    def check_fits(self, prompt_len: int, params: SamplingParams, label: str) -> None:
        """Raise ``LlmcError`` if a request could never run, even alone."""
        # The last generated token is never fed back, so it needs no KV slot.
        tokens = prompt_len + params.max_tokens - 1
        need = self.blocks_needed(tokens)
        if need > self.blocks.num_blocks:
            raise LlmcError(
                f"{label}: {prompt_len} prompt + {params.max_tokens} new tokens need {need} KV blocks of "
                f"{self.block_size} tokens but the pool has {self.blocks.num_blocks}; raise kv_cache_tokens "
                "or lower max_tokens"
            )
        if not self.config.enable_chunked_prefill and tokens > self.config.max_num_tokens:
            raise LlmcError(
                f"{label}: {prompt_len} prompt + {params.max_tokens} new tokens can need {tokens} tokens in one "
                f"step (recompute after preemption) but max_num_tokens is {self.config.max_num_tokens} and chunked "
                "prefill is off; enable chunked prefill or raise max_num_tokens"
            )

    def add(self, request: Request) -> None:
        """Queue a new request (FCFS). Raises ``LlmcError`` when it can never fit or the queue is full."""
        if request.request_id in self.requests:
            raise LlmcError(f"request id {request.request_id!r} is already in use; pick another")
        self.check_fits(request.prompt_len, request.params, f"request {request.request_id}")
        if len(self.waiting) >= self.config.max_waiting:
            raise LlmcError(
                f"request {request.request_id}: the waiting queue is full ({len(self.waiting)} requests, "
                f"max_waiting={self.config.max_waiting}); retry when requests finish, or raise max_waiting"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` (stop, length, cancelled) and return its blocks to the pool at once."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_lora(request)
        else:
            self.waiting.remove(request)
        if self.blocks.has_sequence(request.seq_id):
            self.blocks.free_sequence(request.seq_id)
        self._forget_inflight(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks, reserving their KV slots (preempting when blocks run out)."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_tokens
        scheduled: dict[int, ScheduledChunk] = {}  # by id(request), in scheduling order
        at = cfg.rope_recompute_at
        if at is not None:
            for r in reversed([r for r in self.running if r.admitted_len <= at < len(r.tokens)]):
                self._requeue(r)
                self.counters.rope_recomputes += 1

        decoding = [r for r in self.running if r.num_remaining == 1]
        prefilling = [r for r in self.running if r.num_remaining > 1]
        prefill_cap: int | None = None  # set once the decodes are in
        for r in decoding + prefilling:
            if prefill_cap is None and r.num_remaining > 1:
                prefill_cap = self._prefill_cap(len(scheduled), budget)
                budget = min(budget, prefill_cap)
            if budget == 0:
                break
            if r.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(r.num_remaining, budget)
            if n < r.num_remaining and not cfg.enable_chunked_prefill:
                continue
            n = fit_chunk(r.atomic_spans, r.num_computed, n, budget)
            if n == 0:
                continue
            draft, draft_probs, copies = self._take_draft(r, budget)
            if draft:
                n += len(draft)
            while copies is None and (copies := self.blocks.append_slots(r.seq_id, n)) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                chunk = scheduled.pop(id(victim), None)
                if chunk is not None:
                    budget += chunk.num_tokens
                if victim is r:
                    break
            if copies is None:
                continue
            out.copies += copies
            scheduled[id(r)] = ScheduledChunk(r, r.num_computed, n, draft, draft_probs)
            budget -= n

        if prefill_cap is None:
            budget = min(budget, self._prefill_cap(len(scheduled), budget))
        if not out.preempted:
            self._admit(out, scheduled, budget)
        out.chunks = list(scheduled.values())
        return out

    def _take_draft(self, r: Request, budget: int) -> tuple[list[int], np.ndarray | None, list | None]:
        """Reserve the slots of ``r``'s drafts (trimmed to the budget): (drafts, probs, copies or None).

        The drafts join the block manager's copy of the sequence (not ``r.tokens``) so that the step
        feeds them; when their slots are short they are dropped instead of preempting anyone.
        """
        draft, probs = r.draft, r.draft_probs
        r.draft, r.draft_probs = [], None
        if not draft or r.num_remaining != 1 or budget < 2:
            return [], None, None
        draft = draft[: budget - 1]
        for t in draft:
            self.blocks.append_token(r.seq_id, t)
        copies = self.blocks.append_slots(r.seq_id, 1 + len(draft))
        if copies is None:
            self.blocks.rewind(r.seq_id, len(r.tokens))
            return [], None, None
        return draft, (probs[: len(draft)] if probs is not None else None), copies

    def accept_draft(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """After a verify step: keep the first ``num_accepted`` drafts' KV, rewind the rest away.

        The block manager's sequence keeps ``r.tokens`` plus the accepted drafts, all computed; the
        caller appends the accepted drafts to ``r.tokens`` (token by token, checking stops) with
        :meth:`extend_accepted`, then the token sampled after them with :meth:`append_token`.
        """
        r = chunk.request
        if r.finished:
            return
        keep = chunk.start + chunk.num_tokens - len(chunk.draft) + num_accepted
        self.blocks.rewind(r.seq_id, keep)
        r.num_computed = keep
        self.counters.spec_draft_tokens += len(chunk.draft)
        self.counters.spec_accepted_tokens += num_accepted
        self.counters.spec_verify_steps += 1

    def extend_accepted(self, r: Request, token: int) -> None:
        """Append an accepted draft to ``r.tokens`` (the block manager already holds it)."""
        r.tokens.append(token)

    def _prefill_cap(self, decodes_scheduled: int, budget: int) -> int:
        cap = self.config.max_prefill_tokens_with_decodes
        return budget if cap is None or decodes_scheduled == 0 else min(budget, cap)

    def _admit(self, out: SchedulerOutput, scheduled: dict[int, ScheduledChunk], budget: int) -> None:
        cfg = self.config
        watermark = int(cfg.admission_watermark * self.blocks.num_blocks)
        skipped: list[Request] = []  # waiting for a LoRA slot: they keep their place, those behind them go on
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            r = self.waiting[0]
            cached = self.blocks.cached_prefix_tokens(r.tokens, r.cache_root)
            remaining = len(r.tokens) - cached
            n = min(remaining, budget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break  # FCFS: nobody overtakes the head of the queue
            n = fit_chunk(r.atomic_spans, cached, n, budget)
            if n == 0:
                break
            if self._prefix_in_flight(r, cached):
                break  # the block is computed in this step; reuse it next step
            if self.running:
                new_blocks = self.blocks_needed(cached + n) - cached // self.block_size
                if self.blocks.num_free_blocks - new_blocks < watermark:
                    break
            slot = 0
            if r.params.lora is not None and self.lora is not None:
                slot = self.lora.acquire(r.params.lora)
                if not slot:  # every adapter slot is held by running requests: it waits for one
                    skipped.append(self.waiting.popleft())
                    continue
            if self.blocks.add_sequence(r.seq_id, r.tokens, n, r.cache_root) < 0:
                if slot:
                    self.lora.release(slot)
                break
            r.lora_slot = slot
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            r.num_computed = cached
            r.admitted_len = len(r.tokens)
            self.running.append(r)
            if r.num_preemptions == 0:
                self.counters.admitted_prompt_tokens += r.prompt_len
                self.counters.cached_prompt_tokens += min(cached, r.prompt_len)
                r.num_cached_tokens = cached
            out.admitted.append(r)
            scheduled[id(r)] = ScheduledChunk(r, cached, n)
            budget -= n
            if self.blocks.enable_prefix_caching:
                for h in self._block_hashes(r)[cached // self.block_size :]:
                    self._inflight.setdefault(h, r)
        self.waiting.extendleft(reversed(skipped))

    def _block_hashes(self, r: Request) -> list[int]:
        """Chained hashes of the blocks of ``r`` the prefix cache can serve (full, before the last token)."""
        if r._hashes is None or r._hashes[0] != len(r.tokens):
            bs, hashes, parent = self.block_size, [], r.cache_root
            for i in range((len(r.tokens) - 1) // bs):
                parent = hash_block(parent, r.tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
            r._hashes = (len(r.tokens), hashes)
        return r._hashes[1]

    def _prefix_in_flight(self, r: Request, cached: int) -> bool:
        if not self._inflight:
            return False
        hashes = self._block_hashes(r)
        k = cached // self.block_size
        owner = self._inflight.get(hashes[k]) if k < len(hashes) else None
        return owner is not None and owner is not r

    def _forget_inflight(self, r: Request) -> None:
        if self._inflight:
            for h in [h for h, owner in self._inflight.items() if owner is r]:
                del self._inflight[h]

    def _preempt(self, r: Request, out: SchedulerOutput) -> None:
        self._requeue(r)
        r.num_preemptions += 1
        self.counters.num_preemptions += 1
        out.preempted.append(r)

    def _requeue(self, r: Request) -> None:
        """Free the blocks of running ``r`` and put it at the front of the queue, to be computed again."""
        self.running.remove(r)
        self._release_lora(r)
        self.blocks.free_sequence(r.seq_id)
        r.num_computed = 0
        r.draft, r.draft_probs = [], None
        r.status = RequestStatus.WAITING
        self._forget_inflight(r)
        self.waiting.appendleft(r)  # it arrived before everything still waiting

    def _release_lora(self, r: Request) -> None:
        if r.lora_slot:
            self.lora.release(r.lora_slot)
            r.lora_slot = 0

    def complete(self, out: SchedulerOutput) -> None:
        """The step ran: its chunks' KV is in the cache."""
        c = self.counters
        c.num_steps += 1
        for chunk in out.chunks:
            r, start, n = chunk.request, chunk.start, chunk.num_tokens
            if r.finished:  # cancelled while the step ran
                continue
            self.blocks.mark_computed(r.seq_id, n)
            r.num_computed = start + n
            if self._inflight:  # blocks this chunk completed are in the prefix cache now
                for h in self._block_hashes(r)[start // self.block_size : r.num_computed // self.block_size]:
                    if self._inflight.get(h) is r:
                        del self._inflight[h]
            prompt = max(0, min(start + n, r.prompt_len) - start)
            # The last known token, once it is an output token, is the decode token of this step;
            # output tokens before it are being recomputed after a preemption.
            decode = int(chunk.samples and len(r.tokens) > r.prompt_len)
            c.prompt_tokens_computed += prompt
            c.decode_tokens += decode
            c.recomputed_tokens += n - prompt - decode - len(chunk.draft)

    def append_token(self, r: Request, token: int) -> None:
        r.tokens.append(token)
        self.blocks.append_token(r.seq_id, token)


def fit_chunk(spans: list[tuple[int, int]] | None, start: int, n: int, budget: int) -> int:
    """The tokens a chunk computing ``[start, start + n)`` may take so that it ends inside none of ``spans`` (sorted,
    disjoint ``[a, b)``): cut back to a span's start, or, where it starts inside one (after a prefix-cache hit), run
    to that span's end if ``budget`` allows; 0: not this step."""
    for a, b in spans or ():
        end = start + n
        if a < end < b:
            n = a - start if a > start else (b - start if b - start <= budget else 0)
    return n
