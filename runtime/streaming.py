"""Streaming: per-token outputs turned into :class:`~llmc.runtime.outputs.StreamEvent` s with the text each adds."""

from __future__ import annotations

from collections.abc import Iterator

from llmc.runtime.core.request import Request
from llmc.runtime.outputs import RequestOutput, StreamEvent
from llmc.runtime.tokenizer import Tokenizer


class TextDeltas:
    """Turns per-token outputs into stream events with the text each token adds."""

    def __init__(self, tokenizer: Tokenizer | None, reqs: list[Request]) -> None:
        self._tok = tokenizer
        self._reqs = reqs
        self._ids: list[list[int]] = [[] for _ in reqs]  # tokens delivered so far (the request may be ahead)
        self._shown = [""] * len(reqs)

    def events(self, i: int, o: RequestOutput) -> Iterator[StreamEvent]:
        """One event per new token (a speculative step can bring several); the last one carries ``finished``."""
        if not o.new_token_ids:
            yield StreamEvent(i, o.request_id, None, None, None, o.finished, o.finish_reason)
            return
        n = len(o.new_token_ids)
        for j, token in enumerate(o.new_token_ids):
            last = j == n - 1
            lps = [o.new_logprobs[j]] if o.new_logprobs else None
            yield from self._event(i, RequestOutput(o.request_id, [token], lps, o.finished and last,
                                                    o.finish_reason if last else None))

    def _event(self, i: int, o: RequestOutput) -> Iterator[StreamEvent]:
        self._ids[i] += o.new_token_ids
        text = None
        if self._tok is not None:
            r = self._reqs[i]
            if o.finished and o.finish_reason == "stop" and r.params.stop and r.text is not None:
                full = r.text  # cut before the stop string
            else:
                full = self._tok.decode(self._ids[i])
            # A token can end inside a multi-byte character; hold the text back until it completes.
            text = ""
            if not full.endswith("\ufffd") or o.finished:
                if full.startswith(self._shown[i]):
                    text = full[len(self._shown[i]) :]
                self._shown[i] = full
        lp = o.new_logprobs[0] if o.new_logprobs else None
        yield StreamEvent(i, o.request_id, o.new_token_ids[0], text, lp, o.finished, o.finish_reason)
