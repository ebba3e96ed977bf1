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
    GET  /, /ui/, /api/v1/watch/status     the web console and the status stream it follows (`webui`)

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
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import json
import logging
import math
import os
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web

from ..catalog import CatalogError
from ..httporigin import BrowserGuard
from ..httpserver import error_document
from ..contracts import UNBOUNDED, AgentReport, NodeClaims, ReportError
from ..inventory import ConflictError
from ..observability.metrics import CONTENT_TYPE_LATEST, ControlMetrics
from ..reconciler import LONG_POLL
from ..router.conventions import stamp_request_id
from . import schemas
from .apply import ApplyError, ApplyQueue, decode_content, filename_problem, plan, validate_with, write_atomically
from .auth import ControlAuth
from .controller import Controller
from .usage import TooManyRouters
from .logs import FIRST_ANSWER, FOLLOW_SILENCE, LogRelayError
from .reportlimit import ReportLimiter, retry_after
from .watchlog import WatchLog
from .webui import Console

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
# An apply waits this long for the ones before it (each validation of a large
# directory is seconds, then up to APPLY_WAIT for its catalog in force), then
# gets 503: well inside the CLI's own timeout, so the operator is told why.
APPLY_QUEUE_WAIT = 60.0
# Applies held at once, the one validating included; more get 429 before
# their body is read. Each holds its body (up to MAX_APPLY_BYTES) while it
# waits: eight bound that memory, and are more than a person or a CI job
# applying a few files side by side sends at once.
APPLY_QUEUE = 8
# What a 429 or 503 of apply tells the client to wait: about one validation.
APPLY_RETRY_AFTER = 5
# Lines of log `llmgwctl logs` shows without --tail: a screenful and then some,
# as `kubectl logs --tail` users pick; the agent's crash report keeps 20.
DEFAULT_TAIL = 100


_OK = json.dumps({"ok": True}).encode()


def _error(status: int, message: str, kind: str = "invalid_request_error", **extra) -> web.Response:
    return web.json_response({**error_document(message, kind, status), **extra}, status=status)


def _retry_later(status: int, message: str, kind: str) -> web.Response:
    resp = _error(status, message, kind)
    resp.headers["Retry-After"] = str(APPLY_RETRY_AFTER)
    return resp
# A request body must be in within this once its headers are: the largest
# the API takes (MAX_APPLY_BYTES) arrives in 30 s at 140 KB/s, slower than
# any link an operator applies a catalog over, and an agent gives up on a
# report after 10 s (agent.controller.REPORT_TIMEOUT), so a report slower
# than this has nobody waiting for its answer. A client trickling a body is
# holding a connection and a handler, not sending a request.
BODY_TIMEOUT = 30.0
# What changes something. Each such route takes a JSON document, and asking
# for `Content-Type: application/json` is what makes a browser ask first (a
# CORS preflight) before another site's page can send one: text/plain,
# form and multipart bodies are sent without asking.
_UNSAFE = frozenset(("POST", "PUT", "PATCH", "DELETE"))


@web.middleware
async def _unexpected(request: web.Request, handler):
    # The last resort: an exception no handler expected (a bug) is logged with
    # its traceback and answered in the API's JSON error shape, not aiohttp's
    # bare-text 500, so a client (and `llmgwctl`) can show why. aiohttp's own
    # refusals raised on the way (no such route, a method the route does not
    # take, a body past the size limit) are answered in that shape too.
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return _http_error(request, exc)
    except Exception as exc:  # noqa: BLE001 -- answered, and logged with the traceback
        log.exception("%s %s failed unexpectedly", request.method, request.path)
        return _error(500, f"{request.method} {request.path} failed unexpectedly ({type(exc).__name__}); "
                           "this is a bug in llmgw, the server log has the traceback", kind="server_error")


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """An aiohttp HTTPException (404, 405, 413, ...) as the API's JSON error, its Allow header kept."""
    path = request.path[:100]
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = _error(405, f"{request.method} is not allowed on {path}; it takes {allowed}")
        resp.headers["Allow"] = exc.headers.get("Allow", allowed)
        return resp
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return _error(413, f"the request body is larger than the control API takes ({MAX_APPLY_BYTES} bytes)")
    text = exc.text or ""
    if not text or text.startswith(f"{exc.status}: "):
        # aiohttp's own "404: Not Found": say which route was missed instead.
        text = (f"no route {request.method} {path} on the control API (its routes are under /api/v1/; "
                "llmgwctl-serve(1) lists them)" if exc.status == 404 else exc.reason)
    return _error(exc.status, text, kind="not_found_error" if exc.status == 404 else "invalid_request_error")


@web.middleware
async def _bodies(request: web.Request, handler):
    # One place for every handler that reads a body.
    # - A state-changing route takes `Content-Type: application/json` only
    #   (see _UNSAFE); every client of the API (the CLI, agents, routers)
    #   sends that already. A route that does not exist is its own 404/405.
    # - aiohttp does not decompress bodies on llmgw's servers (an inflating
    #   body grew past every limit, see httpserver.server_options), and no
    #   client of this API compresses one, so an encoded body is refused
    #   before any handler reads it rather than parsed as bytes it is not.
    # - The body is read here, within BODY_TIMEOUT; handlers then read it
    #   from memory (aiohttp keeps what read() returned). Only a body still
    #   arriving waits: the usual request is whole when its handler starts.
    # - A body whose framing is broken (bad chunks, short of its
    #   Content-Length) fails while being read; it is the client's error,
    #   which aiohttp would answer 500. So is a body nested deeper than the
    #   JSON parser recurses ([[[[... 100,000 deep): json.loads raises
    #   RecursionError, which is no ValueError, and every handler's 400 for
    #   a body that is not JSON missed it (a 500 "bug").
    if request.method in _UNSAFE and request.match_info.http_exception is None \
            and request.content_type != "application/json":
        sent = request.headers.get("Content-Type")
        return _error(415, f"{request.method} {request.path[:100]} takes a JSON document sent with "
                           f"Content-Type: application/json, not {'no Content-Type' if sent is None else repr(sent[:100])}")
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return _error(415, "the control API takes request bodies uncompressed (no Content-Encoding)")
    length = request.content_length
    if length is not None and length > MAX_APPLY_BYTES:
        # Said before it is sent: nothing of it is read (aiohttp would read up to the limit first).
        resp = _error(413, f"the request body is larger than the control API takes ({MAX_APPLY_BYTES} bytes)")
        resp.force_close()
        return resp
    try:
        if request.body_exists and not request.content.is_eof():
            try:
                await asyncio.wait_for(request.read(), BODY_TIMEOUT)
            except asyncio.TimeoutError:
                log.info("%s %s from %s: the body did not arrive within %g s; closing the connection",
                         request.method, request.path, request.remote, BODY_TIMEOUT,
                         extra={"event": "body-timeout"})
                resp = _error(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s",
                              kind="timeout_error")
                resp.force_close()      # what is left of the body is not read: the connection cannot carry another
                return resp
        return await handler(request)
    except web.RequestPayloadError:
        return _error(400, "the request body is not framed as its headers say (chunked encoding or Content-Length)")
    except RecursionError:
        return _error(400, "the request body nests too deeply to be read as JSON")


def _after(request: web.Request) -> int | None:
    raw = request.query.get("after")
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps(error_document(f"after must be an integer, got {raw!r}",
                                                                "invalid_request_error", 400)),
                                 content_type="application/json") from None


def _poll_timeout(request: web.Request) -> float:
    # Tests and impatient clients may ask for a shorter hold; never a longer one.
    try:
        return max(0.0, min(LONG_POLL, float(request.query.get("timeout", LONG_POLL))))
    except ValueError:
        return LONG_POLL


# Replica URLs checked once each, not in every report: a changed report
# carries every replica of its node again, and a rollout at 5,000 nodes is
# thousands of changed reports on the loop. Only ready replicas
# have a URL: 20,000 at that size, and a rollout's new ones beside them.
URL_CHECKS = 65536


@functools.lru_cache(maxsize=URL_CHECKS)
def _host(value: str) -> str:
    host = value.strip().strip("[]").lower()
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.rstrip(".")


# Where a cloud machine's instance metadata (and its credentials) is served:
# no replica URL may point there, whoever advertises it -- the router would
# send clients' requests, and return the answers, to it. Link-local addresses
# (169.254.0.0/16, fe80::/10) hold every provider's metadata service; these
# are the names some of them also answer to.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data",
                            "instance-data.ec2.internal", "metadata.azure.internal"})


def forbidden_host(host: str) -> str | None:
    """Why no replica may be served from `host` (already `_host`-normalized), or None."""
    if host in METADATA_HOSTS:
        return "a cloud metadata service's name"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local:
        return "link-local, where cloud metadata services answer"
    if ip.is_unspecified or ip.is_multicast:
        return "not a host's address"
    return None


def replica_url_problem(body: Any, remote: str | None, claims: NodeClaims = UNBOUNDED) -> str | None:
    """Why a report's replica URLs cannot be trusted, naming the field; None when every one is fine.

    Each must be http(s) on the address the report came from, and on the
    port it reports: a node may offer traffic to its own engines only, never
    point the router at another machine (a cloud's metadata service least of
    all: `forbidden_host`, refused whoever asks). The node's `advertise_host`
    is used instead only when its token allows exactly that host
    (`claims.advertise_host`; the operator's own credentials allow any):
    a node cannot vouch for an address by naming it in the same report.
    (Run after the schema check.)
    """
    if not isinstance(body, Mapping) or not isinstance(body.get("replicas"), list):
        return None
    advertised = body.get("advertise_host") or ""
    allowed = claims.advertise_host
    honoured = bool(advertised) and isinstance(advertised, str) and (
        allowed is None or (bool(allowed) and _host(advertised) == _host(allowed)))
    if honoured:
        expected = _host(advertised)
        where = f"the node's advertise_host {advertised!r}"
    else:
        expected = _host(remote or "")
        where = f"the address the report came from ({remote})"
        if advertised:
            where += (f"; its advertise_host {str(advertised)[:100]!r} is not honoured, since its token does not allow "
                      "that host (llmgwctl token node NAME --advertise-host HOST)")
    bad_host = forbidden_host(expected)
    if bad_host and any(isinstance(rep, Mapping) and rep.get("url") is not None for rep in body["replicas"]):
        return f"replicas: {where} is {bad_host}; no replica may be served from there"
    for i, rep in enumerate(body["replicas"]):
        if not isinstance(rep, Mapping) or rep.get("url") is None:
            continue
        field = f"replicas[{i}].url"
        url, reported = rep["url"], rep.get("port")
        hashable = isinstance(url, str) and (reported is None or type(reported) is int)
        wrong = _url_wrong(url, reported, expected) if hashable else _url_wrong.__wrapped__(url, reported, expected)
        if wrong == "shape":
            return f"{field}: {str(url)[:100]!r} is not an http://host:port URL"
        if wrong == "host":
            return f"{field}: {url[:100]!r} is not on {where}; a node's replicas must be served from the node"
        if wrong == "port":
            return f"{field}: {url[:100]!r} is not on the replica's reported port {reported}"
    return None


@functools.lru_cache(maxsize=URL_CHECKS)
def _url_wrong(url: Any, reported: Any, expected: str) -> str | None:
    """What is wrong with one replica URL: "shape", "host" (not `expected`), "port" (not `reported`); None: fine."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError):
        return "shape"
    # Nothing but scheme, host and port: user info, a path or a query could
    # be read differently by the router's own URL handling than here.
    if (parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        return "shape"
    if _host(parts.hostname) != expected:
        return "host"
    if reported is not None and port != reported:
        return "port"
    return None


# Reports larger than this are parsed and checked in a worker thread: a node's
# usual report (8 GPUs, a few replicas) is a few KB and parsed faster than the
# thread hop; one of hundreds of replicas takes milliseconds of the loop.
OFF_LOOP_BYTES = 64 * 1024
# The most of one schema problem a 400 says: the path and the bound, and a
# glimpse of the value.
MAX_PROBLEM = 300


def _checked_report(raw: bytes, node: str, remote: str | None, claims: NodeClaims) -> AgentReport | str:
    """A report's bytes parsed and checked (JSON, finite numbers, schema, URLs, contract); else why not (the 400)."""
    odd: list[str] = []

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            odd.append(text)
        return value

    def constant(name: str) -> float:
        odd.append(name)
        return float("nan")

    try:
        body = json.loads(raw, parse_float=number, parse_constant=constant)
    except (ValueError, UnicodeDecodeError):
        return "report must be a JSON object"
    if odd:
        return (f"{_non_finite_path(body)}: {odd[0][:40]} is not a finite number (a JSON number past a float's range "
                "reads as infinity, and NaN and Infinity are not JSON)")
    wrong = schemas.problems("agent-report", body)
    if wrong:
        # Each cut: a bound's message quotes the value, and a list 10,000 long is megabytes of it.
        return "report does not follow schemas/api/agent-report.schema.json: " + "; ".join(
            p if len(p) <= MAX_PROBLEM else p[:MAX_PROBLEM] + "..." for p in wrong)
    wrong_url = replica_url_problem(body, remote, claims)
    if wrong_url:
        return wrong_url
    try:
        return AgentReport.from_dict(body, node=node)
    except ReportError as exc:
        return str(exc)


def _non_finite_path(doc: Any) -> str:
    """Where in `doc` the first non-finite number is, as `a.b[2].c` (the report's field for the 400)."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "report"
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return "report"


class ControlAPI:
    def __init__(self, controller: Controller, *, auth: ControlAuth | None = None,
                 metrics: ControlMetrics | None = None, limiter: ReportLimiter | None = None):
        self.c = controller
        self.auth = auth or ControlAuth()
        # Changed reports per node (reportlimit); heartbeats are never counted.
        self.limiter = limiter or ReportLimiter()
        self.metrics = metrics or ControlMetrics(controller.state)
        # Encoded answers, kept while what they say holds (see _encoded, desired).
        self._answers: dict[str, tuple[tuple, bytes]] = {}
        # What each watch version answered, and the deltas encoded from it for the current state (watch_endpoints).
        self._watchlog = WatchLog()
        self._deltas: tuple[tuple | None, dict[int, bytes]] = (None, {})
        self._desired: dict[str, tuple[int, bytes]] = {}
        # Per node, the digest of its last accepted report and where it came from (see report).
        self._reports: dict[str, tuple[bytes, str | None]] = {}
        # Catalog applies, one validated at a time (see apply).
        self._applies = ApplyQueue(APPLY_QUEUE)

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
                                           _unexpected, _bodies])
        # Every answer carries a request id, as the router's do: the one to quote in a report.
        app.on_response_prepare.append(stamp_request_id)
        browsers.install(app)
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
        app.router.add_get("/api/v1/replicas/{replica}/logs", self.replica_logs)
        app.router.add_post("/api/v1/agents/{node}/logs/{stream}", self.agent_logs)
        Console(self.c.state, self.c.status_changed).add_routes(app)
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
            return _error(404, f"no model {str(model)[:100]!r} in the catalog in force", kind="not_found_error")
        return web.Response(body=body, content_type="application/json")

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
        except Exception as exc:  # noqa: BLE001 -- a bug in planning answers with why, and writes nothing
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

    async def _desired_or_logs(self, node: str, after: int | None, timeout: float):
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

        def heard_asked(task: asyncio.Future) -> None:
            if held and not task.cancelled():
                desired.wake(node)

        heard = asyncio.ensure_future(asked.wait())
        heard.add_done_callback(heard_asked)
        try:
            return await desired.wait(node, after, timeout)
        finally:
            held = False
            heard.cancel()

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

    def _watch_answer(self) -> dict:
        reconciler = self.c.reconciler
        return {"version": self.c.watch.version, "catalog": self.c.live.current.to_dict(),
                "endpoints": [e.to_dict() for e in reconciler.endpoints],
                # Models starting or unplaceable (contracts.ModelState), so a router can
                # answer at once; routers older than the field ignore it and wait as before.
                "models": [m.to_dict() for m in reconciler.model_states]}

    def _encoded(self, kind: str, answer: Callable[[], dict]) -> web.Response:
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
