"""The reconciler: make what runs on the fleet match what the catalog wants, one pass at a time.

Level-triggered: every pass starts from the catalog in force, the inventory
(what agents report) and its own records, and derives what to do from them.
Events -- a catalog swap, an agent report, a wake from the router -- only make
the next pass come sooner. Everything a pass does is safe to repeat.

Order matters where traffic is involved: a replica leaves the router's
endpoint list in the pass that decides to stop it, and its engine is told to
stop only once the router reports no request in flight on it (or the drain
grace ran out). A new replica joins the list only once its agent reports it
ready, i.e. its health check passed.

`Reconciler` is the coordinator; each job's state lives with its part:
`records` (the replicas and what changed in them), `scaling` (what each
model wants), `adoption` (reports merged into the records), `placement_input`
and `planning` (placement's input, its plan carried out), `publishing` (the
endpoints, model states and desired lists handed out). `maintenance` (the operator's
cordon and drain of nodes). `reconcile_once` is
those parts called in order; `incremental` wraps it for the test suite.

It must not know HTTP or processes: it talks to agents through the
DesiredStore, to the router through the RouterSink contract (`publishing`)
and the contracts' UsageSource, and reads time from an injected clock. What crosses
to other pieces (Endpoint, ReplicaSpec, ReplicaState, the usage snapshot, the
status records) is in `llmgwctl.contracts`, so importing this never loads
the router (or aiohttp).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ..catalog import Catalog, Live, Model
from ..catalog.fallbacks import chains
from ..contracts import (
    AdapterLoadSource,
    ConcurrencySource,
    Endpoint,
    Event,
    FleetStatus,
    LoadSource,
    ModelState,
    ModelStatus,
    ReplicaState,
    RouterSink,
    UsageSnapshot,
    UsageSource,
)
from ..inventory import Inventory
from ..placement import Unplaceable, place
from .adapters import AdapterPlacer
from .adoption import Adoption
from .desired import DesiredStore
from .groups import GroupKeeper
from .incremental import IncrementalMismatch, checked
from .maintenance import SURGE_WAIT, Maintenance
from .placement_input import PlacementInput, SpecHashes, profile_of, replaced_why
from .planning import Planner
from .publishing import Publisher
from .records import Records, Replica
from .scaling import Scaling
from .statusrows import StatusRows

__all__ = ["DRAIN_GRACE", "EVENTS", "MOVE_EVERY", "REPLACE_AFTER", "SETTLE", "SURGE_WAIT",
           "IncrementalMismatch", "Reconciler", "Replica"]

log = logging.getLogger("llmgw.reconciler")

# After a controller start, adopt what agents report and start nothing for up
# to 15 s -- three agent heartbeats -- so a restart never starts duplicates of
# replicas whose nodes simply have not reported yet. It ends early once every
# node heard from has reported twice (the second report proves the first was
# not a stale retry, and that the agent sees our desired list) -- but not
# before a heartbeat and a half has passed since the first pass (EARLIEST_END).
SETTLE = 15.0
# The early end waits at least half the inventory's node timeout (three
# heartbeats: so a heartbeat and a half), counted from the first pass, i.e.
# from when the control API took reports. "Every node heard from" only covers the nodes that
# have reported yet: an agent whose report failed while the controller was
# down retries at most a heartbeat later (agent.controller.report_loop), so
# before then one node's change-driven second report could end the window
# while another was still backing off. That ended it with the late node's pool
# unknown: its models were declared unplaceable and the router answered 503
# (CI, the restart-while-edited fault test), or its replicas were placed a
# second time elsewhere. The half heartbeat is for the report's own trip
# through a controller taking a whole fleet's first reports at once.
EARLIEST_END = 0.5
# A replica being stopped gets up to 30 s for requests already in flight:
# long enough for a typical chat completion to finish streaming, short enough
# that a scale-down frees its GPUs promptly.
DRAIN_GRACE = 30.0
# A node unreachable this long has its replicas replaced elsewhere. Longer than
# the unreachable timeout so a flapping node (a GC pause, a brief network
# blip) comes back to find its replicas still its own, not reshuffled --
# for models that still serve from another node meanwhile. A model left with
# no ready replica by the loss is replaced at once, at the node timeout
# (inventory.UNREACHABLE_AFTER, 15 s): it is down already, and waiting would
# only make its outage longer by this much. If the node comes back, its
# replicas that are healthy and still wanted are adopted again, and where a
# replacement made one surplus the one serving longest is kept (Adoption.trim).
REPLACE_AFTER = 60.0
# Events kept for `status`: enough for the last few minutes of a busy fleet.
EVENTS = 200
# A model is moved from a fallback back to a better profile at most once per
# 5 minutes. A move costs a cold start of the better replica (loading weights
# takes minutes for a large model) and a drain of the fallback; GPUs that free
# and fill again (a scale-to-zero neighbour waking and sleeping) would
# otherwise bounce a model between profiles. The first move is not delayed.
MOVE_EVERY = 300.0

# Set by the test suite: every pass is wrapped in `incremental.checked`, which
# compares what the pass kept (the endpoint list, the desired lists, the merges
# it skips) with a walk of every record and raises IncrementalMismatch on a
# difference. The suite sets it in its own process and, through
# LLMGW_CHECK_INCREMENTAL=1, in every serve it starts, where a mismatch ends
# the process (see reconciler.run): a test then fails loudly instead of a pass
# being logged as failed.
CHECK_INCREMENTAL = os.environ.get("LLMGW_CHECK_INCREMENTAL") == "1"
EXIT_ON_MISMATCH = CHECK_INCREMENTAL        # the test suite's own process sets it False: it raises there


def _delegate(part: str, name: str) -> Any:
    """A Reconciler attribute that is its part's: read and written there."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class Reconciler:
    """The coordinator: one pass is its parts called in order; its public surface is what callers read."""

    def __init__(self, live: Live, inventory: Inventory, desired: DesiredStore, *,
                 endpoints: RouterSink | None = None, usage: UsageSource | None = None,
                 load: LoadSource | None = None, concurrency: ConcurrencySource | None = None,
                 adapter_load: AdapterLoadSource | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 settle: float = SETTLE, drain_grace: float = DRAIN_GRACE, replace_after: float = REPLACE_AFTER,
                 on_change: Callable[[], None] = lambda: None, move_every: float = MOVE_EVERY,
                 surge_wait: float = SURGE_WAIT):
        self.live, self.inventory, self.desired = live, inventory, desired
        self.usage = usage
        self._clock, self._wall = clock, wall_clock
        self.settle = settle
        self.started = clock()
        self.settled = settle <= 0
        self._first_pass: float | None = None      # when the first pass ran (see EARLIEST_END)
        self.events: collections.deque[Event] = collections.deque(maxlen=EVENTS)
        # The parts, each with its own state (see the module docstring).
        self.replicas = Records()
        self.scaling = Scaling(self.event, load=load, concurrency=concurrency)
        hashes = SpecHashes()
        self.adoption = Adoption(self.replicas, inventory, desired, self.scaling, hashes, self.event,
                                 replace_after=replace_after)
        self.placement_input = PlacementInput(self.replicas, inventory, self.adoption.forgotten, hashes)
        self.adoption.draining = self.placement_input.draining
        self.groups = GroupKeeper(self.replicas, inventory, self.event, clock)
        self.planner = Planner(self.replicas, self.event, move_every=move_every, drain_grace=drain_grace,
                               groups=self.groups)
        self.maintenance = Maintenance(self.replicas, self.placement_input.cordoned, self.placement_input.draining,
                                       self.event, surge_wait=surge_wait)
        self.publisher = Publisher(self.replicas, inventory, desired, on_change=on_change, whole=self.groups.whole)
        self.adapters = AdapterPlacer(self.replicas, load=adapter_load, clock=clock, event=self.event)
        if endpoints:
            self.publisher.sinks.append(endpoints)
        self.passes = 0
        # Passes that raised (a bug: no catalog the rules accept should make one
        # raise), and the last one; `degraded` until a pass completes again.
        # Set by `run` through `pass_failed`; status and /metrics show them.
        self.failures = 0
        self.degraded = False
        self.last_failure: dict[str, Any] | None = None
        # Told how long each pass took (seconds); the control API's metrics set it.
        self.on_pass: Callable[[float], None] = lambda seconds: None
        # Status rows kept between reads, rebuilt where a record changed; the
        # models' rows likewise, by what each shows (model name -> (key, row)).
        self._status_rows = StatusRows(_is_fallback)
        self._model_rows: dict[str, tuple[tuple[Any, ...], ModelStatus]] = {}

    # --- what callers read, kept by the parts ------------------------------------

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.publisher.endpoints

    @property
    def endpoints_version(self) -> int:
        return self.publisher.endpoints_version

    @property
    def model_states(self) -> tuple[ModelState, ...]:
        return self.publisher.model_states

    @property
    def unplaceable(self) -> dict[str, str]:
        return self.planner.unplaceable

    @property
    def unplaceable_detail(self) -> dict[str, Unplaceable]:
        return self.planner.unplaceable_detail

    # Settable, as before the parts: tests set them after construction.
    concurrency = _delegate("scaling", "concurrency")
    move_every = _delegate("planner", "move_every")

    def add_sink(self, sink: RouterSink) -> None:
        self.publisher.add_sink(sink)

    # --- inputs -------------------------------------------------------------

    def wake(self, model: str) -> None:
        """The router has a request for `model` and no ready replica: want one now.

        Idempotent: however often it is called, the model wants one replica,
        and placement starts one. The caller wakes the loop for a prompt pass.
        """
        resolved = self.live.current.resolve(model)
        if resolved is not None:
            self.scaling.woken(resolved.name, self._clock())

    def stop_node(self, node: str) -> None:
        """Stop everything on `node` now and place nothing new there (serve's shutdown of its local agent).

        Call with the loop stopped (serve does): a pass after this would count
        the stopping replicas as missing and place them again elsewhere --
        on the way out, for the next start to adopt as drift. It publishes
        itself: the node's empty list, and the endpoints without its replicas.
        """
        with self._checked():
            self.placement_input.cordoned.add(node)
            for rec in self.replicas.values():
                if rec.node == node and rec.state != ReplicaState.STOPPING:
                    rec.state, rec.drain_reason = ReplicaState.STOPPING, "controller shutting down"
            self.desired.set(node, ())
            self.event("node-stopping", f"stopping every replica on {node}")
            self.publisher.publish(self.live.current, self.settled)

    def cordon(self, node: str) -> bool:
        """Place nothing new on `node` (`maintenance`); True if it was not held already. Wake a pass after."""
        return self.maintenance.cordon(node)

    def drain(self, node: str) -> bool:
        """Cordon `node` and move its replicas elsewhere, surge first (`maintenance`). Wake a pass after."""
        return self.maintenance.drain(node, self._clock())

    def uncordon(self, node: str) -> bool:
        """Make `node` placeable again; False if it was not held. Wake a pass after."""
        return self.maintenance.uncordon(node)

    def restore_holds(self, holds: dict[str, bool]) -> None:
        """Cordons (node -> drain) kept across a restart, in force from the first pass."""
        self.maintenance.restore(holds, self._clock())

    def event(self, kind: str, message: str) -> None:
        self.events.append(Event(self._wall(), kind, message))
        log.info("%s: %s", kind, message, extra={"event": kind})     # `event` is a key in JSON logs

    # --- the pass -----------------------------------------------------------

    def reconcile_once(self) -> None:
        started = time.perf_counter()       # real time spent, not the injected clock: it is a cost
        with self._checked():
            self._pass()
        self.degraded = False
        self.on_pass(time.perf_counter() - started)

    def _checked(self) -> contextlib.AbstractContextManager[None]:
        """The test suite's tripwire around whatever publishes (CHECK_INCREMENTAL); nothing otherwise."""
        if CHECK_INCREMENTAL:
            return checked(self.replicas, self.adoption, self.publisher)
        return contextlib.nullcontext()

    def _pass(self) -> None:
        now = self._clock()
        catalog = self.live.current
        self.passes += 1
        try:
            for node in self.inventory.check():
                self.event("node-lost", f"node {node.name} missed its reports; its replicas leave the router")
            self.adoption.merge(catalog, now, self.settled)
            self.adoption.lost_nodes(now)
            self._settle(now)
            self.groups.step(now, self.settled)
            if self.settled:
                usage = dict(self.usage.usage_snapshot()) if self.usage else {}
                self.scaling.read(now)
                wanted = self._plan(catalog, now, usage)
                self.maintenance.step(wanted, now)
                self.planner.drain(now, usage)
                self.groups.step(now, self.settled)     # a head the drain stopped takes its workers now
                # After the plan: its new replicas get their adapters in the specs they start with.
                self.adapters.place(catalog)
        finally:
            # Even when planning raised (a bug), what runs is still published:
            # the router keeps every ready replica and agents their lists, so a
            # broken pass stalls changes but never takes traffic away.
            self.publisher.publish(catalog, self.settled)

    def _settle(self, now: float) -> None:
        """End the settling window once it ran out, or once every node heard from reported twice (SETTLE)."""
        if self._first_pass is None:
            self._first_pass = now
        if self.settled:
            return
        nodes = list(self.inventory.nodes())
        heard_twice = (nodes and all(n.reports >= 2 for n in nodes)
                       and now - self._first_pass >= EARLIEST_END * self.inventory.unreachable_after)
        if now - self.started >= self.settle or heard_twice:
            self.settled = True
            self.event("settled", f"settling window over: adopted {sum(r.adopted for r in self.replicas.values())} replicas")

    def _plan(self, catalog: Catalog, now: float, usage: UsageSnapshot) -> dict[str, int]:
        wanted = self.scaling.wanted(catalog, now, usage, self.replicas)
        held = self._hold_failed_groups(wanted, now)
        self.adoption.trim(catalog, wanted, now)
        running, views = self.placement_input.build(catalog)
        self.planner.plan(catalog, now, wanted, running, views)
        for name, why in held.items():
            # Said where a model that waits for room is: in status, and to the router (it waits, not 503s).
            if name not in self.planner.unplaceable_detail:
                self.planner.unplaceable[name] = why
                self.planner.unplaceable_detail[name] = Unplaceable(name, why, permanent=False)
        self.publisher.derive_model_states(catalog, self.planner.unplaceable_detail)
        return wanted

    def _hold_failed_groups(self, wanted: dict[str, int], now: float) -> dict[str, str]:
        """A model whose group just failed gets no new group until its back-off is over (groups.GroupKeeper):
        it wants only the groups it has. Returns why, for each model held short of what it wants."""
        if not self.groups.holding:
            return {}
        held = {}
        for name, want in wanted.items():
            wait = self.groups.held(name, now)
            if wait:
                have = sum(1 for gid in self.replicas.groups
                           if (head := self.replicas.get(gid)) is not None and head.spec.model == name
                           and head.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING))
                if have < want:
                    wanted[name] = have
                    held[name] = (f"its group failed (see the group-failed event); placed again after a "
                                  f"back-off of {self.groups.backoff_of(name):.0f} s")
        return held

    def pass_failed(self, exc: BaseException) -> None:
        """A pass raised: count it and say so (the supervised loop calls this and goes on).

        The traceback is logged for the first failure of a run of them and
        whenever the error changes; the same error once a second after that
        is one line, so a persistent bug does not bury the log.
        """
        error = f"{type(exc).__name__}: {exc}"[:500]
        repeat = self.degraded and self.last_failure is not None and self.last_failure["error"] == error
        self.failures += 1
        self.degraded = True
        self.last_failure = {"at": self._wall(), "what": "reconcile pass", "error": error}
        if repeat:
            log.error("reconcile pass failed again (%d failures so far): %s", self.failures, error,
                      extra={"event": "reconcile-failed"})
        else:
            log.error("reconcile pass failed; the next pass starts from the state this one left:\n%s",
                      "".join(traceback.format_exception(exc)).rstrip(), extra={"event": "reconcile-failed"})

    def preview(self, catalog: Catalog) -> dict[str, Any]:
        """What swapping in `catalog` would do to replicas, without doing it (for `catalog apply`)."""
        wanted = {}
        for model in catalog.models:
            current = self.scaling.wanted_of(model.name, model.replicas.min)
            wanted[model.name] = max(model.replicas.min, min(model.replicas.max, current))
        running, views = self.placement_input.build(catalog)
        plan = place(catalog, views, running, wanted)
        by_id = {r.replica_id: r for r in running}
        stale = [r for r in running if not r.current and not r.leaving and (m := catalog.resolve(r.model)) is not None
                 and m.name == r.model and profile_of(m, r.profile) is not None]
        return {
            "start": [{"model": a.model, "profile": a.profile, "node": a.node, "gpus": list(a.gpu_indices),
                       # A replica spanning nodes: its other members, rank 1 first.
                       **({"members": [{"node": n, "gpus": list(g)} for n, g in a.members]} if a.members else {})}
                      for a in plan.start],
            "stop": [{"id": s.replica_id, "model": by_id[s.replica_id].model if s.replica_id in by_id else "",
                      "reason": s.reason} for s in plan.stop],
            "replace": [{"id": r.replica_id, "model": r.model, "profile": r.profile, "node": r.node,
                         "why": self._replaced_why(r.replica_id, catalog)} for r in stale],
            "unplaceable": {u.model: u.reason for u in plan.unplaceable},
        }

    def _replaced_why(self, replica_id: str, catalog: Catalog) -> str:
        rec = self.replicas.get(replica_id)
        return replaced_why(rec.spec, catalog.resolve(rec.spec.model)) if rec is not None else "profile changed"

    # --- for status -----------------------------------------------------------

    def fleet_status(self, usage: UsageSnapshot | None = None) -> FleetStatus:
        """What the reconciler wants and what runs, typed: the control API's JSON and its metrics read this.

        Rows come from `_status_rows`, rebuilt only where a record or node changed
        since the last read; ages and usage are read now (see contracts.status).
        """
        catalog = self.live.current
        now = self._clock()
        rows = self._status_rows
        rows.update(self.replicas, self.inventory.nodes(), catalog, self.inventory.conflict, self.maintenance.state)
        models = []
        kept = self._model_rows
        chain = chains(catalog)
        for model in catalog.models:
            ready, count = rows.counts.get(model.name, (0, 0))
            scale = self.scaling.get(model.name)
            detail = self.unplaceable_detail.get(model.name)
            # The row of the last read while nothing it shows moved: no new record per model per read.
            key = (model, scale.wanted if scale else model.replicas.min, ready, count,
                   self.unplaceable.get(model.name), bool(getattr(detail, "permanent", False)),
                   scale.load if scale else None, scale.needed if scale else None,
                   # Its chain follows other models' fallbacks too, not only its own.
                   chain.get(model.name, ()),
                   self.adapters.spreads(model) if model.adapters else ())
            hit = kept.get(model.name)
            if hit is None or hit[0] != key:
                hit = kept[model.name] = (key, ModelStatus(
                    name=model.name, aliases=tuple(model.aliases), min=model.replicas.min, max=model.replicas.max,
                    desired=key[1], ready=ready, replicas=count, unplaceable=key[4], priority=model.priority,
                    unplaceable_permanent=key[5], metric=model.autoscale.metric,
                    target=model.autoscale.policy().target, load=key[6], needed=key[7],
                    fallbacks=key[8], adapters=key[9]))
            models.append(hit[1])
        if len(kept) > len(models):
            names = {m.name for m in models}
            for name in [n for n in kept if n not in names]:
                del kept[name]
        nodes = self.inventory.nodes()
        return FleetStatus(settled=self.settled, passes=self.passes, models=tuple(models),
                           replicas=rows.replica_rows, nodes=rows.node_rows, events=tuple(self.events),
                           failures=self.failures, degraded=self.degraded, last_failure=self.last_failure,
                           now=now, usage=MappingProxyType(dict(usage or {})),
                           seen_at=MappingProxyType({n.name: n.last_seen for n in nodes}),
                           reports_of=MappingProxyType({n.name: n.reports for n in nodes}))

    def status(self, usage: UsageSnapshot | None = None) -> dict[str, Any]:
        """`fleet_status` as the status JSON."""
        return self.fleet_status(usage).to_dict()


def _is_fallback(model: Model | None, profile: str) -> bool:
    """Whether `profile` ranks below the model's best (a strictly lower priority than its first-ranked)."""
    if model is None or not model.profiles:
        return False
    mine = profile_of(model, profile)
    return mine is not None and mine.priority < model.ranked()[0].priority
