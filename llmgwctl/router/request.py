"""The request path: a proxied request from arrival to an engine's answer, in four steps of their own.

Only for a route in the route table (`routes`) or one the catalog's engines
add. `RequestPath.proxy` checks the target, the caller's key and its rate
before reading a byte of body (`_run`), then hands the request on:

    bodies    the body read within its budget, inflated (`BodyReader.read`)
    intake    parsed once, its model resolved (aliases, adapters), the key and
              route checked, a fallback taken, the body renamed (`Intake.resolve`)
    dispatch  endpoints picked and tried in turn, within the request's attempts,
              until one answers (`Dispatch.forward`), whose answer the answer
              path (`answer.AnswerPath`) passes back
    reroute   the switch to a fallback model, asked by intake as the model is
              resolved and by dispatch when every endpoint refused (`Rerouting`)

A request naming a stored response -- `previous_response_id` in a Responses
body, or a route of `/v1/responses/{id}` (`stored`) -- is pinned to the
replica that stored it and tried there alone (`affinity`). A step that
answers the request itself raises `call.Refused`, counted and logged once
here.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import perf_counter

from aiohttp import web

from ..allocator import Trimmer
from ..observability.metrics import RouterMetrics
from . import auth as keyauth
from . import errors, jsonbody
from . import routes as routing
from .accounting import Accounting
from .affinity import Affinity
from .answer import AnswerPath
from .balancer import Balancer
from .bodies import BodyReader
from .call import Call, Refused
from .coldstart import ColdStart
from .config import RouterConfig
from .conventions import ClientGone
from .dispatch import Dispatch
from .inflight import InFlight
from .info import InfoRoutes
from .intake import Intake
from .limits import BodyBudget, PathError, check_target
from .policies import Policies
from .reroute import Rerouting
from .surface import Surface

__all__ = ["RequestPath"]


class RequestPath:
    """A proxied request from arrival to the answer path (`proxy`), and the handlers the app routes to it."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, policies: Policies, cold: ColdStart,
                 limiter: keyauth.Limiter, bodies: BodyBudget, parser: jsonbody.OffLoop, trimmer: Trimmer,
                 metrics: RouterMetrics, surface: Surface, accounting: Accounting, answer: AnswerPath,
                 info: InfoRoutes, affinity: Affinity, inflight: InFlight):
        self._limiter = limiter
        self._surface = surface
        self._accounting = accounting
        self._answer = answer
        self._info = info           # the 404 of a POST no route of the catalog's takes
        self._affinity = affinity   # which replica stored a response a request names
        # The steps, each with the collaborators it needs and nothing else.
        self._reader = BodyReader(config, bodies=bodies, trimmer=trimmer)
        rerouting = Rerouting(balancer=balancer, policies=policies, cold=cold, metrics=metrics, surface=surface)
        self._intake = Intake(config, parser=parser, policies=policies, affinity=affinity, rerouting=rerouting)
        # Public for its `pool`, which the Router makes as the app starts and closes as it stops.
        self.dispatch = Dispatch(config, balancer=balancer, cold=cold, metrics=metrics, surface=surface,
                                 answer=answer, affinity=affinity, inflight=inflight, rerouting=rerouting)

    def close(self) -> None:
        """Let the body reader's inflating thread go (the app stops)."""
        self._reader.close()

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
        body = call.body = await self._intake.resolve(call, await self._reader.read(call))
        return await self.dispatch.forward(call, body)

    async def _by_response(self, call: Call) -> web.StreamResponse:
        """To the replica that stored the response the path names, for the key that made it (affinity.py)."""
        request = call.request
        response_id = call.response_id = request.match_info["id"]
        call.pinned = self._affinity.endpoint(call, response_id)
        # A GET or DELETE sends no body; a cancel's, if any, goes on as it came.
        body = call.body = await self._reader.read(call) if request.method == "POST" else b""
        call.stream = call.route.streams and request.query.get("stream") in ("true", "True", "1")
        answer = await self.dispatch.forward(call, body)
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
                self._reader.release(call)
