"""A streamed /v1/responses answer: the chat-completions stream it runs on, re-told as OpenAI's Responses events
(``response.created`` … ``response.output_text.delta`` … ``response.function_call_arguments.delta`` …
``response.completed``), each with its ``sequence_number``, while the builder collects the output items."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi.responses import StreamingResponse

from llmc.serve.generate import sse_event
from llmc.serve.responses_output import ResponseBuilder, call_item, message_item, reasoning_item


class _Events:
    """The events of one response, in order: one output item is open (streaming) at a time."""

    def __init__(self, b: ResponseBuilder) -> None:
        self.b = b
        self.seq = 0
        self.open_item: dict | None = None  # the output item being streamed
        self.open_index = -1

    def event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\n".encode() + sse_event(payload)

    def close(self) -> list[bytes]:
        """The open item's closing events (none if no item is open)."""
        item = self.open_item
        if item is None:
            return []
        out: list[bytes] = []
        item["status"] = "incomplete" if self.b.finish == "length" and item["type"] == "message" else "completed"
        i = self.open_index
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=item["arguments"], name=item["name"]))
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        self.open_item = None
        return out

    def open(self, item: dict) -> list[bytes]:
        """Close the open item and open ``item`` (added to the output)."""
        out = self.close()
        self.b.output.append(item)
        self.open_item, self.open_index = item, len(self.b.output) - 1
        out.append(self.event("response.output_item.added", output_index=self.open_index,
                              item={**item, "status": "in_progress"}))
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open_index,
                                  content_index=0, part=dict(part)))
        return out

    def delta(self, d: dict) -> list[bytes]:
        """The events of one chat choice's delta: reasoning, then content, then tool-call pieces."""
        out: list[bytes] = []
        if d.get("reasoning"):
            if self.open_item is None or self.open_item["type"] != "reasoning":
                out += self.open(reasoning_item("", "in_progress"))
            self.open_item["content"][0]["text"] += d["reasoning"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open_item["id"],
                                  output_index=self.open_index, content_index=0, delta=d["reasoning"]))
        if d.get("content"):
            if self.open_item is None or self.open_item["type"] != "message":
                out += self.open(message_item("", "in_progress"))
            self.open_item["content"][0]["text"] += d["content"]
            out.append(self.event("response.output_text.delta", item_id=self.open_item["id"],
                                  output_index=self.open_index, content_index=0, delta=d["content"], logprobs=[]))
        for tc in d.get("tool_calls") or []:
            if tc.get("id"):
                out += self.open(call_item(tc["id"], tc["function"]["name"], "", "in_progress"))
            frag = (tc.get("function") or {}).get("arguments") or ""
            if frag and self.open_item is not None and self.open_item["type"] == "function_call":
                self.open_item["arguments"] += frag
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open_item["id"],
                                      output_index=self.open_index, delta=frag))
        return out

    def chunk(self, chunk: dict) -> list[bytes]:
        """The events of one chat-completion chunk (not an error)."""
        if chunk.get("usage"):
            self.b.set_usage(chunk["usage"])
        out: list[bytes] = []
        for ch in chunk.get("choices", []):
            out += self.delta(ch.get("delta") or {})
            if ch.get("finish_reason"):
                self.b.finish = ch["finish_reason"]
        return out

    def failed(self, err: dict) -> list[bytes]:
        """The events of a stream that ended in ``err`` (the chat chunk's error object)."""
        return [self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param")),
                self.event("response.failed", response={**self.b.response("failed"), "error": {
                    "code": "server_error", "message": err.get("message")}})]

    def end(self) -> list[bytes]:
        """The closing events once the chat stream ended (an empty answer is still one, empty, message)."""
        out = self.open(message_item("", "in_progress")) if not self.b.output else []
        return out + self.close()


def _chunks(raw: bytes | str) -> Iterator[dict]:
    """The chat-completion chunks in one piece of an SSE body (``data: {...}`` lines; ``[DONE]`` skipped)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    for line in text.split("\n"):
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            continue
        yield json.loads(data)


async def response_events(b: ResponseBuilder, inner: StreamingResponse, keep: Callable[[], None]
                          ) -> AsyncIterator[bytes]:
    """The Responses events of the chat stream ``inner``; ``keep``: stores the response once it completed."""
    ev = _Events(b)
    iterator = inner.body_iterator
    try:
        yield ev.event("response.created", response=b.response("in_progress"))
        yield ev.event("response.in_progress", response=b.response("in_progress"))
        async for raw in iterator:
            for chunk in _chunks(raw):
                if "error" in chunk:
                    for e in ev.failed(chunk["error"]):
                        yield e
                    return
                for e in ev.chunk(chunk):
                    yield e
        for e in ev.end():
            yield e
        keep()
        kind = "response.incomplete" if b.status == "incomplete" else "response.completed"
        yield ev.event(kind, response=b.response(b.status))
    finally:
        await iterator.aclose()  # the chat stream's own cleanup: cancels unfinished engine requests
