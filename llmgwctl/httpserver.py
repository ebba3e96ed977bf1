"""Hardening shared by llmgw's aiohttp servers: the router's public port and the control API.

Owns what bounds a connection before any handler runs -- aiohttp's parser
limits and keep-alive timer (`server_options`), the cap on open connections
per client address (`ConnectionGuard`) -- and reading the port a server bound
(`bound_port`). Both servers face strangers once bound beyond loopback, so
both take the same limits from here; each caller decides its own values where
its traffic differs.

It must not know about routes, models or endpoints: it sees connections and
header lines only.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # only for the annotation: the constants above load without aiohttp
    from aiohttp import web

log = logging.getLogger("llmgw.httpserver")

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
             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"message": "too many connections from this address; reuse keep-alive '
                  b'connections or retry shortly", "type": "rate_limit_error", "code": "too_many_connections"}}')


def server_options(*, client_idle_timeout: float = CLIENT_IDLE_TIMEOUT, max_field_size: int = MAX_HEADER_BYTES,
                   max_headers: int = MAX_HEADERS) -> dict[str, Any]:
    """Keyword arguments for aiohttp's request handler (via `web.AppRunner(..., **options)`).

    aiohttp's keep-alive timer closes a connection still waiting for a
    complete request when it fires, so `client_idle_timeout` bounds slow
    headers as well as idle connections; an over-long line or too many
    header lines is answered 400 by the parser.
    """
    return {"keepalive_timeout": client_idle_timeout, "max_line_size": max_field_size,
            "max_field_size": max_field_size, "max_headers": max_headers}


def bound_port(runner: "web.BaseRunner") -> int:
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
