"""The shape the router's own errors take, by route: OpenAI's by default, Anthropic's on the Messages routes.

The router builds every refusal once, in OpenAI's shape (`errors`); a route
whose clients parse another API's errors names its `Shape` in the route
table (`routes.Route.error_shape`), and the request path, the answer path
and the 405 pass each refusal through it at the one place it leaves:

- `whole(refusal)`: the refusal as the route's clients parse it, status
  and headers (Retry-After, WWW-Authenticate, x-should-retry) kept;
- `event(refusal)`: the refusal as the last event of a stream already
  open (a cold start held it, see conventions.held_for_cold_start);
- `engine_event(body)`: an engine's whole error answer to such a stream,
  as an event, when it is one of this shape's errors (else None);
- `stream_error(message, type, code)`: a stream whose engine died.

Why Anthropic's is a shape of its own: the `anthropic` SDK (and Claude
Code) raise by status but read `error.type` and `error.message` from
`{"type": "error", "error": {...}}`, and in a stream expect `event: error`;
an OpenAI body reaches them as an unparsed blob, and an OpenAI-shaped
`data:` event in the middle of a Messages stream is not an event they know.

Errors an engine returns are passed on untouched, in whatever shape the
engine gave them: the router is transparent, and vLLM answers its own
Messages route in Anthropic's shape already.

It must not know about endpoints, keys or the catalog.
"""
from __future__ import annotations

import json
from typing import Any, Protocol

from aiohttp import web

from ..httpserver import error_body

__all__ = ["ANTHROPIC", "OPENAI", "AnthropicShape", "OpenAIShape", "Shape"]


class Shape(Protocol):
    """How a route's clients parse the router's own errors (see the module docstring for each method)."""

    name: str

    def whole(self, refusal: web.Response) -> web.Response: ...

    def event(self, refusal: web.Response) -> bytes: ...

    def engine_event(self, body: bytes) -> bytes | None: ...

    def stream_error(self, message: str, type_: str, code: str) -> bytes: ...


class OpenAIShape:
    """OpenAI's `{"error": {"message", "type", "code"}}`, which `errors` already builds: refusals as they are."""

    name = "openai"

    def whole(self, refusal: web.Response) -> web.Response:
        return refusal

    def event(self, refusal: web.Response) -> bytes:
        # OpenAI SDKs raise an APIError on a `data:` event holding an error object.
        return b"data: " + _body(refusal) + b"\n\n"

    def engine_event(self, body: bytes) -> bytes | None:
        body = body.strip()
        if body.startswith(b'{"error"'):
            return b"data: " + body.replace(b"\n", b"") + b"\n\n"
        return None

    def stream_error(self, message: str, type_: str, code: str) -> bytes:
        return b"data: " + error_body(message, type_, code) + b"\n\n"


# Anthropic's error types by status (docs.anthropic.com, "Errors"). A 503
# of the router's -- no replica ready, a cold start past its timeout, a
# model that cannot be placed now -- is capacity missing for a while, which
# is what `overloaded_error` tells a client (Anthropic's own is a 529);
# the status stays the router's, so Retry-After keeps its meaning.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_type(status: int) -> str:
    """Anthropic's `error.type` for an HTTP status: the table's, else `api_error` for a 5xx, else `invalid_request_error`."""
    found = _ANTHROPIC_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_body(message: str, type_: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()


class AnthropicShape:
    """Anthropic's `{"type": "error", "error": {"type", "message"}}`, and `event: error` in a stream."""

    name = "anthropic"

    def whole(self, refusal: web.Response) -> web.Response:
        headers = {k: v for k, v in refusal.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.Response(status=refusal.status, content_type="application/json", headers=headers,
                            body=anthropic_body(_message(_body(refusal)), anthropic_type(refusal.status)))

    def event(self, refusal: web.Response) -> bytes:
        return _event(anthropic_body(_message(_body(refusal)), anthropic_type(refusal.status)))

    def engine_event(self, body: bytes) -> bytes | None:
        body = body.strip()
        if body.startswith((b'{"type":"error"', b'{"type": "error"')):
            return _event(body.replace(b"\n", b""))
        if body.startswith(b'{"error"'):
            # An engine's OpenAI-shaped error on this route (a validation error
            # vLLM's framework answers before its Messages handler runs).
            message = _message(body)
            return _event(anthropic_body(message, "api_error"))
        return None

    def stream_error(self, message: str, type_: str, code: str) -> bytes:
        # Anthropic's streams end a failure with an `error` event; an engine
        # that died mid-stream is an API error on their side of the line.
        return _event(anthropic_body(message, "api_error"))


OPENAI = OpenAIShape()
ANTHROPIC = AnthropicShape()


def _event(data: bytes) -> bytes:
    return b"event: error\ndata: " + data + b"\n\n"


def _body(refusal: web.Response) -> bytes:
    body = refusal.body
    # The router's refusals are JSON bytes (errors.response); anything else has no message to carry.
    return body if isinstance(body, bytes) else b"{}"


def _message(body: bytes) -> str:
    """The `error.message` of an OpenAI-shaped error body (the router's own, or an engine's), else a stand-in."""
    try:
        doc: Any = json.loads(body)
    except ValueError:
        return "the router could not answer the request"
    error = doc.get("error") if type(doc) is dict else None
    message = error.get("message") if type(error) is dict else None
    return message if type(message) is str else "the router could not answer the request"
