"""The answer path: an engine's answer back to the client, whole or streamed, as bytes.

`AnswerPath.respond` takes the engine's answer once its headers are in: an
event stream is passed on chunk by chunk as it arrives (`_pass_stream`, a
client that stops reading dropped after `client_write_timeout`), anything
else read whole up to `max_answer_bytes` and sent in one piece
(`_pass_whole`). A stream opened early to keep a client company through a
cold start (see conventions.held_for_cold_start) ends with the refusal or the
engine's error as its last event (`refuse_in_stream`, `_pass_whole_in_stream`).
Token counts are read off the bytes as they pass (`usage`, as the route
reads its API's); a request by alias has the alias put back as the answer's
`model`, in the bytes as they pass (`echo`); errors of the router's own take
the route's shape (`shapes`). Each answered request is counted once, in
`Accounting.served`. A Responses answer's id (a whole answer's, or its
stream's first event's) is told to `affinity` before it reaches the client.
A chat stream whose engine
dies mid-way goes on from another replica where its model turned
continuation on (`continuation`); any other ends with an error event.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from time import perf_counter

from aiohttp import web

from ..allocator import Trimmer
from ..observability.metrics import RouterMetrics
from . import errors, loraselect
from .accounting import Accounting
from .affinity import Affinity
from .balancer import Balancer, EndpointState
from .call import Call, Refused
from .config import RouterConfig
from .continuation import Continuation, Splice
from .ejection import Ejector
from .inflight import InFlight
from .responses import FirstEvent, id_of_whole
from .retry import ATTEMPTS_HEADER
from .upstream import OutOfBounds, Response, UpstreamError

__all__ = ["AnswerPath"]

log = logging.getLogger("llmgw.router")

_EVENT_STREAM = "text/event-stream"
# Well under asyncio's and uvloop's 64 KiB write high-water mark; SSE events are
# a few hundred bytes, so only bursts take the timed path.
_SMALL_WRITE = 16384


class AnswerPath:
    """An engine's answer, its headers in, passed back to the client: whole, streamed, or as a stream's last event."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, ejector: Ejector, metrics: RouterMetrics,
                 accounting: Accounting, trimmer: Trimmer, affinity: Affinity, inflight: InFlight):
        self._config = config
        self._trimmer = trimmer
        # Told the id of each response an engine stored (a route that `binds`), and by which replica.
        self._affinity = affinity
        self._balancer = balancer
        self._ejector = ejector
        self._metrics = metrics
        self._accounting = accounting
        # Cut chat streams continued on another replica, for the models that ask (continuation.py).
        self.continuation = Continuation(config, balancer=balancer, metrics=metrics, inflight=inflight)
        # Such a stream, cut loose from a replica that stops answering, is continued at once (inflight.py).
        self._inflight = inflight

    async def respond(self, call: Call, upstream: Response, state: EndpointState) -> web.StreamResponse:
        """Pass the engine's answer on: an event stream as it arrives, anything else whole (up to max_answer_bytes).

        OutOfBounds (the caller answers 502 and ejects the replica, see
        `out_of_bounds`) for a redirect: the router never follows one, and
        passing it on would send the client to wherever the engine says,
        with the client's credentials in a browser's case.
        """
        status = upstream.status
        if 300 <= status < 400:
            location = upstream.headers.get("location", "")
            log.warning("endpoint %s answered %d to %s (Location %r); refused, never followed", state.replica_id,
                        status, call.request.path, location[:200])
            raise OutOfBounds("redirect", f"answered {status}, a redirect, which the router never follows")
        ctype = upstream.headers.get("content-type", "application/json")
        headers = {"Content-Type": ctype, "x-llmgw-replica": state.replica_id,
                   "x-llmgw-catalog-version": call.view.version, ATTEMPTS_HEADER: str(call.attempts),
                   "x-llmgw-model": call.model}
        if call.fallback_from:
            # A fallback answered (fallback.py): the model the client asked for.
            headers["x-llmgw-fallback-from"] = call.fallback_from
        encoding = upstream.headers.get("content-encoding")
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        if ctype.startswith(_EVENT_STREAM):
            return await self._pass_stream(call, upstream, state, headers)
        if call.early is not None:
            return await self._pass_whole_in_stream(call, upstream, state)
        return await self._pass_whole(call, upstream, state, headers)

    def out_of_bounds(self, call: Call, state: EndpointState, exc: OutOfBounds) -> web.Response:
        """An engine broke a bound (its answer too large, a redirect, headers without end): eject it for a
        while with the reason, count it, log it; the 502 for the client, naming the replica."""
        ejection = self._ejector.eject(state, exc.code, str(exc))
        self._metrics.engine_refusals.labels(exc.code).inc()
        log.warning("endpoint %s of %r %s; ejected for %.0f s", state.replica_id, call.model, exc, ejection.seconds,
                    extra={"event": "endpoint-ejected", "endpoint": state.replica_id, "reason": exc.code})
        return errors.engine_out_of_bounds(call.model, state.replica_id, str(exc))

    async def _pass_whole(self, call: Call, upstream: Response, state: EndpointState,
                          headers: dict[str, str]) -> web.Response:
        r0 = perf_counter()
        limit = self._config.max_answer_bytes
        try:
            data = await upstream.read(limit)
        except OutOfBounds:
            self._let_go(upstream, limit)
            raise       # the caller's: answered 502, the replica ejected (out_of_bounds)
        except UpstreamError as exc:
            self._balancer.eject(state)
            raise Refused(errors.upstream_failed(
                call.model, f"{state.replica_id} stopped mid-response: {exc or type(exc).__name__}")) from None
        call.waited += perf_counter() - r0
        self._balancer.succeeded(state)
        usage = call.route.usage.whole(data)
        echo = loraselect.echo_for(call, state) if "Content-Encoding" not in headers else None
        if echo is not None:
            # A compressed answer (the router asks for none) goes on as it came.
            data = echo.whole(data)
        status = upstream.status
        if call.route.binds and 200 <= status < 300:
            self._affinity.learned(call, state, id_of_whole(data))
        overhead = perf_counter() - call.t0 - call.waited
        headers["x-llmgw-overhead-ms"] = f"{overhead * 1e3:.3f}"
        # A whole reply is handed to aiohttp in one piece: its first byte and
        # its last leave together (first=0: at the end).
        self._accounting.served(call, state, status, 0.0, overhead, usage)
        if len(data) >= self._config.large_body_bytes:
            # Let go once sent, a moment from now (the trimmer waits for it).
            self._trimmer.released(len(data))
        return web.Response(status=status, body=data, headers=headers)

    def _let_go(self, upstream: Response, limit: int) -> None:
        """An answer refused as too large was let go: what was read of it (up to `limit`) counts towards a trim."""
        declared = upstream.headers.get("content-length")
        if declared is None or not declared.isdigit() or int(declared) <= limit:
            self._trimmer.released(limit)     # read until past the limit, then dropped

    async def _pass_stream(self, call: Call, upstream: Response, state: EndpointState,
                           headers: dict[str, str]) -> web.StreamResponse:
        # No cache, and tell a buffering proxy in front (nginx) not to.
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"
        # The router's own time ends with the headers it sends: past them, the
        # stream runs at the engine's pace and the client's.
        overhead = perf_counter() - call.t0 - call.waited
        headers["x-llmgw-overhead-ms"] = f"{overhead * 1e3:.3f}"
        status = upstream.status
        request = call.request
        resp = call.early
        if resp is None:
            resp = web.StreamResponse(status=status, headers=headers)
            await resp.prepare(request)
        self._balancer.succeeded(state)
        served = self._accounting.served
        write = resp.write
        transport = request.transport
        first = 0.0
        usage = call.route.usage.stream()
        # The alias the client asked by, put back in each event (echo.py); None: asked by the name the engine serves.
        echo = loraselect.echo_for(call, state) if "Content-Encoding" not in headers else None
        # Streams of a model with continuation on are read event by event
        # (continuation.Splice) when they may be continued; every other passes as bytes.
        splice = self.continuation.watch(call) if call.view.continuation else None
        feed = splice.feed if isinstance(splice, Splice) else None
        movable = self._inflight if isinstance(splice, Splice) else None
        if movable is not None:
            _movable(movable, splice, state, upstream)
        parts = upstream.chunks()
        # A Responses stream names its response in its first event: remembered
        # before that event is passed on, so a request naming it finds it.
        first_event = FirstEvent() if call.route.binds and status == 200 else None
        try:
            while True:
                try:
                    # chunks() yields whatever bytes arrived, as soon as they arrive: no
                    # line splitting, no re-encoding, no waiting for a full event.
                    async for chunk in parts:
                        if feed is not None:
                            chunk = feed(chunk)
                            if not chunk:
                                continue
                        if first_event is not None and not first_event.feed(chunk):
                            self._affinity.learned(call, state, first_event.response_id)
                            first_event = None
                        if echo is not None:
                            chunk = echo.chunk(chunk)
                            if not chunk:
                                continue
                        # A write can block only when it leaves the client's socket
                        # backlogged past the transport's high-water mark (64 KiB): a
                        # small chunk onto an empty backlog never does.
                        if transport is not None and (transport.get_write_buffer_size() or len(chunk) > _SMALL_WRITE):
                            await self._write_to_slow_reader(write, chunk, transport)
                        else:
                            await write(chunk)
                        if not first:
                            first = perf_counter()
                        usage.feed(chunk)
                    tail = splice.rest() if isinstance(splice, Splice) else b""
                    if echo is not None:
                        tail = echo.chunk(tail) + echo.rest() if tail else echo.rest()
                    if tail:
                        await write(tail)
                        usage.feed(tail)
                    try:
                        await resp.write_eof()
                    except ConnectionError:
                        # Every byte of the answer was written; only the chunked
                        # framing's last empty chunk was not. A client that read
                        # to the stream's end ([DONE]) and closed at once, before
                        # the loop came back to this (an SDK does; a busy router's
                        # loop comes back late), had its whole answer: served,
                        # not a 499 of a client that left.
                        pass
                    break
                except UpstreamError as exc:
                    # The engine died (or went silent past upstream_idle_timeout)
                    # mid-stream. Headers are sent, so no retry: continued on
                    # another replica where the model allows it, else the stream
                    # ends with an error event, which OpenAI SDKs raise, instead of a hang.
                    self._balancer.eject(state)
                    if movable is not None:
                        movable.stream_done(state, upstream)
                    failure = f"{exc or type(exc).__name__}"
                    resumed = None if splice is None else await self.continuation.resume(call, splice, state, failure)
                    if resumed is not None:
                        upstream, state = resumed
                        if movable is not None:
                            _movable(movable, splice, state, upstream)
                        parts = upstream.chunks()
                        continue
                    if splice is None:
                        log.warning("endpoint %s died mid-stream: %s", state.replica_id, failure)
                    try:
                        held = echo.rest() if echo is not None else b""
                        await write(held + errors.stream_error_event(f"{state.replica_id}: {failure}",
                                                                     call.route.error_shape))
                        await resp.write_eof()
                    except ConnectionError:
                        pass
                    break
        except ConnectionError:
            # The client left: counted as nginx's 499; the caller closes the
            # upstream connection.
            served(call, state, 499, first, overhead, usage.usage)
            return resp
        except asyncio.CancelledError:
            # The same, as a handler cancelled by aiohttp when the client disconnects.
            served(call, state, 499, first, overhead, usage.usage)
            raise
        finally:
            if movable is not None:
                movable.stream_done(state, upstream)
            if isinstance(splice, Splice):
                self.continuation.close(splice)
        served(call, state, status, first, overhead, usage.usage)
        return resp

    async def _write_to_slow_reader(self, write: Callable[[bytes], Awaitable[None]], chunk: bytes,
                                    transport: asyncio.Transport) -> None:
        """A write while the client has unread bytes queued: bounded by client_write_timeout.

        Only this path pays for a timer; a client that keeps up has no backlog
        when the next chunk comes, and events are small. Past the timeout the connection is
        aborted and ConnectionResetError raised, so the stream ends as a client
        that left (499) and the caller closes the upstream request.
        """
        timeout = self._config.client_write_timeout
        if not timeout:
            await write(chunk)
            return
        try:
            await asyncio.wait_for(write(chunk), timeout)
        except asyncio.TimeoutError:
            log.warning("a streaming client at %s read nothing for %g s; dropping it", _peer(transport), timeout)
            transport.abort()
            raise ConnectionResetError("client stopped reading") from None

    # -- a stream opened early for a cold start (see conventions.held_for_cold_start) ----------

    async def refuse_in_stream(self, call: Call, refusal: web.Response) -> web.StreamResponse:
        """A refusal (cold timeout, unplaceable, ...) for a stream whose 200 and headers are sent: its last event.

        The error goes out as the route's shape has it (shapes.py): for
        OpenAI's a `data:` event, which OpenAI SDKs raise as an APIError, for
        Anthropic's an `event: error`; counted and logged under the refusal's status.
        """
        resp = call.early
        assert resp is not None    # the caller checked
        try:
            await resp.write(call.route.error_shape.event(refusal))
            await resp.write_eof()
        except ConnectionError:
            pass
        self._accounting.refuse(call, refusal)
        return resp

    async def _pass_whole_in_stream(self, call: Call, upstream: Response, state: EndpointState) -> web.StreamResponse:
        """An engine's whole (non-stream) answer to a stream already opened: an error, as the last event."""
        status = upstream.status
        limit = self._config.max_answer_bytes
        try:
            data = await upstream.read(limit)
        except OutOfBounds as exc:
            self._let_go(upstream, limit)
            refusal = self.out_of_bounds(call, state, exc)
            assert isinstance(refusal.body, bytes)      # our refusals are JSON bytes
            data, status, detail = refusal.body, refusal.status, ""
        except UpstreamError as exc:
            self._balancer.eject(state)
            data = b""
            detail = f"{state.replica_id} stopped mid-response: {exc or type(exc).__name__}"
        else:
            self._balancer.succeeded(state)
            detail = f"{state.replica_id} answered {upstream.status} without a stream"
        shape = call.route.error_shape
        event = shape.engine_event(data) or errors.stream_error_event(detail, shape)
        resp = call.early
        assert resp is not None    # called only for a stream already opened for a cold start
        served = self._accounting.served
        try:
            await resp.write(event)
            await resp.write_eof()
        except ConnectionError:
            served(call, state, 499, 0.0, perf_counter() - call.t0 - call.waited, None)
            return resp
        served(call, state, status, 0.0, perf_counter() - call.t0 - call.waited, None)
        return resp


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if peer else "?"


def _movable(inflight: InFlight, splice: Splice | str | None, state: EndpointState, upstream: Response) -> None:
    """`upstream` registered to be moved off `state` should it stop answering, while the stream has a
    hand-over left (inflight.py); one with none would only be cut to end with an error."""
    if isinstance(splice, Splice) and splice.tries < splice.attempts:
        inflight.stream(state, upstream, state.endpoint.model, (*splice.tried, state))
