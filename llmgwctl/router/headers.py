"""What of a client's request reaches an engine, and the request id every answer carries.

The policy (man/llmgwctl-router.1, HEADERS): an engine gets the body, a
`Content-Type: application/json` of the router's own, and exactly these from
the client, each checked and dropped when malformed:

    X-Request-Id   the client's when it is 1-128 characters of [A-Za-z0-9._:@/+=-],
                   else one the router makes (16 hex digits); always sent, and
                   returned on every answer, errors and streams included
    traceparent    W3C Trace Context, when it parses as one
    tracestate     only with a valid traceparent (the spec's rule), at most 512
                   printable ASCII characters

Nothing else: not `Authorization` (the client's API key is the gateway's
credential, not the engine's), not cookies, not `Accept-Encoding` (engines
answer uncompressed, see upstream/outgoing.py), not `User-Agent` or any `X-Forwarded-*`
(an engine needs none of them, and an allow-list is the only list that stays
safe as clients invent headers). An id from outside is bounded and limited to
characters that cannot break a log line or a header, since it is written to
both.

It must not know about routing: the server calls `take` once per request.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from ..httpserver import REQUEST_ID_PATTERN as _ID
from ..httpserver import new_request_id as new_id

REQUEST_ID = "x-request-id"

# What an id from outside may be, and how a fresh one is made: one rule for
# every llmgw server (httpserver), so an answer aiohttp or the connection
# limit makes carries an id by the same rule as the router's own.
# version-traceid-parentid-flags; future versions may append fields after a '-'.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]*)?")
_TRACEPARENT_MAX = 256
# Version ff and all-zero ids are invalid by the spec.
_ZERO_TRACE, _ZERO_PARENT = "0" * 32, "0" * 16
# The spec's own bound for what a vendor must pass on.
_TRACESTATE_MAX = 512
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


def valid_id(value: str | None) -> bool:
    return value is not None and _ID.fullmatch(value) is not None


def take(headers: Mapping[str, str]) -> tuple[str, bytes]:
    """(request id, the header lines for the engine) from a request's headers (a case-insensitive mapping).

    The lines are ready for the request head (`Name: value\\r\\n` each), so
    the upstream client writes them as they are.
    """
    rid = headers.get(REQUEST_ID)
    if rid is None or not valid_id(rid):
        rid = new_id()

    lines = b"X-Request-Id: " + rid.encode("ascii") + b"\r\n"
    parent = headers.get("traceparent")
    if (parent is not None and len(parent) <= _TRACEPARENT_MAX and _TRACEPARENT.fullmatch(parent)
            and not parent.startswith("ff") and parent[3:35] != _ZERO_TRACE and parent[36:52] != _ZERO_PARENT):
        lines += b"traceparent: " + parent.encode("ascii") + b"\r\n"
        state = headers.get("tracestate")
        if state is not None and len(state) <= _TRACESTATE_MAX and _PRINTABLE.fullmatch(state):
            lines += b"tracestate: " + state.encode("ascii") + b"\r\n"
    return rid, lines
