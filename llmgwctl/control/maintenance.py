"""Cordon, drain and uncordon over the control API (`llmgwctl cordon|drain|uncordon NODE`).

    GET  /api/v1/nodes/{node}             {"node", "scheduling", "reachable", "replicas": [{"id", "model", "state"}]}
    POST /api/v1/nodes/{node}/cordon      nothing new is placed on the node; what runs keeps running
    POST /api/v1/nodes/{node}/drain       cordon, replace its replicas elsewhere (surge first), then stop them
    POST /api/v1/nodes/{node}/uncordon    placeable again
                                          each POST -> the GET's document and "changed" (false when the node
                                          already was so); 404 for a node no agent reported and none held

The POSTs are the operator's: admin token only (a node's or router's token
gets 403 from `auth`), and like every state-changing route they take
`Content-Type: application/json` (a body, when sent, is a JSON object; none
of its fields are read yet) and are refused to other sites' pages
(`httporigin`). A change is written to the holds file before it takes
effect (`holds`), so a controller restarting right after the answer keeps
it; a file the disk will not take is a 503 and changes nothing. What a hold
does to placement and to the node's replicas is the reconciler's
(`reconciler.maintenance`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from ..reconciler.maintenance import holds_of
from . import holds as holds_file
from .answers import error
from .controller import Controller

log = logging.getLogger("llmgw.control")

VERBS = ("cordon", "drain", "uncordon")


class NodeService:
    """The node maintenance routes, and the order their writes of the holds file come in."""

    def __init__(self, controller: Controller, holds_path: Path | None = None):
        self.c = controller
        self.holds_path = holds_path
        # One change at a time: each writes the file with every hold, so two
        # in flight could land in the wrong order and undo the later one.
        self._lock = asyncio.Lock()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/nodes/{node}", self.get)
        for verb in VERBS:
            app.router.add_post(f"/api/v1/nodes/{{node}}/{verb}", self._handler(verb))

    def _known(self, node: str) -> bool:
        return self.c.inventory.get(node) is not None or node in self.c.reconciler.maintenance.holds

    def document(self, node: str) -> dict[str, Any]:
        r = self.c.reconciler
        known = self.c.inventory.get(node)
        return {"node": node, "scheduling": r.maintenance.state(node).value,
                "reachable": bool(known is not None and known.reachable),
                "replicas": [{"id": rid, "model": rec.spec.model, "state": rec.state.value}
                             for rid, rec in r.replicas.of(node)]}

    def _unknown(self, node: str) -> web.Response:
        return error(404, f"no node {node[:100]!r}: no agent reported it (llmgwctl status lists the nodes)",
                     kind="not_found_error")

    async def get(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        if not self._known(node):
            return self._unknown(node)
        return web.json_response(self.document(node))

    def _handler(self, verb: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            return await self.change(request, verb)
        return handle

    async def change(self, request: web.Request, verb: str) -> web.Response:
        node = request.match_info["node"]
        raw = await request.read()
        if raw.strip():
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict):
                return error(400, f"{verb}: the body, when sent, must be a JSON object ({{}})")
        if not self._known(node):
            return self._unknown(node)
        async with self._lock:
            maintenance = self.c.reconciler.maintenance
            wanted = holds_of(maintenance)
            if verb == "uncordon":
                wanted.pop(node, None)
            else:
                wanted[node] = verb == "drain" or wanted.get(node, False)
            if self.holds_path is not None and wanted != holds_of(maintenance):
                try:
                    await asyncio.to_thread(holds_file.save, self.holds_path, wanted)
                except OSError as exc:
                    log.error("%s %s: cannot write %s: %s", verb, node, self.holds_path, exc)
                    return error(503, f"{verb} {node}: the controller cannot write its holds file "
                                      f"{self.holds_path} ({exc.strerror or exc}); nothing changed",
                                 kind="unavailable_error")
            changed = self.c.set_scheduling(node, verb)
        return web.json_response({**self.document(node), "changed": changed})
