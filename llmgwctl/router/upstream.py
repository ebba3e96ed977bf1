"""The router's client to engines: one POST of a JSON body, the answer passed back.

Why not aiohttp's ClientSession, which the router used first: profiled under
load, its client side (request and response objects, header multidicts,
StreamReader, timers, trace hooks) cost about as much CPU per request as the
whole rest of the router, and the router needs almost none of what it offers.
What it needs is narrow: keep-alive connections per engine, one write per
request, the status, a few headers, the body as the bytes that arrived (a
stream chunk by chunk), back-pressure when a client reads slowly, and errors
that say whether the request may be retried elsewhere. Parsing is httptools
(llhttp, the parser Node.js uses; uvicorn's too), so what engines send is read
by a complete, strict HTTP/1.1 parser rather than code of ours.

Errors say whether sending the request elsewhere is safe:

    UpstreamError         (a RouterError, see errors.py)
     ├── ConnectFailed    refused, reset or closed before any byte of the answer:
     │                    the engine did not answer, another endpoint may
     ├── UpstreamTimeout  no byte for `idle_timeout` (only when one is given), or
     │                    no complete headers within `headers_timeout`: the engine
     │                    took the request and may be running it, no retry
     └── UpstreamBroken   the answer started, then the connection failed or the
          │               engine sent something that is not HTTP: no retry
          └── OutOfBounds the engine broke a bound the router holds every peer to
                          (its headers too long or too many, a whole answer past
                          the cap): not a blip but a broken or hostile engine,
                          which the router keeps out for a while (ejection.py)

    BadEndpointURL        (a ValueError, not an UpstreamError) the URL cannot be
                          an engine's: a configuration error, found by
                          `parse_target` when the endpoint is set, never sent

An engine is a peer the router does not trust (a GPU node can be
compromised, an engine can be buggy): nothing it sends is held without a
bound. Its headers are capped as the router's own server caps a client's
(MAX_HEADER_BYTES a line, MAX_HEADERS lines, and `_MAX_HEAD` bytes in all),
the wait for them is bounded for every request (`headers_timeout`), a whole
answer is read up to a cap given by the caller (`Response.read(limit)`), and
nothing is ever followed: a redirect is just a status the caller refuses.

The three classes talk through methods: the pool hands out connections and is
told when one is idle or closed (`put_idle`, `forget`); a connection feeds its
answer (`feed`, `end`, `fail`) and is asked to pause or resume reading; the
answer hands itself back (`release`).
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import AsyncIterator, Callable, NamedTuple
from urllib.parse import urlsplit

import httptools

from ..httpserver import MAX_HEADER_BYTES, MAX_HEADERS
from .config import DEFAULTS
from .errors import RouterError



class UpstreamError(RouterError):
    pass


class ConnectFailed(UpstreamError):
    """No byte of the answer arrived: safe to try another endpoint."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for the idle timeout."""


class UpstreamBroken(UpstreamError):
    """The answer started and did not finish."""


class OutOfBounds(UpstreamBroken):
    """The engine's answer broke one of the bounds on what a peer may send; `code` names which (a metric label)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BadEndpointURL(ValueError):
    """An endpoint URL no request could be sent to: the configuration is wrong, the engine is not down."""


class Target(NamedTuple):
    """Where an endpoint's requests go, parsed once from its URL (see `parse_target`)."""

    host: str
    port: int
    host_header: bytes      # what the Host header says: the URL's host[:port], IDNA-encoded
    path_prefix: bytes      # the URL's path, prepended to every request's (b"" for most engines)
    tls: bool               # https: verified against the system's trust store


def parse_target(base_url: str) -> Target:
    """The `Target` of an endpoint's URL; BadEndpointURL if it is not an http(s) URL with a host and a valid port."""
    try:
        parts = urlsplit(base_url)
        port = parts.port       # ValueError when it is not a number in 0-65535
        host_header = parts.netloc.encode("idna")
    except (ValueError, UnicodeError) as exc:
        raise BadEndpointURL(f"not a usable endpoint URL: {base_url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadEndpointURL(f"not an http(s) URL: {base_url!r}")
    if not parts.hostname:
        raise BadEndpointURL(f"no host in the endpoint URL {base_url!r}")
    https = parts.scheme == "https"
    return Target(parts.hostname, port or (443 if https else 80), host_header,
                  parts.path.rstrip("/").encode(), https)


# Parsed endpoint URLs kept; past this they are parsed anew (a few µs each).
_TARGETS_KEPT = 1024
# A slow client makes chunks pile up here; past this the engine's socket is no
# longer read, so TCP pushes back on the engine instead of the router's memory
# growing. 256 KiB is a few thousand SSE events.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
# An engine's whole answer head (status line and header lines) at most: a
# real one is a few hundred bytes (vLLM: status, date, server, length, type).
# The bound is also what keeps the parser cheap: httptools joins a header's
# pieces as they arrive (a `bytes +=` per read), so a line trickled in tiny
# reads costs the square of its length, and 64 KiB keeps that square small
# while leaving room for eight header lines of the longest the router takes.
_MAX_HEAD = 64 * 1024


class Response:
    """One answer being read. `status` and `headers` (lower-case names) are set when it is returned."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_buffered", "_done", "_error", "_waiter",
                 "_paused")

    def __init__(self, conn: "_Connection"):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False

    @property
    def complete(self) -> bool:
        """The whole answer has been received (not necessarily read)."""
        return self._done

    @property
    def paused(self) -> bool:
        """Reading from the engine is paused because the body is not read fast enough."""
        return self._paused

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; with `limit`, OutOfBounds as soon as it is known to be longer than that.

        A Content-Length past the limit is refused before a byte of the body
        is read, and a body without one is refused when what arrived passes
        the limit: a `Content-Length: 10 GB` costs nothing, an endless body at
        most `limit` bytes, let go at once. The caller releases the answer,
        which closes its connection.
        """
        if limit is not None:
            declared = self.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise OutOfBounds("answer_too_large", f"answered {declared} bytes, more than the router's limit of "
                                  f"{limit} bytes for a whole answer")
        parts: list[bytes] = []
        got = 0
        while True:
            if self._chunks:
                if limit is not None:
                    got += self._buffered
                    if got > limit:
                        self._chunks.clear()
                        parts.clear()
                        raise OutOfBounds("answer_too_large", f"sent more than the router's limit of {limit} "
                                          "bytes for a whole answer")
                parts.extend(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._maybe_resume()
            if self._done:
                return b"".join(parts)
            if self._error is not None:
                raise self._error
            await self._wait()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: whatever bytes each read of the socket brought, unchanged."""
        while True:
            if self._chunks:
                if len(self._chunks) == 1:
                    data = self._chunks.popleft()
                else:
                    data = b"".join(self._chunks)
                    self._chunks.clear()
                self._buffered = 0
                self._maybe_resume()
                yield data
            elif self._done:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool if it can carry another request.

        Called before the answer is complete (a client that left, an error),
        it closes the connection, which is how the engine learns to stop.
        """
        self._conn.finish(self)

    async def _wait(self) -> None:
        self._waiter = waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _maybe_resume(self) -> None:
        if self._paused and self._buffered < _LOW_WATER:
            self._paused = False
            self._conn.resume_reading()

    # -- fed by the connection ---------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Body bytes arrived; past the high-water mark the connection stops reading until they are taken."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def end(self) -> None:
        """The body is complete. Ignored once the answer failed: what came is not the whole of it."""
        if self._error is None:
            self._done = True
            self._wake()

    def fail(self, error: UpstreamError) -> None:
        """The answer cannot finish; a reader gets `error` once the bytes before it are taken."""
        if not self._done and self._error is None:
            self._error = error
            self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one engine; carries one request at a time."""

    __slots__ = ("pool", "key", "loop", "transport", "parser", "response", "headers_in", "closed",
                 "idle_since", "reused", "got_bytes", "last_read", "timer", "idle_timeout", "counted",
                 "keep_alive", "body_until_close", "head_bytes", "header_lines", "head_timer", "headers_timeout")

    def __init__(self, pool: "Pool", key: str, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_in: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.got_bytes = False
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.idle_timeout = 0.0
        self.counted = True         # in the pool's count of open connections to its engine
        self.keep_alive = False     # the last answer allows another request on this connection
        self.body_until_close = False   # no length, not chunked: the body ends when the connection does
        # Bytes received since the last body byte: the head, and after it only
        # chunked framing and trailers, which are a few bytes between chunks.
        self.head_bytes = 0
        self.header_lines = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.headers_timeout = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            # Bytes nobody asked for (an engine answering twice, or talking on
            # an idle connection): the connection cannot be trusted again.
            self.close()
            return
        self.got_bytes = True
        if self.timer is not None:
            self.last_read = self.loop.time()
        self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("the engine switched protocols"))
        except UpstreamError as exc:
            self._fail(exc)         # a bound a callback found broken (on_header, on_message_begin)
        except httptools.HttpParserError as exc:
            cause = exc.__cause__ or exc.__context__
            self._fail(cause if isinstance(cause, UpstreamError) else
                       UpstreamBroken(f"the engine's answer is not valid HTTP: {exc}"))
        else:
            if self.head_bytes > _MAX_HEAD and not self.closed:
                # One read more than the bound at most reaches the parser: what
                # it holds of a head (or of trailers after a chunked body) that
                # never ends stays under _MAX_HEAD plus a read.
                self._fail(OutOfBounds("headers_too_large", f"sent more than {_MAX_HEAD} bytes of headers"))

    def eof_received(self) -> bool:
        return False        # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.forget(self)
        response = self.response
        if response is None:
            return
        if self.body_until_close and self.headers_in is None and exc is None:
            # A body delimited by the connection's end -- a clean one: a reset
            # cut it short, and a close of ours (an idle timeout) already
            # failed it, which `end` leaves as it is.
            response.end()
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "the engine closed the connection"
        if self.headers_in is not None:
            error: UpstreamError = ConnectFailed(reason) if not self.got_bytes else \
                UpstreamBroken(f"{reason} before the answer's headers were complete")
            if not self.headers_in.done():
                self.headers_in.set_exception(error)
        else:
            response.fail(UpstreamBroken(f"{reason} mid-answer"))

    # -- httptools callbacks -----------------------------------------------------------

    # The parser runs only inside data_received, past its check that a request
    # is out, and nothing a callback does clears `self.response`: every one finds it set.

    def on_message_begin(self) -> None:
        response = self.response
        assert response is not None     # see above
        if response.complete:
            # A second answer before this one was released (an engine answering
            # twice, in the same read or before the release): it would overwrite
            # this answer's status and headers and extend its body. The error
            # stops the parser, and data_received closes the connection.
            raise UpstreamBroken("the engine answered twice")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called per header line: no assert here or in on_body, per chunk (the
        # invariant above holds; this is the hot path and costs what it did).
        # The caps are the router's own server's (httpserver.py): a peer is held to what a client is.
        self.header_lines += 1
        if self.header_lines > MAX_HEADERS or len(name) + len(value) > MAX_HEADER_BYTES:
            raise OutOfBounds("headers_too_large", f"sent more than {MAX_HEADERS} header lines"
                              if self.header_lines > MAX_HEADERS else
                              f"sent a header line longer than {MAX_HEADER_BYTES} bytes")
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None     # see above on_message_begin
        response.status = self.parser.get_status_code()
        headers = response.headers
        if "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "") \
                and response.status not in (204, 304) and response.status >= 200:
            self.body_until_close = True
        if response.status < 200:
            # 1xx (a 100 Continue we did not ask for): the real answer follows.
            headers.clear()
            return
        waiter, self.headers_in = self.headers_in, None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.head_bytes = 0
        self.response.feed(body)  # type: ignore[union-attr]  # set: see above on_message_begin

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and response.status >= 200:
            # Asked here: llhttp answers it only inside the callback, and the
            # answer covers Connection: close and HTTP/1.0 alike.
            self.keep_alive = self.parser.should_keep_alive()
            self._stop_timer()      # nothing more to wait for, however long the release takes
            response.end()

    # -- the pool's side -------------------------------------------------------------

    def send(self, head: bytes, body: bytes, idle_timeout: float | None, headers_timeout: float | None = None,
             ) -> Response:
        """Send one request; ConnectFailed, with the connection closed, if it is found closed.

        `headers_timeout`: the answer's headers must be complete within it
        from now, however the engine paces its bytes (UpstreamTimeout).

        A connection can be closed before it knows: the engine died (SIGKILL)
        while it sat idle, the transport saw the reset and closed, and the
        `connection_lost` telling us is still queued on the loop. uvloop's
        `write` then raises RuntimeError, asyncio's drops the bytes; either
        way nothing was sent, so the request may go elsewhere.
        """
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            self.close()
            raise ConnectFailed("the connection was closed before the request went out")
        self.response = response = Response(self)
        self.headers_in = self.loop.create_future()
        self.got_bytes = False
        self.keep_alive = False
        self.body_until_close = False
        self.head_bytes = self.header_lines = 0
        if headers_timeout:
            self.headers_timeout = headers_timeout
            self.head_timer = self.loop.call_later(headers_timeout, self._headers_late)
        if idle_timeout:
            self.idle_timeout = idle_timeout
            self.last_read = self.loop.time()
            self.timer = self.loop.call_later(idle_timeout, self._check_idle)
        try:
            transport.write(head + body)
        except (RuntimeError, OSError) as exc:
            self._stop_timer()
            self.response = self.headers_in = None
            self.close()
            raise ConnectFailed(f"the connection failed as the request went out: {exc}") from None
        return response

    def _check_idle(self) -> None:
        # One timer per request, moved on only when it fires: a stream pays a
        # float store per read, not a timer per chunk.
        self.timer = None
        due = self.last_read + self.idle_timeout
        now = self.loop.time()
        if self.response is not None and self.response.paused:
            # Nothing is read because the router's client is slow, not because
            # the engine is silent; the client has a write timeout of its own.
            due = now + self.idle_timeout
        if now < due:
            self.timer = self.loop.call_at(due, self._check_idle)
            return
        error = UpstreamTimeout(f"sent nothing for {self.idle_timeout:g} s")
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(error)
        elif self.response is not None:
            self.response.fail(error)
        self.close()

    def _headers_late(self) -> None:
        # A deadline, not a silence: an engine trickling header bytes keeps
        # the idle timer from firing but not this one.
        self.head_timer = None
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(UpstreamTimeout(
                f"sent no complete headers within {self.headers_timeout:g} s"))
            self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _fail(self, error: UpstreamError) -> None:
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(error)
        elif self.response is not None:
            self.response.fail(error)
        self.close()

    # Asked only by a Response, which exists only once send() found a transport,
    # and the transport is never unset.

    def pause_reading(self) -> None:
        assert self.transport is not None   # see above
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        assert self.transport is not None   # see above
        self.transport.resume_reading()

    def finish(self, response: Response) -> None:
        """`response` is done with: keep the connection for the next request if it can carry one, else close it."""
        if response is not self.response:
            return
        self._stop_timer()
        self.response = None
        if response.complete and not self.closed and self.keep_alive and not response.paused:
            self.pool.put_idle(self)
        else:
            self.close()
            self.pool.forget(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class Pool:
    """Keep-alive connections to every engine, opened on demand.

    `limit_per_endpoint` bounds the connections to one engine and `limit_total`
    those to all of them; a request past either waits for one to come free (it
    counts as load in the router meanwhile), and one that finds the total taken
    by idle connections to other engines closes the longest idle.
    Idle connections are closed after `keepalive_timeout`, which must be
    shorter than the engines' own (uvicorn's is 5 s) so the router never sends
    on a connection the engine is closing.
    """

    # The defaults are RouterConfig's, where each one's reason is given.
    def __init__(self, *, connect_timeout: float = DEFAULTS.connect_timeout,
                 keepalive_timeout: float = DEFAULTS.keepalive_timeout,
                 headers_timeout: float = DEFAULTS.upstream_headers_timeout,
                 limit_per_endpoint: int = DEFAULTS.connections_per_endpoint,
                 limit_total: int = DEFAULTS.connections_total,
                 clock: Callable[[], float] = time.monotonic):
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = keepalive_timeout
        self.headers_timeout = headers_timeout
        self.limit_per_endpoint = limit_per_endpoint
        self.limit_total = limit_total
        self._total = 0
        self._any_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._clock = clock
        self._idle: dict[str, list[_Connection]] = {}
        self._open: dict[str, int] = {}
        self._waiters: dict[str, collections.deque[asyncio.Future]] = {}
        self._targets: dict[str, Target] = {}
        self._tls: ssl.SSLContext | None = None     # one for every https engine, made on first use
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    async def post(self, base_url: str, path: str, body: bytes, *,
                   idle_timeout: float | None = None, headers: bytes = b"") -> Response:
        """POST `body` (JSON) to base_url + path; return once the answer's headers are in.

        With `idle_timeout`, the engine may not go silent for longer than that
        (before the headers or between chunks). Whatever the request, its
        headers must be complete within the pool's `headers_timeout` (0: no
        bound). Call `release()` on the answer.
        BadEndpointURL, before anything is sent, if `base_url` cannot be an
        engine's (check it with `parse_target` when the endpoint is set).
        """
        target = self._targets.get(base_url)
        if target is None:
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()       # replicas come and go, each at a new URL
            target = self._targets[base_url] = parse_target(base_url)
        # What engines get: the body is always JSON. The client's Authorization
        # is the gateway's credential and is not passed on; no Accept-Encoding,
        # so engines answer uncompressed and the router never decompresses.
        head = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
            target.path_prefix, path.encode("utf-8", "surrogateescape"), target.host_header, len(body), headers)
        while True:
            conn = await self._acquire(base_url, target)
            try:
                response = conn.send(head, body, idle_timeout, self.headers_timeout)
            except ConnectFailed:
                self.forget(conn)
                if conn.reused:
                    continue        # as below: a fresh connection tells whether the engine is gone
                raise
            headers_in = conn.headers_in
            assert headers_in is not None   # set by the send() just above, with nothing run since
            try:
                await headers_in
            except ConnectFailed:
                conn.finish(response)
                if conn.reused:
                    # A kept-alive connection the engine closed just as the
                    # request went out: nothing was answered, and a fresh
                    # connection tells whether the engine is really gone.
                    continue
                raise
            except BaseException:
                conn.finish(response)
                raise
            return response

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def connections(self, base_url: str) -> int:
        """Open connections to one engine, idle or busy (for tests and metrics)."""
        return self._open.get(base_url, 0)

    # -- connections ------------------------------------------------------------------

    async def _acquire(self, key: str, target: Target) -> _Connection:
        while True:
            idle = self._idle.get(key)
            if idle:
                expired_before = self._clock() - self.keepalive_timeout
                while idle:
                    conn = idle.pop()       # the most recently used: least likely to be closing
                    if not conn.closed and conn.idle_since > expired_before and conn.transport is not None \
                            and not conn.transport.is_closing():
                        conn.reused = True
                        return conn
                    conn.close()
                    self.forget(conn)
            if self._open.get(key, 0) >= self.limit_per_endpoint:
                waiters = self._waiters.setdefault(key, collections.deque())
                try:
                    await self._wait(waiters)
                finally:
                    if not waiters and self._waiters.get(key) is waiters:
                        del self._waiters[key]
            elif self._total >= self.limit_total:
                # Room for this engine is taken by idle connections to others:
                # close the longest idle one; with none idle, wait for any.
                if not self._evict_idle():
                    await self._wait(self._any_waiters)
            else:
                return await self._connect(key, target)

    async def _wait(self, waiters: collections.deque) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                _wake_one(waiters)      # the wake-up this request will not use goes to the next
            raise
        finally:
            if waiter in waiters:
                waiters.remove(waiter)

    def _evict_idle(self) -> bool:
        oldest = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        oldest.close()
        self.forget(oldest)
        return True

    async def _connect(self, key: str, target: Target) -> _Connection:
        context = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        loop = asyncio.get_running_loop()
        self._open[key] = self._open.get(key, 0) + 1
        self._total += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key, loop), target.host, target.port, ssl=context),
                self.connect_timeout)
        except asyncio.TimeoutError:
            self._dec(key)
            raise ConnectFailed(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            self._dec(key)
            raise ConnectFailed(f"{type(exc).__name__}: {exc.strerror or exc}") from None
        except BaseException:
            self._dec(key)
            raise
        return conn

    # -- told by its connections --------------------------------------------------------

    def put_idle(self, conn: _Connection) -> None:
        """`conn` finished an answer and may carry another request: keep it for the next one to its engine."""
        waiters = self._waiters.get(conn.key)
        conn.idle_since = self._clock()
        self._idle.setdefault(conn.key, []).append(conn)
        if waiters:
            _wake_one(waiters)
        if self._any_waiters:
            _wake_one(self._any_waiters)    # it may close this one to reach its own engine
        if self._sweep is None and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_timeout, self._expire)

    def forget(self, conn: _Connection) -> None:
        """`conn` is closed: it no longer counts against its engine's limit."""
        if not conn.counted:
            return
        conn.counted = False
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._dec(conn.key)

    def _dec(self, key: str) -> None:
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)
        self._total -= 1
        waiters = self._waiters.get(key)
        if waiters:
            _wake_one(waiters)
        if self._any_waiters:
            _wake_one(self._any_waiters)

    def _expire(self) -> None:
        # Closes what nobody used for keepalive_timeout; engines without an
        # idle timeout of their own would otherwise keep every socket ever opened.
        self._sweep = None
        expired_before = self._clock() - self.keepalive_timeout
        left = False
        for key, conns in list(self._idle.items()):
            for conn in [c for c in conns if c.closed or c.idle_since <= expired_before]:
                conn.close()
                self.forget(conn)
            if conns:
                left = True
            else:
                del self._idle[key]     # an engine gone for good leaves nothing behind
        if left and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_timeout, self._expire)


def _wake_one(waiters: collections.deque) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return
