"""The control API's middlewares: the last resort for the unexpected, and the one reader of request bodies.

    unexpected   an exception no handler expected (a bug), and aiohttp's own
                 refusals (404, 405, 413), answered in the API's JSON error shape
    bodies       Content-Type and Content-Encoding of a state-changing request,
                 its size, and its arrival within BODY_TIMEOUT, checked before
                 any handler reads it
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from .answers import error as _error

log = logging.getLogger("llmgw.control")

# Catalog documents above this are refused: the largest real catalogs are a
# few hundred KB; this bounds what a client can make the controller parse.
# No other body the API takes comes near it (a full node's report is tens of KB).
MAX_APPLY_BYTES = 4 * 1024 * 1024
# A request body must be in within this once its headers are: the largest
# the API takes (MAX_APPLY_BYTES) arrives in 30 s at 140 KB/s, slower than
# any link an operator applies a catalog over, and an agent gives up on a
# report after 10 s (agent.controller.REPORT_TIMEOUT), so a report slower
# than this has nobody waiting for its answer. A client trickling a body is
# holding a connection and a handler, not sending a request.
BODY_TIMEOUT = 30.0
# What changes something. Each such route takes a JSON document, and asking
# for `Content-Type: application/json` is what makes a browser ask first (a
# CORS preflight) before another site's page can send one: text/plain,
# form and multipart bodies are sent without asking.
_UNSAFE = frozenset(("POST", "PUT", "PATCH", "DELETE"))


@web.middleware
async def unexpected(request: web.Request, handler: Handler) -> web.StreamResponse:
    # The last resort: an exception no handler expected (a bug) is logged with
    # its traceback and answered in the API's JSON error shape, not aiohttp's
    # bare-text 500, so a client (and `llmgwctl`) can show why. aiohttp's own
    # refusals raised on the way (no such route, a method the route does not
    # take, a body past the size limit) are answered in that shape too.
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return http_error(request, exc)
    except Exception as exc:
        log.exception("%s %s failed unexpectedly", request.method, request.path)
        return _error(500, f"{request.method} {request.path} failed unexpectedly ({type(exc).__name__}); "
                           "this is a bug in llmgw, the server log has the traceback", kind="server_error")


def http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """An aiohttp HTTPException (404, 405, 413, ...) as the API's JSON error, its Allow header kept."""
    path = request.path[:100]
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = _error(405, f"{request.method} is not allowed on {path}; it takes {allowed}")
        resp.headers["Allow"] = exc.headers.get("Allow", allowed)
        return resp
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _error(413, f"the request body is larger than the control API takes ({MAX_APPLY_BYTES} bytes)")
    text = exc.text or ""
    if not text or text.startswith(f"{exc.status}: "):
        # aiohttp's own "404: Not Found": say which route was missed instead.
        text = (f"no route {request.method} {path} on the control API (its routes are under /api/v1/; "
                "llmgwctl-serve(1) lists them)" if exc.status == 404 else exc.reason)
    return _error(exc.status, text, kind="not_found_error" if exc.status == 404 else "invalid_request_error")


@web.middleware
async def bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    # One place for every handler that reads a body.
    # - A state-changing route takes `Content-Type: application/json` only
    #   (see _UNSAFE); every client of the API (the CLI, agents, routers)
    #   sends that already. A route that does not exist is its own 404/405.
    # - aiohttp does not decompress bodies on llmgw's servers (an inflating
    #   body grew past every limit, see httpserver.server_options), and no
    #   client of this API compresses one, so an encoded body is refused
    #   before any handler reads it rather than parsed as bytes it is not.
    # - The body is read here, within BODY_TIMEOUT; handlers then read it
    #   from memory (aiohttp keeps what read() returned). Only a body still
    #   arriving waits: the usual request is whole when its handler starts.
    # - A body whose framing is broken (bad chunks, short of its
    #   Content-Length) fails while being read; it is the client's error,
    #   which aiohttp would answer 500. So is a body nested deeper than the
    #   JSON parser recurses ([[[[... 100,000 deep): json.loads raises
    #   RecursionError, which is no ValueError, and every handler's 400 for
    #   a body that is not JSON missed it (a 500 "bug").
    if request.method in _UNSAFE and request.match_info.http_exception is None \
            and request.content_type != "application/json":
        sent = request.headers.get("Content-Type")
        return _error(415, f"{request.method} {request.path[:100]} takes a JSON document sent with "
                           f"Content-Type: application/json, not {'no Content-Type' if sent is None else repr(sent[:100])}")
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return _error(415, "the control API takes request bodies uncompressed (no Content-Encoding)")
    length = request.content_length
    if length is not None and length > MAX_APPLY_BYTES:
        # Said before it is sent: nothing of it is read (aiohttp would read up to the limit first).
        resp = _error(413, f"the request body is larger than the control API takes ({MAX_APPLY_BYTES} bytes)")
        resp.force_close()
        return resp
    try:
        if request.body_exists and not request.content.is_eof():
            try:
                await asyncio.wait_for(request.read(), BODY_TIMEOUT)
            except asyncio.TimeoutError:
                log.info("%s %s from %s: the body did not arrive within %g s; closing the connection",
                         request.method, request.path, request.remote, BODY_TIMEOUT,
                         extra={"event": "body-timeout"})
                resp = _error(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s",
                              kind="timeout_error")
                resp.force_close()      # what is left of the body is not read: the connection cannot carry another
                return resp
        return await handler(request)
    except web.RequestPayloadError:
        return _error(400, "the request body is not framed as its headers say (chunked encoding or Content-Length)")
    except RecursionError:
        return _error(400, "the request body nests too deeply to be read as JSON")
