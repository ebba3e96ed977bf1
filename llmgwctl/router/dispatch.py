"""The attempts of a request whose model is resolved: an endpoint picked, tried, another tried, until one answers.

`Dispatch.forward` is the request path's last step (`request.RequestPath`):
the body is read and the model resolved (`intake`), and what is left is
where to send it. It picks the first endpoint, waiting once, bounded, for
one when none is ready (`_first_endpoint`, `_wait_for_endpoint`: a cold
start), and tries endpoints in turn (`_attempt` each, `_send` the request in
it) within the request's attempts (retry.py) until one answers, whose answer
the answer path (`answer.AnswerPath`) passes back. When every endpoint
refused the connection it asks the rerouting (`reroute.Rerouting`) for a
fallback before it waits. A request pinned to the replica that stored the
response it names (`affinity`) is tried there alone. Any step that answers
the request itself raises `call.Refused`, which the request path counts and
logs.

It owns the requests' connections to engines (`pool`, made as the app
starts); it must not know how the body was read or the model resolved.
"""
from __future__ import annotations

import asyncio
import logging
from time import perf_counter

from aiohttp import web

from ..observability.metrics import RouterMetrics
from . import errors, loraselect
from .affinity import Affinity
from .answer import AnswerPath
from .balancer import Balancer, EndpointState
from .call import Call, Refused
from .coldstart import ColdStart, ColdTimeout, QueueFull
from .config import RouterConfig
from .conventions import held_for_cold_start
from .inflight import Abandoned, InFlight
from .reroute import Rerouting
from .retry import ATTEMPTS_HEADER, Attempts, Failure, retryable, retryable_status
from .surface import Surface
from .upstream import OutOfBounds, Pool, Response, UpstreamError

__all__ = ["Dispatch"]

log = logging.getLogger("llmgw.router")

# What of a refusing engine's 502 or 503 is read, for the log and the last error: an error body is far shorter.
_ERROR_BYTES = 4096


class Dispatch:
    """The attempts at endpoints of a request's model (`forward`), over the router's connections to engines (`pool`)."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, cold: ColdStart, metrics: RouterMetrics,
                 surface: Surface, answer: AnswerPath, affinity: Affinity, inflight: InFlight,
                 rerouting: Rerouting):
        self._config = config
        self._balancer = balancer
        self._cold = cold
        self._metrics = metrics
        self._surface = surface     # what the controller says cannot be placed now
        self._answer = answer
        self._affinity = affinity   # which replica stored a response a request names
        self._inflight = inflight   # moves a request off a replica that stops answering (inflight.py)
        self._rerouting = rerouting  # the fallback once every endpoint refused the connection (reroute.py)
        # Requests' connections to engines (see upstream.py): made by the Router as the app starts.
        self.pool: Pool | None = None

    async def forward(self, call: Call, body: bytes) -> web.StreamResponse:
        """Try endpoints of the model in turn, within the request's attempts, until one answers; Refused when none does.

        An attempt that failed before any byte of an answer could reach the
        client (retry.py says which) is tried again on a replica not tried
        yet, while the budget (max_attempts) lasts; every other ends the
        request. When every endpoint was tried and each refused the
        connection, the request ran nowhere: it goes to a fallback of the
        model that can take it, if the model names one (fallback.py), else
        waits once for an endpoint not tried yet, as for a cold start.
        """
        balancer = self._balancer
        pinned = call.pinned
        if pinned is not None:
            # The replica that stored the response it names, or no one (affinity.py): one attempt.
            once = Attempts(1)
            call.attempts = once.start()
            answer = await self._attempt(call, pinned, body, once, ())
            if isinstance(answer, Failure):
                assert call.response_id is not None     # set with `pinned`
                raise self._affinity.unreachable(call.response_id, answer.reason, call)
            return answer
        attempts = Attempts(self._config.max_attempts)
        state: EndpointState | None = await self._first_endpoint(call)
        tried: tuple[EndpointState, ...] = ()
        held = False
        while state is not None:
            call.attempts = attempts.start()
            answer = await self._attempt(call, state, body, attempts, tried)
            if not isinstance(answer, Failure):
                return answer
            attempts.failed(answer)
            tried += (state,)
            state = balancer.pick(call.model, tried, call.chooser)
            if state is None and not held and not call.fallback_from and attempts.unreached_only():
                # Every endpoint of the model refused the connection, so the
                # request ran nowhere and a fallback may take it (fallback.py),
                # rather than wait for the model's engines to come back.
                fallen = self._rerouting.after_refusals(call, body)
                if fallen is not None:
                    body, state = fallen
                    attempts.grant()        # the fallback's endpoint gets its try
                    continue
            if state is None:
                if not held and attempts.unreached_only() and self._cold.can_wait:
                    # Every endpoint of the model refused the connection: its engines
                    # are down -- the one replica crashed, say, and its agent is
                    # restarting it. That is missing capacity for a few seconds, as in
                    # a cold start, so wait as for one (bounded by the cold timeout)
                    # for an endpoint not tried yet -- the restarted replica joins
                    # anew once healthy -- rather than answer 502 for a gap that heals.
                    held = True
                    state = await self._wait_for_endpoint(call, tried)
                    attempts.grant()        # the endpoint that came back gets its try
            elif attempts.left <= 0:
                state = None
            if state is not None:
                self._metrics.retries.labels(call.model, answer.kind).inc()
        raise Refused(self._failed(call, attempts))

    def _failed(self, call: Call, attempts: Attempts) -> web.Response:
        """The router's answer when no attempt succeeded: each attempt's failure named, their count in a header."""
        failures = attempts.failures
        last = failures[-1] if failures else None
        if last is not None and last.kind == Failure.TIMED_OUT:
            earlier = f" (after {attempts.summary()})" if len(failures) > 1 else ""
            refusal = errors.response(504, f"replica {last.replica} of {call.model!r} {last.reason}{earlier}",
                                      "upstream_error", "upstream_timeout")
        else:
            refusal = errors.upstream_failed(call.model, attempts.summary())
        if attempts.count:
            refusal.headers[ATTEMPTS_HEADER] = str(attempts.count)
        return refusal

    async def _first_endpoint(self, call: Call) -> EndpointState:
        """The endpoint of the first attempt: picked now, or waited for (a cold start); Refused when there can be none."""
        balancer, model = self._balancer, call.model
        top = call.view.top_profile.get(model)
        if top is not None and not balancer.has_profile(model, top):
            self._cold.demand(model)
        state = balancer.pick(model, (), call.chooser)
        if state is None:
            if call.base:
                self._unless_unplaceable(call.base)
                ready = balancer.ready_count(call.base)
                if ready or not self._cold.can_wait:
                    # The base serves, but no replica holds the adapter yet (its
                    # agent is loading it, or the load failed: `llmgwctl status`).
                    raise Refused(errors.adapter_not_loaded(model, call.base, ready))
                self._cold.demand(call.base)
            self._unless_unplaceable(model)
            if not self._cold.can_wait:
                raise Refused(errors.no_replica(model))
            state = await self._wait_for_endpoint(call, ())
        return state

    async def _attempt(self, call: Call, state: EndpointState, body: bytes, attempts: Attempts,
                       tried: tuple[EndpointState, ...]) -> web.StreamResponse | Failure:
        """One try at `state`: the answer passed back, or (a Failure) why it failed before a byte reached the client.

        Refused for any failure after the answer path took the engine's
        answer: bytes of it may have reached the client, so it is not tried
        elsewhere.
        """
        balancer = self._balancer
        # The adapter in the body, for an engine that takes it there (llama.cpp).
        body = loraselect.for_endpoint(call, state, body)
        balancer.started(state)
        if call.base:       # a LoRA adapter's request: its own load, which its spread follows
            balancer.adapters.started(call.model)
        try:
            # With an attempt left, it may move while it waits (inflight.py).
            upstream = await self._send(call, state, body, (*tried, state) if attempts.left > 0 else None)
            if isinstance(upstream, Failure):
                return upstream
            try:
                if retryable_status(upstream.status) and attempts.left > 0 \
                        and balancer.has_other(call.model, (*tried, state)):
                    return await self._refused_by(call, state, upstream)
                return await self._answer.respond(call, upstream, state)
            finally:
                # A response read to its end goes back to the pool; one cut
                # short (client gone, error) closes, so the engine sees the
                # disconnect and frees the slot.
                upstream.release()
        except OutOfBounds as exc:
            raise Refused(self._answer.out_of_bounds(call, state, exc)) from None
        except UpstreamError as exc:
            raise Refused(errors.upstream_failed(call.model, f"{state.replica_id}: {exc or type(exc).__name__}")) from None
        finally:
            balancer.finished(state)
            if call.base:
                balancer.adapters.finished(call.model)

    async def _refused_by(self, call: Call, state: EndpointState, upstream: Response) -> Failure:
        """An engine's 502 or 503, dropped for another replica's answer: its start kept for the log, the replica ejected."""
        self._balancer.eject(state)
        try:
            said = await asyncio.wait_for(upstream.read(_ERROR_BYTES), self._config.connect_timeout)
        except (UpstreamError, asyncio.TimeoutError):
            said = b""      # too long or too slow to be an error body: the status says enough
        text = said[:200].decode(errors="replace").strip()
        log.warning("endpoint %s answered %d before any byte reached the client; trying another", state.replica_id,
                    upstream.status)
        return Failure(state.replica_id, f"answered {upstream.status}" + (f": {text}" if text else ""),
                       Failure.REFUSED)

    async def _send(self, call: Call, state: EndpointState, body: bytes,
                    movable: tuple[EndpointState, ...] | None = None) -> Response | Failure:
        """The request sent to `state`, once its answer's headers are in; or (a Failure) why they did not come.

        Each failure here came before any byte of an answer: the replica is
        ejected for a while (its engine is down, wedged or lost the
        request), and the request may go elsewhere (retry.py). `movable`:
        the endpoints tried, `state` among them, when the request may leave
        `state` for another while it waits, should `state` stop answering
        (inflight.py); None: it waits for its headers here whatever happens.
        """
        pool = self.pool
        assert pool is not None     # made as the app starts, which aiohttp runs before it serves a request
        idle_timeout = (self._config.upstream_idle_timeout or None) if call.stream else None
        up0 = perf_counter()
        sent = pool.post(state.endpoint.url, call.request.raw_path, body, idle_timeout=idle_timeout,
                         headers=call.fwd, method=call.request.method.encode() if call.route.by_response else b"POST")
        try:
            upstream = await (sent if movable is None else self._inflight.headers(state, call.model, movable, sent))
        except Abandoned as exc:
            # Already out of routing, held until it answers: no ejection of ours.
            call.waited += perf_counter() - up0
            log.warning("endpoint %s stopped answering while a request waited on it, trying another: %s",
                        state.replica_id, exc)
            return Failure(state.replica_id, str(exc), Failure.ABANDONED)
        except UpstreamError as exc:
            if not retryable(exc):
                raise
            call.waited += perf_counter() - up0
            self._balancer.eject(state)
            log.warning("endpoint %s failed before answering, trying another: %s", state.replica_id, exc)
            return Failure.of(state.replica_id, exc)
        call.waited += perf_counter() - up0       # the engine's, until its headers
        return upstream

    def _unless_unplaceable(self, model: str) -> None:
        """Refused (503 at once, with the placement's reason) when the controller says `model` cannot be placed now."""
        unplaceable = self._surface.unplaceable
        said = unplaceable.get(model) if unplaceable else None
        if said is not None:
            raise Refused(errors.unplaceable(model, said.reason, said.retry))

    async def _wait_for_endpoint(self, call: Call, tried: tuple[EndpointState, ...]) -> EndpointState:
        """Hold `call` until an endpoint of its model not in `tried` is ready: a cold start, or every one refusing.

        Refused 429 when the model's queue is full, 503 past the cold timeout
        or as soon as the controller says the model cannot be placed. Every
        outcome is observed in the cold-wait histogram, and the time waited is
        left out of the router's overhead.
        """
        model, balancer, cold = call.model, self._balancer, self._cold
        observed = self._metrics.cold_wait
        wait_from = perf_counter()

        def pick() -> EndpointState | None:
            got = balancer.pick(model, tried, call.chooser)
            if got is None:
                self._unless_unplaceable(model)
            return got

        try:
            state = await held_for_cold_start(call, cold.wait(model, pick), self._config.cold_keepalive)
        except Refused:
            observed.labels(model, "unplaceable").observe(perf_counter() - wait_from)
            raise
        except QueueFull:
            observed.labels(model, "queue_full").observe(0.0)
            raise Refused(errors.queue_full(model, cold.max_waiting)) from None
        except ColdTimeout:
            observed.labels(model, "timeout").observe(perf_counter() - wait_from)
            raise Refused(errors.cold_timeout(model, cold.timeout)) from None
        waited = perf_counter() - wait_from
        observed.labels(model, "served").observe(waited)
        call.waited += waited
        return state
