"""A /v1/responses response's body: its output items (reasoning, message, function_call) and the response object
around them, built from chat-completion pieces (a whole answer, or a stream's deltas: serve/responses_stream.py)."""

from __future__ import annotations

import uuid

from llmc.serve.protocol import ResponsesRequest
from llmc.serve.state import ServerState


def new_id(prefix: str) -> str:
    """A fresh id as OpenAI writes them: ``{prefix}_{32 hex digits}``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Builds a response's output items from chat-completion pieces (whole or streamed)."""

    def __init__(self, state: ServerState, req: ResponsesRequest, rid: str, created: float) -> None:
        self.state, self.req, self.id, self.created = state, req, rid, created
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.finish: str | None = None

    def response(self, status: str) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model":
            self.state.config.model_name, "output": self.output, "error": None, "incomplete_details": incomplete,
            "instructions": self.req.instructions, "metadata": self.req.metadata or {},
            "tools": self.req.tools or [],
            "tool_choice": self.req.tool_choice or ("auto" if self.req.tools else "none"),
            "parallel_tool_calls": self.req.parallel_tool_calls is not False,
            "temperature": self.req.temperature, "top_p": self.req.top_p,
            "max_output_tokens": self.req.max_output_tokens, "previous_response_id": self.req.previous_response_id,
            "store": self.req.store is not False, "text": self.req.text or {"format": {"type": "text"}},
            "truncation": "disabled", "usage": self.usage,
        }

    def set_usage(self, usage: dict) -> None:
        self.usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": 0}}

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def assistant_message(self) -> dict:
        """The answer as a chat message, for the stored conversation."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                          "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        msg: dict = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return msg


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
