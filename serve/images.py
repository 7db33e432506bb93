"""Images in chat messages: each ``image_url`` content part placed where it is in the prompt, checked against the
server's limits, then fetched and decoded for the engine (llmc.runtime.vision).

Placement: a chat template that handles image parts itself (it compares a part's type with ``'image'``, as
transformers' multimodal templates do) gets the message's parts, an image as ``{"type": "image"}``; any other
template gets the text with the model's image token (its text in the tokenizer) where each image was. Either way
the rendered prompt must hold exactly one image token per image, which the engine expands to the image's tokens.
Every bad image — not an image, truncated, a decompression bomb, an unsupported format, too many, a bad URL, one
sent to an engine without an image encoder — is an :class:`~llmc.serve.errors.APIError` 400 naming the part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.vision import decode_image
from llmc.serve.errors import APIError
from llmc.serve.image_fetch import check_url, image_bytes
from llmc.serve.state import ServerState


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it is (``messages[i].content[j]``) and its URL."""

    where: str
    url: str


def _part(p) -> dict:
    return p if isinstance(p, dict) else p.model_dump()


def image_token(state: ServerState) -> tuple[int, str | None]:
    """The engine's image placeholder token id and its text (None where the tokenizer has no text that encodes
    to that one token)."""
    section = state.engine.manifest.get("multimodal") or {}
    # the prompt's placeholder: the image token, or a family's own (Gemma 3: its start-of-image token)
    token_id = int(section.get("placeholder_token_id") or section["image_token_id"])
    tok = state.engine.tokenizer
    text = tok.id_to_token(token_id) if tok is not None else None
    if text is None or tok.encode(text, add_special_tokens=False) != [token_id]:
        return token_id, None
    return token_id, text


def _engine_takes_images(state: ServerState, where: str) -> None:
    engine = state.engine
    if not (engine.manifest.get("multimodal") or {}).get("encoder_graph"):
        raise APIError(400, f"{where}: the engine {engine.path.name!r} takes no images (a text model, or a "
                       "vision-language model built --text-only); send text only", param=where,
                       code="images_not_supported")
    if getattr(engine, "images", None) is None:  # llmc serve --replicas: the ingress holds no engine
        raise APIError(400, f"{where}: images are not served behind --replicas yet; serve this engine from one "
                       "server", param=where, code="images_not_supported")


def flatten(state: ServerState, messages) -> tuple[list[dict], list[ImageRef]]:
    """The messages as the chat template takes them, and their images in prompt order (each URL checked,
    the count limited, the engine able to take them)."""
    flat: list[dict] = []
    refs: list[ImageRef] = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=False) if not isinstance(m, dict) else dict(m)
        content = d.get("content")
        if isinstance(content, list):
            parts = [_part(p) for p in content]
            images = [ImageRef(f"messages[{i}].content[{j}]", p["image_url"]["url"])
                      for j, p in enumerate(parts) if p.get("type") == "image_url"]
            if images:
                _engine_takes_images(state, images[0].where)
            d["content"] = _content(state, parts) if images else "".join(p["text"] for p in parts)
            refs += images
        flat.append(d)
    if refs:
        limit = state.config.max_images_per_request
        if len(refs) > limit:
            raise APIError(400, f"messages: {len(refs)} images, this server takes at most {limit} per request "
                           "(--max-images-per-request)", param="messages", code="too_many_images")
        for ref in refs:
            check_url(ref.url, ref.where, state.config)
    return flat, refs


def _content(state: ServerState, parts: list[dict]) -> str | list[dict]:
    """One message's parts with images: the parts themselves for a template that places images, else the text
    with the image token's text at each image."""
    if state.chat_template is not None and state.chat_template.takes_images:
        return [{"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]}
                for p in parts]
    token_id, text = image_token(state)
    if text is None:
        raise APIError(400, f"messages: the engine's chat template does not place images and its tokenizer has no "
                       f"text for the image token {token_id}", param="messages", code="images_not_supported")
    return "".join(text if p["type"] == "image_url" else p["text"] for p in parts)


def check_placeholders(state: ServerState, ids: list[int], refs: list[ImageRef]) -> None:
    """400 unless the rendered prompt ``ids`` holds one image token per image."""
    token_id, text = image_token(state)
    found = sum(1 for t in ids if t == token_id)
    if found != len(refs):
        shown = f" ({text!r})" if text else ""
        raise APIError(400, f"messages: {len(refs)} images but {found} image tokens{shown} in the rendered prompt; "
                       "do not write the image token in the text", param="messages", code="image_placeholder")


def load_images(state: ServerState, refs: list[ImageRef]) -> list[np.ndarray]:
    """Each image fetched and decoded to ``uint8 [H, W, 3]`` (blocking: run it off the event loop)."""
    out = []
    for ref in refs:
        data = image_bytes(ref.url, ref.where, state.config)
        try:
            out.append(decode_image(data, max_pixels=state.config.max_image_pixels, name=ref.where))
        except LlmcError as exc:
            raise APIError(400, str(exc), param=ref.where, code="invalid_image") from exc
    return out
