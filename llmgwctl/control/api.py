"""The control API (aiohttp, default 127.0.0.1:8081): status, catalog, agents, watch streams, wake.

    GET  /healthz                          200 while the process serves
    GET  /readyz                           200 once the settling window is over, else 503
    GET  /api/v1/status                    catalog, models, replicas, nodes, events
    GET  /api/v1/catalog                   {"version", "directory", "catalog": Catalog.to_dict()}
    POST /api/v1/catalog[?dry_run=1]       {"filename": "x.yaml", "content": "<yaml>"} -> plan; 422 with
                                           {"errors": ["file:line:col: path: message", ...]} when invalid
    POST /api/v1/agents/{node}/report      an agent's report (see llmgwctl.agent.core.Agent.report)
    GET  /api/v1/agents/{node}/desired?after=V   long-poll: {"version", "replicas": [ReplicaSpec...]}; 204 if not yet known
    GET  /api/v1/watch/endpoints?after=V   long-poll: {"version", "catalog", "endpoints", "models"} (llmgwctl.router.watch)
    GET  /api/v1/watch/catalog?after=V     long-poll: {"version", "catalog"}
    POST /api/v1/wake                      {"model": NAME} -> 202
    POST /api/v1/usage                     a standalone router's usage (llmgwctl.router.watch) -> 204
    GET  /metrics                          Prometheus text (llmgwctl.observability.metrics.ControlMetrics)

With a token configured (`auth.ControlAuth`), every route but /healthz and
/readyz needs `Authorization: Bearer <token>`; a missing or wrong one is 401
before any handler runs.

Errors are JSON `{"error": {"message", "type", "code"}}` like the router's.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

from aiohttp import web

from ..catalog import CatalogError
from ..contracts import ReportError
from ..observability.metrics import CONTENT_TYPE_LATEST, ControlMetrics
from ..reconciler import LONG_POLL
from . import schemas
from .apply import ApplyError, decode_content, plan, validate_with, write_atomically
from .auth import ControlAuth
from .controller import Controller

log = logging.getLogger("llmgw.control")

# An apply answers once its catalog is in force, so `catalog apply` returning
# means it is live; past this the answer says it was written but not yet seen.
APPLY_WAIT = 10.0
# Catalog documents above this are refused: the largest real catalogs are a
# few hundred KB; this bounds what a client can make the controller parse.
MAX_APPLY_BYTES = 4 * 1024 * 1024
# How often a held watch checks whether the settling window is over: one flag
# read; a router hears the settled list within a tenth of a second of it.
SETTLED_POLL = 0.1


def _error(status: int, message: str, kind: str = "invalid_request_error", **extra) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    body.update(extra)
    return web.json_response(body, status=status)


@web.middleware
async def _undecodable_body(request: web.Request, handler):
    # A body that says Content-Encoding: gzip (or deflate) and does not
    # decompress fails inside request.json(); it is the client's error, which
    # aiohttp would answer 500. One place for every handler that reads a body.
    try:
        return await handler(request)
    except web.RequestPayloadError:
        return _error(400, f"the request body could not be decoded as its Content-Encoding "
                           f"({request.headers.get('Content-Encoding', 'none')}) says; send it uncompressed")


def _after(request: web.Request) -> int | None:
    raw = request.query.get("after")
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": {"message": f"after must be an integer, got {raw!r}",
                                                            "type": "invalid_request_error", "code": 400}}),
                                 content_type="application/json") from None


def _poll_timeout(request: web.Request) -> float:
    # Tests and impatient clients may ask for a shorter hold; never a longer one.
    try:
        return max(0.0, min(LONG_POLL, float(request.query.get("timeout", LONG_POLL))))
    except ValueError:
        return LONG_POLL


class ControlAPI:
    def __init__(self, controller: Controller, *, auth: ControlAuth | None = None,
                 metrics: ControlMetrics | None = None):
        self.c = controller
        self.auth = auth or ControlAuth()
        self.metrics = metrics or ControlMetrics(controller.state)

    def app(self) -> web.Application:
        requests = self.metrics.requests
        app = web.Application(client_max_size=MAX_APPLY_BYTES,
                              middlewares=[self.auth.middleware(lambda route, code: requests.labels(route, str(code)).inc()),
                                           _undecodable_body])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/api/v1/status", self.status)
        app.router.add_get("/api/v1/catalog", self.get_catalog)
        app.router.add_post("/api/v1/catalog", self.apply)
        app.router.add_post("/api/v1/agents/{node}/report", self.report)
        app.router.add_get("/api/v1/agents/{node}/desired", self.desired)
        app.router.add_get("/api/v1/watch/endpoints", self.watch_endpoints)
        app.router.add_get("/api/v1/watch/catalog", self.watch_catalog)
        app.router.add_post("/api/v1/wake", self.wake)
        app.router.add_post("/api/v1/usage", self.usage)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.c.reconciler.settled
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.c.status())

    async def get_catalog(self, request: web.Request) -> web.Response:
        catalog = self.c.live.current
        return web.json_response({"version": catalog.version, "directory": self.c.watcher.directory,
                                  "catalog": catalog.to_dict()})

    async def apply(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body must be JSON: {\"filename\": \"x.yaml\", \"content\": \"...\"}")
        if not isinstance(body, dict) or not isinstance(body.get("filename"), str) or not isinstance(body.get("content"), str):
            return _error(400, "body must be {\"filename\": \"x.yaml\", \"content\": \"<yaml text>\"}")
        dry_run = request.query.get("dry_run", "").lower() in ("1", "true", "yes")
        directory = self.c.watcher.directory
        current = self.c.live.current
        try:
            content = decode_content(body["content"])
            new = await asyncio.to_thread(validate_with, directory, body["filename"], content)
        except ApplyError as exc:
            return _error(400, str(exc))
        except CatalogError as exc:
            errors = [str(p) for p in exc.problems]
            return _error(422, f"catalog is invalid ({len(errors)} problem{'s' if len(errors) != 1 else ''}); nothing was written",
                          errors=errors)
        result = plan(current, new, self.c.reconciler.preview(new))
        result["dry_run"] = dry_run
        if dry_run:
            return web.json_response(result)
        path = await asyncio.to_thread(write_atomically, directory, body["filename"], content)
        result["written"] = path
        self.c.reconciler.event("catalog-applied", f"{os.path.basename(path)} written by catalog apply")
        result["in_force"] = await self._until_in_force(new.version)
        return web.json_response(result)

    async def _until_in_force(self, version: str) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + APPLY_WAIT
        while self.c.live.current.version != version:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def report(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "report must be a JSON object")
        wrong = schemas.problems("agent-report", body)
        if wrong:
            return _error(400, "report does not follow schemas/api/agent-report.schema.json: " + "; ".join(wrong))
        try:
            self.c.agent_reported(request.match_info["node"], body)
        except ReportError as exc:
            return _error(400, str(exc))
        return web.json_response({"ok": True})

    async def desired(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        answer = await self.c.desired.wait(node, _after(request), _poll_timeout(request))
        if answer is None:
            return web.Response(status=204)
        version, specs = answer
        return web.json_response({"version": version, "replicas": [s.to_dict() for s in specs]})

    async def watch_endpoints(self, request: web.Request) -> web.Response:
        after, timeout = _after(request), _poll_timeout(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self.c.watch.wait(after, timeout)
        # A router that already holds a list (it sends the version it has) is not
        # given ours before the settling window is over: right after a restart
        # this controller knows only the replicas agents have reported so far --
        # none in the first moment -- and the router would drop every endpoint
        # it serves. It keeps its own until the adopted list is complete (or the
        # hold runs out, for a settling window longer than a long-poll).
        while after and not self.c.reconciler.settled and loop.time() < deadline:
            await asyncio.sleep(SETTLED_POLL)
        version = self.c.watch.version
        reconciler = self.c.reconciler
        return web.json_response({"version": version, "catalog": self.c.live.current.to_dict(),
                                  "endpoints": [e.to_dict() for e in reconciler.endpoints],
                                  # issue 15: models starting or unplaceable (contracts.ModelState); routers
                                  # older than the field ignore it and wait as before.
                                  "models": [m.to_dict() for m in reconciler.model_states]})

    async def watch_catalog(self, request: web.Request) -> web.Response:
        version = await self.c.watch.wait(_after(request), _poll_timeout(request))
        return web.json_response({"version": version, "catalog": self.c.live.current.to_dict()})

    async def usage(self, request: web.Request) -> web.Response:
        try:
            self.c.usage.report(await request.json())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"usage report: {exc}")
        return web.Response(status=204)

    async def wake(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            model = body["model"]
            if not isinstance(model, str):
                raise TypeError
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            return _error(400, "body must be {\"model\": \"<name or alias>\"}")
        if self.c.live.current.resolve(model) is None:
            return _error(404, f"model {model!r} is not in the catalog", code_name="model_not_found")
        self.c.wake(model)
        return web.json_response({"ok": True}, status=202)
