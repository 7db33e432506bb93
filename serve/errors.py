"""The OpenAI error object, and the exception that carries one out of a handler.

Every failure a client can cause leaves the server as ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status, as OpenAI's API answers, so that its clients raise their typed exceptions
(``BadRequestError``, ``AuthenticationError``, ``RateLimitError``…) with the message intact.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# OpenAI's error types by status; clients branch on the status, people read the message.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """A request that cannot be served: the status, one-line message, and the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Fields whose value may take several shapes: one message that lists them beats one error per shape.
_UNION_MESSAGES = {
    "prompt": "must be a string, an array of strings, an array of token ids, or an array of arrays of token ids",
    "stop": "must be a string or an array of strings",
    "content": "must be a string or an array of content parts ({\"type\": \"text\", \"text\": ...} or "
               "{\"type\": \"image_url\", \"image_url\": {\"url\": ...}})",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def field_path(loc: Sequence[str | int]) -> str:
    """``("messages", 0, "content", "str")`` -> ``messages[0].content`` (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part.startswith(("function-", "literal[")) or part[:1].isupper():
            continue  # pydantic's tag for the union member it tried, not a field
        else:
            out += f".{part}" if out else part
    return out


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    path = field_path(loc)
    leaf = next((p for p in reversed(loc) if isinstance(p, str) and field_path([p])), "")
    is_union = any(isinstance(p, str) and ("[" in p or p in _TYPE_TAGS) for p in loc)
    if err["type"] == "missing":
        msg = f"{path}: required field is missing"
    elif is_union and leaf in _UNION_MESSAGES:
        path = field_path(loc[: loc.index(leaf) + 1])
        msg = f"{path}: {_UNION_MESSAGES[leaf]}"
    else:
        got = err.get("input")
        shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
        msg = f"{path}: {err['msg'][:1].lower()}{err['msg'][1:]} (got {shown[:80]})"
    return APIError(400, msg, param=path or None, code="invalid_value" if err["type"] != "missing" else "missing")
