"""The agent service of the control API: a node's reports in, its desired replicas out (long-poll).

    POST /api/v1/agents/{node}/report     an agent's report, cut to what the node's token claims
    GET  /api/v1/agents/{node}/desired    long-poll of the node's desired list (log requests ride on it)

A heartbeat (the node's last report again, byte for byte) costs a digest; a
changed report is limited per node (reportlimit), then parsed and checked
(`reportcheck`), off the loop when large.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from aiohttp import web

from ..contracts import ReplicaSpec, ReportError
from ..inventory import ConflictError
from .answers import OK as _OK
from .answers import after as _after
from .answers import error as _error
from .answers import poll_timeout as _poll_timeout
from .auth import ControlAuth
from .controller import Controller
from .reportcheck import OFF_LOOP_BYTES
from .reportcheck import checked_report as _checked_report
from .reportlimit import ReportLimiter, retry_after


class AgentService:
    """Reports and desired lists, with what they keep between requests (digests, encoded lists)."""

    def __init__(self, controller: Controller, auth: ControlAuth, limiter: ReportLimiter):
        self.c, self.auth = controller, auth
        # Changed reports per node (reportlimit); heartbeats are never counted.
        self.limiter = limiter
        # Per node, its desired list encoded for the version it was encoded at (see desired).
        self._desired: dict[str, tuple[int, bytes]] = {}
        # Per node, the digest of its last accepted report and where it came from (see report).
        self._reports: dict[str, tuple[bytes, str | None]] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/api/v1/agents/{node}/report", self.report)
        app.router.add_get("/api/v1/agents/{node}/desired", self.desired)

    async def report(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        raw = await request.read()
        authorization = request.headers.get("Authorization") or ""
        # A heartbeat is the node's last report again, byte for byte (an agent
        # encodes the same state the same way): a digest of the bytes stands
        # for the schema check, the URL check and the parse it already passed.
        # Checked against the same peer and the same credentials, since the URL
        # check reads the address a report came from and the claims read its
        # token. At 5,000 nodes this is 500 a second.
        digest = hashlib.blake2b(raw, digest_size=16)
        digest.update(authorization.encode("utf-8", "surrogateescape"))
        seen = digest.digest()
        if self._reports.get(node) == (seen, request.remote) and self.c.agent_heartbeat(node):
            return web.Response(body=_OK, content_type="application/json")
        # A changed report costs its parse and a pass over its node: limited per
        # node (reportlimit), before any of it is paid. The node is still heard:
        # a live agent sending too much is not a silent one, and keeps its replicas.
        wait = self.limiter.take(node, len(raw))
        if wait is not None:
            self.c.agent_heartbeat(node)
            resp = _error(429, f"node {node!r} sends changed reports faster than {self.limiter.rate:g} a second "
                               f"(bursts of {self.limiter.burst:g}); send its state again in {wait:.1f} s",
                          kind="rate_limit_error")
            resp.headers["Retry-After"] = retry_after(wait)
            return resp
        claims = self.auth.claims(authorization)
        # Parsed and checked in a worker thread when large, so a big report (a
        # full node's, or a hostile one's) does not hold the loop from chat,
        # /healthz and every other node while it is read.
        if len(raw) > OFF_LOOP_BYTES:
            checked = await asyncio.to_thread(_checked_report, raw, node, request.remote, claims)
        else:
            checked = _checked_report(raw, node, request.remote, claims)
        if isinstance(checked, str):
            return _error(400, checked)
        try:
            refused = self.c.agent_reported(node, checked, claims)
        except ConflictError as exc:
            return _error(409, str(exc), kind="conflict_error")
        except ReportError as exc:
            return _error(400, str(exc))
        self._reports[node] = (seen, request.remote)
        if refused:
            # Taken, without what its token does not allow: the agent logs why.
            return web.json_response({"ok": True, "refused": list(refused)})
        return web.Response(body=_OK, content_type="application/json")

    async def desired(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        # Only the agent process that speaks for the node is told what to run: a
        # second one started with the same --node would start every replica again.
        # Agents older than instance ids send none and are not checked.
        instance = request.query.get("instance")
        holder = self.c.inventory.holder(node)
        if instance and holder is not None and instance != holder:
            return _error(409, f"node {node!r} has another running agent (instance {holder[:12]}); this one "
                               f"(instance {instance[:12]}) is not given its replicas", kind="conflict_error")
        answer = await self._desired_or_logs(node, _after(request), _poll_timeout(request))
        if answer is None:
            return web.Response(status=204)
        version, specs = answer
        asks = self.c.logs.take(node)
        if asks:
            # Log requests ride on this answer (see `logs`): built for it alone, never cached.
            return web.json_response({"version": version, "replicas": [s.to_dict() for s in specs],
                                      "log_requests": asks})
        # Encoded once per version of the node's list: a held poll answers the
        # same version again every 30 s, for every node of the fleet.
        hit = self._desired.get(node)
        if hit is None or hit[0] != version:
            hit = self._desired[node] = (version, json.dumps({"version": version,
                                                              "replicas": [s.to_dict() for s in specs]}).encode())
        return web.Response(body=hit[1], content_type="application/json")


    async def _desired_or_logs(self, node: str, after: int | None,
                               timeout: float) -> tuple[int, tuple[ReplicaSpec, ...]] | None:
        """The node's desired list when it changes -- or at once, unchanged, when logs are asked of its agent.

        The held long-poll is how the controller reaches an agent that only
        dials out (see `logs`); an unchanged version is no news to the agent,
        which just reads the requests that came with it. A node whose list is
        not known yet is not answered early: its requests wait for the list.
        """
        desired = self.c.desired
        asked = self.c.logs.asked(node)
        if asked.is_set() and desired.get(node) is not None:
            return desired.get(node)
        # The poll is this task itself, so a change resumes it in one step of the loop
        # (aio.Waiters); a log request answers it through the store, with the list as it is.
        held = True

        def heard_asked(task: asyncio.Future[Any]) -> None:
            if held and not task.cancelled():
                desired.wake(node)

        heard = asyncio.ensure_future(asked.wait())
        heard.add_done_callback(heard_asked)
        try:
            return await desired.wait(node, after, timeout)
        finally:
            held = False
            heard.cancel()
