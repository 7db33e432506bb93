"""POST /tokenize and /detokenize (vLLM's): text or chat messages to token ids, and back."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmc.serve.errors import APIError
from llmc.serve.generate import chat_prompt_ids, check_model
from llmc.serve.protocol import DetokenizeRequest, TokenizeRequest
from llmc.serve.routes.request_body import authorize, body_of, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    authorize(request)
    req, _ = await body_of(request, TokenizeRequest)
    state = server_state(request)
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "prompt: give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        ids = chat_prompt_ids(state, req.messages, True, None)
    else:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    authorize(request)
    req, _ = await body_of(request, DetokenizeRequest)
    state = server_state(request)
    check_model(state, req.model)
    vocab_size = state.engine.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is outside the vocabulary (0..{vocab_size - 1})",
                       param="tokens", code="invalid_token_id")
    return {"prompt": state.tokenizer.decode(req.tokens)}
