"""The request path: a proxied request from arrival to an engine's answer.

Only for a route in the route table (`routes`) or one the catalog's engines
add. `RequestPath.proxy` checks the target, the caller's key and its rate
before reading a byte of body; reads the body within its budget
(`_read_body`, `limits.BodyBudget`) and parses it once (off the loop when
costly, `jsonbody`); resolves the model against the catalog taken once for
the request (`_resolve`), or the fallback that answers for it when it has
no replica that can (`_fall_back`, `fallback`); picks an endpoint, waiting
once, bounded, for one when none is ready (`_wait_for_endpoint`); and tries
endpoints in turn (`_forward`: `_attempt` each, `_send` the request in it)
until one answers, whose answer the answer path (`answer.AnswerPath`) passes
back. A request naming a stored response -- `previous_response_id` in a
Responses body, or a route of `/v1/responses/{id}` (`stored`) -- is pinned
to the replica that stored it and tried there alone (`affinity`). A step
that answers the request itself raises `call.Refused`, counted and logged
once here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Awaitable, Callable
from time import perf_counter

from aiohttp import web

from .. import httpbody
from ..allocator import Trimmer
from ..catalog import Model
from ..observability.metrics import RouterMetrics
from . import auth as keyauth
from . import errors, jsonbody
from . import routes as routing
from .accounting import Accounting
from .affinity import Affinity
from .answer import AnswerPath
from .balancer import Balancer, EndpointState
from .call import Call, Refused, known, usable_names
from .coldstart import ColdStart, ColdTimeout, QueueFull
from .config import RouterConfig
from .conventions import ClientGone, held_for_cold_start
from .fallback import DOWN, Choice, Fallbacks
from .inflight import Abandoned, InFlight
from .info import InfoRoutes
from .limits import BodyBudget, BudgetFull, PathError, check_target
from .policies import Policies
from .retry import ATTEMPTS_HEADER, Attempts, Failure, retryable, retryable_status
from .surface import Surface
from .upstream import OutOfBounds, Pool, Response, UpstreamError

__all__ = ["RequestPath"]

log = logging.getLogger("llmgw.router")

# What of a refusing engine's 502 or 503 is read, for the log and the last error: an error body is far shorter.
_ERROR_BYTES = 4096


class RequestPath:
    """A proxied request from arrival to the answer path (`proxy`), and the handlers the app routes to it."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, policies: Policies, cold: ColdStart,
                 limiter: keyauth.Limiter, bodies: BodyBudget, parser: jsonbody.OffLoop, trimmer: Trimmer,
                 metrics: RouterMetrics, surface: Surface, accounting: Accounting, answer: AnswerPath,
                 info: InfoRoutes, affinity: Affinity, inflight: InFlight):
        self._config = config
        self._balancer = balancer
        self.policies = policies
        self._cold = cold
        self._limiter = limiter
        self._bodies = bodies
        self._parser = parser
        self._trimmer = trimmer
        # Compressed bodies past a small one are inflated here (httpbody): one
        # thread, so gzip bombs queue behind each other and take at most one
        # core, and never the default executor serve's agent also uses.
        # Made on the first compressed body, let go with the app.
        self._inflater: concurrent.futures.ThreadPoolExecutor | None = None
        self._metrics = metrics
        self._surface = surface
        self._accounting = accounting
        self._answer = answer
        self._info = info           # the 404 of a POST no route of the catalog's takes
        # Which model answers a request whose own has no replica that can (fallback.py).
        self._fallbacks = Fallbacks(balancer)
        self._affinity = affinity   # which replica stored a response a request names
        self._inflight = inflight   # moves a request off a replica that stops answering (inflight.py)
        # Requests' connections to engines (see upstream.py): made by the Router as the app starts.
        self.pool: Pool | None = None

    def close(self) -> None:
        """Let the inflating thread go (the app stops)."""
        inflater, self._inflater = self._inflater, None
        if inflater is not None:
            inflater.shutdown(wait=False, cancel_futures=True)

    def handler(self, route: routing.Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def proxy(request: web.Request) -> web.StreamResponse:
            return await self.proxy(request, route)
        return proxy

    async def catalog_route(self, request: web.Request) -> web.StreamResponse:
        """A POST under /v1/ that is not in the table: proxied if the current catalog's engines add it, else a 404."""
        route = self._surface.view.routes.routes.get(request.raw_path.partition("?")[0])
        if route is None:
            return await self._info.not_found(request)
        return await self.proxy(request, route)

    async def proxy(self, request: web.Request, route: routing.Route) -> web.StreamResponse:
        """A request on a route of the table (or the catalog's): to a replica of the model its body names."""
        return await self._run(Call(request, route, perf_counter(), self._surface.view), self._by_model)

    def stored(self, route: routing.Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The handler of a route naming a stored response (`route.by_response`)."""
        async def proxy(request: web.Request) -> web.StreamResponse:
            return await self._run(Call(request, route, perf_counter(), self._surface.view), self._by_response)
        return proxy

    async def _by_model(self, call: Call) -> web.StreamResponse:
        body = call.body = await self._resolve(call, await self._read_body(call))
        return await self._forward(call, body)

    async def _by_response(self, call: Call) -> web.StreamResponse:
        """To the replica that stored the response the path names, for the key that made it (affinity.py)."""
        request = call.request
        response_id = call.response_id = request.match_info["id"]
        call.pinned = self._affinity.endpoint(call, response_id)
        # A GET or DELETE sends no body; a cancel's, if any, goes on as it came.
        body = call.body = await self._read_body(call) if request.method == "POST" else b""
        call.stream = call.route.streams and request.query.get("stream") in ("true", "True", "1")
        answer = await self._forward(call, body)
        if answer.status == 404 or (request.method == "DELETE" and 200 <= answer.status < 300):
            # Deleted, or its engine no longer has it: nothing left to route to.
            self._affinity.store.forget(response_id)
        return answer

    async def _run(self, call: Call, steps: Callable[[Call], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """The checks every proxied request passes first, then `steps`; a refusal counted and logged once."""
        request, route = call.request, call.route
        accounting = self._accounting
        try:
            try:
                # The target the engine will get, before anything else is
                # spent on the request.
                check_target(request.raw_path, route.prefix)
            except PathError as exc:
                raise Refused(errors.response(400, str(exc), "invalid_request_error", "invalid_path")) from None
            # The key and its rate before the body is read: a stranger or a
            # key over its rate makes the router parse nothing.
            api_key = call.api_key = accounting.key(request)
            if api_key is not None:
                wait = self._limiter.take(api_key)
                if wait:
                    raise Refused(keyauth.rate_limited(api_key, wait))
            return await steps(call)
        except Refused as refused:
            if call.early is not None:
                return await self._answer.refuse_in_stream(call, refused.response)
            # In the shape the route's clients parse (shapes.py): OpenAI's unless the route says.
            return accounting.refuse(call, route.error_shape.whole(refused.response))
        except ClientGone:
            # Left while held for a cold start: a keep-alive comment found the connection closed.
            accounting.refuse(call, web.Response(status=499))
            assert call.early is not None    # ClientGone is raised only by a keep-alive write to the opened stream
            return call.early
        except asyncio.CancelledError:
            # The same, seen first by aiohttp, which cancels the handler; a
            # request cancelled before its stream opened is not counted, as before.
            if call.early is not None:
                accounting.refuse(call, web.Response(status=499))
            raise
        finally:
            if call.held:
                self._bodies.give_back(request.remote or "?", call.held)
                self._trimmer.released(call.held)

    # -- the body and the model --------------------------------------------------------------------

    async def _read_body(self, call: Call) -> bytes:
        """The body as sent, decoded; its size (compressed and inflated) at most max_body_bytes.

        aiohttp does not decompress (see httpserver.server_options): a gzip
        body is inflated here by httpbody, which stops at the limit as it
        inflates.
        """
        request, cfg = call.request, self._config
        limit = cfg.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise Refused(errors.too_large(limit))
        client = request.remote or "?"
        try:
            if length is not None:
                # Declared: charged before a byte of it is held.
                self._hold(call, client, length)
            if request.content.is_eof():
                data = await request.read()      # already buffered: the usual small request
            else:
                # wait_for, not asyncio.timeout: Python 3.10 is supported. Only
                # bodies still arriving pay for it.
                data = await asyncio.wait_for(request.read(), cfg.body_timeout)
            if length is None:
                self._hold(call, client, len(data))
            encoding = request.headers.get("Content-Encoding")
            if encoding is not None:
                if self._inflater is None:
                    self._inflater = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmgw-inflate")
                data = await httpbody.decode(data, encoding, limit, executor=self._inflater,
                                             admit=lambda size: self._hold(call, client, size))
            return data
        except web.HTTPRequestEntityTooLarge:
            self._trimmer.released(limit)     # what aiohttp read before it stopped, let go
            raise Refused(errors.too_large(limit)) from None
        except httpbody.BodyTooLarge:
            raise Refused(errors.response(
                413, f"the request body inflates to more than the router's limit of {limit} bytes",
                "invalid_request_error", "request_too_large")) from None
        except httpbody.BodyError as exc:
            raise Refused(errors.response(exc.status, str(exc), "invalid_request_error", exc.code)) from None
        except web.RequestPayloadError:
            # Bad chunked framing, or a body shorter than its Content-Length.
            raise Refused(errors.response(
                400, "the request body is not framed as its headers say (chunked encoding or Content-Length)",
                "invalid_request_error", "invalid_body")) from None
        except asyncio.TimeoutError:
            raise Refused(errors.response(
                408, f"the request body did not arrive within {cfg.body_timeout:g} s", "invalid_request_error",
                "request_timeout", headers={"Connection": "close"})) from None

    def _hold(self, call: Call, client: str, size: int) -> None:
        """Charge a body of `size` bytes to the large-body budget (raised past what was charged); Refused when full."""
        if size <= call.held:
            return
        budget = self._bodies
        budget.give_back(client, call.held)
        call.held = 0
        try:
            call.held = budget.take(client, size)
        except BudgetFull as full:
            raise Refused(errors.large_bodies_busy(full.per_client, full.limit)) from None

    async def _parse(self, call: Call, body: bytes) -> jsonbody.Facts:
        """The body's facts, parsed on the loop when cheap for certain, else off it (see jsonbody)."""
        route, depth = call.route, self._config.max_json_depth
        try:
            if jsonbody.heavy(body):
                return await self._parser.parse(body, route.model_key, route.prompt, depth)
            return jsonbody.parse(body, route.model_key, depth)
        except jsonbody.BodyRefused as exc:
            raise Refused(errors.response(400, str(exc), "invalid_request_error", exc.code)) from None
        except jsonbody.WorkerBusy:
            raise Refused(errors.response(
                503, "the router is parsing as many large request bodies as it may at once; retry shortly",
                "service_unavailable", "too_many_large_bodies",
                headers={"Retry-After": str(errors.RETRY_LARGE_BODIES)})) from None

    async def _resolve(self, call: Call, body: bytes) -> bytes:
        """Parse the body and resolve its model into `call`; return the body to forward."""
        facts = await self._parse(call, body)
        name = facts.model
        if type(name) is not str or not name:
            raise Refused(errors.missing_model())
        if len(name) > errors.MAX_NAME_CHARS:
            # Before any lookup, key pattern or "did you mean": no name is that long.
            raise Refused(errors.name_too_long(name, facts.model_chars))
        view = call.view
        call.asked = name
        model = view.catalog.resolve(name)
        adapter = None
        if model is None:
            ref = view.catalog.adapter(name)
            if ref is not None:
                # A LoRA adapter: picked under its own name among the base's
                # replicas that hold it (balancer), under the base's route and policy.
                adapter, model = ref.adapter, ref.base
                call.base = model.name
        served = adapter.name if adapter is not None else model.name if model is not None else ""
        call.model = served
        if call.api_key is not None and not keyauth.allows(call.api_key, name, adapter or model):
            raise Refused(keyauth.forbidden(name))
        if model is None:
            raise Refused(errors.unknown_model(name, usable_names(view.catalog, call.api_key)))
        route = call.route
        if not view.routes.allows(route, model.name):
            raise Refused(errors.no_such_route(call.request.method, route.path, model.name))
        call.stream = route.streams and facts.stream
        previous = facts.doc.get("previous_response_id") if route.binds else None
        if previous is not None:
            if type(previous) is not str:
                raise Refused(errors.response(400, "'previous_response_id' must be a string, a response's id",
                                              "invalid_request_error", "invalid_previous_response_id"))
            # Only the replica that stored it can continue it: no policy picks, and
            # no fallback model, which never saw the response it names.
            call.response_id = previous
            call.pinned = self._affinity.endpoint(call, previous, model.name)
        elif adapter is None:
            # An adapter's request has no fallback: another model lacks the adapter.
            chain = view.fallbacks.get(model.name)
            if chain:
                model = self._fall_back(call, model, chain)
                served = model.name
        policy = view.routing.get(model.name) if call.pinned is None else None
        if policy is not None:
            # Parsed on the loop, the prompt is read only now, when a policy wants it.
            reader = known(facts.prompt) if facts.off_loop else route.prompt
            # Under the served name: an adapter's KV cache is its own, not its base's.
            call.chooser = self.policies.chooser(policy, served, facts.doc, call.request.headers, prompt=reader)
        if name != served:
            body = self._renamed(body, facts, route.model_key, served)
            if not call.fallback_from:
                # An alias: echoed back in the answer (echo.py). A fallback's
                # answer names the model that gave it, as its headers do.
                call.echo_as = name
        return body

    def _fall_back(self, call: Call, model: Model, chain: tuple[str, ...]) -> Model:
        """The model that answers `call`: `model`, or the fallback taken when it has no replica that can (fallback.py).

        Asked after the key and the route were checked against `model`, so a
        request its key or route could not send to `model` gets `model`'s refusal,
        never a fallback's answer.
        """
        choice = self._switch(call, model, chain)
        if choice is None:
            return model
        if choice.reason == DOWN:
            # Woken all the same, as a request waiting for it would: the
            # fallback answers until the model's own replica is ready.
            self._cold.demand(model.name)
        return choice.model

    def _fall_back_after_refusals(self, call: Call, body: bytes) -> tuple[bytes, EndpointState] | None:
        """`call` moved to a fallback once every endpoint of its model refused the connection: the body
        renamed for it and its endpoint; None when the model has no fallback that can take it.

        The model's policy chooser was built for the model's endpoints: the
        fallback's is built anew, from the body parsed again (it passed once),
        so its pick follows its own policy; least-load's for a body too large
        to parse again on the loop.
        """
        view = call.view
        chain = view.fallbacks.get(call.model)
        model = view.catalog.resolve(call.model)
        if not chain or model is None:
            return None
        choice = self._switch(call, model, chain)
        if choice is None:
            return None
        name = choice.model.name
        body = call.body = self._renamed(body, None, call.route.model_key, name)
        policy = view.routing.get(name)
        call.chooser = None if policy is None or jsonbody.heavy(body) else self.policies.chooser(
            policy, name, jsonbody.parse(body, call.route.model_key, 0).doc, call.request.headers,
            prompt=call.route.prompt)
        state = self._balancer.pick(name, (), call.chooser)
        # choose() took a fallback with a usable endpoint, and nothing ran since: there is one.
        assert state is not None
        return body, state

    def _switch(self, call: Call, model: Model, chain: tuple[str, ...]) -> Choice | None:
        """The fallback of `model` that `call` goes to, counted and marked on the call; None: `model` keeps it."""
        unplaceable = self._surface.unplaceable
        choice = self._fallbacks.choose(call, model, chain, bool(unplaceable) and model.name in unplaceable)
        if choice is None:
            return None
        self._metrics.fallbacks.labels(model.name, choice.model.name, choice.reason).inc()
        call.fallback_from = model.name
        call.model = choice.model.name
        # A fallback's answer names the model that gave it, as its headers do,
        # even when the request came by alias and was already set to echo it.
        call.echo_as = ""
        return choice

    def _renamed(self, body: bytes, facts: jsonbody.Facts | None, key: str, name: str) -> bytes:
        """`body` naming the model `name` instead of the alias it was sent with: only the model's value changes.

        `facts`: what parsing the body found, which saves a scan; None for a
        body already forwarded once (a fallback after refusals, `_forward`).
        """
        lone = facts.lone_surrogate if facts is not None else None
        if lone is None:
            lone = jsonbody.lone_surrogate(body)
        if lone:
            # A lone surrogate ("\ud800"): JSON's escapes can spell it, UTF-8
            # cannot, and no engine could read it either. Refused by alias as
            # ever (a rewrite once re-encoded the body, which failed on it).
            raise Refused(errors.response(
                400, "the request body holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                "which is not text", "invalid_request_error", "invalid_json"))
        span = (facts.span if facts is not None else None) or jsonbody.model_span(body, key)
        if span is not None:
            return jsonbody.with_model(body, span, name)
        # Not UTF-8 (JSON may be UTF-16 or 32): re-encoded whole, as UTF-8.
        doc = json.loads(body)
        doc[key] = name
        try:
            return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            raise Refused(errors.response(
                400, "the request body holds a lone UTF-16 surrogate, which is not text", "invalid_request_error",
                "invalid_json")) from None

    # -- an endpoint, and the attempts at it -------------------------------------------------------

    async def _forward(self, call: Call, body: bytes) -> web.StreamResponse:
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
                fallen = self._fall_back_after_refusals(call, body)
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
        balancer.started(state)
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
