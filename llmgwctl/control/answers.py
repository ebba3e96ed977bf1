"""How the control API answers: its JSON error shape, the `{"ok": true}` body, and the query values long-polls take.

One place for them, so every route module answers the same way. Errors are
the OpenAI shape the router answers with too (`httpserver.error_document`),
with the HTTP status as their code.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..httpserver import error_document
from ..reconciler import LONG_POLL

OK = json.dumps({"ok": True}).encode()
# What a 429 or 503 of a busy route (a catalog apply) tells the client to
# wait: about one validation of a catalog directory.
RETRY_AFTER = 5


def error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> web.Response:
    """The JSON error answer: `{"error": {"message", "type", "code": status}, **extra}`."""
    return web.json_response({**error_document(message, kind, status), **extra}, status=status)


def retry_later(status: int, message: str, kind: str) -> web.Response:
    """`error`, with a Retry-After of RETRY_AFTER seconds."""
    resp = error(status, message, kind)
    resp.headers["Retry-After"] = str(RETRY_AFTER)
    return resp


def after(request: web.Request) -> int | None:
    """A long-poll's `?after=V` (the version the client holds); None when not given; 400 when not an integer."""
    raw = request.query.get("after")
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps(error_document(f"after must be an integer, got {raw!r}",
                                                                "invalid_request_error", 400)),
                                 content_type="application/json") from None


def poll_timeout(request: web.Request) -> float:
    """A long-poll's hold, `?timeout=S`: tests and impatient clients may ask for a shorter one, never a longer."""
    try:
        return max(0.0, min(LONG_POLL, float(request.query.get("timeout", LONG_POLL))))
    except ValueError:
        return LONG_POLL
