"""One keep-alive connection to one engine: a request out, its answer in, and the timers that bound the wait.

The connection owns the socket's side of a request: it writes the request
(outgoing.py), feeds what arrives to its parser (parser.py), which fills the
`Response` (response.py), and tells its pool when it is idle again or closed
(`put_idle`, `forget`). Whatever the engine does, the wait is bounded: the
headers must be complete within `headers_timeout` of the request, and with
an `idle_timeout` the engine may not go silent for longer than that.
"""
from __future__ import annotations

import asyncio
from typing import Protocol, cast

from .errors import ConnectFailed, UpstreamBroken, UpstreamError, UpstreamTimeout
from .outgoing import write_request
from .parser import AnswerParser
from .response import Response


class Owner(Protocol):
    """What a connection tells its pool (pool.py): declared here so the connection does not import the pool."""

    def put_idle(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection to one engine; carries one request at a time."""

    __slots__ = ("pool", "key", "loop", "transport", "parser", "response", "headers_in", "closed",
                 "idle_since", "reused", "got_bytes", "last_read", "timer", "idle_timeout", "counted",
                 "head_timer", "headers_timeout")

    def __init__(self, pool: Owner, key: str, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = AnswerParser(self._head_in, self._answer_in)
        self.response: Response | None = None
        self.headers_in: asyncio.Future[None] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.got_bytes = False
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.idle_timeout = 0.0
        self.counted = True         # in the pool's count of open connections to its engine
        self.head_timer: asyncio.TimerHandle | None = None
        self.headers_timeout = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP (or TLS) connection's: asyncio's is an asyncio.Transport, and
        # uvloop's has the same methods without the base class.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            # Bytes nobody asked for (an engine answering twice, or talking on
            # an idle connection): the connection cannot be trusted again.
            self.close()
            return
        self.got_bytes = True
        if self.timer is not None:
            self.last_read = self.loop.time()
        try:
            self.parser.feed(data)
        except UpstreamError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False        # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool.forget(self)
        response = self.response
        if response is None:
            return
        if self.parser.body_until_close and self.headers_in is None and exc is None:
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

    # -- told by the parser ------------------------------------------------------------

    def _head_in(self) -> None:
        waiter, self.headers_in = self.headers_in, None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _answer_in(self) -> None:
        self._stop_timer()      # nothing more to wait for, however long the release takes

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
        self.parser.start(response)
        self.headers_in = self.loop.create_future()
        self.got_bytes = False
        if headers_timeout:
            self.headers_timeout = headers_timeout
            self.head_timer = self.loop.call_later(headers_timeout, self._headers_late)
        if idle_timeout:
            self.idle_timeout = idle_timeout
            self.last_read = self.loop.time()
            self.timer = self.loop.call_later(idle_timeout, self._check_idle)
        try:
            write_request(transport, head, body)
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
        self._fail(UpstreamTimeout(f"sent nothing for {self.idle_timeout:g} s"))

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
        if response.complete and not self.closed and self.parser.keep_alive and not response.paused:
            self.pool.put_idle(self)
        else:
            self.close()
            self.pool.forget(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
