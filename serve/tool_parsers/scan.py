"""Text scanning for streamed tool calls: where a JSON value or a Python list ends, and what end of a text may
still grow into a marker (held back until the next chunk decides it)."""

from __future__ import annotations


def json_end(s: str, i: int, memo: dict | None = None) -> int | None:
    """The index after the JSON object or array opening at ``s[i]`` (braces inside strings are text);
    None while it is incomplete; -1 if ``s[i]`` opens neither. ``memo``: where an earlier call on a
    shorter ``s`` (the same text, grown) stopped, so a stream scans each character once."""
    if i >= len(s) or s[i] not in "{[":
        return -1
    depth, in_str, esc, start = 0, False, False, i
    if memo is not None and memo.get("i") == i:
        depth, in_str, esc, start = memo["depth"], memo["in_str"], memo["esc"], memo["pos"]
    for j in range(start, len(s)):
        ch = s[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    if memo is not None:
        memo.update(i=i, depth=depth, in_str=in_str, esc=esc, pos=len(s))
    return None


def python_end(s: str, i: int) -> int | None:
    """As :func:`json_end` for a Python list/call expression (quotes ' and \", brackets of every kind)."""
    if i >= len(s) or s[i] != "[":
        return -1
    depth, quote, esc = 0, None, False
    j = i
    while j < len(s):
        ch = s[j]
        if quote:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif s.startswith(quote, j):
                j += len(quote) - 1
                quote = None
        elif ch in "\"'":
            quote = ch * 3 if s.startswith(ch * 3, j) else ch
            j += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def skip_ws(s: str, i: int) -> int:
    """The first index at or after ``i`` that is not whitespace (``len(s)`` if none)."""
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of a marker (held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best
