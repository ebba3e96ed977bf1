"""One engine answer being read: its body handed to the router whole or chunk by chunk, with back-pressure.

The connection feeds it (`feed`, `end`, `fail`); the router reads it (`read`,
`chunks`) and hands it back (`release`). A slow reader pauses the engine's
socket instead of letting the router's memory grow, and a whole answer is
read only up to the cap its caller gives.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

from .errors import OutOfBounds, UpstreamError

# A slow client makes chunks pile up here; past this the engine's socket is no
# longer read, so TCP pushes back on the engine instead of the router's memory
# growing. 256 KiB is a few thousand SSE events.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class Source(Protocol):
    """What an answer needs of the connection it arrives on (connection.py): declared here so neither imports the other."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def finish(self, response: Response) -> None: ...


class Response:
    """One answer being read. `status` and `headers` (lower-case names) are set when it is returned."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_buffered", "_done", "_error", "_waiter",
                 "_paused")

    def __init__(self, conn: Source):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
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
        if self._paused and self._buffered < LOW_WATER:
            self._paused = False
            self._conn.resume_reading()

    # -- fed by the connection ---------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Body bytes arrived; past the high-water mark the connection stops reading until they are taken."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
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
