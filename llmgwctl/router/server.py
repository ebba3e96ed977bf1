"""The router's HTTP face: the OpenAI-compatible API, proxying to the chosen endpoint.

Owns the request path -- read and parse the body once, resolve the model
against the catalog taken once for the request, pick an endpoint, forward,
pass the answer back (streams chunk by chunk, as bytes) -- and the three
narrow surfaces the control plane meets it through:

- `set_endpoints(endpoints)` and `set_catalog(catalog)`: pushed once per change,
  never pulled per request;
- `usage_snapshot()`: last use and in-flight count per replica, read once a tick;
- a `Waker` it calls when a request finds no ready replica.

It must not know about placement, agents or the reconciler.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import aiohttp
from aiohttp import web

from ..catalog import Catalog
from . import errors
from .balancer import Balancer, EndpointState
from .coldstart import ColdStart, ColdTimeout, QueueFull, Waker
from .endpoint import Endpoint
from .poller import LoadPoller, ParseLoad, _default_parse

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    # Bodies above this get 413 before they are read: a 128k-token prompt is
    # about 0.5 MB of text and requests with a few base64 images reach several
    # MB; 32 MiB leaves room for those while bounding memory per request.
    max_body_bytes: int = 32 * 1024 * 1024
    # Engine gauges change at the pace of requests finishing; 1 s keeps the pick
    # current while costing each engine one small scrape a second.
    poll_interval: float = 1.0
    # Long enough for a 7B-70B model cached on local disk to load (30-90 s with
    # vLLM); past it, a 503 with Retry-After lets the client decide.
    cold_timeout: float = 120.0
    # Waiting requests per cold model: a burst costs memory in proportion but not
    # without limit; 256 is one vLLM engine's default max_num_seqs.
    cold_queue: int = 256
    # Endpoints tried per request when connections are refused or reset: the
    # first failure is usually one replica going away, a third in a row means
    # the model is in trouble and the client should hear about it.
    max_attempts: int = 3
    # Engines are on the same LAN; a connect taking longer than this means the
    # host is gone, and the request is better moved to another endpoint.
    connect_timeout: float = 3.0
    # One client connection pool for every engine. Per host: twice vLLM's default
    # max_num_seqs, so every slot plus a visible queue is reachable and requests
    # past that wait in the router, where they count as in-flight load. Total:
    # bounded well under the file-descriptor limit the CLI raises to.
    connections_per_endpoint: int = 512
    connections_total: int = 8192
    # Below uvicorn's default 5 s keep-alive (vLLM, SGLang), so the router closes
    # an idle connection before the engine does and never sends a request down
    # a socket the engine is closing (which would look like a reset and eject a
    # healthy endpoint).
    keepalive_timeout: float = 4.0


class _View:
    """The per-catalog facts the hot path needs, built once per `set_catalog`."""

    __slots__ = ("catalog", "version", "top_profile")

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.version = catalog.version
        # A model whose best profile has no ready endpoint is cold, even when a
        # fallback profile serves it meanwhile.
        self.top_profile = {m.name: m.ranked()[0].name for m in catalog.models if m.profiles}


# What the router sends engines: the body is always JSON. The client's
# Authorization is the gateway's credential and is not passed on.
_UPSTREAM_HEADERS = {"Content-Type": "application/json"}
# Before any byte has reached the client these are safe to retry elsewhere: the
# connection was refused, reset, or never completed.
_CONNECT_ERRORS = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ServerTimeoutError)
_EVENT_STREAM = "text/event-stream"


class Router:
    def __init__(self, catalog: Catalog | None = None, *, waker: Waker | None = None,
                 config: RouterConfig = RouterConfig(), clock: Callable[[], float] = time.monotonic,
                 parse_load: ParseLoad = _default_parse):
        self.config = config
        self._clock = clock
        self._parse_load = parse_load
        # A reading older than three polls is unknown: one missed scrape is noise,
        # three mean the engine is not answering.
        self.balancer = Balancer(clock=clock, stale_after=3 * config.poll_interval)
        self.cold = ColdStart(waker, max_waiting=config.cold_queue, timeout=config.cold_timeout, clock=clock)
        self._view = _View(catalog if catalog is not None else Catalog())
        self._session: aiohttp.ClientSession | None = None
        self.poller: LoadPoller | None = None
        self._poll_task: asyncio.Task | None = None
        self._models_cache: tuple[object, bytes] = (None, b"")

    # -- the control plane's side ------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replace the whole list of ready endpoints. Call on the event loop, once per change."""
        gained = self.balancer.set_endpoints(endpoints)
        self.cold.endpoints_changed(gained)
        if self.poller is not None:
            self.poller.resync()

    def set_catalog(self, catalog: Catalog) -> None:
        """Make `catalog` the one new requests resolve against; requests already running keep theirs."""
        if catalog.version != self._view.version:
            self._view = _View(catalog)

    @property
    def catalog(self) -> Catalog:
        return self._view.catalog

    def usage_snapshot(self) -> dict[str, tuple[float | None, int]]:
        """{replica_id: (last use on the router's monotonic clock or None, requests in flight)}."""
        return self.balancer.usage_snapshot()

    # -- lifecycle ------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_post("/v1/{tail:.+}", self._proxy)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=cfg.connections_total, limit_per_host=cfg.connections_per_endpoint,
                                         keepalive_timeout=cfg.keepalive_timeout)
        # No total or read timeout: a generation may run for minutes, and a long
        # prefill sends no byte for a long time. A client that gives up
        # disconnects, and that cancels the upstream request.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout)
        # No Accept-Encoding, so engines answer uncompressed and the router never
        # decompresses; no User-Agent, one header less per request.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding", "User-Agent"))
        self.poller = LoadPoller(self.balancer, self._session, interval=cfg.poll_interval, parse=self._parse_load)
        self._poll_task = asyncio.get_running_loop().create_task(self.poller.run())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            try:
                await self._poll_task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            await self._session.close()

    # -- handlers ---------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        view = self._view
        return web.json_response({"status": "ok", "catalog_version": view.version,
                                  "models": len(view.catalog), "endpoints": len(self.balancer.states())})

    async def _not_found(self, request: web.Request) -> web.Response:
        return errors.not_found(f"{request.method} {request.path}")

    async def _models(self, request: web.Request) -> web.Response:
        view = self._view
        key = (view, self.balancer.generation)
        if self._models_cache[0] != key:
            self._models_cache = (key, self._models_body(view))
        return web.Response(body=self._models_cache[1], content_type="application/json",
                            headers={"x-llmgw-catalog-version": view.version})

    def _models_body(self, view: _View) -> bytes:
        data = []
        for m in view.catalog.models:
            ready = self.balancer.ready_count(m.name)
            data.append({"id": m.name, "object": "model", "created": 0, "owned_by": "llmgw",
                         "llmgw": {"ready_replicas": ready, "aliases": list(m.aliases),
                                   "profiles": [p.name for p in m.ranked()]}})
            for alias in m.aliases:
                data.append({"id": alias, "object": "model", "created": 0, "owned_by": "llmgw",
                             "llmgw": {"ready_replicas": ready, "alias_of": m.name}})
        return json.dumps({"object": "list", "data": data}).encode()

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            return errors.too_large(limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return errors.too_large(limit)
        try:
            doc = json.loads(body)
        except ValueError as exc:
            return errors.invalid_json(str(exc))
        if type(doc) is not dict:
            return errors.not_an_object()
        name = doc.get("model")
        if type(name) is not str or not name:
            return errors.missing_model()
        view = self._view           # taken once: a swap from here on is invisible to this request
        model = view.catalog.resolve(name)
        if model is None:
            return errors.unknown_model(name, view.catalog.names())
        target = model.name
        if name != target:
            # Only an alias costs a re-serialisation; the canonical name is
            # forwarded as the very bytes the client sent.
            doc["model"] = target
            body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        return await self._forward(request, target, body, view)

    async def _forward(self, request: web.Request, model: str, body: bytes, view: _View) -> web.StreamResponse:
        balancer = self.balancer
        top = view.top_profile.get(model)
        if top is not None and not balancer.has_profile(model, top):
            self.cold.demand(model)
        state = balancer.pick(model)
        if state is None:
            if not self.cold.can_wait:
                return errors.no_replica(model)
            try:
                state = await self.cold.wait(model, lambda: balancer.pick(model))
            except QueueFull:
                return errors.queue_full(model, self.cold.max_waiting)
            except ColdTimeout:
                return errors.cold_timeout(model, self.cold.timeout)
        session = self._session
        path = request.raw_path
        clock = self._clock
        tried: tuple[EndpointState, ...] = ()
        failure = "no endpoint left to try"
        for _ in range(self.config.max_attempts):
            state.inflight += 1
            state.last_used = clock()
            try:
                try:
                    upstream = await session.post(state.base_url + path, data=body, headers=_UPSTREAM_HEADERS)
                except _CONNECT_ERRORS as exc:
                    balancer.eject(state)
                    failure = f"{state.replica_id}: {exc or type(exc).__name__}"
                    log.warning("endpoint %s failed before answering, trying another: %s", state.replica_id, exc)
                else:
                    try:
                        return await self._respond(request, upstream, state, view)
                    finally:
                        # A response read to its end goes back to the pool; one cut
                        # short (client gone, error) closes, so the engine sees the
                        # disconnect and frees the slot.
                        if upstream.content.is_eof():
                            upstream.release()
                        else:
                            upstream.close()
            except aiohttp.ClientError as exc:
                return errors.upstream_failed(model, f"{state.replica_id}: {exc}")
            finally:
                state.inflight -= 1
                state.last_used = clock()
            tried += (state,)
            state = balancer.pick(model, tried)
            if state is None:
                break
        return errors.upstream_failed(model, failure)

    async def _respond(self, request: web.Request, upstream: aiohttp.ClientResponse, state: EndpointState,
                       view: _View) -> web.StreamResponse:
        ctype = upstream.headers.get("Content-Type", "application/json")
        headers = {"Content-Type": ctype, "x-llmgw-replica": state.replica_id,
                   "x-llmgw-catalog-version": view.version}
        encoding = upstream.headers.get("Content-Encoding")
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        if not ctype.startswith(_EVENT_STREAM):
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.balancer.eject(state)
                return errors.upstream_failed(state.endpoint.model,
                                              f"{state.replica_id} stopped mid-response: {exc or type(exc).__name__}")
            self.balancer.succeeded(state)
            return web.Response(status=upstream.status, body=data, headers=headers)
        # Streams: no cache, and tell a buffering proxy in front (nginx) not to.
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        await resp.prepare(request)
        self.balancer.succeeded(state)
        write = resp.write
        try:
            # iter_any yields whatever bytes arrived, as soon as they arrive: no
            # line splitting, no re-encoding, no waiting for a full event.
            async for chunk in upstream.content.iter_any():
                await write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # The engine died mid-stream. Headers are sent, so no retry: end the
            # stream with an error event, which OpenAI SDKs raise, instead of a hang.
            self.balancer.eject(state)
            log.warning("endpoint %s died mid-stream: %s", state.replica_id, exc)
            try:
                await write(errors.stream_error_event(f"{state.replica_id}: {exc or type(exc).__name__}"))
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        except ConnectionError:
            return resp     # the client left; the caller closes the upstream connection
        await resp.write_eof()
        return resp


async def start(router: Router, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve `router` on host:port; return the runner (`await runner.cleanup()` to stop) and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler at
    # once, which closes the upstream request even while the engine is still
    # silent (a long prefill), so the engine frees the slot.
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port    # type: ignore[union-attr]
    return runner, bound
