"""The fake engine misbehaving on purpose: answers and /metrics pages a hostile or broken engine sends.

What the router's bounds on engines are tested and benched against
(`llmgwctl engine fake --fault MODE --metrics-fault MODE`); off by default,
and nothing here runs unless asked. Each mode is what a real engine on a
compromised or buggy node could send; the router must hold it without its
memory growing or its loop stalling.

Answers (`--fault`, on every POST under /v1/):

    huge-length      200, Content-Length: 10 GB, then filler as fast as the socket takes it
    endless-body     200, chunked, filler chunks that never end (no length to refuse by)
    endless-headers  200 and header lines without end
    growing-header   200 and one header value that grows without end, in small writes
    no-headers       reads the request, never answers
    redirect         302 to --redirect-to

Failures before the first byte, which a gateway may retry on another
replica (--fault too, on every POST under /v1/):

    unavailable      503 in vLLM's error shape, as an engine overloaded or shutting down
    reset            reads the request, then resets the connection (RST) without a byte
    cut-headers      reads the request, sends half a head (status line, one header), then closes

And at run time, SIGUSR1 turns `unavailable` on for the fake's OpenAI
routes, and the next SIGUSR1 turns it off again (`Unavailable`, read by
the server's request gate): a healthy replica that starts refusing, then
recovers, while its process, port and /health stay up.

Pages (`--metrics-fault`, on GET /metrics):

    many-series      the real page, then 1,000,000 series of a family nobody reads
    huge-page        the real page, then 100 MB of comment lines
    redirect         302 to --redirect-to

Raw modes write to the socket themselves and never return a response while
the connection lasts; they pace on the transport's buffer, so the fake's own
memory stays flat however slowly the other side reads.

It must not know about the rest of llmgw, like the fake engine itself.
"""
from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

# What the raw modes keep queued on the socket at most before waiting for it to drain.
_BUFFERED = 1024 * 1024
_FILLER = b" " * 65536          # JSON whitespace: a body that stays "valid" as far as it goes
SERIES = 1_000_000
HUGE_PAGE_BYTES = 100 * 1024 * 1024


async def _write_forever(transport: Any, head: bytes, more: Callable[[int], bytes], pause: float = 0.0) -> None:
    """`head`, then `more(n)` for n = 0, 1, ... until the other side closes; paced on the transport's buffer.

    `transport` is aiohttp's (asyncio's or uvloop's TCP transport, which share no base class).
    """
    transport.write(head)
    n = 0
    while not transport.is_closing():
        if transport.get_write_buffer_size() > _BUFFERED:
            await asyncio.sleep(0.005)
            continue
        transport.write(more(n))
        n += 1
        await asyncio.sleep(pause)      # a turn of the loop at least: the fake serves others meanwhile


def unavailable() -> web.Response:
    """vLLM's error shape for a 503."""
    return web.json_response({"error": {"message": "The engine is not available (injected: --fault unavailable "
                                                   "or SIGUSR1).", "type": "ServiceUnavailableError", "param": None,
                                        "code": 503}}, status=503)


class Unavailable:
    """Whether this fake answers 503 to every POST under /v1/ now; `flip` (on SIGUSR1) turns it on and off."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    def flip(self) -> None:
        self.on = not self.on
        print(f"fake engine: answering 503 to every request: {'on' if self.on else 'off'}", flush=True)


def _reset(transport: Any) -> None:
    """Close with a TCP reset, not a FIN: a zero linger makes the kernel drop the connection as a crash does."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def answer(fault: str, redirect_to: str, request: web.Request) -> web.StreamResponse:
    """The answer `fault` gives to a POST under /v1/."""
    if fault == "redirect":
        return web.Response(status=302, headers={"Location": redirect_to or "http://127.0.0.1:9/"})
    if fault == "unavailable":
        return unavailable()
    await request.read()
    transport = request.transport
    if fault == "reset" and transport is not None:
        _reset(transport)
        return web.Response(status=499)     # never seen: the connection is gone
    if fault == "cut-headers" and transport is not None:
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        await asyncio.sleep(0.01)           # the half head leaves in its own segment before the close
        transport.close()
        return web.Response(status=499)
    if fault == "no-headers" or transport is None:
        # Until the client leaves: the fake cancels a handler whose client disconnected.
        await asyncio.Event().wait()
    elif fault == "huge-length":
        await _write_forever(transport, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: 10000000000\r\n\r\n{", lambda n: _FILLER)
    elif fault == "endless-body":
        chunk = b"%x\r\n%s\r\n" % (len(_FILLER), _FILLER)
        await _write_forever(transport, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                        b"Transfer-Encoding: chunked\r\n\r\n", lambda n: chunk)
    elif fault == "endless-headers":
        await _write_forever(transport, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n",
                             lambda n: b"".join(b"X-Pad-%d: %s\r\n" % (n * 64 + i, b"a" * 100) for i in range(64)))
    elif fault == "growing-header":
        # Small writes, a loop turn apart: each reaches the router as its own read.
        await _write_forever(transport, b"HTTP/1.1 200 OK\r\nX-Grow: ", lambda n: b"a" * 512, pause=0.0005)
    return web.Response(status=499)     # never seen: the connection is gone


async def metrics_page(fault: str, redirect_to: str, real: Callable[[], str],
                       request: web.Request) -> web.StreamResponse:
    """The /metrics answer `fault` gives: the real page first, then what makes it hostile, chunked (no length)."""
    if fault == "redirect":
        return web.Response(status=302, headers={"Location": redirect_to or "http://127.0.0.1:9/"})
    resp = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
    await resp.prepare(request)
    try:
        await resp.write(real().encode())
        if fault == "many-series":
            await resp.write(b"# HELP fake_noise A family no adapter reads.\n# TYPE fake_noise gauge\n")
            for start in range(0, SERIES, 10_000):
                await resp.write("".join(f'fake_noise{{series="{i}"}} 1.0\n'
                                         for i in range(start, start + 10_000)).encode())
        elif fault == "huge-page":
            block = (b"# " + b"x" * 1021 + b"\n") * 64
            for _ in range(HUGE_PAGE_BYTES // len(block)):
                await resp.write(block)
        await resp.write_eof()
    except ConnectionError:
        pass        # the router stopped reading at its cap: what it should do
    return resp


def install(app: web.Application, fault: str | None, metrics_fault: str | None, redirect_to: str,
            real_metrics: Callable[[], str]) -> None:
    """Make `app` (the fake engine's) misbehave as asked; nothing when both are None."""
    if fault:
        @web.middleware
        async def faulty(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            if request.method == "POST" and request.path.startswith("/v1/"):
                return await answer(fault, redirect_to, request)
            return await handler(request)
        app.middlewares.append(faulty)
    if metrics_fault:
        @web.middleware
        async def faulty_metrics(request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:

            if request.method == "GET" and request.path == "/metrics":
                return await metrics_page(metrics_fault, redirect_to, real_metrics, request)
            return await handler(request)
        app.middlewares.append(faulty_metrics)
