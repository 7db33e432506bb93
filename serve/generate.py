"""/v1/completions and /v1/chat/completions: from a validated request to engine requests, and back.

One HTTP request becomes ``len(prompts) * n`` engine requests (choice ``i * n + j`` is prompt ``i``'s
``j``-th sample, seeded ``seed + j``), submitted all or none. Responses follow OpenAI's shapes,
streamed as Server-Sent Events when asked; a client that goes away cancels its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmc.errors import LlmcError
from llmc.runtime import GenerationOutput, SamplingParams
from llmc.serve import images
from llmc.serve.errors import APIError
from llmc.serve.images import ImageRef
from llmc.serve.loop import Delivery, LoopDead, QueueFull
from llmc.serve.protocol import ChatCompletionRequest, CompletionRequest
from llmc.serve.state import ServerState
from llmc.serve.structured import precompile, requested
from llmc.serve.text import TextStream
from llmc.serve.tool_parsers import PARSERS
from llmc.serve.tools import ChoiceOutput, ToolSpec, constraint, template_messages, tool_call_json, validate

MAX_RETRY_AFTER = 60  # seconds: past this an estimate says little; clients should back off on their own

# OpenAI's stand-in for a log-probability too small for a float (JSON has no -Infinity).
_MIN_LOGPROB = -9999.0
_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Plan:
    """What one HTTP request asks the engine for."""

    kind: str  # "completion" or "chat"
    id: str
    model: str
    prompts: list[list[int]]
    n: int
    params: list[SamplingParams]  # one per choice
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))
    structured_field: str | None = None  # the request field a constraint came from (serve/structured.py)
    tool_spec: ToolSpec | None = None  # tools in play (serve/tools.py)
    tool_family: str | None = None  # the format calls are parsed from (None: not parsed)
    reasoning: str | None = None  # the reasoning parser (serve/reasoning.py)
    keep_special: bool = False  # decode with special tokens kept: the format's markers are special tokens
    images: list[ImageRef] = field(default_factory=list)  # the chat's image parts, fetched and decoded by run()
    image_tokens: int = 0  # prompt tokens the images add once expanded (manifest multimodal.tokens_per_image)

    @property
    def parses(self) -> bool:
        """Whether choices' text goes through the reasoning / tool parsers (serve/tools.ChoiceOutput)."""
        return self.kind == "chat" and (self.tool_family is not None or self.reasoning is not None)

    def output(self) -> ChoiceOutput:
        offered = self.tool_spec is not None and self.tool_spec.choice != "none"
        return ChoiceOutput(self.tool_family, self.tool_spec.tools if offered else None, self.reasoning, offered)

    @property
    def choice_ids(self) -> list[str]:
        return [f"{self.id}-{i}" for i in range(len(self.params))]


# -- request -> plan --------------------------------------------------------------------------------


def check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter that ``model`` names (None: the base model); 404 for a model not served here."""
    if model is None or model == state.config.model_name:
        return None
    adapters = lora_adapters(state)
    if model in adapters:
        return model
    also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
    raise APIError(404, f"model: {model!r} is not served here; this server serves {state.config.model_name!r}{also} "
                   "(GET /v1/models)", param="model", code="model_not_found")


def lora_adapters(state: ServerState) -> dict:
    """The engine's LoRA adapters (name -> directory), read without the engine's lock (a step may hold it)."""
    lora = getattr(state.engine, "lora", None)
    return {name: a.path for name, a in list(lora.adapters.items())} if lora is not None else {}


def _prompt_ids(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [state.tokenizer.encode(prompt)]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], str):
        tok = state.tokenizer
        prompts = [tok.encode(p) for p in prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt: is empty; give a string, a list of strings or token ids", param="prompt")
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise APIError(400, f"{where}: is empty after tokenization; give at least one token", param="prompt")
        vocab = state.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt", code="invalid_token_id")
    return prompts


def _check_lengths(state: ServerState, prompts: list[list[int]], max_tokens: int | None, default: int | None,
                   field_name: str, prompt_field: str) -> int:
    """The max_tokens every choice gets (explicit, or the default fitted to the context); 400 if it cannot fit."""
    ctx = state.engine.max_model_len
    pool = state.kv_pool_tokens
    longest = max(len(p) for p in prompts)
    if ctx is not None and longest >= ctx:
        raise APIError(400, f"{prompt_field}: {longest} tokens, but the engine's context is {ctx} tokens (prompt plus "
                       "at least one new token); shorten it", param=prompt_field, code="context_length_exceeded")
    room = min(ctx - longest if ctx is not None else pool, pool - longest + 1)
    if room < 1:
        raise APIError(400, f"{prompt_field}: {longest} tokens do not fit in the KV cache of {pool} tokens",
                       param=prompt_field, code="context_length_exceeded")
    if max_tokens is None:
        return min(default, room) if default is not None else room
    if ctx is not None and longest + max_tokens > ctx:
        raise APIError(400, f"{field_name}: {longest} prompt + {max_tokens} new tokens exceed the engine's context "
                       f"of {ctx} tokens; at most {ctx - longest} here", param=field_name,
                       code="context_length_exceeded")
    if longest + max_tokens - 1 > pool:
        raise APIError(400, f"{field_name}: {longest} prompt + {max_tokens} new tokens exceed the KV cache of {pool} "
                       f"tokens; at most {pool - longest + 1} here", param=field_name, code="context_length_exceeded")
    return max_tokens


def _sampling(state: ServerState, req: CompletionRequest | ChatCompletionRequest, n_prompts: int,
              max_tokens: int, top_logprobs: int | None, structured=None) -> list[SamplingParams]:
    if req.n > state.config.max_n:
        raise APIError(400, f"n: {req.n} choices, this server allows at most {state.config.max_n} (--max-n)",
                       param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop: stop strings must be non-empty", param="stop")
    if stop and state.engine.tokenizer is None:
        raise APIError(400, "stop: stop strings need the engine's tokenizer; use stop_token_ids", param="stop")
    vocab = state.engine.vocab_size
    bad = next((t for t in req.stop_token_ids or [] if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="stop_token_ids")
    out = []
    for _ in range(n_prompts):
        for j in range(req.n):
            try:
                out.append(SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=max(0, req.top_k or 0),
                    min_p=req.min_p or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    seed=None if req.seed is None else (req.seed + j) % (1 << 63),
                    stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                    logprobs=top_logprobs, structured=structured, lora=check_model(state, req.model),
                ))
            except LlmcError as exc:  # a range SamplingParams checks that the request model does not
                field_name = str(exc).split("=", 1)[0].removeprefix("SamplingParams.")
                raise APIError(400, str(exc).removeprefix("SamplingParams."), param=field_name) from exc
    return out


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    unsupported = []
    if req.logit_bias:
        unsupported.append(("logit_bias", "logit_bias is not supported"))
    if isinstance(req, CompletionRequest):
        if req.echo:
            unsupported.append(("echo", "echo is not supported"))
        if req.suffix:
            unsupported.append(("suffix", "suffix (insertion) is not supported"))
        if req.best_of is not None and req.best_of != req.n:
            unsupported.append(("best_of", "best_of other than n is not supported; use n"))
    if unsupported:
        name, why = unsupported[0]
        raise APIError(400, f"{name}: {why}", param=name, code="unsupported")


def _return_token_ids(body: dict) -> bool:
    # vLLM's extension (not an OpenAI field): token ids of the prompt and of each choice in the response.
    value = body.get("return_token_ids", False)
    if not isinstance(value, bool):
        raise APIError(400, f"return_token_ids: must be a boolean (got {value!r})", param="return_token_ids")
    return value


def plan_completion(state: ServerState, req: CompletionRequest, body: dict) -> Plan:
    check_model(state, req.model)
    _refuse_unsupported(req)
    prompts = _prompt_ids(state, req.prompt)
    max_tokens = _check_lengths(state, prompts, req.max_tokens, _DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", "prompt")
    spec, where = requested(req.response_format, req.structured_outputs)
    params = _sampling(state, req, len(prompts), max_tokens, req.logprobs, spec)
    return Plan("completion", f"cmpl-{uuid.uuid4().hex}", _model_name(state, req), prompts, req.n, params,
                bool(req.stream), bool(req.stream_options and req.stream_options.include_usage), req.logprobs,
                _return_token_ids(body), structured_field=where if spec is not None else None)


def plan_chat(state: ServerState, req: ChatCompletionRequest, body: dict) -> Plan:
    check_model(state, req.model)
    _refuse_unsupported(req)
    if state.chat_template is None:
        raise APIError(400, f"messages: the engine {state.engine.path.name!r} has no chat template (tokenizer_config"
                       ".json chat_template or chat_template.jinja); use /v1/completions with a prompt",
                       param="messages", code="no_chat_template")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
    if req.chat_template_kwargs is not None and not isinstance(req.chat_template_kwargs, dict):
        raise APIError(400, "chat_template_kwargs: must be an object", param="chat_template_kwargs")
    tool_spec = validate(req.tools, req.tool_choice, req.parallel_tool_calls)
    ids, refs = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template_kwargs, tool_spec)
    prompts = [ids]
    per_image = int((state.engine.manifest.get("multimodal") or {}).get("tokens_per_image") or 1)
    image_tokens = len(refs) * (per_image - 1)  # each image token becomes the image's tokens
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _check_lengths(state, [ids + [0] * image_tokens], limit, None, which, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    spec, where = requested(req.response_format, req.structured_outputs)
    reasoning = state.config.reasoning_parser
    family = None
    if tool_spec is not None and tool_spec.choice != "none":
        family = state.tool_family
        forced = constraint(tool_spec, family, _special_ids(state))
        if forced is not None:
            if spec is not None:
                raise APIError(400, f"{where}: cannot be combined with tool_choice {tool_spec.choice!r} (or strict "
                               "tools), which constrains the output itself", param=where, code="invalid_value")
            spec, where = forced, "tools"
            if tool_spec.forced and reasoning in ("qwen3", "deepseek_r1"):
                reasoning = None  # a forced call is the whole answer, written at once: no think block to split
    if reasoning == "gpt_oss" and family is None:
        family = "harmony"  # gpt-oss's reasoning is its analysis channel
    params = _sampling(state, req, 1, max_tokens, top, spec)
    keep = family is not None and PARSERS[family].needs_special_tokens
    return Plan("chat", f"chatcmpl-{uuid.uuid4().hex}", _model_name(state, req), prompts, req.n, params,
                bool(req.stream), bool(req.stream_options and req.stream_options.include_usage), top,
                _return_token_ids(body), structured_field=where if spec is not None else None,
                tool_spec=tool_spec, tool_family=family, reasoning=reasoning, keep_special=keep, images=refs,
                image_tokens=image_tokens)


def _model_name(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> str:
    """What responses name as their model: the LoRA adapter asked for, else the served model."""
    return req.model if check_model(state, req.model) is not None else state.config.model_name


def _special_ids(state: ServerState) -> dict[str, int]:
    """Special tokens of the engine's tokenizer by their text (a grammar names them by id)."""
    tok = state.engine.tokenizer
    if tok is None:
        return {}
    added = getattr(tok, "_tok", None)
    decoder = added.get_added_tokens_decoder() if added is not None else {}
    return {t.content: i for i, t in decoder.items() if t.special}


def chat_prompt_ids(state: ServerState, messages, add_generation_prompt: bool, extra: dict | None,
                    tool_spec: ToolSpec | None = None) -> list[int]:
    """The conversation's prompt tokens (one image token per image part: serve/images.py)."""
    return chat_prompt(state, messages, add_generation_prompt, extra, tool_spec)[0]


def chat_prompt(state: ServerState, messages, add_generation_prompt: bool, extra: dict | None,
                tool_spec: ToolSpec | None = None) -> tuple[list[int], list[ImageRef]]:
    """The conversation's prompt tokens and its images in prompt order (checked, not yet fetched)."""
    if state.chat_template is None:
        raise APIError(400, "messages: this engine has no chat template", param="messages", code="no_chat_template")
    flat, refs = images.flatten(state, messages)
    flat, tool_extra = template_messages(flat, tool_spec, state.chat_template.takes_tools)
    text = state.chat_template.render(flat, add_generation_prompt=add_generation_prompt,
                                      extra={**(extra or {}), **tool_extra})
    # The template wrote the special tokens (BOS…) itself.
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    if refs:
        images.check_placeholders(state, ids, refs)
    return ids, refs


# -- running a plan ---------------------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    text: TextStream | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    final: GenerationOutput | None = None
    finish_reason: str | None = None
    out: ChoiceOutput | None = None  # reasoning / tool-call parsing (chat with tools or a reasoning parser)
    parsed: bool = False  # out has seen the whole text


def _encode_images(encoder, refs: list[ImageRef], pixels: list) -> list:
    """Each image preprocessed and encoded (llmc.runtime ImageInputs.prefetch, cached by content); one the image
    processor refuses is a 400 naming where it was in the request."""
    out = []
    for ref, px in zip(refs, pixels, strict=True):
        try:
            out.extend(encoder.prefetch([px]))
        except LlmcError as exc:
            raise APIError(400, str(exc), param=ref.where, code="invalid_image") from exc
    return out


async def run(state: ServerState, plan: Plan, request: Request, arrival: float) -> Response:
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down")
    if plan.structured_field is not None:  # refused here (400), before the step loop sees it
        await precompile(state.engine, plan.params[0].structured, plan.structured_field)
    prompts = [p for p in plan.prompts for _ in range(plan.n)]
    if len(prompts) > state.loop.max_queue:  # would never fit, however long the client waits: not a 429
        field_name = "prompt" if len(plan.prompts) > 1 else "n"
        raise APIError(400, f"{field_name}: {len(plan.prompts)} prompts x n={plan.n} = {len(prompts)} choices exceed "
                       f"the server's queue of {state.loop.max_queue} (--max-queue); send fewer at once",
                       param=field_name)
    # Fetched and decoded off the event loop; a bad image is a 400 before anything is queued.
    pixels = await asyncio.to_thread(images.load_images, state, plan.images) if plan.images else None
    encoder = getattr(state.engine, "images", None)
    if pixels and encoder is not None:  # encoded on a worker thread too: the step loop never waits on an encoder
        pixels = await asyncio.to_thread(_encode_images, encoder, plan.images, pixels)
    try:
        sink = await state.loop.submit(prompts, plan.params, plan.choice_ids, arrival,
                                       **({"images": [pixels] * len(prompts)} if pixels else {}))
    except QueueFull as exc:
        # The queue's own drain estimate where requests have been finishing; the configured floor otherwise.
        wait = state.config.retry_after
        if exc.retry_after is not None:
            wait = min(MAX_RETRY_AFTER, max(wait, math.ceil(exc.retry_after)))
        raise APIError(429, f"{exc}; retry after {wait} s", code="queue_full",
                       headers={"Retry-After": str(wait)}) from exc
    except LoopDead as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    except LlmcError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    index = {rid: i for i, rid in enumerate(plan.choice_ids)}
    tok = state.engine.tokenizer
    choices = [_Choice(i, TextStream(tok, p.stop, not plan.keep_special) if tok is not None else None,
                       out=plan.output() if plan.parses else None) for i, p in enumerate(plan.params)]
    if plan.stream:
        return StreamingResponse(_stream(state, plan, sink, index, choices), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(state, plan, sink, index, choices, request)


def _cancel_unfinished(state: ServerState, plan: Plan, choices: list[_Choice]) -> None:
    for rid, c in zip(plan.choice_ids, choices, strict=True):
        if c.finish_reason is None:
            state.loop.cancel(rid)


def _apply(d: Delivery, index: dict[str, int], choices: list[_Choice]) -> _Choice:
    if d.error is not None:
        raise APIError(500, f"the engine failed: {type(d.error).__name__}: {d.error}", code="engine_error")
    o = d.output
    c = choices[index[o.request_id]]
    c.token_ids += o.new_token_ids
    if o.new_logprobs:
        c.logprobs += o.new_logprobs
    if o.finished:
        c.finish_reason = o.finish_reason
        c.final = d.final
    return c


async def _collect(state: ServerState, plan: Plan, sink: asyncio.Queue, index: dict[str, int],
                   choices: list[_Choice], request: Request) -> Response:
    async def gather() -> None:
        left = len(choices)
        while left:
            if _apply(await sink.get(), index, choices).finish_reason is not None:
                left -= 1

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: nobody wants the rest
            work.cancel()
            return Response(status_code=499)
        work.result()
    finally:
        gone.cancel()
        _cancel_unfinished(state, plan, choices)
    return JSONResponse(_response(state, plan, choices))


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _choice_text(c: _Choice, tok, keep_special: bool = False, eos_ids=()) -> str:
    if keep_special and tok is not None:  # the engine's text has them dropped
        ids = c.token_ids
        if c.finish_reason == "stop" and ids and ids[-1] in eos_ids:
            ids = ids[:-1]  # the end-of-sequence token is no text (the parsers end open messages themselves)
        text = tok.decode(ids, skip_special_tokens=False)
        if c.final is not None and c.final.text is not None and c.final.text != tok.decode(c.token_ids):
            return c.final.text  # cut before a stop string: no markers to keep
        return text
    if c.final is not None and c.final.text is not None:
        return c.final.text
    return tok.decode(c.token_ids) if tok is not None else ""


def _finish_reason(c: _Choice) -> str | None:
    """OpenAI's: ``tool_calls`` when the answer made calls and ended by itself."""
    if c.out is not None and c.out.calls and c.finish_reason == "stop":
        return "tool_calls"
    return c.finish_reason


def _message(c: _Choice, text: str) -> dict:
    if c.out is None:
        return {"role": "assistant", "content": text}
    if c.finish_reason is not None and not c.parsed:
        c.out.feed(text)
        c.out.finish(truncated=c.finish_reason == "length")
        c.parsed = True
    msg: dict = {"role": "assistant", "content": c.out.content}
    if c.out.calls:
        msg["tool_calls"] = [tool_call_json(None, cid, call) for _, cid, call in c.out.calls]
    if c.out.reasoning is not None or c.out.tools is not None and c.out.reasoning_text is not None:
        msg["reasoning"] = msg["reasoning_content"] = c.out.reasoning_text
    return msg


def _response(state: ServerState, plan: Plan, choices: list[_Choice]) -> dict:
    tok = state.engine.tokenizer
    out = []
    for c in choices:
        text = _choice_text(c, tok, plan.keep_special, state.engine.eos_token_ids)
        if plan.kind == "completion":
            ch = {"index": c.index, "text": text, "logprobs": _completion_logprobs(state, c.token_ids, c.logprobs,
                                                                                   plan.top_logprobs),
                  "finish_reason": c.finish_reason}
        else:
            ch = {"index": c.index, "message": _message(c, text),
                  "logprobs": _chat_logprobs(state, c.token_ids, c.logprobs, plan.top_logprobs),
                  "finish_reason": _finish_reason(c)}
        if plan.return_token_ids:
            ch["token_ids"] = c.token_ids
            expanded = c.final.prompt_token_ids if plan.images and c.final is not None else None  # image tokens
            ch["prompt_token_ids"] = expanded or plan.prompts[c.index // plan.n]
        _structured_fields(plan, c, ch)
        out.append(ch)
    obj = "text_completion" if plan.kind == "completion" else "chat.completion"
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model, "choices": out,
            "usage": _usage(plan, choices)}


def _structured_fields(plan: Plan, c: _Choice, ch: dict) -> None:
    """A constrained choice says whether its structure is complete (``structured_incomplete``: it ended by
    max_tokens, a stop string or an error first, so its text does not parse), and why a constraint failed."""
    if plan.structured_field is None or c.final is None:
        return
    ch["structured_incomplete"] = c.final.structured_incomplete
    if c.final.structured_error is not None:
        ch["structured_error"] = c.final.structured_error


def _usage(plan: Plan, choices: list[_Choice]) -> dict:
    prompt = sum(len(p) for p in plan.prompts) + plan.image_tokens
    completion = sum(len(c.token_ids) for c in choices)
    # Prompt tokens count once per prompt (not per choice); so do cached ones: those every choice reused.
    cached = sum(min((c.final.num_cached_tokens if c.final else 0) for c in choices[i * plan.n:(i + 1) * plan.n])
                 for i in range(len(plan.prompts)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _completion_logprobs(state: ServerState, ids: list[int], lps: list[dict[int, float]], top: int | None,
                         offset: int = 0) -> dict | None:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
    if top is None:
        return None
    strings = state.token_strings
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(ids, lps, strict=True):
        s = strings.get(t)[0]
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(lp[t]))
        out["top_logprobs"].append({strings.get(k)[0]: _lp(v) for k, v in _top(lp, top)})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _chat_logprobs(state: ServerState, ids: list[int], lps: list[dict[int, float]], top: int | None) -> dict | None:
    if top is None:
        return None
    strings = state.token_strings
    content = []
    for t, lp in zip(ids, lps, strict=True):
        s, b = strings.get(t)
        content.append({"token": s, "logprob": _lp(lp[t]), "bytes": b, "top_logprobs": [
            {"token": strings.get(k)[0], "logprob": _lp(v), "bytes": strings.get(k)[1]} for k, v in _top(lp, top)]})
    return {"content": content, "refusal": None}


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's dict holds the top k and the chosen token, which may be outside them.
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k]


# -- streaming --------------------------------------------------------------------------------------


# Characters that JSON leaves raw but str.splitlines() breaks lines at: SSE clients that split with it (httpx's
# iter_lines, so the openai client's raw streams too) would cut an event in two. Escaped, the JSON is the same.
_SPLITLINES_SAFE = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(obj: dict) -> bytes:
    """One Server-Sent Event ``data: {json}`` on a single line for every line splitter."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False).translate(_SPLITLINES_SAFE)
    return b"data: " + text.encode() + b"\n\n"


def _parsed_chunks(state: ServerState, plan: Plan, c: _Choice, delta: str, new: list[int],
                   lps: list) -> list[dict]:
    """A parsed chat choice's next chunks: content and reasoning, then each finished call as two deltas (its
    index, id, type and name; then its arguments), then the finish reason."""
    em = c.out.feed(delta)
    if c.finish_reason is not None:
        rest = c.out.finish(truncated=c.finish_reason == "length")
        em.content, em.reasoning, em.calls = (em.content + rest.content, em.reasoning + rest.reasoning,
                                              em.calls + rest.calls)
        c.parsed = True
    deltas: list[dict] = []
    if em.content or em.reasoning:
        d: dict = {}
        if em.reasoning:
            d["reasoning"] = d["reasoning_content"] = em.reasoning
        if em.content:
            d["content"] = em.content
        deltas.append(d)
    for index, cid, call in em.calls:
        deltas.append({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    if c.finish_reason is not None or (not deltas and (plan.top_logprobs is not None or plan.return_token_ids)):
        deltas.append({})
    chunks = []
    for k, d in enumerate(deltas):
        ch = {"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}
        if k == 0:
            ch["logprobs"] = _chat_logprobs(state, new, lps, plan.top_logprobs)
            if plan.return_token_ids:
                ch["token_ids"] = new
        chunks.append(ch)
    if c.finish_reason is not None:
        chunks[-1]["finish_reason"] = _finish_reason(c)
        _structured_fields(plan, c, chunks[-1])
    return chunks


async def _stream(state: ServerState, plan: Plan, sink: asyncio.Queue, index: dict[str, int],
                  choices: list[_Choice]) -> AsyncIterator[bytes]:
    obj = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
    head = {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}
    offsets = [0] * len(choices)
    try:
        if plan.kind == "chat":  # OpenAI opens every choice with its role
            chunk = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for c in choices]
            yield sse_event({**head, "choices": chunk})
        left = len(choices)
        while left:
            d = await sink.get()
            if d.error is not None:
                err = APIError(500, f"the engine failed: {type(d.error).__name__}: {d.error}", code="engine_error")
                yield sse_event(err.body())
                return
            c = _apply(d, index, choices)
            new = d.output.new_token_ids
            delta = ""
            if c.finish_reason is not None:
                left -= 1
                if c.text is not None:  # the engine's final text: cut before a stop string this token completed
                    delta = c.text.finish(_choice_text(c, state.engine.tokenizer, plan.keep_special,
                                                       state.engine.eos_token_ids))
            elif c.text is not None and new:
                delta = c.text.add(new)
            if not (delta or c.finish_reason or plan.top_logprobs is not None or plan.return_token_ids):
                continue  # text held back (a split character, a possible stop string): nothing to say yet
            lps = d.output.new_logprobs or []
            if c.out is not None:
                for chunk in _parsed_chunks(state, plan, c, delta, new, lps):
                    yield sse_event({**head, "choices": [chunk]})
                continue
            if plan.kind == "completion":
                ch = {"index": c.index, "text": delta, "logprobs": _completion_logprobs(
                    state, new, lps, plan.top_logprobs, offsets[c.index]), "finish_reason": c.finish_reason}
            else:
                ch = {"index": c.index, "delta": {"content": delta} if delta or not c.finish_reason else {},
                      "logprobs": _chat_logprobs(state, new, lps, plan.top_logprobs),
                      "finish_reason": c.finish_reason}
            if plan.top_logprobs is not None and state.token_strings is not None:  # as the non-streamed text_offset
                offsets[c.index] += sum(len(state.token_strings.get(t)[0]) for t in new)
            if plan.return_token_ids:
                ch["token_ids"] = new
            if c.finish_reason is not None:
                _structured_fields(plan, c, ch)
            yield sse_event({**head, "choices": [ch]})
        if plan.include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(plan, choices)})
        yield b"data: [DONE]\n\n"
    finally:  # also when the client disconnected (Starlette cancels this generator)
        _cancel_unfinished(state, plan, choices)
