"""One engine step: schedule, run the worker on the packed chunks, sample, book the tokens and retire requests.

:class:`Stepper` holds what a step touches (scheduler, worker, KV pool and blocks, state slots, LoRA slots) and
what steps accumulate (tokens generated, busy time, finished requests kept for ``Engine.result``). The engine
sets ``speculator`` (drafts proposed before, verified after) and ``structured`` (constrained requests' masks);
both are used through their methods only, so this module imports neither.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from llmc.runtime.core.request import Request
from llmc.runtime.core.scheduler import Scheduler, SchedulerOutput
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.sampling.sampler import SampleRow, sample, token_logprobs
from llmc.runtime.tokenizer import Tokenizer


class Stepper:
    """Runs :meth:`step`; the engine calls it under its lock. ``lora_feed`` says how the worker takes the LoRA
    slot buffers (``"device"``, ``"ortvalue"`` or ``"numpy"``, see ``LoraSlots.bind``)."""

    def __init__(self, scheduler: Scheduler, session: Any, pool: Any, blocks: Any, state: Any, lora: Any,
                 lora_feed: str, eos_token_ids: list[int], tokenizer: Tokenizer | None, rope_lengths: bool) -> None:
        self.scheduler = scheduler
        self.session = session
        self.pool = pool
        self.blocks = blocks
        self.state = state
        self.lora = lora
        self.lora_feed = lora_feed
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.rope_lengths = rope_lengths
        self.speculator: Any = None  # a Speculator, set by the engine
        self.structured: Any = None  # a StructuredRuntime, made by the engine for the first constrained request
        self.images: Any = None  # an ImageInputs (llmc.runtime.image_inputs) of an engine that takes images
        self.last_schedule: SchedulerOutput | None = None  # the latest step's decisions, for inspection
        self.generated = 0  # tokens generated
        self.busy = 0.0  # seconds in steps
        self.retain: set[str] = set()  # ids from submit(): kept when finished until result() reads them
        self.done: dict[str, Request] = {}

    def step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Run one scheduler step; appends what each affected request produced to ``outputs`` and returns it."""
        if not self.scheduler.has_work():
            return outputs
        t0 = time.perf_counter()
        self._propose()
        sched = self.scheduler.schedule()
        self.last_schedule = sched
        if not sched.chunks:
            if not self.scheduler.running:  # nothing runs and nothing could start: would spin forever
                waiting = len(self.scheduler.waiting)
                raise RuntimeError(f"scheduler made no progress with {waiting} waiting requests and none "
                                   "running (a bug: please report it)")
            return outputs
        self.pool.copy_blocks(sched.copies)
        chunks = sched.chunks
        sampling = [c for c in chunks if c.samples]
        feeds = self._feeds(sched)
        # Constrained requests' token masks (one per verified position), computed while the forward pass runs.
        masks = self.structured.start_masks([(c.request, c.draft) for c in sampling]) if self.structured else None
        # Whole decode/verify steps (proposals and verification included; prefill chunks cost another
        # amount per token) feed the cost model that sizes the drafts. Decided now: sampling changes tokens.
        # (Every chunk has num_tokens >= 1 + len(draft), with equality only for decodes, which all sample; a
        # step is decode-only exactly when it has one logits row per token.)
        num_tokens = len(feeds["input_ids"])
        pure = self.speculator is not None and num_tokens == len(feeds["logits_indices"])
        if self.session.samples_on_device:
            picked, host = self._sample_on_device(sampling, feeds)
        else:
            picked, host = {}, self.session.run(feeds, self.pool, state=self.state_arrays())
        self.scheduler.complete(sched)
        now = time.perf_counter()
        at = 0  # host rows: every sampling chunk's but those sampled on the device, in order
        for i, chunk in enumerate(sampling):
            if i in picked:
                outputs.append(self._emit(chunk.request, *picked[i], now))
                continue
            n = 1 + len(chunk.draft)
            if chunk.draft:
                outputs.append(self._accept_draft(chunk, host[at: at + n], now, masks))
            else:
                outputs.append(self._accept(chunk.request, host[at], now, masks))
            at += n
        if pure:
            self.speculator.observe_step(num_tokens, len(chunks), time.perf_counter() - t0)
        self.busy += time.perf_counter() - t0
        return outputs

    def _propose(self) -> None:
        """Drafts for decoding requests, consumed by schedule(); a constrained request's end where its grammar says."""
        if self.speculator is None:
            return
        self.speculator.propose(self.scheduler.running, len(self.scheduler.waiting))
        if self.structured is not None:
            for r in self.scheduler.running:
                if r.draft:
                    r.draft, r.draft_probs = self.structured.filter_draft(r, r.draft, r.draft_probs)

    def _feeds(self, sched: SchedulerOutput) -> dict[str, np.ndarray]:
        """The worker's inputs for the step's chunks: tokens, positions, slots, block tables, one logits row per
        sampling chunk (a verify chunk needs all of its 1 + k rows), LoRA slots, rotary lengths, state slots."""
        chunks = sched.chunks
        state_slots = None
        if self.state is not None:  # preempted sequences start over (from a zero state) when readmitted
            for r in sched.preempted:
                self.state.release(r.seq_id)
            state_slots = np.asarray([self.state.slot_of(c.request.seq_id) for c in chunks], np.int64)
        ids, pos, slots, tables, ctx, qsl = self.blocks.prepare_step(
            [c.request.seq_id for c in chunks], [c.num_tokens for c in chunks])
        rows = np.concatenate([np.arange(qsl[i + 1] - 1 - len(c.draft), qsl[i + 1], dtype=np.int64)
                               for i, c in enumerate(chunks) if c.samples] or [np.zeros(0, np.int64)])
        feeds = {"input_ids": ids, "positions": pos, "slot_mapping": slots, "block_tables": tables,
                 "context_lens": ctx, "query_start_loc": qsl, "logits_indices": rows}
        if self.lora is not None:
            self.lora.bind(feeds, [c.request.lora_slot for c in chunks], [c.num_tokens for c in chunks],
                           self.lora_feed)
        if self.rope_lengths:
            feeds["rope_lengths"] = np.repeat(np.asarray([len(c.request.tokens) for c in chunks], np.int64),
                                              [c.num_tokens for c in chunks])
        if state_slots is not None:
            feeds["state_slots"] = state_slots
        if self.images is not None:
            feeds.update(self.images.feeds(chunks, qsl))
        return feeds

    def _sample_on_device(self, sampling: list, feeds: dict[str, np.ndarray]
                          ) -> tuple[dict[int, tuple[int, dict[int, float] | None]], np.ndarray | None]:
        """Run the step on a session that samples where its logits are (the CUDA engine's).

        Plain rows (no drafts, no constraint) are sampled there in one batch, and only their token ids
        (and the logprobs asked for) come back: ``{chunk index: (token, logprobs)}``. The other chunks'
        rows (verify chunks, constrained rows) come back as host logits, in order, for the numpy path.
        Each sampled row's uniform comes from its request's own generator, as the numpy sampler draws it,
        so a seed gives the same tokens on either path.
        """
        logits = self.session.run_device(feeds, self.pool)
        starts = np.cumsum([0] + [1 + len(c.draft) for c in sampling])
        plain = [i for i, c in enumerate(sampling) if not c.draft and c.request.params.structured is None]
        rows = []
        for i in plain:
            r = sampling[i].request
            p = r.params
            rows.append(SampleRow(int(starts[i]), p, r.tokens if p.uses_history else (), r.prompt_len,
                                  None if p.greedy else float(r.rng.random())))
        tokens, lps = self.session.sample(logits, rows)
        picked = {i: (t, lp) for i, t, lp in zip(plain, tokens, lps, strict=True)}
        host_idx = [int(j) for i in range(len(sampling)) if i not in picked for j in range(starts[i], starts[i + 1])]
        return picked, self.session.host_rows(logits, host_idx) if host_idx else None

    def _accept_draft(self, chunk, logits: np.ndarray, now: float, masks=None) -> RequestOutput:
        """A verify chunk's ``[1 + k, vocab]`` logits: emit the kept drafts and one more token, in order.

        A constrained request's rows are masked first (row ``i``: what its grammar allows after the first
        ``i`` drafts); the rows after the first forbidden draft stay as they are, as verification rejects
        that draft at the latest and never reads them.
        """
        r, p = chunk.request, chunk.request.params
        allowed = self.structured.allowed(masks, r) if masks is not None else None
        model_logits = logits
        if allowed is not None:
            if not self.structured.usable(r, allowed):  # never verify unconstrained
                return self._constraint_failed(r, now)
            if p.logprobs is not None:  # logprobs stay the model's own distribution
                logits = logits.copy()
            for i, words in enumerate(allowed):
                self.structured.apply(words, logits[i], in_place=True)
        emitted = self.speculator.verify(chunk, logits)
        kept = len(emitted) - 1
        self.scheduler.accept_draft(chunk, kept)
        self.speculator.record(r, len(chunk.draft), kept)
        new: list[int] = []
        lps: list[dict[int, float]] = []
        reason = None
        for i, token in enumerate(emitted):
            lp = token_logprobs(model_logits[i], token, p.logprobs) if p.logprobs is not None else None
            if i < kept:
                self.scheduler.extend_accepted(r, token)
            else:
                self.scheduler.append_token(r, token)
            new.append(token)
            if lp is not None:
                lps.append(lp)
            structured = self.structured.advance(r, token, self.eos_token_ids) if allowed is not None else None
            reason = self._record(r, token, lp, now, structured)
            if reason is not None:  # a stop among the drafts: the tokens after it were never generated
                self.finish(r, reason, now)
                break
        return RequestOutput(r.request_id, new, lps if p.logprobs is not None else None, reason is not None, reason)

    def _record(self, r: Request, token: int, lp: dict[int, float] | None, now: float,
                structured: str | None = None) -> str | None:
        """Book one token that is already in ``r.tokens``; returns the finish reason it causes, if any
        (``structured``: what the request's constraint matcher says after this token, if it has one)."""
        p = r.params
        self.generated += 1
        if r.first_token_time is None:
            r.first_token_time = now
        r.token_times.append(now)
        if lp is not None:
            r.logprobs.append(lp)
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(r):
            if self.structured is not None:  # complete or not: judged on the text returned
                self.structured.cut(r, r.text)
            return "stop"
        if structured is not None:  # "stop": the structure is complete; "error": its matcher failed
            return structured
        if len(r.tokens) - r.prompt_len >= p.max_tokens:
            return "length"
        return None

    def _accept(self, r: Request, logits: np.ndarray, now: float, masks=None) -> RequestOutput:
        p = r.params
        allowed = self.structured.allowed(masks, r) if masks is not None else None
        token = None
        if allowed is not None:
            if not self.structured.usable(r, allowed):  # never sample unconstrained
                return self._constraint_failed(r, now)
            if p.greedy and not p.uses_history:
                # The model's own first argmax, when the grammar allows it, is the masked argmax too (every
                # allowed token before it scores strictly less): no pass over the row.
                top = int(logits.argmax())
                token = top if self.structured.allows(allowed[0], top) else None
            if token is None:
                # In place unless logprobs, which stay the model's own distribution, still need the row.
                masked = self.structured.apply(allowed[0], logits, in_place=p.logprobs is None)
                token = sample(masked, p, r.rng, r.tokens if p.uses_history else (), r.prompt_len)
        else:
            token = sample(logits, p, r.rng, r.tokens if p.uses_history else (), r.prompt_len)
        lp = token_logprobs(logits, token, p.logprobs) if p.logprobs is not None else None
        return self._emit(r, token, lp, now, allowed)

    def _emit(self, r: Request, token: int, lp: dict[int, float] | None, now: float,
              allowed: np.ndarray | None = None) -> RequestOutput:
        """Append the token chosen for ``r`` (``allowed``: its constraint's mask rows, if it has one)."""
        self.scheduler.append_token(r, token)
        structured = self.structured.advance(r, token, self.eos_token_ids) if allowed is not None else None
        reason = self._record(r, token, lp, now, structured)
        if reason is not None:
            self.finish(r, reason, now)
        return RequestOutput(r.request_id, [token], [lp] if lp is not None else None, reason is not None, reason)

    def _constraint_failed(self, r: Request, now: float) -> RequestOutput:
        """End ``r`` with ``"error"``: its constraint's mask is missing or empty (never sample unconstrained)."""
        self.finish(r, "error", now)
        return RequestOutput(r.request_id, [], [] if r.params.logprobs is not None else None, True, "error")

    def state_arrays(self) -> list[np.ndarray] | None:
        return self.state.arrays if self.state is not None else None

    def finish(self, r: Request, reason: str, now: float) -> None:
        self.scheduler.finish(r, reason)
        if self.state is not None:
            self.state.release(r.seq_id)
        if self.speculator is not None:
            self.speculator.release(r)
        if self.structured is not None:
            self.structured.finish(r, reason)
        r.finish_time = now
        if r.request_id in self.retain:
            self.retain.discard(r.request_id)
            self.done[r.request_id] = r

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.output_token_ids)
        # Only the tail can hold a stop string that this token completed.
        start = max(0, len(r.text or "") - max(len(s) for s in r.params.stop))
        r.text = text
        hits = [i for i in (text.find(s, start) for s in r.params.stop) if i >= 0]
        if hits:
            r.text = text[: min(hits)]
            return True
        return False
