"""Requests in flight to a replica that stopped answering: moved off it as soon as it leaves the routing.

Outlier ejection (outlier.py) takes a wedged engine -- SIGSTOPped, a hung
GPU -- out of routing within seconds, but that steers only new requests: one
already sent there waits on an engine that will not answer, until its
headers timeout (`upstream_headers_timeout`) or, for a stream, its idle
timeout. `InFlight` keeps, per endpoint, the requests waiting on it, and
`abandon(state, why)` moves them:

- A request still waiting for its answer's headers -- nothing of an answer
  has reached its client -- waits through `headers`. Abandoned, its task is
  cancelled and `headers` raises `Abandoned` in its place: the request path
  counts a failed attempt (retry.Failure.ABANDONED, in the attempt count
  and the access log like every retry) and sends it to another replica at
  once. A cut stream's continuation waiting for its headers (continuation.py)
  waits the same way, and moves to its next replica as a failed hand-over. Only while the request has an attempt left in its budget (the
  request path does not register one that has none) and its model has
  another replica in routing it has not tried: one that would find nowhere
  to go keeps waiting as before, since its engine may yet wake up.
- A stream that already sent bytes, and that its model may continue
  (continuation.py), is registered by `stream` while its engine's answer is
  read. Abandoned, that answer fails as if the engine had died (its
  connection is closed, so the engine frees the slot if it ever wakes), and
  the answer path continues the stream on another replica. By the same rule
  as a request waiting for headers: only when its model has another replica
  in routing that the stream has not been on. A stream with nowhere to go --
  a model's lone replica ejected for missed polls, say, a busy CPU engine
  whose /metrics answers come late -- is left to read on: cut, it could only
  end with an error, and its engine may be answering yet. A stream that may
  not be continued is not registered: it ends as before, by its idle
  timeout, unless its engine wakes first.

Only a cause that says the engine does not answer calls `abandon` (the
router's outlier ejection, server.py wires it). An endpoint that merely
leaves the list -- drained, scaled down, stopped gracefully -- is not
abandoned: its engine answers, and the drain waits for its requests
(reconciler/maintenance.py).

What it costs a request: a ticket in a dict while its headers are awaited,
no task and no timer. It must not know HTTP or the catalog: it is told an
endpoint, and asks the balancer whether a model has another to go to.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from .balancer import Balancer, EndpointState
from .upstream import Response, UpstreamBroken

__all__ = ["Abandoned", "InFlight"]

log = logging.getLogger("llmgw.router")

T = TypeVar("T")


class Abandoned(Exception):
    """The attempt's replica left the routing for not answering while its headers were awaited: try another."""


class _Ticket:
    """One request waiting on an endpoint for its answer's headers."""

    __slots__ = ("task", "model", "tried", "cancels", "cut")

    def __init__(self, task: asyncio.Task[object], model: str, tried: tuple[EndpointState, ...], cancels: int):
        self.task = task
        self.model = model
        self.tried = tried          # the endpoints it must not go back to, this one among them
        self.cancels = cancels      # its task's pending cancellations when it began to wait
        self.cut: str | None = None     # why it was abandoned; None while it is not


class InFlight:
    """Per endpoint, the requests waiting on it that may move (`headers`, `stream`); `abandon` moves them."""

    def __init__(self, balancer: Balancer):
        self._balancer = balancer
        self._waiting: dict[EndpointState, dict[_Ticket, None]] = {}
        # Per endpoint, each stream with its model and the endpoints a continuation must not go to.
        self._streams: dict[EndpointState, dict[Response, tuple[str, tuple[EndpointState, ...]]]] = {}

    async def headers(self, state: EndpointState, model: str, tried: tuple[EndpointState, ...],
                      sent: Awaitable[T]) -> T:
        """`sent` awaited (a request to `state`, until its answer's headers are in); Abandoned if `state`
        is abandoned meanwhile. `tried`: the endpoints the request tried, `state` among them."""
        task = asyncio.current_task()
        if task is None:        # not in a task (never so in the router): nothing to cancel
            return await sent
        ticket = _Ticket(task, model, tried, _cancelling(task))
        waiting = self._waiting.get(state)
        if waiting is None:
            waiting = self._waiting[state] = {}
        waiting[ticket] = None
        try:
            return await sent
        except asyncio.CancelledError:
            # Ours alone, or ours and another's (the app stopping): only ours becomes a retry.
            if ticket.cut is None or _cancelling(task) > ticket.cancels + 1:
                raise
            uncancel = getattr(task, "uncancel", None)     # Python 3.11+: the cancel is taken back
            if uncancel is not None:
                uncancel()
            raise Abandoned(ticket.cut) from None
        finally:
            waiting.pop(ticket, None)
            if not waiting and self._waiting.get(state) is waiting:
                del self._waiting[state]

    def stream(self, state: EndpointState, upstream: Response, model: str,
               tried: tuple[EndpointState, ...]) -> None:
        """`upstream`, a stream of `model` from `state` that may be continued elsewhere, is being passed on.
        `tried`: the endpoints the stream was on or must not go to, `state` among them."""
        streams = self._streams.get(state)
        if streams is None:
            streams = self._streams[state] = {}
        streams[upstream] = (model, tried)

    def stream_done(self, state: EndpointState, upstream: Response) -> None:
        """`upstream` (from `stream`) is no longer read: ended, cut, or continued elsewhere."""
        streams = self._streams.get(state)
        if streams is not None:
            streams.pop(upstream, None)
            if not streams:
                del self._streams[state]

    def abandon(self, state: EndpointState, why: str) -> tuple[int, int]:
        """`state`'s engine does not answer and it left the routing (`why`, a sentence naming it): move what
        waits on it; return how many requests waiting for headers and how many streams were moved."""
        moved = continued = 0
        balancer = self._balancer
        waiting = self._waiting.get(state)
        if waiting:
            for ticket in list(waiting):
                if ticket.cut is None and balancer.has_usable(ticket.model, ticket.tried):
                    ticket.cut = f"abandoned: {why}"
                    del waiting[ticket]
                    ticket.task.cancel()
                    moved += 1
        streams = self._streams.get(state)
        if streams:
            for upstream, (model, tried) in list(streams.items()):
                if not balancer.has_usable(model, tried):
                    continue        # nowhere to continue: it reads on, as a request waiting for headers waits
                del streams[upstream]
                # Failed as a dead engine's stream fails, and its connection
                # closed at once: the engine, if it wakes, sees the client gone.
                upstream.fail(UpstreamBroken(f"abandoned mid-stream: {why}"))
                upstream.release()
                continued += 1
            if not streams:
                del self._streams[state]
        if moved or continued:
            log.warning("endpoint %s stopped answering: %d requests waiting on it moved, %d streams cut to be "
                        "continued", state.replica_id, moved, continued,
                        extra={"event": "requests-moved", "endpoint": state.replica_id})
        return moved, continued

    def waiting(self, state: EndpointState) -> int:
        """Requests waiting on `state` for their answer's headers (for tests)."""
        return len(self._waiting.get(state) or ())

    def streaming(self, state: EndpointState) -> int:
        """Streams from `state` registered to be moved (for tests)."""
        return len(self._streams.get(state) or ())


def _cancelling(task: asyncio.Task[object]) -> int:
    counted = getattr(task, "cancelling", None)     # Python 3.11+
    return int(counted()) if counted is not None else 0
