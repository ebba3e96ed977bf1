"""The catalog over the control API: read it, and apply a file to it.

    GET  /api/v1/catalog                   {"version", "directory", "catalog": Catalog.to_dict()}
    POST /api/v1/catalog[?dry_run=1]       {"filename": "x.yaml", "content": "<yaml>"} -> plan; 422 with
                                           {"errors": ["file:line:col: path: message", ...]} when invalid

An apply is validated, planned, written atomically and waited for in force,
one at a time (`apply.ApplyQueue`): it ends as a file in the catalog
directory that the watcher swaps in, like every other change.
"""
from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

from ..catalog import CatalogError
from .answers import error as _error
from .answers import retry_later as _retry_later
from .apply import ApplyError, ApplyQueue, decode_content, filename_problem, plan, validate_with, write_atomically
from .controller import Controller

log = logging.getLogger("llmgw.control")

# An apply answers once its catalog is in force, so `catalog apply` returning
# means it is live; past this the answer says it was written but not yet seen.
APPLY_WAIT = 10.0
# An apply waits this long for the ones before it (each validation of a large
# directory is seconds, then up to APPLY_WAIT for its catalog in force), then
# gets 503: well inside the CLI's own timeout, so the operator is told why.
APPLY_QUEUE_WAIT = 60.0
# Applies held at once, the one validating included; more get 429 before
# their body is read. Each holds its body (up to MAX_APPLY_BYTES) while it
# waits: eight bound that memory, and are more than a person or a CI job
# applying a few files side by side sends at once.
APPLY_QUEUE = 8


class CatalogService:
    """The catalog routes, and the queue applies wait in."""

    def __init__(self, controller: Controller):
        self.c = controller
        # Catalog applies, one validated at a time (see apply).
        self._applies = ApplyQueue(APPLY_QUEUE)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/catalog", self.get_catalog)
        app.router.add_post("/api/v1/catalog", self.apply)

    async def get_catalog(self, request: web.Request) -> web.Response:
        catalog = self.c.live.current
        return web.json_response({"version": catalog.version, "directory": self.c.watcher.directory,
                                  "catalog": catalog.to_dict()})

    async def apply(self, request: web.Request) -> web.Response:
        # Refused before the body is read: a client that keeps sending applies
        # faster than they are validated holds no more bodies than the queue.
        if self._applies.full():
            return _retry_later(429, f"{self._applies.held} catalog applies are already being validated or waiting; "
                                     "nothing was written, retry when they are done", "rate_limit_error")
        with self._applies.held_one():
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                return _error(400, "body must be JSON: {\"filename\": \"x.yaml\", \"content\": \"...\"}")
            if not isinstance(body, dict) or "filename" not in body or not isinstance(body.get("content"), str):
                return _error(400, "body must be {\"filename\": \"x.yaml\", \"content\": \"<yaml text>\"}")
            wrong = filename_problem(body["filename"])
            if wrong is not None:
                return _error(400, wrong + "; nothing was written")
            try:
                content = decode_content(body["content"])
            except ApplyError as exc:
                return _error(400, str(exc))
            dry_run = request.query.get("dry_run", "").lower() in ("1", "true", "yes")
            try:
                async with self._applies.turn(APPLY_QUEUE_WAIT):
                    return await self._apply(body["filename"], content, dry_run)
            except asyncio.TimeoutError:
                return _retry_later(503, f"other catalog applies held the validation for {APPLY_QUEUE_WAIT:.0f} s; "
                                         "nothing was written, retry", "unavailable_error")

    async def _apply(self, filename: str, content: bytes, dry_run: bool) -> web.Response:
        """Validate, plan, write and wait for it in force: one apply at a time (see ApplyQueue).

        Read here, under the turn, so a second apply is validated with the
        first's file in the directory and planned against the catalog the
        first put in force.
        """
        directory = self.c.watcher.directory
        current = self.c.live.current
        try:
            new = await asyncio.to_thread(validate_with, directory, filename, content)
        except ApplyError as exc:
            return _error(400, str(exc))
        except CatalogError as exc:
            errors = [str(p) for p in exc.problems]
            return _error(422, f"catalog is invalid ({len(errors)} problem{'s' if len(errors) != 1 else ''}); nothing was written",
                          errors=errors)
        try:
            preview = self.c.reconciler.preview(new)
        except Exception as exc:
            log.exception("planning catalog apply of %s failed unexpectedly", filename)
            return _error(500, f"the catalog is valid, but planning what it changes failed "
                               f"({type(exc).__name__}: {str(exc)[:200]}); nothing was written. This is a bug in "
                               "llmgw; the server log has the traceback", kind="server_error")
        result = plan(current, new, preview)
        result["dry_run"] = dry_run
        del new, preview        # a large catalog's objects are not held through the write and the wait
        if dry_run:
            return web.json_response(result)
        path = await asyncio.to_thread(write_atomically, directory, filename, content)
        result["written"] = path
        self.c.reconciler.event("catalog-applied", f"{os.path.basename(path)} written by catalog apply")
        result["in_force"] = await self._until_in_force(result["to_version"])
        if not result["in_force"]:
            result["why_not_in_force"] = self.c.watcher.why_not_in_force()
        return web.json_response(result)

    async def _until_in_force(self, version: str) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + APPLY_WAIT
        while self.c.live.current.version != version:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True
