"""The router's HTTP face: the OpenAI-compatible API, proxying to the chosen endpoint.

`Router` is the public entry: it builds the router's parts, each owning one
job, hands each its collaborators, and wires them into one aiohttp app
(`app()`), whose start and stop it owns (the upstream pool, the load poller):

    surface     what the control plane tells it (endpoints, catalog, model states, API keys)
    request     the request path: target, key and rate, then its steps: the body (bodies), the model
                (intake, a fallback: reroute), the endpoint and the attempts (dispatch)
    answer      the answer path: whole or streamed, slow readers, a stream opened early for a cold start
                (a cut chat stream continued on another replica: continuation)
    affinity    which replica stored each response a Responses answer named, for the requests naming it
    accounting  the caller's key; each request counted and logged once
    info        /health, /healthz, /readyz, /metrics, /v1/models, the 404
    modelinfo   what each endpoint's engine says of its model (its context length), asked as it joins
    call        what they pass each other (the catalog's `View`, a request's `Call`, `Refused`)
    usage       the token counts read off an answer's bytes

The control plane meets it through narrow surfaces only:

- `set_endpoints(endpoints)` (or `change_endpoints`, by the changes),
  `set_catalog(catalog)` and `set_model_states(states)` (a model that cannot
  be placed now is answered at once with the reason): pushed once per
  change, never pulled per request;
- `usage_snapshot()`: last use and in-flight count per replica, read once a tick;
- `load_snapshot()`: each engine's latest fresh load reading, for the autoscaler;
- `inflight_seconds()`: each replica's in-flight count integrated over time, for the autoscaler;
- `adapter_inflight_seconds()`: the same per LoRA adapter, for its spread over its base's replicas;
- a `Waker` it calls when a request finds no ready replica;
- `set_api_keys(keys)`: optional API keys (see `auth`), swapped whole like a catalog;
- `set_request_sink(sink)`: where each answered request goes as a `RequestRecord` (the request log).

The input limits are in `limits` and `llmgwctl.httpserver`. It must not
know about placement, agents or the reconciler.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp
from aiohttp import web

from ..aio import cancel_and_wait
from ..allocator import Trimmer
from ..catalog import Catalog
from ..contracts import Endpoint, LoadReading, ModelState, RequestSink, Usage
from ..httporigin import BrowserGuard
from ..httpserver import ConnectionGuard, bound_port, json_errors, server_options
from ..observability.metrics import RouterMetrics, RouterProbe
from . import auth as keyauth
from . import jsonbody
from . import routes as routing
from .accounting import Accounting
from .affinity import Affinity
from .answer import AnswerPath
from .balancer import Balancer, EndpointState
from .coldstart import ColdStart, Waker
from .config import DEFAULTS, RouterConfig
from .conventions import stamp_request_id
from .ejection import Ejector
from .inflight import InFlight
from .info import InfoRoutes
from .limits import BodyBudget
from .modelinfo import ModelInfo
from .outlier import Outliers
from .policies import Policies
from .poller import BoundedResponse, LoadPoller, ParseLoad, parse_with_drivers
from .request import RequestPath
from .responses import ResponseStore
from .surface import Surface
from .upstream import Pool

__all__ = ["CORS_EXPOSE", "Router", "start"]

# What a browser script of an allowed origin may read off an answer: the id to
# quote in a bug report, which replica answered, and how long to back off.
CORS_EXPOSE = ("X-Request-Id, x-llmgw-replica, x-llmgw-catalog-version, x-llmgw-overhead-ms, x-llmgw-attempts, "
               "x-llmgw-model, x-llmgw-fallback-from, Retry-After")


class Router:
    """The router: its parts built and wired once, the control plane's methods, the app and its lifecycle."""

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
        # Requests in flight to an endpoint that stops answering move to another (inflight.py).
        # Built with eject_after 0 too: it ejects nothing then, but its count of silent
        # endpoints still moves what waits on one that the controller withdraws (_left_silent).
        self.inflight = InFlight(self.balancer)
        self.outliers = Outliers(self.balancer, self.ejector, clock=clock, after=config.eject_after,
                                 on_wedged=self._wedged)
        self.policies = Policies(self.balancer)
        self.cold = ColdStart(waker, max_waiting=config.cold_queue, timeout=config.cold_timeout, clock=clock)
        self._session: aiohttp.ClientSession | None = None     # the poller's
        self.poller: LoadPoller | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._info_task: asyncio.Task[None] | None = None
        self.limiter = keyauth.Limiter(clock)
        # A budget never below one body at the size limit, so any allowed body can be sent.
        self.bodies = BodyBudget(config.large_body_bytes,
                                 max(config.large_bodies_per_client, config.max_body_bytes),
                                 max(config.large_bodies_total, config.max_body_bytes))
        self.parser = jsonbody.OffLoop()
        # The heap given back to the kernel after large bodies and answers are let go (allocator.py).
        self.trimmer = Trimmer()
        self.metrics = RouterMetrics(RouterProbe(
            states=self.balancer.states,
            waiting=lambda: {m.name: self.cold.waiting(m.name) for m in self.surface.view.catalog.models},
            catalog=lambda: (self.surface.view.version, [m.name for m in self.surface.view.catalog.models]),
            clock=clock, ejected=lambda: {rid: e.code for rid, e in self.ejector.current().items()}))
        # The parts, each with the collaborators it needs and nothing else.
        self.surface = Surface(catalog if catalog is not None else Catalog(), balancer=self.balancer,
                               metrics=self.metrics, cold=self.cold, limiter=self.limiter, resync=self._resync)
        self.accounting = Accounting(config, self.metrics, self.surface)
        # What each endpoint's engine says about its model (its context length), for /v1/models.
        self.modelinfo = ModelInfo()
        self.info = InfoRoutes(config, balancer=self.balancer, metrics=self.metrics, surface=self.surface,
                               accounting=self.accounting, modelinfo=self.modelinfo)
        # Which replica stored each response a Responses answer named (affinity.py, responses.py).
        self.affinity = Affinity(ResponseStore(config.responses_kept, config.responses_ttl, clock), self.balancer,
                                 counted=lambda outcome: self.metrics.response_affinity.labels(outcome).inc())
        self.metrics.responses_kept.set_function(lambda: len(self.affinity.store))
        self.answer = AnswerPath(config, balancer=self.balancer, ejector=self.ejector, metrics=self.metrics,
                                 accounting=self.accounting, trimmer=self.trimmer, affinity=self.affinity,
                                 inflight=self.inflight)
        self.requests = RequestPath(config, balancer=self.balancer, policies=self.policies, cold=self.cold,
                                    limiter=self.limiter, bodies=self.bodies, parser=self.parser,
                                    trimmer=self.trimmer,
                                    metrics=self.metrics, surface=self.surface, accounting=self.accounting,
                                    answer=self.answer, info=self.info, affinity=self.affinity,
                                    inflight=self.inflight)

    # -- the control plane's side (see surface.py) ---------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the whole list of ready endpoints. Call on the event loop, once per change (Surface.set_endpoints)."""
        silent = self.outliers.silent()
        self.surface.set_endpoints(endpoints)
        if silent:
            self._left_silent(silent)

    def change_endpoints(self, endpoints: tuple[Endpoint, ...], changed: Mapping[str, Endpoint | None]) -> None:
        """The list changed by `changed`; `endpoints` is the whole new list (Surface.change_endpoints)."""
        silent = self.outliers.silent()
        self.surface.change_endpoints(endpoints, changed)
        if silent:
            self._left_silent(silent)

    def _wedged(self, state: EndpointState, reason: str) -> None:
        self.inflight.abandon(state, f"{state.replica_id} was ejected: {reason}")

    def _left_silent(self, silent: Mapping[str, EndpointState]) -> None:
        """Endpoints that left the list while their polls went unanswered: taken out because their engine
        stopped answering (its agent saw it first), so what waits on them moves (inflight.py). One that
        answers its polls and leaves -- drained, scaled down -- keeps its requests until they finish."""
        for rid, state in silent.items():
            if self.balancer.state_of(rid) is not state:
                self.inflight.abandon(state, f"{rid} left the routing while not answering the router's health probes")

    def set_model_states(self, states: Iterable[ModelState]) -> None:
        """Replace what the controller says about models without a ready replica (Surface.set_model_states)."""
        self.surface.set_model_states(states)

    def set_catalog(self, catalog: Catalog) -> None:
        """Make `catalog` the one new requests resolve against; requests already running keep theirs."""
        self.surface.set_catalog(catalog)
        self.modelinfo.retain(m.name for m in catalog.models)
        self.balancer.adapters.retain(a.name for m in catalog.models for a in m.adapters)

    @property
    def catalog(self) -> Catalog:
        return self.surface.view.catalog

    @property
    def _bad_urls(self) -> dict[str, str]:
        """{replica id: the URL it was left out of routing for} (Surface.bad_urls)."""
        return self.surface.bad_urls

    def set_api_keys(self, keys: keyauth.ApiKeys | None) -> None:
        """Require one of `keys` on every request from now on (None: no keys, the router is open)."""
        self.surface.set_api_keys(keys)

    def set_request_sink(self, sink: RequestSink | None) -> None:
        """Hand every request answered from now on to `sink` (the request log and history); None: to nothing."""
        self.accounting.sink = sink

    def usage_snapshot(self) -> dict[str, Usage]:
        """{replica_id: (last use on the router's monotonic clock or None, requests in flight)}."""
        return self.balancer.usage_snapshot()

    def load_snapshot(self) -> dict[str, LoadReading]:
        """{replica_id: its engine's latest fresh load reading}, for the autoscaler (a LoadSource)."""
        return self.balancer.load_snapshot()

    def inflight_seconds(self) -> dict[str, float]:
        """{replica_id: in flight integrated over time}, for the autoscaler (a ConcurrencySource)."""
        return self.balancer.inflight_seconds()

    def adapter_inflight_seconds(self) -> dict[str, float]:
        """{adapter name: its requests in flight integrated over time}, for its spread (an AdapterLoadSource)."""
        return self.balancer.adapters.inflight_seconds()

    def endpoint_problems(self) -> dict[str, str]:
        """{replica_id: what this router holds against its engine now}, for status: an ejection for a
        cause (see ejection.py), else why its /metrics gives no reading; absent: nothing."""
        poller = self.poller
        out = dict(poller.problems) if poller is not None else {}
        out.update((rid, e.describe()) for rid, e in self.ejector.current().items())
        return out

    def _resync(self) -> None:
        """The endpoint list changed: the poller scrapes the new list (before the app starts there is none),
        and a new endpoint's engine is asked its context length."""
        if self.poller is not None:
            self.poller.resync()
            self.modelinfo.changed()

    # -- lifecycle ------------------------------------------------------------------

    def app(self, bind_host: str | None = None) -> web.Application:
        """The aiohttp app; `bind_host`, the address it will listen on, decides whether Host is checked
        (see httporigin.BrowserGuard.for_bind; None: as on loopback)."""
        cfg, info = self.config, self.info
        # Before any handler: a web page of another site, or a Host a page could
        # have pointed here (DNS rebinding), spends no GPU time (see httporigin).
        browsers = BrowserGuard.for_bind(bind_host, server="router", cors_origins=cfg.cors_origins,
                                         allowed_hosts=cfg.allowed_hosts, expose=CORS_EXPOSE,
                                         methods="GET, POST, DELETE, OPTIONS")
        app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[browsers.middleware()])
        app.router.add_get("/v1/models", info.models)
        app.router.add_get("/v1/models/{name:.+}", info.model)
        app.router.add_get("/healthz", info.healthz)
        app.router.add_get("/health", info.health)
        app.router.add_get("/readyz", info.readyz)
        app.router.add_get("/metrics", info.metrics)
        # Only the routes in the table, and below them those the catalog adds
        # (looked up per request: the catalog changes while the app runs).
        # Anything else under /v1/ is the 404 of every unknown path.
        for route in routing.TABLE:
            handler = self.requests.stored(route) if route.by_response else self.requests.handler(route)
            for method in route.methods:
                app.router.add_route(method, route.path, handler)
        app.router.add_post("/v1/{tail:.+}", self.requests.catalog_route)
        # Allowed origins' preflights and answers (only when origins are configured:
        # with none, answers carry no CORS header).
        browsers.install(app)
        app.router.add_route("*", "/{tail:.*}", info.not_found)
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
        pool = self.requests.dispatch.pool = Pool(connect_timeout=cfg.connect_timeout,
                                                  keepalive_timeout=cfg.keepalive_timeout,
                                                  headers_timeout=cfg.upstream_headers_timeout,
                                                  limit_per_endpoint=cfg.connections_per_endpoint,
                                                  limit_total=cfg.connections_total)
        # A cut stream's continuation goes to its next replica over the same pool.
        self.answer.continuation.pool = pool
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
        # Asked over the poller's session: the same caps on an engine's headers.
        self.modelinfo.start(self._session)
        self.modelinfo.changed()
        self._info_task = asyncio.get_running_loop().create_task(self.modelinfo.run(self.balancer.states))

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._poll_task is not None:
            await cancel_and_wait(self._poll_task)
        if self._info_task is not None:
            await cancel_and_wait(self._info_task)
        await self.modelinfo.close()
        if self._session is not None:
            await self._session.close()
        if self.poller is not None:
            self.poller.close()
        if self.requests.dispatch.pool is not None:
            await self.requests.dispatch.pool.close()
        await self.parser.aclose()
        self.trimmer.close()
        self.requests.close()


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
