"""The router's HTTP face: the OpenAI-compatible API, proxying to the chosen endpoint.

Owns the request path -- only for a route in the route table (`routes`) or
one the catalog's engines add; read the body within its budget and parse it
once (off the loop when costly, `jsonbody`), resolve the model against the
catalog taken once for the request, pick an endpoint, forward, pass the
answer back (streams chunk by chunk, as bytes) -- and the three
narrow surfaces the control plane meets it through:

- `set_endpoints(endpoints)`, `set_catalog(catalog)` and
  `set_model_states(states)` (a model that cannot be placed now is answered at
  once with the reason): pushed once per change, never pulled per request;
- `usage_snapshot()`: last use and in-flight count per replica, read once a tick;
- `load_snapshot()`: each engine's latest fresh load reading, for the autoscaler;
- `inflight_seconds()`: each replica's in-flight count integrated over time, for the autoscaler;
- a `Waker` it calls when a request finds no ready replica;
- `set_api_keys(keys)`: optional API keys (see `auth`), swapped whole like a catalog.

A proxied request carries one `_Call` through its path: key and rate, body,
model (`_resolve`), endpoint and attempts (`_forward`, with one bounded wait
for an endpoint, `_wait_for_endpoint`), then the answer, whole
(`_pass_whole`) or streamed (`_pass_stream`). A step that answers the request
itself raises `_Refused`. Each request is counted in `self.metrics`
(pre-bound children, see `llmgwctl.observability.metrics`) and, unless turned
off, written as one line to the `llmgw.access` log, in `_served` or
`_refuse`; the input limits are in `limits` and `llmgwctl.httpserver`.

It must not know about placement, agents or the reconciler.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from time import perf_counter
from typing import Awaitable, Callable, Iterable, Mapping

import aiohttp
from aiohttp import web

from ..catalog import Catalog
from ..observability.metrics import CONTENT_TYPE_LATEST, RouterMetrics, RouterProbe, StreamUsage, usage_tokens
from . import auth as keyauth
from . import errors, jsonbody
from . import headers as reqheaders
from . import routes as routing
from .balancer import Balancer, Chooser, EndpointState
from .conventions import RID, ClientGone, held_for_cold_start, method_not_allowed, stamp_request_id
from .coldstart import ColdStart, ColdTimeout, QueueFull, Waker
from .. import httpbody
from ..aio import cancel_and_wait
from ..contracts import Endpoint, LoadReading, ModelCondition, ModelState, Usage
from ..httpserver import ConnectionGuard, bound_port, json_errors, server_options
from ..httporigin import BrowserGuard
from .config import DEFAULTS, RouterConfig
from .limits import BodyBudget, BudgetFull, PathError, check_target
from .poller import BoundedResponse, LoadPoller, ParseLoad, parse_with_drivers
from .prefix import DEFAULT_POLICY, LEAST_LOAD, Policies
from .ejection import Ejector
from .outlier import Outliers
from .upstream import (BadEndpointURL, ConnectFailed, OutOfBounds, Pool, Response, UpstreamError, UpstreamTimeout,
                       parse_target)

log = logging.getLogger("llmgw.router")
access_log = logging.getLogger("llmgw.access")

# What a browser script of an allowed origin may read off an answer: the id to
# quote in a bug report, which replica answered, and how long to back off.
CORS_EXPOSE = "X-Request-Id, x-llmgw-replica, x-llmgw-catalog-version, x-llmgw-overhead-ms, Retry-After"


class _View:
    """The per-catalog facts the hot path needs, built once per `set_catalog`."""

    __slots__ = ("catalog", "version", "top_profile", "routing", "routes")

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.version = catalog.version
        # A model whose best profile has no ready endpoint is cold, even when a
        # fallback profile serves it meanwhile.
        self.top_profile = {m.name: m.ranked()[0].name for m in catalog.models if m.profiles}
        # Only models whose policy is not least-load: the rest pay one failed lookup.
        self.routing = {m.name: m.routing or DEFAULT_POLICY for m in catalog.models
                        if (m.routing or DEFAULT_POLICY) != LEAST_LOAD}
        # The routes the catalog's engines add (routes.py), and who may use them.
        self.routes = routing.View(catalog)


class _Call:
    """One proxied request on its way through the router: what each step after arrival needs.

    Filled in as the request advances -- the caller's key once checked, the
    model once resolved -- and owned by that request alone. It is the one
    object of the router's own a request allocates.
    """

    __slots__ = ("request", "route", "t0", "api_key", "model", "view", "stream", "waited", "rid", "fwd", "early",
                 "chooser", "held")

    def __init__(self, request: web.Request, route: routing.Route, t0: float, view: _View):
        self.request = request
        self.route = route                      # the API it is for (routes.py)
        self.t0 = t0                            # arrival, on perf_counter
        # Taken once, at arrival: a catalog swap from here on is invisible to this request.
        self.view = view
        self.api_key: keyauth.ApiKey | None = None     # None: not checked yet, or the router is open
        self.model = ""                         # the canonical name once resolved; "" is logged as "-"
        self.stream = False                     # the body asked for a stream ("stream": true)
        # Seconds spent waiting on others -- a cold wait, failed attempts, the
        # answering engine -- so the router's own time (its overhead) is the
        # time since arrival less this.
        self.waited = 0.0
        # The request id (the client's if valid, else ours) and the header lines
        # the engine gets (see headers.py): taken at arrival.
        self.rid, self.fwd = reqheaders.take(request.headers)
        request[RID] = self.rid
        # The event stream opened early to keep a client waiting for a cold
        # start company (see conventions.held_for_cold_start); None until then.
        self.early: web.StreamResponse | None = None
        # The model's routing policy for this request (prefix.py); None: least-load.
        self.chooser: Chooser | None = None
        # Bytes of its body charged to the large-body budget (limits.BodyBudget), given back at its end.
        self.held = 0


class _Refused(Exception):
    """The router answers this request itself (a 4xx, or a 5xx of its own), with `response`.

    Raised anywhere on the request path; `_proxy` catches it and counts and
    logs the refusal once.
    """

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


_EVENT_STREAM = "text/event-stream"
# Well under asyncio's and uvloop's 64 KiB write high-water mark; SSE events are
# a few hundred bytes, so only bursts take the timed path.
_SMALL_WRITE = 16384


@functools.lru_cache(maxsize=65536)
def _url_problem(url: str) -> str | None:
    """Why no request could be sent to `url`, or None; remembered per URL.

    Every push of the list checks every endpoint, and at 20,000 endpoints
    parsing each URL again was half of a reconcile pass in `serve` (issue 19).
    65,536 URLs: well past a fleet's endpoints, a few MB at most.
    """
    try:
        parse_target(url)
    except BadEndpointURL as exc:
        return str(exc)
    return None


class Router:
    def __init__(self, catalog: Catalog | None = None, *, waker: Waker | None = None,
                 config: RouterConfig = DEFAULTS, clock: Callable[[], float] = time.monotonic,
                 parse_load: ParseLoad = parse_with_drivers):
        self.config = config
        self._parse_load = parse_load
        # A reading older than three polls is unknown: one missed scrape is noise,
        # three mean the engine is not answering.
        self.balancer = Balancer(clock=clock, stale_after=3 * config.poll_interval)
        # Endpoints kept out for what their engines did (a 10 GB answer, a
        # redirect), with the reason status shows.
        self.ejector = Ejector(self.balancer, clock=clock,
                               on_eject=lambda code: self.metrics.endpoint_ejections.labels(code).inc())
        # ... and those whose engines stopped answering polls (config.eject_after).
        self.outliers = Outliers(self.balancer, self.ejector, clock=clock, after=config.eject_after) \
            if config.eject_after else None
        self.policies = Policies(self.balancer)
        self.cold = ColdStart(waker, max_waiting=config.cold_queue, timeout=config.cold_timeout, clock=clock)
        self._view = _View(catalog if catalog is not None else Catalog())
        self._session: aiohttp.ClientSession | None = None     # the poller's
        self._pool: Pool | None = None                          # requests' (see upstream.py)
        self.poller: LoadPoller | None = None
        self._poll_task: asyncio.Task | None = None
        self._models_cache: tuple[object, bytes] = (None, b"")
        self._keys: keyauth.ApiKeys | None = None
        self._bad_urls: dict[str, str] = {}     # replica id -> the url it was left out for, logged once
        # Models the controller cannot place now, by name: a request finding no
        # endpoint for one is answered at once (set_model_states).
        self._unplaceable: dict[str, ModelState] = {}
        self._told_endpoints = False        # set_endpoints was called once: /readyz
        self.limiter = keyauth.Limiter(clock)
        # A budget never below one body at the size limit, so any allowed body can be sent.
        self.bodies = BodyBudget(config.large_body_bytes,
                                 max(config.large_bodies_per_client, config.max_body_bytes),
                                 max(config.large_bodies_total, config.max_body_bytes))
        self.parser = jsonbody.OffLoop()
        self.metrics = RouterMetrics(RouterProbe(
            states=self.balancer.states,
            waiting=lambda: {m.name: self.cold.waiting(m.name) for m in self._view.catalog.models},
            catalog=lambda: (self._view.version, [m.name for m in self._view.catalog.models]),
            clock=clock, ejected=lambda: {rid: e.code for rid, e in self.ejector.current().items()}))

    # -- the control plane's side ------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the whole list of ready endpoints. Call on the event loop, once per change.

        An endpoint whose URL no request could be sent to is left out, with an
        error logged once: it is a configuration error, and sending to it would
        look like an engine down and eject it again and again.
        """
        refused: dict[str, str] = {}
        usable = [ep for ep in endpoints if self._usable(ep, refused, self._bad_urls.get(ep.replica_id))]
        self._bad_urls = refused
        self._told_endpoints = True
        gained, added, removed = self.balancer.change_endpoints(self.balancer.changes_to(usable))
        self.metrics.change_endpoints(added, removed)
        self.cold.endpoints_changed(gained)
        if self.poller is not None:
            self.poller.resync()

    def change_endpoints(self, endpoints: tuple[Endpoint, ...], changed: Mapping[str, Endpoint | None]) -> None:
        """The list changed by `changed` (replica id -> its new Endpoint, or None: it left); `endpoints` is the whole new list.

        What the in-process controller calls (reconciler.EndpointChangeSink): a
        push costs the endpoints that changed, not the 20,000 listed (issue 19:
        ~40 ms a publishing pass at 5,000 nodes). The same as `set_endpoints(endpoints)`;
        if the balancer's count disagrees with the list afterwards (a push this
        router missed), it takes the whole list instead.
        """
        refused = self._bad_urls
        changes: dict[str, Endpoint | None] = {}
        for rid, ep in changed.items():
            logged = refused.pop(rid, None)
            changes[rid] = ep if ep is None or self._usable(ep, refused, logged) else None
        self._told_endpoints = True
        gained, added, removed = self.balancer.change_endpoints(changes)
        if self.balancer.count() != len(endpoints) - len(refused):
            log.warning("the router's endpoints drifted from the controller's list; taking the whole list")
            self.set_endpoints(endpoints)
            return
        self.metrics.change_endpoints(added, removed)
        self.cold.endpoints_changed(gained)
        if self.poller is not None and (added or removed):
            self.poller.resync()

    def _usable(self, ep: Endpoint, refused: dict[str, str], logged: str | None) -> bool:
        """Whether a request could be sent to `ep`'s URL; if not, it goes into `refused`, logged
        unless `logged` (the URL it was last refused for) is this one."""
        problem = _url_problem(ep.url)
        if problem is None:
            return True
        refused[ep.replica_id] = ep.url
        if logged != ep.url:
            log.error("endpoint %s of %r left out of routing: %s", ep.replica_id, ep.model, problem,
                      extra={"event": "endpoint-url-invalid", "endpoint": ep.replica_id})
        return False

    def set_model_states(self, states: Iterable[ModelState]) -> None:
        """Replace what the controller says about models without a ready replica. Call on the event loop, once per change.

        Only `unplaceable` changes what a request gets (a 503 at once, with the
        reason); `starting`, like no state at all, means a request waits.
        Requests already waiting re-check, so one held for a model that turns
        out unplaceable is answered now, not at the cold timeout.
        """
        new = {s.name: s for s in states if s.state is ModelCondition.UNPLACEABLE}
        old = self._unplaceable
        self._unplaceable = new
        self.cold.nudge({name for name in new.keys() | old.keys() if new.get(name) != old.get(name)})

    def set_catalog(self, catalog: Catalog) -> None:
        """Make `catalog` the one new requests resolve against; requests already running keep theirs."""
        if catalog.version != self._view.version:
            self._view = _View(catalog)

    @property
    def catalog(self) -> Catalog:
        return self._view.catalog

    def set_api_keys(self, keys: "keyauth.ApiKeys | None") -> None:
        """Require one of `keys` on every request from now on (None: no keys, the router is open)."""
        self._keys = keys
        if keys is not None:
            self.limiter.retain(keys.names())
            self.metrics.retain_keys(keys.names())

    def usage_snapshot(self) -> dict[str, Usage]:
        """{replica_id: (last use on the router's monotonic clock or None, requests in flight)}."""
        return self.balancer.usage_snapshot()

    def load_snapshot(self) -> dict[str, LoadReading]:
        """{replica_id: its engine's latest fresh load reading}, for the autoscaler (a LoadSource)."""
        return self.balancer.load_snapshot()

    def inflight_seconds(self) -> dict[str, float]:
        """{replica_id: in flight integrated over time}, for the autoscaler (a ConcurrencySource)."""
        return self.balancer.inflight_seconds()

    def endpoint_problems(self) -> dict[str, str]:
        """{replica_id: what this router holds against its engine now}, for status: an ejection for a
        cause (see ejection.py), else why its /metrics gives no reading; absent: nothing."""
        poller = self.poller
        out = dict(poller.problems) if poller is not None else {}
        out.update((rid, e.describe()) for rid, e in self.ejector.current().items())
        return out

    # -- lifecycle ------------------------------------------------------------------

    def app(self, bind_host: str | None = None) -> web.Application:
        """The aiohttp app; `bind_host`, the address it will listen on, decides whether Host is checked
        (see httporigin.BrowserGuard.for_bind; None: as on loopback)."""
        cfg = self.config
        # Before any handler: a web page of another site, or a Host a page could
        # have pointed here (DNS rebinding), spends no GPU time (see httporigin).
        browsers = BrowserGuard.for_bind(bind_host, server="router", cors_origins=cfg.cors_origins,
                                         allowed_hosts=cfg.allowed_hosts, expose=CORS_EXPOSE)
        app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[browsers.middleware()])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{name:.+}", self._model)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/health", self._health)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        # Only the routes in the table, and below them those the catalog adds
        # (looked up per request: the catalog changes while the app runs).
        # Anything else under /v1/ is the 404 of every unknown path.
        for route in routing.TABLE:
            for method in route.methods:
                app.router.add_route(method, route.path, self._handler(route))
        app.router.add_post("/v1/{tail:.+}", self._catalog_route)
        # Allowed origins' preflights and answers (only when origins are configured:
        # with none, answers carry no CORS header).
        browsers.install(app)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        # Every answer carries the request's id, whichever handler (or error) made it.
        app.on_response_prepare.append(stamp_request_id)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        cfg = self.config
        # Requests: no total or read timeout, as a generation may run for
        # minutes and a long prefill sends no byte for a long time; a client
        # that gives up disconnects, and that closes the upstream request.
        # Streams alone get a bound on silence (upstream_idle_timeout, passed
        # per request). The pool sends no Accept-Encoding, so engines answer
        # uncompressed and the router never decompresses.
        self._pool = Pool(connect_timeout=cfg.connect_timeout, keepalive_timeout=cfg.keepalive_timeout,
                          headers_timeout=cfg.upstream_headers_timeout,
                          limit_per_endpoint=cfg.connections_per_endpoint, limit_total=cfg.connections_total)
        # The poller's scrapes, one a second per engine, stay on aiohttp.
        connector = aiohttp.TCPConnector(limit=cfg.connections_total, keepalive_timeout=cfg.keepalive_timeout)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout)
        # Its headers held to the caps the router's own server and its upstream client hold peers to.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding", "User-Agent"),
                                              max_line_size=cfg.max_header_bytes, max_field_size=cfg.max_header_bytes,
                                              max_headers=cfg.max_headers, response_class=BoundedResponse)
        self.poller = LoadPoller(self.balancer, self._session, interval=cfg.poll_interval, parse=self._parse_load,
                                 max_bytes=cfg.max_metrics_bytes, outliers=self.outliers,
                                 probe_timeout=cfg.probe_timeout,
                                 on_refused=lambda code: self.metrics.engine_refusals.labels(code).inc())
        self._poll_task = asyncio.get_running_loop().create_task(self.poller.run())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._poll_task is not None:
            await cancel_and_wait(self._poll_task)
        if self._session is not None:
            await self._session.close()
        if self.poller is not None:
            self.poller.close()
        if self._pool is not None:
            await self._pool.close()
        self.parser.close()

    # -- handlers ---------------------------------------------------------------------

    def _key(self, request: web.Request) -> "keyauth.ApiKey | None":
        """The caller's API key; None when the router is open. _Refused (401) when keys are on and it sent none of them.

        The one place a request's key is looked up, for every route but
        /healthz (which probes use without one).
        """
        keys = self._keys
        if keys is None:
            return None
        key = keys.lookup(request.headers.get("Authorization"))
        if key is None:
            raise _Refused(keyauth.unauthorized())
        return key

    async def _healthz(self, request: web.Request) -> web.Response:
        view = self._view
        return web.json_response({"status": "ok", "catalog_version": view.version,
                                  "models": len(view.catalog), "endpoints": len(self.balancer.states())})

    async def _health(self, request: web.Request) -> web.Response:
        """Liveness, as vLLM's and llama-swap's /health: 200 while the process answers, whatever it routes.

        A load balancer or an orchestrator restarts a process that fails this,
        so it must not fail for what a restart cannot fix (no replica yet).
        """
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        """Readiness (Kubernetes' /readyz): 200 once the router can route, else 503 with why.

        Ready means it was told a catalog holding a model and was told an
        endpoint list (the first push or watch answer), so a request gets an
        answer from the fleet's state rather than a 404 from an empty router.
        It does *not* need a ready endpoint: with scale to zero, a router with
        none is how models get woken, and taking it out of the load balancer
        would keep them asleep for good.
        """
        problems = []
        if not len(self._view.catalog):
            problems.append("no catalog with a model in it yet")
        if not self._told_endpoints:
            problems.append("no endpoint list received yet")
        body: dict[str, object] = {"status": "ready" if not problems else "not ready",
                                   "catalog_version": self._view.version,
                "models": len(self._view.catalog), "endpoints": len(self.balancer.states())}
        if problems:
            body["problems"] = problems
        return web.json_response(body, status=503 if problems else 200)

    async def _not_found(self, request: web.Request) -> web.Response:
        try:
            check_target(request.raw_path, "/")
        except PathError as exc:
            # Refused as on /v1/: a dot segment there is a probe, not a typo.
            return errors.response(400, str(exc), "invalid_request_error", "invalid_path")
        wrong_method = method_not_allowed(request, cors=bool(self.config.cors_origins))
        if wrong_method is not None:
            return wrong_method
        return errors.not_found(f"{request.method} {request.path}")

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            self._key(request)
        except _Refused as refused:
            return refused.response
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        view = self._view
        headers = {"x-llmgw-catalog-version": view.version}
        try:
            api_key = self._key(request)
        except _Refused as refused:
            return refused.response
        if api_key is not None:
            # Only what this key may use: the list must not reveal the rest.
            return web.Response(body=self._models_body(view, api_key), content_type="application/json",
                                headers=headers)
        cache_key = (view, self.balancer.generation)
        if self._models_cache[0] != cache_key:
            self._models_cache = (cache_key, self._models_body(view))
        return web.Response(body=self._models_cache[1], content_type="application/json", headers=headers)

    async def _model(self, request: web.Request) -> web.Response:
        """One entry of the list by its id (a name or an alias): OpenAI's "retrieve model"."""
        view = self._view
        name = request.match_info["name"]
        try:
            api_key = self._key(request)
        except _Refused as refused:
            return refused.response
        model = view.catalog.resolve(name)
        # As for requests: a name outside the key's patterns is 403 whether or
        # not it exists, so nothing tells the two apart.
        if api_key is not None and not keyauth.allows(api_key, name, model):
            return keyauth.forbidden(name)
        if model is None:
            return errors.unknown_model(name, _usable_names(view.catalog, api_key))
        entry = self._model_entry(model, name)
        return web.Response(body=json.dumps(entry).encode(), content_type="application/json",
                            headers={"x-llmgw-catalog-version": view.version})

    def _models_body(self, view: _View, api_key: "keyauth.ApiKey | None" = None) -> bytes:
        data = []
        for m in view.catalog.models:
            if api_key is not None and not keyauth.allows(api_key, m.name, m):
                continue
            data.append(self._model_entry(m, m.name))
            data.extend(self._model_entry(m, alias) for alias in m.aliases)
        return json.dumps({"object": "list", "data": data}).encode()

    def _model_entry(self, model, listed_as: str) -> dict:
        """A model (or one of its aliases) in OpenAI's model shape, with llmgw's extension field."""
        ready = self.balancer.ready_count(model.name)
        if listed_as == model.name:
            extra = {"ready_replicas": ready, "aliases": list(model.aliases),
                     "profiles": [p.name for p in model.ranked()]}
        else:
            extra = {"ready_replicas": ready, "alias_of": model.name}
        return {"id": listed_as, "object": "model", "created": 0, "owned_by": "llmgw", "llmgw": extra}

    # -- the request path: arrival to an endpoint ---------------------------------------

    def _handler(self, route: routing.Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def proxy(request: web.Request) -> web.StreamResponse:
            return await self._proxy(request, route)
        return proxy

    async def _catalog_route(self, request: web.Request) -> web.StreamResponse:
        """A POST under /v1/ that is not in the table: proxied if the current catalog's engines add it, else a 404."""
        route = self._view.routes.routes.get(request.raw_path.partition("?")[0])
        if route is None:
            return await self._not_found(request)
        return await self._proxy(request, route)

    async def _proxy(self, request: web.Request, route: routing.Route) -> web.StreamResponse:
        call = _Call(request, route, perf_counter(), self._view)
        try:
            try:
                # The target the engine will get, before anything else is
                # spent on the request.
                check_target(request.raw_path)
            except PathError as exc:
                raise _Refused(errors.response(400, str(exc), "invalid_request_error", "invalid_path")) from None
            # The key and its rate before the body is read: a stranger or a
            # key over its rate makes the router parse nothing.
            api_key = call.api_key = self._key(request)
            if api_key is not None:
                wait = self.limiter.take(api_key)
                if wait:
                    raise _Refused(keyauth.rate_limited(api_key, wait))
            body = await self._resolve(call, await self._read_body(call))
            return await self._forward(call, body)
        except _Refused as refused:
            response = route.error_shape(refused.response)
            if call.early is not None:
                return await self._refuse_in_stream(call, response)
            return self._refuse(call, response)
        except ClientGone:
            # Left while held for a cold start: a keep-alive comment found the connection closed.
            self._refuse(call, web.Response(status=499))
            assert call.early is not None    # ClientGone is raised only by a keep-alive write to the opened stream
            return call.early
        except asyncio.CancelledError:
            # The same, seen first by aiohttp, which cancels the handler; a
            # request cancelled before its stream opened is not counted, as before.
            if call.early is not None:
                self._refuse(call, web.Response(status=499))
            raise
        finally:
            if call.held:
                self.bodies.give_back(request.remote or "?", call.held)

    async def _read_body(self, call: _Call) -> bytes:
        """The body as sent, decoded; its size (compressed and inflated) at most max_body_bytes.

        aiohttp does not decompress (see httpserver.server_options): a gzip
        body is inflated here by httpbody, which stops at the limit as it
        inflates.
        """
        request, cfg = call.request, self.config
        limit = cfg.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise _Refused(errors.too_large(limit))
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
                data = await httpbody.decode(data, encoding, limit,
                                             admit=lambda size: self._hold(call, client, size))
            return data
        except web.HTTPRequestEntityTooLarge:
            raise _Refused(errors.too_large(limit)) from None
        except httpbody.BodyTooLarge:
            raise _Refused(errors.response(
                413, f"the request body inflates to more than the router's limit of {limit} bytes",
                "invalid_request_error", "request_too_large")) from None
        except httpbody.BodyError as exc:
            raise _Refused(errors.response(exc.status, str(exc), "invalid_request_error", exc.code)) from None
        except web.RequestPayloadError:
            # Bad chunked framing, or a body shorter than its Content-Length.
            raise _Refused(errors.response(
                400, "the request body is not framed as its headers say (chunked encoding or Content-Length)",
                "invalid_request_error", "invalid_body")) from None
        except asyncio.TimeoutError:
            raise _Refused(errors.response(
                408, f"the request body did not arrive within {cfg.body_timeout:g} s", "invalid_request_error",
                "request_timeout", headers={"Connection": "close"})) from None

    def _hold(self, call: _Call, client: str, size: int) -> None:
        """Charge a body of `size` bytes to the large-body budget (raised past what was charged); _Refused when full."""
        if size <= call.held:
            return
        budget = self.bodies
        budget.give_back(client, call.held)
        call.held = 0
        try:
            call.held = budget.take(client, size)
        except BudgetFull as full:
            raise _Refused(errors.large_bodies_busy(full.per_client, full.limit)) from None

    async def _parse(self, call: _Call, body: bytes) -> jsonbody.Facts:
        """The body's facts, parsed on the loop when cheap for certain, else off it (see jsonbody)."""
        route, depth = call.route, self.config.max_json_depth
        try:
            if jsonbody.heavy(body):
                return await self.parser.parse(body, route.model_key, route.prompt, depth)
            return jsonbody.parse(body, route.model_key, depth)
        except jsonbody.BodyRefused as exc:
            raise _Refused(errors.response(400, str(exc), "invalid_request_error", exc.code)) from None
        except jsonbody.WorkerBusy:
            raise _Refused(errors.response(
                503, "the router is parsing as many large request bodies as it may at once; retry shortly",
                "service_unavailable", "too_many_large_bodies",
                headers={"Retry-After": str(errors.RETRY_LARGE_BODIES)})) from None

    async def _resolve(self, call: _Call, body: bytes) -> bytes:
        """Parse the body and resolve its model into `call`; return the body to forward."""
        facts = await self._parse(call, body)
        name = facts.model
        if type(name) is not str or not name:
            raise _Refused(errors.missing_model())
        if len(name) > errors.MAX_NAME_CHARS:
            # Before any lookup, key pattern or "did you mean": no name is that long.
            raise _Refused(errors.name_too_long(name, facts.model_chars))
        view = call.view
        model = view.catalog.resolve(name)
        call.model = model.name if model is not None else ""
        if call.api_key is not None and not keyauth.allows(call.api_key, name, model):
            raise _Refused(keyauth.forbidden(name))
        if model is None:
            raise _Refused(errors.unknown_model(name, _usable_names(view.catalog, call.api_key)))
        route = call.route
        if not view.routes.allows(route, model.name):
            raise _Refused(errors.no_such_route(call.request.method, route.path, model.name))
        call.stream = route.streams and facts.stream
        policy = view.routing.get(model.name)
        if policy is not None:
            # Parsed on the loop, the prompt is read only now, when a policy wants it.
            reader = _known(facts.prompt) if facts.off_loop else route.prompt
            call.chooser = self.policies.chooser(policy, model.name, facts.doc, call.request.headers, prompt=reader)
        if name != model.name:
            body = self._renamed(body, facts, route.model_key, model.name)
        return body

    def _renamed(self, body: bytes, facts: jsonbody.Facts, key: str, name: str) -> bytes:
        """`body` naming the model `name` instead of the alias it was sent with: only the model's value changes."""
        lone = facts.lone_surrogate
        if lone is None:
            lone = jsonbody.lone_surrogate(body)
        if lone:
            # A lone surrogate ("\ud800"): JSON's escapes can spell it, UTF-8
            # cannot, and no engine could read it either. Refused by alias as
            # ever (a rewrite once re-encoded the body, which failed on it).
            raise _Refused(errors.response(
                400, "the request body holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                "which is not text", "invalid_request_error", "invalid_json"))
        span = facts.span or jsonbody.model_span(body, key)
        if span is not None:
            return jsonbody.with_model(body, span, name)
        # Not UTF-8 (JSON may be UTF-16 or 32): re-encoded whole, as UTF-8.
        doc = json.loads(body)
        doc[key] = name
        try:
            return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            raise _Refused(errors.response(
                400, "the request body holds a lone UTF-16 surrogate, which is not text", "invalid_request_error",
                "invalid_json")) from None

    async def _forward(self, call: _Call, body: bytes) -> web.StreamResponse:
        balancer = self.balancer
        model = call.model
        top = call.view.top_profile.get(model)
        if top is not None and not balancer.has_profile(model, top):
            self.cold.demand(model)
        chooser = call.chooser
        state = balancer.pick(model, (), chooser)
        if state is None:
            self._unless_unplaceable(model)
            if not self.cold.can_wait:
                raise _Refused(errors.no_replica(model))
            state = await self._wait_for_endpoint(call, ())
        pool = self._pool
        assert pool is not None     # made in _on_startup, which aiohttp runs before it serves a request
        idle_timeout = (self.config.upstream_idle_timeout or None) if call.stream else None
        path = call.request.raw_path
        tried: tuple[EndpointState, ...] = ()
        failure = "no endpoint left to try"
        attempts, held = self.config.max_attempts, False
        while attempts:
            attempts -= 1
            balancer.started(state)
            try:
                up0 = perf_counter()
                try:
                    upstream = await pool.post(state.endpoint.url, path, body, idle_timeout=idle_timeout,
                                               headers=call.fwd)
                except UpstreamTimeout as exc:
                    # The engine took the request and then said nothing for
                    # upstream_idle_timeout: wedged, and the request may have
                    # run there, so not retried elsewhere.
                    balancer.eject(state)
                    raise _Refused(errors.response(
                        504, f"replica {state.replica_id} of {model!r} {exc}", "upstream_error",
                        "upstream_timeout")) from None
                except ConnectFailed as exc:
                    call.waited += perf_counter() - up0
                    balancer.eject(state)
                    failure = f"{state.replica_id}: {exc or type(exc).__name__}"
                    log.warning("endpoint %s failed before answering, trying another: %s", state.replica_id, exc)
                else:
                    call.waited += perf_counter() - up0       # the engine's, until its headers
                    try:
                        return await self._respond(call, upstream, state)
                    finally:
                        # A response read to its end goes back to the pool; one cut
                        # short (client gone, error) closes, so the engine sees the
                        # disconnect and frees the slot.
                        upstream.release()
            except OutOfBounds as exc:
                raise _Refused(self._out_of_bounds(call, state, exc)) from None
            except UpstreamError as exc:
                raise _Refused(errors.upstream_failed(
                    model, f"{state.replica_id}: {exc or type(exc).__name__}")) from None
            finally:
                balancer.finished(state)
            tried += (state,)
            state = balancer.pick(model, tried, chooser)
            if state is None and not held and self.cold.can_wait:
                # Every endpoint of the model refused the connection: its engines
                # are down -- the one replica crashed, say, and its agent is
                # restarting it. That is missing capacity for a few seconds, as in
                # a cold start, so wait as for one (bounded by the cold timeout)
                # for an endpoint not tried yet -- the restarted replica joins
                # anew once healthy -- rather than answer 502 for a gap that heals.
                held = True
                state = await self._wait_for_endpoint(call, tried)
                attempts = max(attempts, 1)     # the endpoint that came back gets its try
            if state is None:
                break
        raise _Refused(errors.upstream_failed(model, failure))

    def _unless_unplaceable(self, model: str) -> None:
        """_Refused (503 at once, with the placement's reason) when the controller says `model` cannot be placed now."""
        said = self._unplaceable.get(model) if self._unplaceable else None
        if said is not None:
            raise _Refused(errors.unplaceable(model, said.reason, said.retry))

    async def _wait_for_endpoint(self, call: _Call, tried: tuple[EndpointState, ...]) -> EndpointState:
        """Hold `call` until an endpoint of its model not in `tried` is ready: a cold start, or every one refusing.

        _Refused 429 when the model's queue is full, 503 past the cold timeout
        or as soon as the controller says the model cannot be placed. Every outcome is observed in the cold-wait histogram, and the time
        waited is left out of the router's overhead.
        """
        model, balancer, cold = call.model, self.balancer, self.cold
        observed = self.metrics.cold_wait
        wait_from = perf_counter()

        def pick() -> EndpointState | None:
            got = balancer.pick(model, tried, call.chooser)
            if got is None:
                self._unless_unplaceable(model)
            return got

        try:
            state = await held_for_cold_start(call, cold.wait(model, pick), self.config.cold_keepalive)
        except _Refused:
            observed.labels(model, "unplaceable").observe(perf_counter() - wait_from)
            raise
        except QueueFull:
            observed.labels(model, "queue_full").observe(0.0)
            raise _Refused(errors.queue_full(model, cold.max_waiting)) from None
        except ColdTimeout:
            observed.labels(model, "timeout").observe(perf_counter() - wait_from)
            raise _Refused(errors.cold_timeout(model, cold.timeout)) from None
        waited = perf_counter() - wait_from
        observed.labels(model, "served").observe(waited)
        call.waited += waited
        return state

    # -- the request path: the engine's answer back ---------------------------------------

    async def _respond(self, call: _Call, upstream: Response, state: EndpointState) -> web.StreamResponse:
        """Pass the engine's answer on: an event stream as it arrives, anything else whole (up to max_answer_bytes).

        OutOfBounds (the caller answers 502 and ejects the replica, see
        `_out_of_bounds`) for a redirect: the router never follows one, and
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
                   "x-llmgw-catalog-version": call.view.version}
        encoding = upstream.headers.get("content-encoding")
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        if ctype.startswith(_EVENT_STREAM):
            return await self._pass_stream(call, upstream, state, headers)
        if call.early is not None:
            return await self._pass_whole_in_stream(call, upstream, state)
        return await self._pass_whole(call, upstream, state, headers)

    async def _pass_whole(self, call: _Call, upstream: Response, state: EndpointState,
                          headers: dict[str, str]) -> web.Response:
        r0 = perf_counter()
        try:
            data = await upstream.read(self.config.max_answer_bytes)
        except OutOfBounds:
            raise       # the caller's: answered 502, the replica ejected (_out_of_bounds)
        except UpstreamError as exc:
            self.balancer.eject(state)
            raise _Refused(errors.upstream_failed(
                call.model, f"{state.replica_id} stopped mid-response: {exc or type(exc).__name__}")) from None
        call.waited += perf_counter() - r0
        self.balancer.succeeded(state)
        usage = usage_tokens(data)
        status = upstream.status
        overhead = perf_counter() - call.t0 - call.waited
        headers["x-llmgw-overhead-ms"] = f"{overhead * 1e3:.3f}"
        # A whole reply is handed to aiohttp in one piece: its first byte and
        # its last leave together (first=0: at the end).
        self._served(call, state, status, 0.0, overhead, usage)
        return web.Response(status=status, body=data, headers=headers)

    def _out_of_bounds(self, call: _Call, state: EndpointState, exc: OutOfBounds) -> web.Response:
        """An engine broke a bound (its answer too large, a redirect, headers without end): eject it for a
        while with the reason, count it, log it; the 502 for the client, naming the replica."""
        ejection = self.ejector.eject(state, exc.code, str(exc))
        self.metrics.engine_refusals.labels(exc.code).inc()
        log.warning("endpoint %s of %r %s; ejected for %.0f s", state.replica_id, call.model, exc, ejection.seconds,
                    extra={"event": "endpoint-ejected", "endpoint": state.replica_id, "reason": exc.code})
        return errors.engine_out_of_bounds(call.model, state.replica_id, str(exc))

    async def _pass_stream(self, call: _Call, upstream: Response, state: EndpointState,
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
        self.balancer.succeeded(state)
        write = resp.write
        transport = request.transport
        first = 0.0
        usage = StreamUsage()
        try:
            # chunks() yields whatever bytes arrived, as soon as they arrive: no
            # line splitting, no re-encoding, no waiting for a full event.
            async for chunk in upstream.chunks():
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
        except UpstreamError as exc:
            # The engine died (or went silent past upstream_idle_timeout)
            # mid-stream. Headers are sent, so no retry: end the stream with an
            # error event, which OpenAI SDKs raise, instead of a hang.
            self.balancer.eject(state)
            log.warning("endpoint %s died mid-stream: %s", state.replica_id, exc or type(exc).__name__)
            try:
                await write(errors.stream_error_event(f"{state.replica_id}: {exc or type(exc).__name__}"))
                await resp.write_eof()
            except ConnectionError:
                pass
        except ConnectionError:
            # The client left: counted as nginx's 499; the caller closes the
            # upstream connection.
            self._served(call, state, 499, first, overhead, usage.usage)
            return resp
        except asyncio.CancelledError:
            # The same, as a handler cancelled by aiohttp when the client disconnects.
            self._served(call, state, 499, first, overhead, usage.usage)
            raise
        else:
            await resp.write_eof()
        self._served(call, state, status, first, overhead, usage.usage)
        return resp

    async def _write_to_slow_reader(self, write, chunk: bytes, transport) -> None:
        """A write while the client has unread bytes queued: bounded by client_write_timeout.

        Only this path pays for a timer; a client that keeps up has no backlog
        when the next chunk comes, and events are small. Past the timeout the connection is
        aborted and ConnectionResetError raised, so the stream ends as a client
        that left (499) and the caller closes the upstream request.
        """
        timeout = self.config.client_write_timeout
        if not timeout:
            await write(chunk)
            return
        try:
            await asyncio.wait_for(write(chunk), timeout)
        except asyncio.TimeoutError:
            log.warning("a streaming client at %s read nothing for %g s; dropping it", request_peer(transport), timeout)
            transport.abort()
            raise ConnectionResetError("client stopped reading") from None

    # -- counting and logging, once per request ---------------------------------------------

    def _served(self, call: _Call, state: EndpointState, status: int, first: float, overhead: float,
                usage: tuple[int, int] | None) -> None:
        """Count and log a request an endpoint answered; `first` is when its first byte left (0: at the end)."""
        now = perf_counter()
        elapsed = now - call.t0
        self.metrics.endpoint(state.endpoint.model, state.replica_id).done(
            status, elapsed, (first or now) - call.t0, overhead, usage)
        if call.api_key is not None:
            self.metrics.key_used(call.api_key.name, status, usage)
        if self.config.access_log and access_log.isEnabledFor(logging.INFO):
            self._log_access(call, status, state.replica_id, elapsed, overhead, usage)

    def _refuse(self, call: _Call, resp: web.Response) -> web.Response:
        """Count and log a request answered without an endpoint (4xx, 5xx of the router's own)."""
        self.metrics.unrouted(call.model, resp.status)
        if call.api_key is not None:
            self.metrics.key_used(call.api_key.name, resp.status, None)
        if self.config.access_log and access_log.isEnabledFor(logging.INFO):
            self._log_access(call, resp.status, "", perf_counter() - call.t0)
        return resp

    def _log_access(self, call: _Call, status: int, endpoint: str, seconds: float,
                    overhead: float | None = None, usage: tuple[int, int] | None = None) -> None:
        # The key's name, never the key; the client address, never a body.
        # `endpoint` is the replica id: in a log line the exact replica is the
        # point (metrics label by slot instead, see observability.metrics).
        request, model = call.request, call.model
        name = call.api_key.name if call.api_key is not None else "-"
        tokens_in, tokens_out = usage if usage is not None else (None, None)
        access_log.info("%s %s %s %d model=%s endpoint=%s key=%s id=%s tokens=%s/%s %.1fms", request.remote,
                        request.method, request.path, status, model or "-", endpoint or "-", name, call.rid,
                        "-" if tokens_in is None else tokens_in, "-" if tokens_out is None else tokens_out,
                        seconds * 1e3,
                        extra={"event": "access", "client": request.remote, "method": request.method,
                               "path": request.path, "status": status, "model": model, "endpoint": endpoint,
                               "key": name, "request_id": call.rid, "tokens_in": tokens_in,
                               "tokens_out": tokens_out, "duration_ms": round(seconds * 1e3, 3),
                               "overhead_ms": None if overhead is None else round(overhead * 1e3, 3)})

    # -- a stream opened early for a cold start (see conventions.held_for_cold_start) ----------

    async def _refuse_in_stream(self, call: _Call, refusal: web.Response) -> web.StreamResponse:
        """A refusal (cold timeout, unplaceable, ...) for a stream whose 200 and headers are sent: its last event.

        The OpenAI error body goes out as a `data:` event, which OpenAI SDKs
        raise as an APIError; counted and logged under the refusal's status.
        """
        resp = call.early
        assert resp is not None and isinstance(refusal.body, bytes)    # the caller checked; our refusals are JSON bytes
        try:
            await resp.write(b"data: " + refusal.body + b"\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass
        self._refuse(call, refusal)
        return resp

    async def _pass_whole_in_stream(self, call: _Call, upstream: Response, state: EndpointState) -> web.StreamResponse:
        """An engine's whole (non-stream) answer to a stream already opened: an error, as the last event."""
        status = upstream.status
        try:
            data = await upstream.read(self.config.max_answer_bytes)
        except OutOfBounds as exc:
            refusal = self._out_of_bounds(call, state, exc)
            assert isinstance(refusal.body, bytes)      # our refusals are JSON bytes
            data, status, detail = refusal.body, refusal.status, ""
        except UpstreamError as exc:
            self.balancer.eject(state)
            data = b""
            detail = f"{state.replica_id} stopped mid-response: {exc or type(exc).__name__}"
        else:
            self.balancer.succeeded(state)
            detail = f"{state.replica_id} answered {upstream.status} without a stream"
        event = (b"data: " + data.strip().replace(b"\n", b"") + b"\n\n" if data.lstrip().startswith(b'{"error"')
                 else errors.stream_error_event(detail))
        resp = call.early
        assert resp is not None    # called only for a stream already opened for a cold start
        try:
            await resp.write(event)
            await resp.write_eof()
        except ConnectionError:
            self._served(call, state, 499, 0.0, perf_counter() - call.t0 - call.waited, None)
            return resp
        self._served(call, state, status, 0.0, perf_counter() - call.t0 - call.waited, None)
        return resp


def _known(prompt: str | None) -> Callable[[object], str | None]:
    """A prompt reader that returns the prompt the body's facts already hold."""
    return lambda doc: prompt


def _usable_names(catalog: Catalog, api_key: "keyauth.ApiKey | None") -> list[str]:
    """The names and aliases a 404 may suggest: all of them on an open router, else those `api_key` may use.

    A key limited to some models must not learn the rest from a "did you mean".
    """
    names = catalog.names()
    if api_key is None:
        return list(names)
    return [n for n in names if keyauth.allows(api_key, n, catalog.resolve(n))]


def request_peer(transport) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if peer else "?"


async def start(router: Router, host: str = "127.0.0.1", port: int = 0, *,
                shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, int]:
    """Serve `router` on host:port; return the runner (`await runner.cleanup()` to stop) and the bound port.

    `shutdown_timeout`: how long `cleanup()` lets requests in flight finish
    before cancelling them (aiohttp's own default, 60 s, unless told; `serve`
    passes its documented drain).
    """
    # handler_cancellation: a client that disconnects cancels its handler at
    # once, which closes the upstream request even while the engine is still
    # silent (a long prefill), so the engine frees the slot.
    cfg = router.config
    runner = web.AppRunner(router.app(host), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           **server_options(client_idle_timeout=cfg.client_idle_timeout,
                                            max_field_size=cfg.max_header_bytes, max_headers=cfg.max_headers))
    await runner.setup()
    json_errors(runner.server)
    if cfg.max_connections_per_client:
        refused = router.metrics.refused.labels("per_client_limit")
        ConnectionGuard(cfg.max_connections_per_client, on_refuse=lambda addr: refused.inc()).install(runner.server)
    await web.TCPSite(runner, host, port).start()
    return runner, bound_port(runner)
