"""Draft-model proposer: a second, smaller llmc engine with the target's tokenizer, its own KV pool, driven step
by step beside the target."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.speculative.draft_source import DraftModel
from llmc.runtime.speculative.verification import greedy_token, target_probs

if TYPE_CHECKING:
    from llmc.runtime.core.request import Request


class DraftProposer:
    """Proposes tokens with a draft engine: one sequence per target request in the draft's own KV pool.

    Each call first catches every draft sequence up with its request's tokens (rewinding what the
    target rejected, then computing the new tokens in one packed step), then runs one step per further
    draft token. Draft sequences of requests that stopped running are freed; a request the draft pool
    has no room for just gets no proposal (speculation never preempts anything).
    """

    def __init__(self, draft: DraftModel, target_vocab: int) -> None:
        if draft.vocab_size != target_vocab:
            raise LlmcError(f"SpeculativeConfig.draft_model {draft.path}: vocabulary of {draft.vocab_size} tokens, "
                            f"the target has {target_vocab}; the draft must use the target's tokenizer")
        self.engine = draft
        self.blocks = draft.blocks
        self.seconds = 0.0  # time in draft steps
        self.steps = 0
        self._known: set[int] = set()  # seq ids with a draft sequence

    def _run(self, seq_ids: list[int], counts: list[int]) -> np.ndarray:
        e = self.engine
        ids, pos, slots, tables, ctx, qsl = self.blocks.prepare_step(seq_ids, counts)
        feeds = {"input_ids": ids, "positions": pos, "slot_mapping": slots, "block_tables": tables,
                 "context_lens": ctx, "query_start_loc": qsl, "logits_indices": qsl[1:] - 1}
        if e.rope_lengths:
            feeds["rope_lengths"] = np.repeat(ctx, counts)
        t0 = time.perf_counter()
        logits = e.session.run(feeds, e.pool)
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
