"""`llmgwctl logs` over the control API: an engine's log asked of its agent and relayed to the reader.

    GET  /api/v1/replicas/{id}/logs?tail=N&follow=1   NDJSON chunks; 404 for a replica the controller does not
                                                      know, 504 when its agent does not answer
    POST /api/v1/agents/{node}/logs/{stream}          an agent's chunk of a requested log -> 200, or 410 once
                                                      nobody reads it

The request reaches the agent on its desired long-poll (`agentapi`), since
nothing dials in to a node; the relay itself is `control.logs`.
"""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .answers import error as _error
from .controller import Controller
from .logs import FIRST_ANSWER, FOLLOW_SILENCE, LogRelayError

# Lines of log `llmgwctl logs` shows without --tail: a screenful and then some,
# as `kubectl logs --tail` users pick; the agent's crash report keeps 20.
DEFAULT_TAIL = 100


class LogService:
    """Both ends of a relayed log: the reader's stream and the agent's chunks."""

    def __init__(self, controller: Controller):
        self.c = controller

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/replicas/{replica}/logs", self.replica_logs)
        app.router.add_post("/api/v1/agents/{node}/logs/{stream}", self.agent_logs)

    async def replica_logs(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["replica"]
        rec = self.c.reconciler.replicas.get(rid)
        if rec is None:
            return _error(404, f"no replica {rid!r} (llmgwctl status lists them)", kind="not_found_error")
        try:
            tail = int(request.query.get("tail", DEFAULT_TAIL))
            if tail < 0:
                raise ValueError
        except ValueError:
            return _error(400, f"tail must be a whole number of lines, got {request.query.get('tail')!r}")
        follow = request.query.get("follow", "").lower() in ("1", "true", "yes")
        try:
            stream = self.c.logs.open(rec.node, rid, tail, follow)
        except LogRelayError as exc:
            return _error(429, str(exc), kind="rate_limit_error")
        resp: web.StreamResponse | None = None
        try:
            try:
                chunk = await asyncio.wait_for(stream.chunks.get(), FIRST_ANSWER)
            except asyncio.TimeoutError:
                return _error(504, f"the agent of node {rec.node} did not send {rid}'s log within {FIRST_ANSWER:.0f} s "
                                   "(is it running and reporting, and as new as this controller?)",
                              kind="timeout_error")
            if "error" in chunk:
                return _error(502, f"the agent of node {rec.node}: {chunk['error']}", kind="agent_error")
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            while True:
                await resp.write(json.dumps(chunk).encode() + b"\n")
                if chunk.get("done") or "error" in chunk:
                    break
                try:
                    chunk = await asyncio.wait_for(stream.chunks.get(), FOLLOW_SILENCE if follow else FIRST_ANSWER)
                except asyncio.TimeoutError:
                    chunk = {"error": f"the agent of node {rec.node} stopped sending (agent restarted or node lost)"}
            await resp.write_eof()
            return resp
        except ConnectionError:
            return resp if resp is not None else web.Response(status=499)   # the reader left
        finally:
            self.c.logs.close(stream.id)

    async def agent_logs(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "a log chunk must be JSON: {\"lines\": [...], \"done\": false}")
        lines = body.get("lines", []) if isinstance(body, dict) else None
        if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            return _error(400, "a log chunk must be {\"lines\": [\"...\"], \"done\": bool} or {\"error\": \"...\"}")
        error = body.get("error")
        delivered = await self.c.logs.deliver(request.match_info["node"], request.match_info["stream"], lines,
                                              done=bool(body.get("done")), error=str(error) if error else None)
        if not delivered:
            return _error(410, "nobody reads this log stream any more; stop sending it", kind="gone")
        return web.json_response({"ok": True})
