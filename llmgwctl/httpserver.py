"""Hardening shared by llmgw's aiohttp servers: the router's public port and the control API.

Owns what bounds a connection before any handler runs -- aiohttp's parser
limits and keep-alive timer (`server_options`), the cap on open connections
per client address (`ConnectionGuard`) -- what a server answers when aiohttp
itself refuses a request or a handler fails unexpectedly (`json_errors`, with
an `X-Request-Id` like every other answer, `request_id`), reading the port
a server bound (`bound_port`), and the one builder of the OpenAI error
shape both servers answer with (`error_document`, `error_body`,
`error_response`). Which web pages may use a server is
`llmgwctl.httporigin`. Both servers face strangers
once bound beyond loopback, so both take the same limits from here; each
caller decides its own values where its traffic differs. Decoding a
compressed request body within a bound is `llmgwctl.httpbody`.

It must not know about routes, models or endpoints: it sees connections and
header lines only.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # only for the annotation: the constants above load without aiohttp
    from aiohttp import web

log = logging.getLogger("llmgw.httpserver")

# A client's request id passed on as it is: printable and short enough to log,
# quote and put in a header again. 128: room for a UUID, a ULID or a trace id
# with a prefix, and small enough that an id cannot bloat every log line it is
# written to. The one rule: the router's own (router.headers) is this one.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

# An idle keep-alive connection is closed after this, and a new connection
# (or the next request on one) must complete its headers within it, which
# is what defeats slowloris. Longer than the idle expiry of common client
# pools (httpx 5 s, aiohttp 15 s, requests never reuses past a minute), so
# clients close first and never send on a socket the server is closing;
# 75 s is also nginx's default. The control API's long-polls answer within
# 30 s, so it never cuts one.
CLIENT_IDLE_TIMEOUT = 75.0
# Request line and each header line; 8 KiB is what aiohttp and nginx allow
# by default, and an API key or a trace header is a few hundred bytes.
MAX_HEADER_BYTES = 8190
# Header lines per request: SDKs send about ten.
MAX_HEADERS = 128
# Open connections per client address (0: no limit). A busy application
# server keeps its pool of 100 (httpx, aiohttp defaults) and more in bursts,
# and a rack of agents behind one NAT holds two each (report and long-poll);
# 256 is above both and still far below the file-descriptor limit, so one
# address cannot take every socket. Behind a load balancer every client
# shares its address: raise it or set 0 there.
MAX_CONNECTIONS_PER_CLIENT = 256

# What a client past its connection limit reads before the socket closes: a
# valid HTTP response, so it sees why instead of a bare reset.
_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
             b"X-Request-Id: %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


def server_options(*, client_idle_timeout: float = CLIENT_IDLE_TIMEOUT, max_field_size: int = MAX_HEADER_BYTES,
                   max_headers: int = MAX_HEADERS) -> dict[str, Any]:
    """Keyword arguments for aiohttp's request handler (via `web.AppRunner(..., **options)`).

    aiohttp's keep-alive timer closes a connection still waiting for a
    complete request when it fires, so `client_idle_timeout` bounds slow
    headers as well as idle connections; an over-long line or too many
    header lines is answered 400 by the parser.

    auto_decompress is off: aiohttp would inflate a gzip body whole, past any
    size limit (a 1 MB body inflating to 1 GiB was inflated to its end after
    the 413), so a server decodes bodies itself, bounded (`llmgwctl.httpbody`),
    or refuses encoded ones.
    """
    return {"keepalive_timeout": client_idle_timeout, "max_line_size": max_field_size,
            "max_field_size": max_field_size, "max_headers": max_headers, "auto_decompress": False}


def bound_port(runner: web.BaseRunner) -> int:
    """The port `runner`'s first site listens on: the one the kernel chose when it was asked for 0."""
    return int(runner.addresses[0][1])


class ConnectionGuard:
    """Counts open connections per client address on an aiohttp server; refuses past `limit` (0: no limit).

    Installed with `install(server)` on the `web.Server` an AppRunner made: it
    wraps that server's connection_made / connection_lost, which every
    connection passes through exactly once each. The connection past the
    limit is answered 429 and closed at once.
    """

    def __init__(self, limit: int, on_refuse: Callable[[str], None] = lambda addr: None):
        self.limit = limit
        self._on_refuse = on_refuse
        self.open: dict[str, int] = {}
        self._counted: dict[Any, str] = {}

    def install(self, server: Any) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            addr = peer[0] if peer else "?"
            n = self.open.get(addr, 0)
            if self.limit and n >= self.limit:
                self._on_refuse(addr)
                log.warning("refused a connection from %s: it already has %d open (limit %d)", addr, n, self.limit)
                transport.write(_TOO_MANY % (request_id(None).encode(), len(_TOO_MANY_BODY), _TOO_MANY_BODY))
                # Closed on the next loop turn, not here: aiohttp starts the
                # connection's handler task after this returns, and a connection
                # closed (force_close closes the transport) before that task's
                # first step left it asserting on a cleared manager -- one "Task
                # exception was never retrieved" traceback in the log per refused
                # connection, thousands of them when a fleet passes the cap.
                asyncio.get_running_loop().call_soon(handler.force_close)
                return
            self.open[addr] = n + 1
            self._counted[handler] = addr

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            addr = self._counted.pop(handler, None)
            if addr is not None:
                n = self.open.get(addr, 1) - 1
                if n > 0:
                    self.open[addr] = n
                else:
                    self.open.pop(addr, None)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost


# -- errors aiohttp answers itself ------------------------------------------------------

# What a request aiohttp's parser refused is told, by the parser's exception
# class (looked up along its MRO, so a subclass a later aiohttp adds finds its
# parent's). A fixed sentence each: aiohttp's own messages quote the bytes the
# client sent, and an answer must never echo a stranger's bytes back.
_PROTOCOL_ERRORS = {
    "BadHttpMethod": ("the request method is not a valid HTTP method", "bad_http_method"),
    "BadStatusLine": ("the request line is not valid HTTP/1.1 (METHOD /path HTTP/1.1)", "bad_request_line"),
    "LineTooLong": ("the request line or a header line is too long", "header_too_large"),
    "InvalidHeader": ("a request header is not valid HTTP/1.1", "invalid_header"),
    "InvalidURLError": ("the request target is not a valid URL path", "invalid_url"),
    "TransferEncodingError": ("the request body's chunked encoding is not valid", "invalid_body_framing"),
    "ContentLengthError": ("the request body is shorter than its Content-Length", "invalid_body_framing"),
    "PayloadEncodingError": ("the request body is not valid for its encoding", "invalid_body_framing"),
    "BadHttpMessage": ("the request is not valid HTTP/1.1", "malformed_request"),
    # A body's framing error as a handler reading the body meets it, when the
    # handler lets it through; its cause (above) is what was wrong.
    "RequestPayloadError": ("the request body is not framed as its headers say (chunked encoding or "
                            "Content-Length)", "invalid_body_framing"),
}
_PROTOCOL_DEFAULT = ("the request is not valid HTTP/1.1", "malformed_request")


def error_document(message: str, type_: str, code: str | int) -> dict[str, Any]:
    """An error in the OpenAI shape every llmgw server answers with: `{"error": {"message", "type", "code"}}`.

    Clients are OpenAI SDKs: they read `error.message` and raise by status.
    The router's `code` names the error, as OpenAI's does; the control API's
    is the status. Built here only, so the two servers cannot drift apart.
    """
    return {"error": {"message": message, "type": type_, "code": code}}


def error_body(message: str, type_: str, code: str | int) -> bytes:
    """`error_document` as a response body."""
    return json.dumps(error_document(message, type_, code)).encode()


def error_response(status: int, message: str, type_: str, code: str | int, *,
                   headers: dict[str, str] | None = None) -> web.Response:
    """`error_body` as a JSON response with `status`."""
    from aiohttp import web

    return web.Response(status=status, body=error_body(message, type_, code), content_type="application/json",
                        headers=headers)


_TOO_MANY_BODY = error_body("too many connections from this address; reuse keep-alive connections or retry "
                            "shortly", "rate_limit_error", "too_many_connections")


def _protocol_error(exc: BaseException | None) -> tuple[str, str]:
    for cls in type(exc).__mro__ if exc is not None else ():
        found = _PROTOCOL_ERRORS.get(cls.__name__)
        if found is not None:
            return found
    return _PROTOCOL_DEFAULT


def json_errors(server: Any) -> None:
    """Make every answer aiohttp gives on its own behalf, on `server` (a `web.Server`), OpenAI-shaped JSON.

    aiohttp answers two things itself, both in plain text: a request its
    parser refuses (a bad request line or header, an over-long line, bad
    chunked framing: 400, with the offending bytes quoted), and a handler
    that raised something it did not catch (500; 504 for a TimeoutError).
    Both go through `RequestHandler.handle_error`, the one seam aiohttp has
    for them (3.9 to 3.14 alike), which the connections of `server` get
    overridden. The last resort for the unexpected is there rather than in a
    middleware: a middleware costs every request a call, this costs nothing
    until something fails. A 5xx is logged with its traceback; a client's
    malformed request at INFO, without its bytes.
    """
    from aiohttp import web

    if not isinstance(server, web.Server):
        raise TypeError(f"json_errors needs an aiohttp web.Server, not {type(server).__name__}")
    server.__class__ = _json_error_server_class()


def _is_payload_error(exc: BaseException | None) -> bool:
    return exc is not None and any(cls.__name__ == "RequestPayloadError" for cls in type(exc).__mro__)


def request_id(headers: Any) -> str:
    """The id an answer carries: the client's `X-Request-Id` when it is one llmgw would make or pass on, else a new one.

    The router's rule too (`router.headers` uses this one), for the answers no
    route makes: aiohttp's own refusals here, and the connection limit's.
    """
    sent = headers.get("X-Request-Id") if headers is not None else None
    if sent is not None and REQUEST_ID_PATTERN.fullmatch(sent):
        return str(sent)
    return new_request_id()


def new_request_id() -> str:
    """A fresh id: 64 random bits as hex.

    Not from `secrets`: an id names a request in logs, it guards nothing, and
    the Mersenne Twister makes one in a fraction of a microsecond without a
    system call.
    """
    return f"{random.getrandbits(64):016x}"


def _handle_error(self: Any, request: Any, status: int = 500, exc: BaseException | None = None,
                  message: str | None = None) -> Any:
    from aiohttp import web

    if request.writer.output_size > 0:
        # What aiohttp does too: the answer is under way, a second one cannot follow.
        raise ConnectionError("the response is under way; cannot send an error in its place")
    peer = request.remote or "?"
    if _is_payload_error(exc):
        # A handler read a body whose framing was broken and did not catch
        # it: the client's error, not a failure of llmgw's. Its cause, when
        # the table knows it, says best what was wrong.
        status = 400
        cause = exc.__cause__ if exc is not None else None
        if cause is not None and _protocol_error(cause) is not _PROTOCOL_DEFAULT:
            exc = cause
    if status >= 500:
        log.error("unexpected error answering %s %s from %s", request.method, request.path, peer, exc_info=exc,
                  extra={"event": "unexpected-error", "status": status})
        if status == 504:
            body = error_body("the request timed out inside llmgw", "server_error", "timeout")
        else:
            body = error_body("llmgw failed unexpectedly on this request; the error is logged", "server_error",
                              "internal_error")
    else:
        text, code = _protocol_error(exc)
        log.info("refused a malformed request from %s: %s (%s)", peer, code, type(exc).__name__,
                 extra={"event": "malformed-request", "code": code})
        body = error_body(text, "invalid_request_error", code)
    try:
        headers = request.headers
    except Exception:  # noqa: BLE001 -- a request the parser refused may have no headers to read
        headers = None
    resp = web.Response(status=status, body=body, content_type="application/json",
                        headers={"X-Request-Id": request_id(headers)})
    resp.force_close()      # what aiohttp does: the connection's framing cannot be trusted past this
    return resp


@functools.cache
def _json_error_server_class() -> type:
    # Built on first use: this module's constants load without aiohttp.
    from aiohttp import web
    from aiohttp.web_protocol import RequestHandler

    class _JsonErrorHandler(RequestHandler):
        __slots__ = ()      # the same layout as RequestHandler's, so a handler's class can be swapped
        handle_error = _handle_error

    class JsonErrorServer(web.Server):
        """A `web.Server` whose connections answer aiohttp's own errors in JSON (see `json_errors`)."""

        def __call__(self) -> Any:
            handler = super().__call__()
            handler.__class__ = _JsonErrorHandler
            return handler

    return JsonErrorServer
