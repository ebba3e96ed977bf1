"""What clients, proxies and browsers expect of an HTTP API, each done the way the tool it mimics does it.

- every answer carries `X-Request-Id` (`stamp_request_id`, a response-prepare
  hook, so errors, streams and aiohttp's own answers on the app get it too);
- a method a route does not take is 405 with `Allow` and a body in the
  route's error shape (`method_not_allowed`), where aiohttp would say 404;
- a stream held for a cold start gets SSE comments every few seconds
  (`held_for_cold_start`), so neither the client nor a proxy between takes the
  silence for a dead connection.

It must not know how requests are routed: the server hands each function the
request (and, for the cold start, the one `call.Call`-like object it needs).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from time import perf_counter
from typing import Protocol, TypeVar

from aiohttp import web

from ..aio import cancel_and_wait
from ..httpserver import new_request_id as new_id
from . import errors, routes
from .headers import REQUEST_ID, valid_id

log = logging.getLogger("llmgw.router")

T = TypeVar("T")

# Where a proxied request's id is kept on the request, for the hook below.
RID = web.RequestKey("llmgw_request_id", str)


# -- request ids --------------------------------------------------------------------------------

async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Put the request's id on `response` as it is prepared (on_response_prepare).

    A proxied request's id was taken at arrival and stored on the request
    (`request.RequestPath.proxy`, which also sends it to the engine); any other route takes
    the client's, if valid, or makes one here.
    """
    if REQUEST_ID in response.headers:
        return
    rid = request.get(RID)
    if rid is None:
        sent = request.headers.get(REQUEST_ID)
        rid = sent if sent is not None and valid_id(sent) else new_id()
    response.headers["X-Request-Id"] = rid


# -- 405 ------------------------------------------------------------------------------------------

# The router's read-only routes (GET, and the HEAD aiohttp adds to each).
_GET_PATHS = frozenset(("/v1/models", "/healthz", "/health", "/readyz", "/metrics"))


def method_not_allowed(request: web.Request, *, cors: bool) -> web.Response | None:
    """405 with Allow when `request`'s path is a route of the router's under another method; else None (a 404)."""
    path = request.path
    route = routes.BY_PATH.get(routes.template_of(path))
    if path in _GET_PATHS or path.startswith("/v1/models/"):
        allow = "GET, HEAD"
    elif route is not None:
        # The routes the router proxies (routes.TABLE), a stored response's by its id.
        allow = ", ".join(route.methods)
    else:
        return None
    if cors:
        allow += ", OPTIONS"
    refusal = errors.response(405, f"{request.method} is not allowed on {errors.quote(path)}; it takes {allow}",
                              "invalid_request_error", "method_not_allowed", headers={"Allow": allow})
    return route.error_shape.whole(refusal) if route is not None else refusal


# -- a stream held for a cold start ------------------------------------------------------------

class ClientGone(Exception):
    """The client left while its stream was held for a cold start (a keep-alive comment could not be written)."""


class _Versioned(Protocol):
    @property
    def version(self) -> str: ...


class ColdCall(Protocol):
    """What a cold-start wait needs of the request in flight (the server's per-request record).

    Declared here so this module needs nothing of the server's: the record
    says whether it streams, for which model, and holds the stream opened early.
    """

    early: web.StreamResponse | None

    @property
    def stream(self) -> bool: ...
    @property
    def model(self) -> str: ...
    @property
    def request(self) -> web.Request: ...
    @property
    def view(self) -> _Versioned: ...


async def held_for_cold_start(call: ColdCall, wait: Awaitable[T], interval: float) -> T:
    """Await `wait` (the cold-start wait of `call`); for a stream, send an SSE comment every `interval` meanwhile.

    A wait shorter than `interval` sends nothing, so its outcome keeps its own
    status code. Past it, the stream's 200 and headers go out, `call.early`
    holds the response, and `: waiting for model X to start` follows every
    `interval` seconds: SSE comments, which every SSE parser skips (the OpenAI
    SDKs included) and which keep proxies' idle timers from cutting the
    connection. What happens next is the caller's: the engine's stream goes
    into `call.early`, a refusal becomes its last event.
    """
    if not (call.stream and interval > 0):
        return await wait
    task = asyncio.ensure_future(wait)
    t0 = perf_counter()
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=interval)
            if done:
                return task.result()
            await _comment(call, f": waiting for model {call.model} to start, "
                                 f"{perf_counter() - t0:.0f} s so far\n\n".encode())
    finally:
        # Its outcome no longer matters (the client left, or this handler was
        # cancelled: that cancellation goes on to the caller).
        await cancel_and_wait(task)


async def _comment(call: ColdCall, line: bytes) -> None:
    try:
        if call.early is None:
            # No cache, and no buffering by a proxy in front (nginx), as for any stream.
            resp = web.StreamResponse(status=200, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                "x-llmgw-catalog-version": call.view.version})
            await resp.prepare(call.request)
            call.early = resp
        await call.early.write(line)
    except ConnectionError:
        raise ClientGone() from None
