"""Text from tokens: stream deltas that never split a character or leak a stop string; logprob token strings."""

from __future__ import annotations

from functools import lru_cache

from llmc.runtime.tokenizer import Tokenizer


class TextStream:
    """The text each new token adds to one choice.

    A token's text depends on its neighbours (a merged leading space, a character whose bytes span
    tokens), so each new token is decoded together with the tokens since the last clean cut: the delta is
    ``decode(window + new) - decode(window)``, held back while it ends in an incomplete UTF-8 character
    (the incremental detokenizer of TGI and vLLM; the cost per token stays constant however long the
    output). With stop strings the last ``len(longest stop) - 1`` characters are held back too: they could
    be the start of a stop string the engine cuts.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens  # False: keep them (tool formats whose markers are special tokens)
        self._ids: list[int] = []
        self._start = 0  # the window: tokens [start, read) are decoded into text already, read.. are new
        self._read = 0
        self._text = ""  # the output's text so far (complete characters only)
        self._shown = ""
        self._hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token_ids: list[int]) -> str:
        self._ids += token_ids
        before = self._tok.decode(self._ids[self._start:self._read], self._skip) if self._read > self._start else ""
        after = self._tok.decode(self._ids[self._start:], self._skip)
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""  # an incomplete character (or nothing new yet): wait for the next token
        self._text += after[len(before):]
        self._start, self._read = self._read, len(self._ids)
        return self._advance(self._text[: max(0, len(self._text) - self._hold)])

    def finish(self, final_text: str) -> str:
        """The rest of the text, given the engine's final text (cut before a stop string), in place of :meth:`add`
        for the last token: that token may complete a stop string that must not be shown."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self._shown) or not text.startswith(self._shown):
            # Decoding more tokens changed earlier text (rare normalisers); never re-send, never go back.
            return ""
        delta = text[len(self._shown):]
        self._shown = text
        return delta


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenStrings:
    """A token's text and its bytes, as OpenAI's logprobs show them (cached per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            data = list(text.encode())
            if "\ufffd" in text:  # part of a character: the raw bytes say which part
                raw = self._tok.id_to_token(token_id) or ""
                table = _byte_decoder()
                if raw and all(c in table for c in raw):
                    data = [table[c] for c in raw]
            hit = self._cache[token_id] = (text, data)
        return hit
