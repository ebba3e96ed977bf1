"""The control API (aiohttp, default 127.0.0.1:8081): status, catalog, agents, watch streams, wake.

    GET  /healthz                          200 while the process serves
    GET  /readyz                           200 once the settling window is over, else 503
    GET  /api/v1/status[?model=NAME]       catalog, models, replicas, nodes, events (with model: its
                                           replicas and their nodes only; 404 for a model not in the catalog)
    GET  /api/v1/catalog                   {"version", "directory", "catalog": Catalog.to_dict()}
    POST /api/v1/catalog[?dry_run=1]       {"filename": "x.yaml", "content": "<yaml>"} -> plan; 422 with
                                           {"errors": ["file:line:col: path: message", ...]} when invalid
    POST /api/v1/agents/{node}/report      an agent's report (see llmgwctl.agent.core.Agent.report), cut to what
                                           the node's token claims ({"ok", "refused"}); 409 when another agent
                                           process speaks for the node; 429 + Retry-After when its changed
                                           reports come faster than reportlimit takes them
    GET  /api/v1/agents/{node}/desired?after=V[&instance=ID]   long-poll: {"version", "replicas": [ReplicaSpec...]};
                                           204 if not yet known; 409 for an agent that is not the node's
    GET  /api/v1/watch/endpoints?after=V[&delta=1]   long-poll: {"version", "catalog", "endpoints", "models"};
                                           with delta=1, {"version", "delta", "models"[, "catalog"]} when V is
                                           known (llmgwctl.router.watch, control.watchlog)
    GET  /api/v1/watch/catalog?after=V     long-poll: {"version", "catalog"}
    POST /api/v1/wake                      {"model": NAME} -> 202
    POST /api/v1/usage                     a standalone router's usage (llmgwctl.router.watch) -> 204
    GET  /metrics                          Prometheus text (llmgwctl.observability.metrics.ControlMetrics)
    GET  /api/v1/replicas/{id}/logs?tail=N&follow=1   the engine's log, relayed from its agent (NDJSON, see
                                           `logs`); 404 for a replica the controller does not know, 504 when
                                           its agent does not answer
    POST /api/v1/agents/{node}/logs/{request}   an agent's chunk of a requested log -> 200, or 410 once
                                           nobody reads it
    GET  /api/v1/nodes/{node}              a node's scheduling (cordoned, draining, ...) and replicas
    POST /api/v1/nodes/{node}/cordon|drain|uncordon   the operator's maintenance verbs (`maintenance`)
    GET  /, /ui/, /api/v1/watch/status     the web console and the status stream (`webui`)
    GET  /api/v1/watch/console             the stream the console follows: a bounded summary and the traffic
                                           history's new points (`webui`, `summary`)
    GET  /api/v1/history[?model=&since=]   traffic over time per model and fleet-wide (`history`)
    GET  /api/v1/requests[?model=&status=&id=&limit=]   the last requests the routers answered (`requestlog`)
    GET  /api/v1/gpus[?node=&offset=&limit=]   per node, each GPU's memory and the replicas holding it (`gpuview`)
    POST /api/v1/playground/chat           a chat prompt sent through this process's router, its stream relayed
                                           (`playground`: why a relay, and the key rules it keeps)

With a token configured (`auth.ControlAuth`), every route but /healthz,
/readyz and the console's static files needs `Authorization: Bearer <token>`; a missing or wrong one is 401
before any handler runs, and `/api/v1/agents/{node}/...` needs the admin token
or `{node}`'s own node token (403 otherwise).

Before any of that, web pages are kept out (`llmgwctl.httporigin`): a request
from another site's page (its Origin, or Sec-Fetch-Site) or with a Host name a
page could have pointed here (DNS rebinding) is 403; the console, served from
this API's own origin, passes. Every POST takes `Content-Type:
application/json` only (415 otherwise), and its body must arrive within
BODY_TIMEOUT (408, and the connection closes).

Errors are JSON `{"error": {"message", "type", "code"}}` like the router's,
aiohttp's own 404, 405 and 413 included, and every answer carries an
`X-Request-Id`.

This module wires the routes; each group lives in a module of its own:
`catalogapi` (catalog, apply), `agentapi` (reports, desired lists),
`logsapi` (engine logs), `watchapi` (what routers follow and send),
`maintenance` (node cordon and drain), `webui` (the console), `trafficapi`
(history, request log, GPUs); `middleware`
reads bodies and answers the unexpected, `reportcheck` checks a report.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ..httporigin import BrowserGuard
from ..observability.metrics import CONTENT_TYPE_LATEST, ControlMetrics
from ..router.conventions import stamp_request_id
from .agentapi import AgentService
from .answers import error
from .auth import ControlAuth
from .catalogapi import CatalogService
from .controller import Controller
from .logsapi import LogService
from .maintenance import NodeService
from .middleware import BODY_TIMEOUT, MAX_APPLY_BYTES, bodies, unexpected
from .playground import Playground
from .reportcheck import forbidden_host, replica_url_problem
from .reportlimit import ReportLimiter
from .summary import Summaries
from .trafficapi import TrafficService
from .watchapi import RouterService
from .webui import Console

__all__ = ["BODY_TIMEOUT", "MAX_APPLY_BYTES", "ControlAPI", "forbidden_host", "replica_url_problem"]


class ControlAPI:
    """The control API's routes, each group kept by its own service (see the module docstring)."""

    def __init__(self, controller: Controller, *, auth: ControlAuth | None = None,
                 metrics: ControlMetrics | None = None, limiter: ReportLimiter | None = None,
                 holds: Path | None = None, router_url: Callable[[], str | None] | None = None):
        self.c = controller
        self.auth = auth or ControlAuth()
        self.metrics = metrics or ControlMetrics(controller.state)
        self.catalog = CatalogService(controller)
        self.agents = AgentService(controller, self.auth, limiter or ReportLimiter())
        self.logs = LogService(controller)
        self.routers = RouterService(controller)
        # `holds`: where cordons and drains are kept across a restart (control.holds); None: not kept.
        self.nodes = NodeService(controller, holds)
        self.traffic = TrafficService(controller)
        # The console's playground relays to this process's router (`playground` says why); none: 501.
        self.playground = Playground(router_url or (lambda: None))

    def app(self, browsers: BrowserGuard | None = None) -> web.Application:
        """The aiohttp app. `browsers`: which web pages and Host names it answers (see httporigin); by
        default, as bound to loopback with no other origin allowed."""
        requests = self.metrics.requests
        if browsers is None:
            browsers = BrowserGuard(server="control API", cors_option="--control-cors-origin")
        # The browser checks first: a page of another site is refused the same
        # whether or not a token is configured, and before the token is looked at.
        app = web.Application(client_max_size=MAX_APPLY_BYTES,
                              middlewares=[browsers.middleware(),
                                           self.auth.middleware(lambda route, code: requests.labels(route, str(code)).inc()),
                                           unexpected, bodies])
        # Every answer carries a request id, as the router's do: the one to quote in a report.
        app.on_response_prepare.append(stamp_request_id)
        browsers.install(app)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/api/v1/status", self.status)
        for service in (self.catalog, self.agents, self.routers, self.logs, self.nodes, self.traffic,
                        self.playground):
            service.add_routes(app)
        summaries = Summaries()
        Console(self.c.state, self.c.status_changed, summary=lambda: summaries(self.c.state()),
                history=self.c.history).add_routes(app)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.c.reconciler.settled
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        try:
            body = self.c.status_json(model)
        except KeyError:
            return error(404, f"no model {str(model)[:100]!r} in the catalog in force", kind="not_found_error")
        return web.Response(body=body, content_type="application/json")
