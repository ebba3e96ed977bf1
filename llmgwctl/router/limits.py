"""Input limits for everything a stranger can reach on the router's port.

What bounds what (defaults and their reasons are in `RouterConfig`):

- body size: `max_body_bytes`, 413 before the body is read when the client
  declares it, and while reading when it does not;
- a slow body: `body_timeout` for the whole body once the headers are in;
- headers: aiohttp's parser limits, passed by `server_options` (request line
  and each header line at most 8 KiB, at most 128 header lines -> 400);
- slow headers (slowloris): a connection must finish its request headers
  within `client_idle_timeout` of opening (or of its previous response):
  aiohttp's keep-alive timer closes a connection still waiting for a complete
  request when it fires, and this is the value it is given;
- JSON nesting: `check_depth` (-> 400) before anything walks the document;
- connections per client address: `ConnectionGuard`, installed on the aiohttp
  server: the connection past the limit is answered 429 and closed at once,
  so one address cannot hold every socket the router has;
- a streaming client that stops reading: `client_write_timeout`, then the
  connection is aborted and the engine's slot freed (server.py);
- a stream whose engine goes silent: `upstream_idle_timeout` (the upstream
  pool's idle timer, on streams only), 504 before the first byte, an error event
  after. A whole reply is bounded by its client, whose disconnect cancels the
  upstream request.

Not here: the control API's long-polls are capped by the control API itself
(30 s, `reconciler.LONG_POLL`), and its body size by `MAX_APPLY_BYTES`.

A request to the router costs the strangers nothing they can multiply: every
wait is bounded in time, every buffer in size, and the number of both per
address.

It must not know about models or endpoints.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from .errors import RouterError

log = logging.getLogger("llmgw.router.limits")

# What a client past its connection limit reads before the socket closes: a
# valid HTTP response, so it sees why instead of a bare reset.
_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"message": "too many connections from this address; reuse keep-alive '
                  b'connections or retry shortly", "type": "rate_limit_error", "code": "too_many_connections"}}')


class DepthError(RouterError, ValueError):
    pass


def check_depth(body: bytes, doc: Any, limit: int) -> None:
    """DepthError if `doc` (parsed from `body`) nests lists/objects deeper than `limit`.

    Fast path: a body with fewer than `limit` brackets cannot nest that deep, and
    counting bytes runs at memory speed; only larger bodies are walked, and the
    walk stops at the first container past the limit.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise DepthError(f"the request body nests JSON deeper than {limit} levels")
        if type(node) is dict:
            stack.extend((v, depth + 1) for v in node.values() if type(v) in (dict, list))
        elif type(node) is list:
            stack.extend((v, depth + 1) for v in node if type(v) in (dict, list))


def server_options(*, client_idle_timeout: float, max_field_size: int, max_headers: int) -> dict[str, Any]:
    """Keyword arguments for aiohttp's request handler (via `web.AppRunner(..., **options)`)."""
    return {"keepalive_timeout": client_idle_timeout, "max_line_size": max_field_size,
            "max_field_size": max_field_size, "max_headers": max_headers}


class ConnectionGuard:
    """Counts open connections per client address on an aiohttp server; refuses past `limit` (0: no limit).

    Installed with `install(server)` on the `web.Server` an AppRunner made: it
    wraps that server's connection_made / connection_lost, which every
    connection passes through exactly once each.
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
                transport.write(_TOO_MANY % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
                handler.force_close()
                transport.close()
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
