"""/v1/responses: the subset of OpenAI's Responses API that ``client.responses.create`` needs for text and
function tools, served through the chat-completions path (the same template, parsers, constraints).

- Input: a string, or items: messages (``user`` / ``system`` / ``developer`` / ``assistant``; text or
  ``input_text`` / ``output_text`` / ``input_image`` parts, an image as a ``data:`` URL: serve/images.py),
  ``function_call`` and ``function_call_output`` (``reasoning`` items are skipped); ``instructions`` become the
  system message (not carried to the next response).
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

Here: the input as chat messages, the store, and :func:`create`; the response's items and body are
serve/responses_output.py's, a streamed answer's events serve/responses_stream.py's.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import llmc.serve.generate as generate
from llmc.serve.errors import APIError, from_validation
from llmc.serve.protocol import ChatCompletionRequest, ResponsesRequest
from llmc.serve.responses_output import ResponseBuilder, call_item, message_item, new_id, reasoning_item
from llmc.serve.responses_stream import response_events
from llmc.serve.state import ServerState


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


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or an array of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not \
                isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: {kind!r} parts are not supported; give input_text parts",
                           param=f"{where}[{j}]", code="unsupported")
        out.append(part["text"])
    return "".join(out)


def _content_of(content: Any, where: str) -> str | list[dict]:
    """A message's content: its text, or chat content parts where it has ``input_image`` parts
    (``{"type": "input_image", "image_url": "data:image/png;base64,..."}``; ``detail`` ignored)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, where)
    out: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                why = "file_id images are not supported" if part.get("file_id") else "needs an image_url string"
                raise APIError(400, f"{at}: {why}; give image_url as a data: URL (data:image/png;base64,...)",
                               param=f"{at}.image_url", code="invalid_value")
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{at}: {kind!r} parts are not supported; give input_text or input_image parts",
                           param=at, code="unsupported")
    return out


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
                        "content": _content_of(item.get("content"), f"{where}.content")})
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
    rid = new_id("resp")
    b = ResponseBuilder(state, req, rid, time.time())

    def keep() -> None:
        if req.store is not False:
            store.put(rid, _Stored(conversation + [b.assistant_message()], b.response(b.status)))

    if isinstance(inner, StreamingResponse):
        return StreamingResponse(response_events(b, inner, keep), media_type="text/event-stream",
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
