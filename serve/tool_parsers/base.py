"""What every tool-call parser shares: the call and result types, and the streaming base of the
marker-delimited families (content until a marker, then a call region parsed once it is complete)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.serve.tool_parsers.scan import partial_suffix, skip_ws


@dataclass
class ToolCall:
    """One call: the function's name and its arguments."""

    name: str
    arguments: str  # a JSON object's text


@dataclass
class Parsed:
    """What one :meth:`ToolParser.feed` or :meth:`ToolParser.finish` made certain."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


class ToolParser:
    """Base of the marker-delimited families: content until a marker, then a call region.

    Subclasses set ``markers`` and implement :meth:`region_end` (where the region that starts at a marker
    ends: an index, or None while it may go on) and :meth:`parse_region` (its calls, or None: content).
    ``at_start``: a call region may only open the answer (after whitespace, or right after another region).
    """

    markers: tuple[str, ...] = ()
    at_start = False
    needs_special_tokens = False  # the markers are special tokens: decode the output with them kept

    def __init__(self, tools: list[dict] | None = None, calls: bool = True) -> None:
        self.allow_calls = calls  # False: no tools were offered, so a call is only text (harmony's reasoning)
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if isinstance(t, dict)
                      and isinstance(t.get("function"), dict) and "name" in t["function"]}
        self._buf = ""
        self._pos = 0  # text before this is decided
        self._region: int | None = None  # start of an open call region
        self._closed = False  # at_start families: no call can come any more
        self._after_region = False
        self._scan: dict = {}  # json_end's progress in the open region
        self._ws = ""  # content's trailing whitespace, held: dropped if a call follows it
        self._trim = False  # a call was the last thing: drop the whitespace that follows it

    def _say(self, out: Parsed, text: str) -> None:
        """Content, less the whitespace that only separates it from calls."""
        if self._trim:
            text = text.lstrip()
            if not text:
                return
            self._trim = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        out.content += body

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._advance(final=False)

    def finish(self, truncated: bool = False) -> Parsed:
        """The rest. ``truncated``: the text was cut (max_tokens), so an open call is content, not a call."""
        out = self._advance(final=not truncated)
        if self._region is not None:
            rest = self._buf[self._region:]
            calls = None if truncated else self.parse_region(rest, final=True)
            if calls is None:
                self._say(out, rest)
            else:
                out.calls += calls
                self._ws, self._trim = "", True
            self._region = None
        elif self._pos < len(self._buf):
            self._say(out, self._buf[self._pos:])
        if not self._trim:
            out.content += self._ws
        self._ws = ""
        self._pos = len(self._buf)
        return out

    def _advance(self, final: bool) -> Parsed:
        out, buf = Parsed(), self._buf
        while True:
            if self._region is None:
                start = self._find_start(buf, final)
                if start is None:  # nothing decided past what may still become a marker
                    break
                i, is_region = start
                self._say(out, buf[self._pos:i])
                self._pos = i
                if not is_region:
                    break
                self._region = i
            end = self.region_end(buf, self._region, final)
            if end is None:
                break
            calls = self.parse_region(buf[self._region:end], final=True)
            if calls is None:
                self._say(out, buf[self._region:end])
                self._closed = self.at_start
            else:
                out.calls += calls
                self._ws, self._trim = "", True
                self._after_region = True
            self._pos, self._region = end, None
        return out

    def _find_start(self, buf: str, final: bool) -> tuple[int, bool] | None:
        """(index, True) where a region starts; (index, False): text up to index is content and no region
        starts yet; None: nothing new is decided."""
        if self._closed:
            return (len(buf), False)
        if self.at_start:
            j = skip_ws(buf, self._pos)
            if j == len(buf):  # only whitespace so far: it may precede a call
                return (len(buf), False) if final else None
            for m in self.markers:
                if buf.startswith(m, j):
                    if self._after_region:
                        self._pos = j  # the whitespace between calls is no content
                    return (j, True)
                if m.startswith(buf[j:]) and not final:
                    return None
            k = self.continue_after_region(buf, j, final) if self._after_region else None
            if k == -1:
                return None
            if k is not None:
                self._pos = k  # the separator is no content either
                return (k, True)
            self._closed = True
            return (len(buf), False)
        best = None
        for m in self.markers:
            k = buf.find(m, self._pos)
            if k >= 0 and (best is None or k < best):
                best = k
        if best is not None:
            return (best, True)
        hold = 0 if final else partial_suffix(buf[self._pos:], self.markers)
        return (len(buf) - hold, False)

    def continue_after_region(self, buf: str, j: int, final: bool) -> int | None:
        """at_start families: where a further region starts after a call (e.g. after ``;``), -1 to wait."""
        return None

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        raise NotImplementedError

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        raise NotImplementedError
