"""What standalone routers follow and send: the endpoint and catalog watches, usage reports and wakes.

    GET  /api/v1/watch/endpoints?after=V[&delta=1]   long-poll: {"version", "catalog", "endpoints", "models"};
                                           with delta=1, {"version", "delta", "models"[, "catalog"]} when V is
                                           known (llmgwctl.router.watch, control.watchlog)
    GET  /api/v1/watch/catalog?after=V     long-poll: {"version", "catalog"}
    POST /api/v1/usage                     a standalone router's usage (llmgwctl.router.watch) -> 204
    POST /api/v1/wake                      {"model": NAME} -> 202

Answers are encoded once per state and sent to every router asking for it
(`_encoded`, `_encoded_delta`).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .answers import after as _after
from .answers import error as _error
from .answers import poll_timeout as _poll_timeout
from .controller import Controller
from .usage import TooManyRouters
from .watchlog import WatchLog

# How often a held watch checks whether the settling window is over: one flag
# read; a router hears the settled list within a tenth of a second of it.
SETTLED_POLL = 0.1


class RouterService:
    """The routes routers use, and the encoded answers kept while what they say holds."""

    def __init__(self, controller: Controller):
        self.c = controller
        # Encoded answers, kept while what they say holds (see _encoded).
        self._answers: dict[str, tuple[tuple[Any, ...], bytes]] = {}
        # What each watch version answered, and the deltas encoded from it for the current state (watch_endpoints).
        self._watchlog = WatchLog()
        self._deltas: tuple[tuple[Any, ...] | None, dict[int, bytes]] = (None, {})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/watch/endpoints", self.watch_endpoints)
        app.router.add_get("/api/v1/watch/catalog", self.watch_catalog)
        app.router.add_post("/api/v1/wake", self.wake)
        app.router.add_post("/api/v1/usage", self.usage)

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
        while after and not self.c.reconciler.settled and loop.time() < deadline:  # noqa: ASYNC110 -- a flag the reconciler sets, polled for a few seconds after a start only
            await asyncio.sleep(SETTLED_POLL)
        r = self.c.reconciler
        self._watchlog.answered(self.c.watch.version, r.endpoints, self.c.live.current.version)
        if after and request.query.get("delta") in ("1", "true"):
            body = self._encoded_delta(after)
            if body is not None:
                return web.Response(body=body, content_type="application/json")
        return self._encoded("endpoints", self._watch_answer)

    async def watch_catalog(self, request: web.Request) -> web.Response:
        await self.c.watch.wait(_after(request), _poll_timeout(request))
        return self._encoded("catalog", lambda: {"version": self.c.watch.version,
                                                 "catalog": self.c.live.current.to_dict()})

    def _watch_answer(self) -> dict[str, Any]:
        reconciler = self.c.reconciler
        return {"version": self.c.watch.version, "catalog": self.c.live.current.to_dict(),
                "endpoints": [e.to_dict() for e in reconciler.endpoints],
                # Models starting or unplaceable (contracts.ModelState), so a router can
                # answer at once; routers older than the field ignore it and wait as before.
                "models": [m.to_dict() for m in reconciler.model_states]}

    def _encoded(self, kind: str, answer: Callable[[], dict[str, Any]]) -> web.Response:
        """A watch answer, encoded once per state and sent to every router asking for it.

        Fifty routers woken by one change asked for the same document fifty
        times, and with tens of thousands of endpoints each encoding holds the
        loop for a while. The key is everything the answer is made of: the watch
        version (bumped on every change), and the catalog, endpoint and model
        state objects themselves, which are replaced, never changed in place.
        """
        r = self.c.reconciler
        key = (self.c.watch.version, self.c.live.current.version, id(r.endpoints), id(r.model_states))
        hit = self._answers.get(kind)
        if hit is None or hit[0] != key:
            hit = self._answers[kind] = (key, json.dumps(answer()).encode())
        return web.Response(body=hit[1], content_type="application/json")

    def _encoded_delta(self, after: int) -> bytes | None:
        """The delta answer from version `after` to now, encoded once per (after, state); None: answer in full.

        A router that asked with `delta=1` holds `after`; what changed since is
        usually a few endpoints, not the 20,000 of a whole list. The catalog
        rides along only when it changed since `after`; model states always
        (a short list, and the router takes it whole).
        """
        r = self.c.reconciler
        catalog = self.c.live.current
        key = (self.c.watch.version, catalog.version, id(r.endpoints), id(r.model_states))
        if self._deltas[0] != key:
            self._deltas = (key, {})
        encoded = self._deltas[1]
        if after not in encoded:
            delta = self._watchlog.delta(after, r.endpoints, catalog.version)
            if delta is None:
                return None         # not remembered for it: a client may send any number, each answered whole
            doc = {"version": self.c.watch.version, "delta": delta.to_dict(),
                   "models": [m.to_dict() for m in r.model_states]}
            if delta.catalog_changed:
                doc["catalog"] = catalog.to_dict()
            # At most one per version the watch log remembers, so bounded by it.
            encoded[after] = json.dumps(doc).encode()
        return encoded[after]

    async def usage(self, request: web.Request) -> web.Response:
        # Bounded and checked by the board (control.usage): a router's claims count only as far as
        # the engines' own readings show traffic, and only for replicas this controller has.
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "usage report: the body must be JSON (llmgwctl.contracts.usage)")
        try:
            self.c.usage.report(body)
        except TooManyRouters as exc:
            return _error(429, f"usage report: {exc}", kind="rate_limit_error")
        except ValueError as exc:       # UsageError, naming the field
            return _error(400, f"usage report: {exc}")
        # The requests it answered since its last report, for the request log and the history
        # (control.requestlog): taken after the usage, so a bad record loses only itself.
        self.c.requests.take_reported(body.get("requests") if isinstance(body, dict) else None)
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
            return _error(404, f"model {model[:100]!r} is not in the catalog", code_name="model_not_found")
        self.c.wake(model)
        return web.json_response({"ok": True}, status=202)
