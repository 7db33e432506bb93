"""Reasoning parsers (``--reasoning-parser``): split a model's thinking from its answer, whole or streamed.

- ``qwen3``: an answer that opens with ``<think>`` thinks until ``</think>``; one that does not is all answer
  (Qwen3 with ``enable_thinking: false`` writes no think block).
- ``deepseek_r1``: the answer starts inside the think block (the template opened it; a leading ``<think>`` is
  dropped) and thinks until ``</think>``; with no ``</think>`` at all, everything is reasoning.
- ``gpt_oss``: the harmony format's ``analysis`` channel (the ``harmony`` tool parser splits it).

The answer's leading newlines after ``</think>`` are dropped. Tool calls are parsed from the answer only.
"""

from __future__ import annotations

from llmc.serve.tool_parsers.scan import partial_suffix

FAMILIES = ("qwen3", "deepseek_r1", "gpt_oss")
OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, family: str) -> None:
        if family not in ("qwen3", "deepseek_r1"):
            raise ValueError(f"no think-block reasoning parser {family!r}")
        self.family = family
        self._buf = ""
        self._mode = "start"  # start -> think -> answer
        self._lead = True  # drop newlines that open the answer after </think>

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that ``text`` made certain."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, answer = "", ""
        while True:
            if self._mode == "start":
                body = self._buf.lstrip()
                if body.startswith(OPEN):
                    self._buf, self._mode = body[len(OPEN):], "think"
                elif OPEN.startswith(body) and not final:
                    return reasoning, answer  # may still become <think>
                else:
                    self._mode = "think" if self.family == "deepseek_r1" else "answer"
                    self._lead = self.family != "qwen3"
                continue
            if self._mode == "think":
                k = self._buf.find(CLOSE)
                if k < 0:
                    hold = 0 if final else partial_suffix(self._buf, (CLOSE,))
                    reasoning += self._buf[:len(self._buf) - hold]
                    self._buf = self._buf[len(self._buf) - hold:]
                    return reasoning, answer
                reasoning += self._buf[:k]
                self._buf, self._mode = self._buf[k + len(CLOSE):], "answer"
                continue
            if self._lead:
                stripped = self._buf.lstrip("\n")
                if not stripped and not final:
                    self._buf = ""
                    return reasoning, answer
                self._buf, self._lead = stripped, False
            answer += self._buf
            self._buf = ""
            return reasoning, answer
