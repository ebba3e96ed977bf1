"""Keep-alive connections to every engine, opened on demand and bounded per engine and in all.

The pool hands out connections (connection.py) and is told when one is idle
again or closed (`put_idle`, `forget`); `post` is the router's one call: a
request out, the answer's head in.
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable

from ..config import DEFAULTS
from .connection import Connection
from .errors import ConnectFailed
from .outgoing import Target, Targets, request_head
from .response import Response


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
        self._any_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._clock = clock
        self._idle: dict[str, list[Connection]] = {}
        self._open: dict[str, int] = {}
        self._waiters: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._targets = Targets()
        self._tls: ssl.SSLContext | None = None     # one for every https engine, made on first use
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    async def post(self, base_url: str, path: str, body: bytes, *,
                   idle_timeout: float | None = None, headers: bytes = b"", method: bytes = b"POST") -> Response:
        """POST `body` (JSON) to base_url + path; return once the answer's headers are in.

        `method`: another, for the routes of a stored response (GET, DELETE).
        With `idle_timeout`, the engine may not go silent for longer than that
        (before the headers or between chunks). Whatever the request, its
        headers must be complete within the pool's `headers_timeout` (0: no
        bound). Call `release()` on the answer.
        BadEndpointURL, before anything is sent, if `base_url` cannot be an
        engine's (check it with `parse_target` when the endpoint is set).
        """
        target = self._targets.get(base_url)
        head = request_head(target, path, len(body), headers, method)
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

    async def _acquire(self, key: str, target: Target) -> Connection:
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

    async def _wait(self, waiters: collections.deque[asyncio.Future[None]]) -> None:
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
        oldest: Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        oldest.close()
        self.forget(oldest)
        return True

    async def _connect(self, key: str, target: Target) -> Connection:
        context: ssl.SSLContext | None = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        loop = asyncio.get_running_loop()
        self._open[key] = self._open.get(key, 0) + 1
        self._total += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self, key, loop), target.host, target.port, ssl=context),
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

    def put_idle(self, conn: Connection) -> None:
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

    def forget(self, conn: Connection) -> None:
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


def _wake_one(waiters: collections.deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return
