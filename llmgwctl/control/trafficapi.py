"""What the console charts and lists: traffic over time, the last requests, the GPUs of the nodes.

    GET /api/v1/history[?model=NAME][&since=T]        control.history
    GET /api/v1/requests[?model=M&status=S&id=ID&limit=N]   control.requestlog
    GET /api/v1/gpus[?node=PREFIX&offset=N&limit=N]   control.gpuview

All read-only, with the token of `llmgwctl status`; all bounded in what they answer.
"""
from __future__ import annotations

import math

from aiohttp import web

from .answers import error
from .controller import Controller
from .gpuview import DEFAULT_LIMIT as GPU_LIMIT
from .gpuview import gpu_view
from .requestlog import DEFAULT_LIMIT, QueryError


def _count(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest() from None
    if value < 0:
        raise web.HTTPBadRequest()
    return value


class TrafficService:
    def __init__(self, controller: Controller):
        self.c = controller

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/history", self.history)
        app.router.add_get("/api/v1/requests", self.requests)
        app.router.add_get("/api/v1/gpus", self.gpus)

    async def history(self, request: web.Request) -> web.Response:
        since = None
        raw = request.query.get("since")
        if raw:
            try:
                since = float(raw)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                return error(400, f"since must be a time in seconds (a `t` of an earlier answer), not {raw[:40]!r}")
        model = request.query.get("model") or None
        if model is not None:
            found = self.c.live.current.resolve(model)
            model = found.name if found is not None else model
        try:
            return web.json_response(self.c.history.to_dict(model, since))
        except KeyError:
            return error(404, f"no history of model {str(model)[:100]!r} (models of the catalog have one)",
                         kind="not_found_error")

    async def requests(self, request: web.Request) -> web.Response:
        try:
            limit = _count(request, "limit", DEFAULT_LIMIT)
        except web.HTTPBadRequest:
            return error(400, f"limit must be a whole number of requests, not {request.query.get('limit', '')[:40]!r}")
        q = request.query
        try:
            found = self.c.requests.query(model=q.get("model") or None, status=q.get("status") or None,
                                          request_id=(q.get("id") or "").strip() or None, limit=limit)
        except QueryError as exc:
            return error(400, str(exc))
        log = self.c.requests
        return web.json_response({"capacity": log.capacity, "total": log.total,
                                  "requests": [r.to_dict() for r in found]})

    async def gpus(self, request: web.Request) -> web.Response:
        try:
            offset = _count(request, "offset", 0)
            limit = _count(request, "limit", GPU_LIMIT)
        except web.HTTPBadRequest:
            return error(400, "offset and limit must be whole numbers of nodes")
        return web.json_response(gpu_view(self.c.inventory.nodes(), self.c.reconciler.replicas,
                                          prefix=request.query.get("node", ""), offset=offset, limit=limit))
