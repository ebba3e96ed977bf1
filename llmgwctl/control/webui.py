"""The web console: a read-only page over the control API, and the status stream it follows.

    GET /                       302 to ui/
    GET /ui/, /ui/{file}        the page: plain HTML, CSS and JS shipped in the package (control/console/),
                                no build step, nothing from another origin
    GET /api/v1/watch/status    Server-Sent Events: `event: status` with the status JSON, sent when
                                what status shows changes, at most STATUS_MAX_RATE a second
    GET /api/v1/watch/console   what the page follows: `event: summary` with the status' summary
                                (control.summary: bounded at any fleet size), on the same terms,
                                and `event: history` with the traffic history's new points
                                (control.history; the first event the last hour; the first
                                CHART_MODELS models by name), past HISTORY_PART in parts:
                                `event: history-part` with more models' series for the times it names

The page's files hold no data, so they are served without a token (the page
must load to ask for one); everything it shows comes from the API with the
same bearer token as `llmgwctl status`. The page keeps the token in
sessionStorage (this tab only, gone when it closes) and sends it as an
`Authorization` header from `fetch` -- the stream too, read with `fetch`
rather than `EventSource`, which cannot send headers. No cookie: a cookie
rides along on any request another site makes the browser send, and this
API can rewrite the catalog; a header only our own script sets cannot be
forged that way (no CSRF), and the Content-Security-Policy below keeps any
script but ours from running on the page to read it.

The page calls the API from the origin it was served from, so the API's
browser checks (`llmgwctl.httporigin`: Origin, Sec-Fetch-Site, Host) let it
through as the API's own; a page of another origin, or one reached by a
name pointed here (DNS rebinding), is refused before the token is looked at.
A link to the page from another site opens it (a navigation), and its calls
then come from this origin like any other.

It must not know what status contains: the status says what only ages (`StatusView.unaged`).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from .broadcast import Broadcast

CONSOLE_DIR = Path(__file__).with_name("console")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
# Only our own files run and load; no inline script, no framing (clickjacking),
# no base-URI tricks. connect-src 'self' is the API the page reads.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # A new release's page is picked up at once; the files are a few KB.
    "Cache-Control": "no-cache",
}
# Two updates a second at most: a fleet whose agents report every few seconds
# changes status many times a second, and a person reads no faster.
STATUS_MAX_RATE = 2.0
# Without a signalled change, status is still compared this often (what no
# event announces, such as a node turning unreachable by time), and sent this
# often anyway, so ages on the page are re-based and proxies see traffic.
STATUS_RECHECK, STATUS_REFRESH = 5.0, 15.0
# The console's summary costs the controller at most 1/SUMMARY_BUDGET of a
# core: the next is built no sooner than this many times the last one took.
# A small fleet's summary takes a millisecond (two a second, as ever); at
# 20,000 replicas reading the status is tens of milliseconds, and a rollout
# bumps the status many times a second, so it is the bound that holds there.
# One summary serves every open page: built and encoded once per status change.
SUMMARY_BUDGET = 20.0
# Models whose history the stream carries (the first by name; the page charts as many): a point of
# each is ~50 bytes, the last hour of one ~40 KB. The rest: /api/v1/history?model=.
CHART_MODELS = 24
# The first history event, the last hour of CHART_MODELS models, is ~1 MB: past this size it is sent as
# the times and the fleet's series (`history`), then the models' series a few at a time
# (`history-part`, each with the times it is for), so no one update is larger than about this.
HISTORY_PART = 64_000
_compact = json.JSONEncoder(separators=(",", ":")).encode


class StatusView(Protocol):
    """What the stream reads from a status: its JSON, and a value that stays equal while only ages move.

    So the stream need not know which fields age (contracts.status says, in
    `unaged`), nor build and compare the whole document as a dict: at 20,000
    replicas that held the loop for most of a second per look, twice a second per open page.
    """

    def to_json(self) -> bytes: ...

    def unaged(self) -> Any: ...


class SummaryView(Protocol):
    """A summary of the status (control.summary): its JSON, and a key equal while only ages move."""

    key: Any

    def to_json(self) -> bytes: ...


class HistoryView(Protocol):
    """The traffic history (control.history): a version bumped per point, and its points after a time."""

    version: int

    def to_dict(self, model: str | None = None, since: float | None = None, first: int | None = None) -> dict[str, Any]: ...


def _files() -> dict[str, tuple[bytes, str]]:
    out = {}
    for path in sorted(CONSOLE_DIR.iterdir()):
        if path.suffix in TYPES and path.is_file():
            out[path.name] = (path.read_bytes(), TYPES[path.suffix])
    # The charting library and its licence, shipped beside the page (console/vendor/).
    vendor = CONSOLE_DIR / "vendor"
    if vendor.is_dir():
        for path in sorted(vendor.iterdir()):
            if path.suffix in TYPES and path.is_file():
                out["vendor/" + path.name] = (path.read_bytes(), TYPES[path.suffix])
    return out


def history_events(doc: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The history's answer as (event, data): one `history` event, or, past HISTORY_PART, the times and the
    fleet's series in it and the models' series in `history-part` events of about HISTORY_PART each."""
    whole = _compact(doc).encode()
    if len(whole) <= HISTORY_PART:
        return [(b"history", whole)]
    out = [(b"history", _compact({**doc, "models": {}}).encode())]
    times = len(_compact(doc["t"]))
    part: dict[str, Any] = {}
    size = times
    for name, series in doc["models"].items():
        one = len(_compact(series)) + len(name) + 4
        if part and size + one > HISTORY_PART:
            out.append((b"history-part", _compact({"t": doc["t"], "models": part}).encode()))
            part, size = {}, times
        part[name] = series
        size += one
    if part:
        out.append((b"history-part", _compact({"t": doc["t"], "models": part}).encode()))
    return out


class Console:
    def __init__(self, status: Callable[[], StatusView], changed: Broadcast,
                 summary: Callable[[], SummaryView] | None = None, history: HistoryView | None = None):
        self.status = status
        self.changed = changed
        self.summary = summary
        self.history = history
        self._summary: tuple[int, float, SummaryView] | None = None     # (status version, when built, it)
        self.summary_cost = 0.0     # seconds the last summary took to build
        self.files = _files()
        self.streams = 0        # status streams open now (for tests and a curious operator)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self.root)
        app.router.add_get("/ui", self.root)
        app.router.add_get("/ui/", self.file)
        app.router.add_get("/ui/{name}", self.file)
        app.router.add_get("/ui/vendor/{vname}", self.file)
        app.router.add_get("/api/v1/watch/status", self.watch_status)
        if self.summary is not None:
            app.router.add_get("/api/v1/watch/console", self.watch_console)

    async def root(self, request: web.Request) -> web.Response:
        # Relative, so a console behind a proxy under a path prefix still lands on its own page.
        # (From /ui, "ui/" resolves to /ui/ as well.)
        raise web.HTTPFound("ui/")

    async def file(self, request: web.Request) -> web.Response:
        vname = request.match_info.get("vname")
        name = ("vendor/" + vname) if vname else (request.match_info.get("name") or "index.html")
        found = self.files.get(name)
        if found is None:
            raise web.HTTPNotFound(text=f"no console file {name[:100]!r}")
        body, kind = found
        return web.Response(body=body, headers={"Content-Type": kind, **HEADERS})

    async def _stream(self, request: web.Request,
                      events: Callable[[web.StreamResponse], Awaitable[None]]) -> web.StreamResponse:
        """An event stream to the page that `events` writes, counted in `streams` while open; the page going
        away ends it quietly."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           # nginx would buffer the stream otherwise
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        self.streams += 1
        try:
            await events(resp)
        except (ConnectionResetError, ConnectionError):
            pass        # the page went away
        finally:
            self.streams -= 1
        return resp

    async def watch_status(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, self._status_events)

    async def _status_events(self, resp: web.StreamResponse) -> None:
        loop = asyncio.get_running_loop()
        last, sent_at, version, n = None, 0.0, None, 0
        while True:
            status = self.status()
            key = status.unaged()
            now = loop.time()
            if key != last or now - sent_at >= STATUS_REFRESH:
                n += 1
                # One line of compact JSON: no newline can end the event early.
                await resp.write(b"id: %d\nevent: status\ndata: %s\n\n" % (n, status.to_json()))
                last, sent_at = key, now
            await asyncio.sleep(1.0 / STATUS_MAX_RATE)
            version = await self.changed.wait(version, STATUS_RECHECK)

    def shared_summary(self, now: float) -> SummaryView:
        """The summary of the status as it is, built once for every page that asks at one version."""
        assert self.summary is not None
        hit = self._summary
        version = self.changed.version
        if hit is not None and hit[0] == version and now - hit[1] < 1.0 / STATUS_MAX_RATE:
            return hit[2]
        started = time.perf_counter()
        summary = self.summary()
        self.summary_cost = time.perf_counter() - started
        self._summary = (version, now, summary)
        return summary

    async def watch_console(self, request: web.Request) -> web.StreamResponse:
        """The page's one stream: the summary when it changed (as `watch_status` sends the status), and the
        history's new points as they are sampled -- each event bounded at any fleet size."""
        assert self.summary is not None
        return await self._stream(request, self._console_events)

    async def _console_events(self, resp: web.StreamResponse) -> None:
        loop = asyncio.get_running_loop()
        last, sent_at, version, n = None, 0.0, None, 0
        history, seen, since = self.history, -1, None
        while True:
            summary = self.shared_summary(loop.time())
            now = loop.time()
            if summary.key != last or now - sent_at >= STATUS_REFRESH:
                n += 1
                await resp.write(b"id: %d\nevent: summary\ndata: %s\n\n" % (n, summary.to_json()))
                last, sent_at = summary.key, now
            if history is not None and history.version != seen:
                seen = history.version
                doc = history.to_dict(since=since, first=CHART_MODELS)
                if doc["t"]:
                    since = doc["t"][-1]
                    for event, data in history_events(doc):
                        n += 1
                        await resp.write(b"id: %d\nevent: %s\ndata: %s\n\n" % (n, event, data))
            await asyncio.sleep(max(1.0 / STATUS_MAX_RATE, SUMMARY_BUDGET * self.summary_cost))
            version = await self.changed.wait(version, STATUS_RECHECK)
