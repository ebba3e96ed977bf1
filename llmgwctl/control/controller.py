"""`Controller`: wires catalog, watcher, inventory, reconciler and (optionally) an in-process router.

It only connects pieces; each decision lives in the piece that owns it. The
order of a catalog swap is spelled out here because it crosses pieces: the
router gets the new catalog first (so a new model's name resolves before its
endpoints arrive), then the reconciler is woken to move replicas.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..aio import Flag, cancel_and_wait, sleep_unless
from ..catalog import Catalog, Live
from ..catalog.watcher import CatalogWatcher, Outcome
from ..contracts import UNBOUNDED, AgentReport, CatalogStatus, ControlStatus, NodeClaims, WatcherStatus
from ..inventory import ConflictError, Inventory
from ..reconciler import DesiredStore, Reconciler
from ..reconciler import run as run_reconciler
from .broadcast import Broadcast
from .history import History, ModelSample
from .logs import LogRelay
from .requestlog import RequestLog
from .usage import UsageBoard

log = logging.getLogger("llmgw.control")


class Controller:
    def __init__(self, catalogs_dir: str, *, router: Any = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, node_timeout: float | None = None,
                 **reconciler_options: Any):
        self.live = Live()
        self.watcher = CatalogWatcher(catalogs_dir, self.live, wall_clock=wall_clock)
        self.inventory = Inventory(clock=clock, **({"unreachable_after": node_timeout} if node_timeout else {}))
        self.desired = DesiredStore()
        # Flags, not Events: the pass they wake starts one step of the loop after
        # the set, not three, which matters when a rollout's reports crowd the loop (aio.Flag).
        self.wake_event = Flag()
        # Set with wake_event for a pass that should not wait out the spacing of
        # woken passes: a catalog swap, a request waiting for a model (reconciler.WOKEN_SHARE).
        self.urgent_event = Flag()
        # The watch stream standalone routers follow: one version for "catalog or
        # endpoints changed", so a router applies both in the right order.
        self.watch = Broadcast()
        # What the console's status stream waits on: bumped on anything that
        # changes what status shows (a report, a swap, a rejection, a replica
        # moving), so the page updates without polling.
        self.status_changed = Broadcast()
        # Engine logs asked of agents for `llmgwctl logs` (see control.logs).
        self.logs = LogRelay()
        self.router = router
        # The last requests the routers answered, and traffic over time built
        # from them and from the fleet's status (the console's charts): both in
        # memory, bounded (control.requestlog, control.history).
        self.requests = RequestLog()
        self.history = History()
        self.requests.listeners.append(self.history.observe)
        if router is not None:
            router.set_request_sink(self.requests)
        self._wall_clock = wall_clock
        # Files followed beside the catalog (the router's API key file): each
        # a `status()` with a WatcherStatus's fields, shown in status' `watchers`.
        self.followed: list[Callable[[], dict[str, Any]]] = []
        self._loaded = False
        # Usage from the in-process router and from standalone routers' reports, which may speak
        # only of replicas the reconciler has (a record, draining ones included).
        self.usage = UsageBoard(router, version=lambda: self.watch.version, clock=clock,
                                known=lambda rid: rid in self.reconciler.replicas,
                                known_adapter=self._is_adapter)
        self.reconciler = Reconciler(self.live, self.inventory, self.desired, endpoints=router, usage=self.usage,
                                     load=self.usage, concurrency=self.usage, adapter_load=self.usage,
                                     clock=clock, wall_clock=wall_clock, on_change=self._fleet_changed,
                                     **reconciler_options)
        self.live.subscribe(self._swapped)

    def _is_adapter(self, name: str) -> bool:
        """Whether `name` is an adapter's own name in the catalog in force (not an alias: routers count by name)."""
        ref = self.live.current.adapter(name)
        return ref is not None and ref.adapter.name == name

    def _fleet_changed(self) -> None:
        self.watch.bump()
        self.status_changed.bump()

    def _swapped(self, old: Catalog, new: Catalog) -> None:
        if self.router is not None:
            self.router.set_catalog(new)     # first: names resolve before endpoints or replicas move
        self.watch.bump()
        self.status_changed.bump()
        if self._loaded:
            self.reconciler.event("catalog-swapped", f"{old.version} -> {new.version}")
        else:
            self.reconciler.event("catalog-loaded", f"{new.version}: {len(new)} models from {self.watcher.directory}")
            self._loaded = True
        self.urgent_event.set()
        self.wake_event.set()

    def _reloaded(self, outcome: Outcome) -> None:
        self.status_changed.bump()
        if outcome.rejection is not None:
            problems = outcome.rejection.problems
            self.reconciler.event("catalog-rejected", f"{len(problems)} problem{'s' if len(problems) != 1 else ''}, "
                                  f"keeping {outcome.catalog.version}: {problems[0]}")

    def load(self) -> Catalog:
        """Load the catalog directory; CatalogError if invalid (serve refuses to start on it)."""
        return self.watcher.load_initial()

    def wake(self, model_name: str) -> None:
        """The router's Waker: a request arrived for a model with no ready replica."""
        self.reconciler.wake(model_name)
        self.urgent_event.set()
        self.wake_event.set()

    def agent_reported(self, node: str, body: dict[str, Any] | AgentReport, claims: NodeClaims = UNBOUNDED) -> tuple[str, ...]:
        """Take a report, bounded by what the node's token `claims` (ReportError if malformed, ConflictError if
        another agent speaks for the node). Returns what was refused of it (`NodeClaims.bound`)."""
        known = self.inventory.get(node)
        before = known.revision if known is not None else None
        refused_before = known.refused if known is not None else ()
        legacy_before = known.claims.legacy if known is not None else False
        try:
            reported, came_back = self.inventory.report(node, body, claims)
        except ConflictError as exc:
            if exc.first:
                self.reconciler.event("node-conflict", str(exc))
            raise
        if came_back:
            self.reconciler.event("node-back", f"node {node} reports again")
        # Only a report that changed something wakes a pass: a heartbeat repeating
        # the last one needs none (its node's last_seen is all it moves, which the
        # next tick's pass reads). At 5,000 nodes heartbeating every 10 s, waking on
        # each was 500 passes asked for a second, each over the whole fleet.
        if reported.refused and reported.refused != refused_before:
            self.reconciler.event("node-claims-refused", f"node {node} claims more than its token allows, "
                                  f"dropped: {'; '.join(reported.refused)}")
        if reported.claims.legacy and not legacy_before:
            bound = "claims what it reports (serve --legacy-node-tokens)" if reported.claims.unbounded else \
                "may claim no pool and 8 GPUs"
            self.reconciler.event("node-legacy-token", f"node {node} reports with a token from before claims: it "
                                  f"{bound}; mint it one with llmgwctl token node {node} --pools ... --max-gpus N")
        if reported.revision != before:
            self.status_changed.bump()
            self.wake_event.set()
        return reported.refused

    def revocations_changed(self, revoked: Mapping[str, int | None]) -> None:
        """The revocation list changed: a node whose last report came with a token it now revokes is lost at once.

        Its agent's next report is refused (401), so it would be lost at its
        node timeout anyway; a revoked node is likely a compromised one, and
        its replicas leave the router in the next pass instead.
        """
        for name, lowest in revoked.items():
            node = self.inventory.get(name)
            if node is None or node.claims is UNBOUNDED or (lowest is not None and node.claims.serial >= lowest):
                continue
            if self.inventory.revoke(name):
                self.reconciler.event("node-revoked", f"node {name}'s token (serial {node.claims.serial}) is revoked; "
                                      "its replicas leave the router and are replaced")
                self.status_changed.bump()
                self.urgent_event.set()
                self.wake_event.set()

    def set_scheduling(self, node: str, verb: str) -> bool:
        """`cordon`, `drain` or `uncordon` `node` (reconciler.maintenance); True if it changed anything.

        A change wakes a pass at once: a drain's replacements are placed in it.
        """
        r = self.reconciler
        changed = {"cordon": r.cordon, "drain": r.drain, "uncordon": r.uncordon}[verb](node)
        if changed:
            self.status_changed.bump()
            self.urgent_event.set()
            self.wake_event.set()
        return changed

    def agent_heartbeat(self, node: str) -> bool:
        """The node's last accepted report, sent again unchanged: True if taken as a heartbeat (no wake)."""
        return self.inventory.heartbeat(node)

    async def run(self, stop: asyncio.Event, tick: float | None = None) -> None:
        """Follow the catalog directory and reconcile until `stop` is set."""
        tasks = [
            asyncio.create_task(self.watcher.run(stop, on_batch=self._reloaded), name="catalog-watcher"),
            asyncio.create_task(run_reconciler(self.reconciler, self.wake_event, stop, urgent=self.urgent_event,
                                               **({"tick": tick} if tick else {})), name="reconciler"),
            asyncio.create_task(self._follow_history(stop), name="history"),
        ]
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(*tasks)

    async def _follow_history(self, stop: asyncio.Event) -> None:
        while not await sleep_unless(self.history.interval, stop):
            self.sample_history()

    def sample_history(self) -> None:
        """One point of the traffic history for every model and the fleet (the history loop's one pass)."""
        fleet = self.reconciler.fleet_status()
        # In flight per model: only replicas with requests on them are looked up (few, even at fleet size).
        inflight: dict[str, int] = {}
        records = self.reconciler.replicas
        for rid, (_, n) in self.usage.usage_snapshot().items():
            rec = records.get(rid) if n else None
            if rec is not None:
                inflight[rec.spec.model] = inflight.get(rec.spec.model, 0) + n
        self.history.sample(self._wall_clock(), (
            ModelSample(m.name, inflight.get(m.name, 0), m.desired, m.ready, m.load, m.target)
            for m in fleet.models))
        self.status_changed.bump()      # a new point: the console's stream sends it

    def state(self) -> ControlStatus:
        """Everything `status` shows, typed: the control metrics read this, the status JSON is its `to_dict`."""
        w = self.watcher
        current = self.live.current
        catalog = CatalogStatus(
            directory=w.directory, version=current.version, models=len(current), swapped_at=w.swapped_at,
            swaps=w.swaps, rejections=w.rejections, directory_valid=w.directory_valid,
            last_rejection=w.last_rejection.to_dict() if w.last_rejection else None,
            failures=w.failures, degraded=w.degraded, last_failure=w.last_failure, problem=w.problem,
            followed=w.followed)
        watchers = tuple(WatcherStatus(**row()) for row in (w.watcher_status, *self.followed))
        fleet = self.reconciler.fleet_status(self.usage.usage_snapshot())
        problems = self.usage.endpoint_problems()
        if problems:
            fleet = dataclasses.replace(fleet, router=problems)
        return ControlStatus(catalog=catalog, routers=self.usage.routers(), fleet=fleet,
                             log_streams=self.logs.open_streams(), watchers=watchers)

    def status(self) -> dict[str, Any]:
        """`GET /api/v1/status` as a dict (tests, and callers in process)."""
        return self.state().to_dict()

    def status_json(self, model: str | None = None) -> bytes:
        """`GET /api/v1/status`'s body: the same document, from the rows' cached JSON (see contracts.status).

        With `model` (a name or alias; KeyError if the catalog has no such model)
        only that model's part of the fleet (`ControlStatus.only`).
        """
        if model is None:
            return self.state().to_json()
        found = self.live.current.resolve(model)
        if found is None:
            raise KeyError(model)
        return self.state().only(found.name).to_json()
