"""/v1/responses: the subset of OpenAI's Responses API that ``client.responses.create`` needs for text and
function tools, served through the chat-completions path (the same template, parsers, constraints).

- Input: a string, or items: messages (``user`` / ``system`` / ``developer`` / ``assistant``; text or
  ``input_text`` / ``output_text`` parts), ``function_call`` and ``function_call_output`` (``reasoning``
  items are skipped); ``instructions`` become the system message (not carried to the next response).
- Fields: ``tools`` (``{"type": "function", "name", "description", "parameters", "strict"}``),
  ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
  ``text.format`` (``text`` / ``json_object`` / ``json_schema``), ``stream``, ``store``,
  ``previous_response_id``, ``metadata``.
- Output items: ``reasoning`` (with a ``--reasoning-parser``), ``message`` (``output_text``) and
  ``function_call``; ``status`` ``incomplete`` with ``incomplete_details.reason == "max_output_tokens"``
  when the length limit cut the answer. Streams send OpenAI's events (``response.created`` …
  ``response.output_text.delta`` … ``response.function_call_arguments.delta`` … ``response.completed``).
- Storage: a response is kept (unless ``store: false``) in memory for ``previous_response_id`` and
  ``GET /v1/responses/{id}``: at most ``--responses-store-size`` of them; past that the oldest stored is
  evicted first. A response continues the conversation that produced the previous one (its input and its
  output), with the new ``instructions``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from llmc.serve import generate
from llmc.serve.errors import APIError, from_validation
from llmc.serve.protocol import ChatCompletionRequest, _Body
from llmc.serve.state import ServerState


class ResponsesRequest(_Body):
    model: str | None = None
    input: Any = None
    instructions: str | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None  # not OpenAI's: as on chat completions
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: dict | None = None
    metadata: dict | None = None


@dataclass
class _Stored:
    messages: list[dict]  # the conversation so far (no instructions): inputs and the answer
    response: dict


class ResponseStore:
    """Stored responses, oldest evicted first past ``capacity`` (0: nothing is stored)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, rid: str, item: _Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = item
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> _Stored | None:
        return self._items.get(rid)

    def __len__(self) -> int:
        return len(self._items)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or an array of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not \
                isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: {kind!r} parts are not supported; give input_text parts",
                           param=f"{where}[{j}]", code="unsupported")
        out.append(part["text"])
    return "".join(out)


def input_messages(value: Any) -> list[dict]:
    """The Responses API's ``input`` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise APIError(400, "input: must be a string or an array of input items", param="input",
                       code="invalid_type")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object", param=where, code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: {role!r} is not one of 'user', 'system', 'developer', "
                               "'assistant'", param=f"{where}.role", code="invalid_value")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and arguments",
                               param=where, code="invalid_value")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}.call_id: must be the call's id", param=f"{where}.call_id",
                               code="invalid_value")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}.type: {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", param=f"{where}.type", code="unsupported")
    return out


def _chat_tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools  # the chat validation names the problem
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise APIError(400, f"tools[{i}].type: {kind!r} is not supported; only function tools are",
                           param=f"tools[{i}].type", code="unsupported")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: must be an object", param="text.format", code="invalid_type")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return fmt


_RENAMES = [("max_tokens", "max_output_tokens"), ("messages", "input"), ("response_format", "text.format"),
            ("tool_choice.function.name", "tool_choice.name")]


def _renamed(exc: APIError) -> APIError:
    """A chat-completions error in the Responses API's field names."""
    param, message = exc.param, exc.message
    if param:
        new = param
        for old, to in _RENAMES:
            if new == old or new.startswith(old + "[") or new.startswith(old + "."):
                new = to + new[len(old):]
                break
        if new.startswith("tools["):
            new = new.replace(".function.", ".", 1).replace(".function", "", 1)
        if message.startswith(param):
            message = new + message[len(param):]
        param = new
    return APIError(exc.status, message, param=param, code=exc.code, headers=exc.headers)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Builder:
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
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


async def create(state: ServerState, store: ResponseStore, request: Request, req: ResponsesRequest,
                 arrival: float) -> Response:
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(400, f"previous_response_id: {req.previous_response_id!r} is not stored here (never "
                           "stored, store: false, or evicted: the server keeps the last --responses-store-size)",
                           param="previous_response_id", code="previous_response_not_found")
        history = [dict(m) for m in prev.messages]
    if req.input is None:
        raise APIError(400, "input: required field is missing", param="input", code="missing")
    conversation = history + input_messages(req.input)
    if not conversation:
        raise APIError(400, "input: is empty; give a string or at least one item", param="input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
            "stream": bool(req.stream), "stream_options": {"include_usage": True} if req.stream else None}
    body = {k: v for k, v in body.items() if v is not None}
    try:
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from exc
        plan = generate.plan_chat(state, chat, body)
        inner = await generate.run(state, plan, request, arrival)
    except APIError as exc:
        raise _renamed(exc) from exc
    rid = _new_id("resp")
    b = _Builder(state, req, rid, time.time())

    def keep() -> None:
        if req.store is not False:
            store.put(rid, _Stored(conversation + [b.assistant_message()], b.response(b.status)))

    if isinstance(inner, StreamingResponse):
        return StreamingResponse(_events(b, inner, keep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if not isinstance(inner, JSONResponse):
        return inner  # the client went away (499)
    chat_obj = json.loads(inner.body)
    choice = chat_obj["choices"][0]
    msg = choice["message"]
    b.finish = choice["finish_reason"]
    status = "incomplete" if b.finish == "length" else "completed"
    if msg.get("reasoning"):
        b.output.append(reasoning_item(msg["reasoning"]))
    if msg.get("content") or not msg.get("tool_calls"):
        b.output.append(message_item(msg.get("content") or "", status))
    for tc in msg.get("tool_calls") or []:
        b.output.append(call_item(tc["id"], tc["function"]["name"], tc["function"]["arguments"]))
    b.set_usage(chat_obj["usage"])
    keep()
    return JSONResponse(b.response(b.status))


async def _events(b: _Builder, inner: StreamingResponse, keep) -> AsyncIterator[bytes]:
    seq = 0
    open_item: dict | None = None  # the output item being streamed
    open_index = -1

    def event(kind: str, **fields) -> bytes:
        nonlocal seq
        seq += 1
        payload = {"type": kind, "sequence_number": seq - 1, **fields}
        return f"event: {kind}\n".encode() + generate.sse_event(payload)

    def close() -> list[bytes]:
        nonlocal open_item
        if open_item is None:
            return []
        item, out = open_item, []
        item["status"] = "incomplete" if b.finish == "length" and item["type"] == "message" else "completed"
        i = open_index
        if item["type"] == "message":
            part = item["content"][0]
            out.append(event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=part["text"], logprobs=[]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=part["text"]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part))
        else:
            out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=item["arguments"], name=item["name"]))
        out.append(event("response.output_item.done", output_index=i, item=item))
        open_item = None
        return out

    def open_(item: dict) -> list[bytes]:
        nonlocal open_item, open_index
        out = close()
        b.output.append(item)
        open_item, open_index = item, len(b.output) - 1
        out.append(event("response.output_item.added", output_index=open_index,
                         item={**item, "status": "in_progress"}))
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            out.append(event("response.content_part.added", item_id=item["id"], output_index=open_index,
                             content_index=0, part=dict(part)))
        return out

    iterator = inner.body_iterator
    try:
        yield event("response.created", response=b.response("in_progress"))
        yield event("response.in_progress", response=b.response("in_progress"))
        async for raw in iterator:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.split("\n"):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                    yield event("response.failed", response={**b.response("failed"), "error": {
                        "code": "server_error", "message": err.get("message")}})
                    return
                if chunk.get("usage"):
                    b.set_usage(chunk["usage"])
                for ch in chunk.get("choices", []):
                    d = ch.get("delta") or {}
                    if d.get("reasoning"):
                        if open_item is None or open_item["type"] != "reasoning":
                            for e in open_(reasoning_item("", "in_progress")):
                                yield e
                        open_item["content"][0]["text"] += d["reasoning"]
                        yield event("response.reasoning_text.delta", item_id=open_item["id"],
                                    output_index=open_index, content_index=0, delta=d["reasoning"])
                    if d.get("content"):
                        if open_item is None or open_item["type"] != "message":
                            for e in open_(message_item("", "in_progress")):
                                yield e
                        open_item["content"][0]["text"] += d["content"]
                        yield event("response.output_text.delta", item_id=open_item["id"], output_index=open_index,
                                    content_index=0, delta=d["content"], logprobs=[])
                    for tc in d.get("tool_calls") or []:
                        if tc.get("id"):
                            for e in open_(call_item(tc["id"], tc["function"]["name"], "", "in_progress")):
                                yield e
                        frag = (tc.get("function") or {}).get("arguments") or ""
                        if frag and open_item is not None and open_item["type"] == "function_call":
                            open_item["arguments"] += frag
                            yield event("response.function_call_arguments.delta", item_id=open_item["id"],
                                        output_index=open_index, delta=frag)
                    if ch.get("finish_reason"):
                        b.finish = ch["finish_reason"]
        if not b.output:  # an empty answer is still one (empty) message
            for e in open_(message_item("", "in_progress")):
                yield e
        for e in close():
            yield e
        keep()
        kind = "response.incomplete" if b.status == "incomplete" else "response.completed"
        yield event(kind, response=b.response(b.status))
    finally:
        await iterator.aclose()  # the chat stream's own cleanup: cancels unfinished engine requests
