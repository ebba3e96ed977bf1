"""Following a controller from a router in its own process (`llmgwctl router --controller URL`).

Owns the client side of two control-API calls; the controller implements the
server side from this description.

Watch (long poll)::

    GET {controller}/api/v1/watch/endpoints?after=VERSION&delta=1
    Authorization: Bearer TOKEN          (when the router was given one)

    200 application/json
    {
      "version": 42,                      # integer, grows by at least 1 with every change
      "catalog": {...},                   # Catalog.to_dict() of the catalog in force
      "endpoints": [                      # every ready endpoint: the complete list, not a delta
        {"replica_id": "r-7", "model": "qwen2.5-7b-instruct", "profile": "h100",
         "engine": "vllm", "url": "http://10.0.0.5:8000", "priority": 10,
         "weight": 2.0, "metrics_path": "/metrics"}
      ],
      "models": [                         # models without a ready replica the controller has news of
        {"name": "big-model", "state": "unplaceable",       # or "starting"
         "reason": "profile h100 ...: pool h100: 0 of 4 GPUs free ..., needs 8", "retry": false}
      ]
    }

- `after` is the last version the router applied; the first call sends 0.
- `delta=1`: when the controller still knows the state it
  answered with `after`, it answers with what changed since instead of the
  whole list::

    {"version": 43,
     "delta": {"since": 42,               # always the `after` asked with
               "endpoints": [...],        # added, or changed (same replica_id, other fields)
               "removed": ["r-7"]},       # replica ids no longer listed
     "models": [...],                     # complete, as in a full answer
     "catalog": {...}}                    # only when the catalog changed since `since`

  and with the whole answer above when it does not (too old, a restarted
  controller) or when `after` is 0. A controller older than the parameter
  ignores it and always answers whole; a router that does not send it gets
  whole answers from any controller.
- The controller answers at once when its version is greater than `after`;
  otherwise it holds the request until something changes, and after about
  30 s answers with its current state anyway (same version), so proxies and
  dead peers are noticed.
- Any version other than `after` is news, higher or lower: the router applies
  it. A restarted controller starts counting from its start time in
  milliseconds, so its versions never repeat the one the router last saw.
- A controller still in its settling window (just restarted, adopting what
  agents report) holds the watch of a router that sends `after` > 0 until it
  has settled, so that router keeps its list rather than take a partial one.
- Endpoint fields are those of `Endpoint.to_dict()`; `priority`, `weight` and
  `metrics_path` may be omitted (0, 1.0, "/metrics"). The router applies the
  catalog first, then the endpoints, so a new model's endpoints never arrive
  before the catalog that names it. The catalog is checked as a catalog
  file is, from the document itself (`catalog.load_document`: the same
  schema, rules and limits); one this router cannot load is logged, naming
  the controller, and the catalog in force stays.
- `models` (`llmgwctl.contracts.ModelState`, the complete list) may be absent
  (a controller older than the field): no model is then unplaceable. An
  entry whose state this router does not know is skipped. The router applies
  them after the catalog and before the endpoints.

Wake::

    POST {controller}/api/v1/wake
    {"model": "qwen2.5-7b-instruct"}     # canonical name
    -> 202, body ignored

sent at most once per model per cold period (see `coldstart.ColdStart.demand`).

Usage (every USAGE_INTERVAL seconds), a `llmgwctl.contracts.UsageReport`::

    POST {controller}/api/v1/usage
    {"router": "<id, new per process>", "version": 42,          # the watch version this router has applied
     "replicas": {"r-7": {"idle_seconds": 3.2, "inflight": 1,   # idle_seconds null: never used
                          "inflight_seconds": 812.4, "load": {...}}},
     "requests": [RequestRecord...]}                            # answered since the last report (contracts.requestlog)
    -> 204

the standalone form of the in-process router's `usage_snapshot()`,
`inflight_seconds()`, `adapter_inflight_seconds()` and `load_snapshot()` (see llmgwctl.contracts.usage):
the controller's idle scale-down, drain and autoscaler read it. `version` lets the controller
tell a report sent before this router applied a withdrawal from one after it.

While the controller is unreachable the router keeps serving its last list and
catalog, and reconnects with backoff.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from ..backoff import Backoff
from ..catalog import Catalog, CatalogError
from ..contracts import Endpoint, ModelState, ModelStateError, RequestRecord, RouterSink, UsageReport, UsageSource
from .errors import RouterError

log = logging.getLogger("llmgw.router.watch")

# The controller holds a watch for about 30 s; no answer in 45 s means the
# connection is dead, not that nothing changed.
WATCH_TIMEOUT = 45.0
# Reconnect backoff: first retry within half a second (a controller restart is
# usually that quick), the ceiling doubling to 15 s so a long outage costs one
# request every 7.5 s on average and a recovery is noticed within 15 s. Jittered
# (llmgwctl.backoff): every router lost the controller at the same moment, and
# would otherwise all come back to it in the same one.
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 15.0


class WatchError(RouterError):
    """One watch round failed; the loop backs off and retries."""


def _load_catalog(doc: Any, source: str) -> Catalog:
    # The document as the controller sent it, checked as a file would be; no text to go back to.
    from ..catalog.loader import load_document  # heavy (yaml, jsonschema); only a standalone router needs it
    return load_document(doc, source)


def _model_states(docs: Iterable[Any]) -> list[ModelState]:
    states = []
    for doc in docs:
        try:
            states.append(ModelState.from_dict(doc))
        except ModelStateError as exc:
            # A state a newer controller knows and we don't: that model is
            # treated as having none (a request waits), the rest still apply.
            log.debug("skipping a model state: %s", exc)
    return states


class ControllerWatch:
    """Follows a controller's watch and tells `sink` what it learns (the `RouterSink` the controller tells in-process)."""

    def __init__(self, sink: RouterSink, controller: str, session: aiohttp.ClientSession, *, token: str | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random):
        self._sink = sink
        self._url = controller.rstrip("/") + "/api/v1/watch/endpoints"
        self._catalog_source = f"<catalog from {controller.rstrip('/')}>"
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._sleep = sleep
        self._clock = clock
        self.version = 0
        # The endpoint list as applied with `version`, by replica id: what a delta answer is applied to.
        self._endpoints: dict[str, Endpoint] = {}
        self.deltas = 0             # answers applied as deltas (the rest came whole)
        self.catalog_version: str | None = None     # of the catalog last applied
        self.backoff = Backoff(initial=BACKOFF_FIRST, cap=BACKOFF_MAX, random=rand)
        self.last_contact: float | None = None

    async def poll_once(self) -> bool:
        """One long poll; apply the answer. True if something changed; WatchError if the round failed."""
        try:
            async with self._session.get(self._url, params={"after": str(self.version), "delta": "1"},
                                         headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=WATCH_TIMEOUT)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise WatchError(f"{self._url} answered {resp.status}: {text}")
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise WatchError(f"{self._url}: {exc or type(exc).__name__}") from None
        self.last_contact = self._clock()
        try:
            version = int(doc["version"])
            changed: dict[str, Endpoint | None] | None = None
            if "delta" in doc:
                endpoints, changed = self._apply_delta(doc["delta"])
                catalog_doc = doc.get("catalog")        # only when it changed since the version we hold
            else:
                endpoints = {e.replica_id: e for e in (Endpoint.from_dict(d) for d in doc["endpoints"])}
                catalog_doc = doc["catalog"]
            states = _model_states(doc.get("models") or ())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WatchError(f"{self._url}: malformed watch answer: {exc}") from None
        if version == self.version:
            return False
        if catalog_doc is not None:
            try:
                # Parsing a big catalog is slow work; keep it off the loop the requests run on.
                catalog = await asyncio.to_thread(_load_catalog, catalog_doc, self._catalog_source)
            except CatalogError as exc:
                # The controller only serves validated catalogs, so this is version
                # skew between it and us; keep the catalog we have, take the endpoints.
                log.error("controller sent a catalog this router cannot load; keeping %s:\n%s",
                          self.catalog_version or "none", exc)
            else:
                self._sink.set_catalog(catalog)
                self.catalog_version = catalog.version
        self._sink.set_model_states(states)
        ordered = tuple(sorted(endpoints.values(), key=lambda e: e.replica_id))
        if changed is not None:
            # A delta: what it costs is the change, not the tens of thousands of
            # endpoints a large fleet lists.
            self._sink.change_endpoints(ordered, changed)
        else:
            self._sink.set_endpoints(ordered)
        self._endpoints = endpoints
        self.version = version
        self.deltas += "delta" in doc
        return True

    def _apply_delta(self, delta: Any) -> tuple[dict[str, Endpoint], dict[str, Endpoint | None]]:
        """The list we hold with a delta answer applied (a new dict: ours stays as it was until all
        is applied), and what it changed (id -> its new Endpoint, or None: it left)."""
        if int(delta["since"]) != self.version:
            # Not from the version we hold: a controller bug or a mixed-up proxy.
            # Ask for a whole list next time rather than apply it to the wrong state.
            since, self.version = delta["since"], 0
            raise ValueError(f"a delta since version {since}, but this router holds another; asking for the whole list")
        endpoints = dict(self._endpoints)
        changed: dict[str, Endpoint | None] = {}
        for rid in delta["removed"]:
            if endpoints.pop(str(rid), None) is not None:
                changed[str(rid)] = None
        for d in delta["endpoints"]:
            e = Endpoint.from_dict(d)
            endpoints[e.replica_id] = changed[e.replica_id] = e
        return endpoints, changed

    @property
    def failures(self) -> int:
        """Rounds failed in a row."""
        return self.backoff.failures

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except WatchError as exc:
                delay = self.backoff.failure()
                log.warning("controller watch failed (%d in a row), keeping the last endpoints; retrying in %.1f s: %s",
                            self.failures, delay, exc)
                await self._sleep(delay)
            else:
                if self.failures:
                    log.info("controller watch reconnected after %d failures", self.failures)
                self.backoff.reset()


class ControllerWaker:
    """The `Waker` of a standalone router: tells the controller over HTTP, without waiting for it."""

    def __init__(self, controller: str, session: aiohttp.ClientSession, *, token: str | None = None):
        self._url = controller.rstrip("/") + "/api/v1/wake"
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._tasks: set[asyncio.Task[None]] = set()

    def wake(self, model_name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post(model_name))
        self._tasks.add(task)       # held so it is not collected mid-flight
        task.add_done_callback(self._tasks.discard)

    async def _post(self, model_name: str) -> None:
        try:
            async with self._session.post(self._url, json={"model": model_name}, headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status >= 300:
                    log.warning("controller refused to wake %s: %s %s", model_name, resp.status,
                                (await resp.text())[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Lost wakes are repeated after a cold-start timeout; the waiting
            # requests get a 503 meanwhile, which is the truth.
            log.warning("could not ask the controller to wake %s: %s", model_name, exc)


# Every 2 s: a drain waits for in-flight counts to reach zero, so a stale one
# delays a scale-down by at most this much; one small POST per router per 2 s
# costs the controller nothing.
USAGE_INTERVAL = 2.0


# Requests a router holds for its next usage report: at 500 requests a
# second, two seconds' worth; past it the oldest go (the controller's log is a
# view of the last requests, not their record: the access log is that).
OUTBOX = 1000


class RequestOutbox:
    """A RequestSink that holds the requests this router answered until its next usage report takes them."""

    def __init__(self, capacity: int = OUTBOX):
        self._held: collections.deque[RequestRecord] = collections.deque(maxlen=capacity)

    def record(self, rec: RequestRecord) -> None:
        self._held.append(rec)

    def take(self) -> list[RequestRecord]:
        out = list(self._held)
        self._held.clear()
        return out


class UsageReporter:
    """Sends this router's usage to the controller: last use and in-flight count per replica, and
    (with an outbox) the requests it answered since the last report, for the request log and history.
    A report that does not arrive loses its requests: the controller's log shows a gap, never a double."""

    def __init__(self, source: UsageSource, watch: ControllerWatch, controller: str, session: aiohttp.ClientSession,
                 *, token: str | None = None, interval: float = USAGE_INTERVAL,
                 clock: Callable[[], float] = time.monotonic, outbox: RequestOutbox | None = None):
        self._source, self._watch = source, watch
        self.outbox = outbox
        self._url = controller.rstrip("/") + "/api/v1/usage"
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.interval = interval
        self._clock = clock
        self.router_id = uuid.uuid4().hex[:12]

    def payload(self) -> dict[str, Any]:
        # The engine gauges and the in-flight counters ride along (the
        # controller's autoscaler reads them); a source without them (a test's
        # dict) reports usage alone.
        loads = getattr(self._source, "load_snapshot", None)
        busy = getattr(self._source, "inflight_seconds", None)
        adapters = getattr(self._source, "adapter_inflight_seconds", None)
        report = UsageReport.of(self.router_id, self._watch.version, self._source.usage_snapshot(), self._clock(),
                                loads() if loads is not None else None, busy() if busy is not None else None,
                                adapters() if adapters is not None else None)
        doc = report.to_dict()
        if self.outbox is not None:
            # A controller from before the request log ignores the key.
            doc["requests"] = [r.to_dict() for r in self.outbox.take()]
        return doc

    async def report_once(self) -> bool:
        try:
            async with self._session.post(self._url, json=self.payload(), headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False    # the watch loop reports the controller being away; usage just resumes

    async def run(self) -> None:
        while True:
            await self.report_once()
            await asyncio.sleep(self.interval)
