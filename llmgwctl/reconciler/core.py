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

It must not know HTTP or processes: it talks to agents through the
DesiredStore, to the router through the EndpointSink protocol below and the
contracts' UsageSource, and reads time from an injected clock. What crosses
to other pieces (Endpoint, ReplicaSpec, ReplicaState, the usage snapshot, the
status records) is in `llmgwctl.contracts`, so importing this never loads
the router (or aiohttp).
"""
from __future__ import annotations

import bisect
import collections
import logging
import os
import time
import traceback
import uuid
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, runtime_checkable

from ..catalog import Autoscale, Catalog, Live, Model, Profile, ScalingPolicy
from ..contracts import (ConcurrencySource, Endpoint, Event, FleetStatus, LoadReading, LoadSource, ModelState,
                         ModelStatus, ReplicaSpec, ReplicaState, ReportedReplica,
                         UsageSnapshot, UsageSource)
from ..contracts.usage import UNUSED
from ..inventory import Inventory, Node
from ..placement import Memo, NodeView, Running, Unplaceable, place
from .adoption import Refusals, adoption_problem
from .autoscale import Autoscaler, signal
from .desired import DesiredStore
from .modelstates import model_states
from .statusrows import StatusRows

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
# replacement made one surplus the one serving longest is kept (_trim_returned).
REPLACE_AFTER = 60.0
# Events kept for `status`: enough for the last few minutes of a busy fleet.
EVENTS = 200
# A model is moved from a fallback back to a better profile at most once per
# 5 minutes. A move costs a cold start of the better replica (loading weights
# takes minutes for a large model) and a drain of the fallback; GPUs that free
# and fill again (a scale-to-zero neighbour waking and sleeping) would
# otherwise bounce a model between profiles. The first move is not delayed.
MOVE_EVERY = 300.0


class EndpointSink(Protocol):
    """Where the ready endpoints go: the router. A push once per change, never a pull per request,
    so the control plane does not depend on the router; when the two run as separate processes this
    becomes the watch stream and nothing above it changes."""

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None: ...


@runtime_checkable
class EndpointChangeSink(Protocol):
    """An EndpointSink that can also be told what changed, so a push costs what changed, not the list.

    `changed` maps each replica id whose endpoint came, changed or left since the
    list the sink was last given (by either call) to its Endpoint, or None if it
    left; `endpoints` is the whole new list, for a sink that would rather take it.
    """

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None: ...

    def change_endpoints(self, endpoints: tuple[Endpoint, ...], changed: Mapping[str, Endpoint | None]) -> None: ...


@runtime_checkable
class ModelStateSink(Protocol):
    """Where model states go: the router, beside the endpoints. A model that cannot be placed
    is answered at once with the reason, one that is starting is waited for (`modelstates`).
    Pushed once per change like the endpoints; a sink without it simply waits as before."""

    def set_model_states(self, states: Iterable[ModelState]) -> None: ...


# The record fields a pass's per-record work reads, beside its spec and node
# (which never change): what its Endpoint and its node's desired list are made
# of, and what a node's merge compares. A write to one marks the record and its
# node for the next pass (Records, Reconciler._changed), so a pass looks at
# what changed and not at 20,000 records (issue 19).
_PUBLISHED = frozenset({"state", "reported"})
# Set by the test suite: every pass also works out the endpoint list and the
# desired lists the whole way, and which nodes a merge may skip, and raises
# IncrementalMismatch if what was kept differs. The suite sets it in its own
# process and, through LLMGW_CHECK_INCREMENTAL=1, in every serve it starts,
# where a mismatch ends the process (see reconciler.run): a test then fails
# loudly instead of a pass being logged as failed.
CHECK_INCREMENTAL = os.environ.get("LLMGW_CHECK_INCREMENTAL") == "1"
EXIT_ON_MISMATCH = CHECK_INCREMENTAL        # the test suite's own process sets it False: it raises there


class IncrementalMismatch(AssertionError):
    """What a pass kept differs from what a walk of every record gives (CHECK_INCREMENTAL): a bug."""


@dataclass
class Replica:
    """The controller's record of one replica it desires (or adopted)."""

    spec: ReplicaSpec
    node: str
    created: float
    state: ReplicaState = ReplicaState.PENDING
    reported: ReportedReplica | None = None
    adopted: bool = False
    drain_since: float | None = None
    drain_reason: str = ""
    seen: bool = False              # its agent has reported it at least once
    ready_since: float | None = None    # when it last became ready (and reachable); None while not
    returned: bool = False          # its node came back with it after a loss: surplus is settled next plan
    timed: bool = False             # its placement-to-ready time went into its model's cold start
    spec_hash: str = field(init=False)
    # Placement's view of it, kept with what it was built from: (state, current) -> Running.
    # Its spec and node never change, so those two are all that can make it differ.
    placed_as: tuple[ReplicaState, bool, Running] | None = field(default=None, init=False, repr=False, compare=False)
    # Told this record's id and node when a field in _PUBLISHED is written; set by
    # the Records it is in, None outside one.
    _watch: Callable[[str, str], None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: the spec never changes for a record, and every pass compares it.
        self.spec_hash = self.spec.spec_hash

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _PUBLISHED:
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch(self.spec.id, self.node)

    @property
    def url(self) -> str | None:
        return self.reported.url if self.reported else None

_replica_id = attrgetter("replica_id")


class Records(dict[str, Replica]):
    """The records by replica id, and by node (`on_node`, in record order).

    Tells `changed` the id and node of every record put in, taken out, or
    written to in a field of _PUBLISHED while in, so a pass can look at what
    changed instead of every record.
    """

    def __init__(self, changed: Callable[[str, str], None]):
        super().__init__()
        self._changed = changed
        self.on_node: dict[str, dict[str, Replica]] = {}

    def __setitem__(self, rid: str, rec: Replica) -> None:
        old = self.get(rid)
        if old is not None and old is not rec:
            old._watch = None
            if old.node != rec.node:
                self._unindex(rid, old.node)
                self._changed(rid, old.node)
        super().__setitem__(rid, rec)
        self.on_node.setdefault(rec.node, {})[rid] = rec     # an id kept keeps its place, as in the dict
        rec._watch = self._changed
        self._changed(rid, rec.node)

    def __delitem__(self, rid: str) -> None:
        rec = self[rid]
        super().__delitem__(rid)
        self._unindex(rid, rec.node)
        rec._watch = None
        self._changed(rid, rec.node)

    def _unindex(self, rid: str, node: str) -> None:
        mine = self.on_node[node]
        del mine[rid]
        if not mine:
            del self.on_node[node]

    def pop(self, rid: str, *default: Any) -> Any:
        if rid in self:
            rec = self[rid]
            del self[rid]
            return rec
        return super().pop(rid, *default)

    def clear(self) -> None:
        for rid in list(self):
            del self[rid]

    def of(self, node: str) -> list[tuple[str, Replica]]:
        """`node`'s records as (id, record), in record order: a copy, safe to change the records while walking it."""
        mine = self.on_node.get(node)
        return list(mine.items()) if mine else []


# What a model's scale leaves out (on their way out) and counts as on their way in.
_GONE = (ReplicaState.DRAINING, ReplicaState.STOPPING)
_COMING = (ReplicaState.PENDING, ReplicaState.STARTING)


@dataclass
class _ModelScale:
    wanted: int = 0
    last_used: float | None = None
    woken: float | None = None
    # --- autoscaling (issue 17): the policy's state and its last measurement, for status ---
    autoscaler: Autoscaler = field(default_factory=Autoscaler)
    policy: ScalingPolicy | None = None    # the catalog policy the history was gathered under
    policy_of: Autoscale | None = None     # the catalog block `policy` was resolved from (see _wanted)
    load: float | None = None
    needed: int | None = None
    # Seconds from placement to ready of its recent replicas (a running mean): how far ahead a step
    # up is sized (autoscale.Autoscaler.decide); 0 until one of its replicas was placed and became ready.
    cold_start: float = 0.0


class _Tally:
    """One model's records as one pass of `_wanted` sees them (see `Reconciler._tally`)."""

    __slots__ = ("ready", "starting", "last_used", "grown", "span")

    def __init__(self, last_used: float | None, span: float | None):
        self.ready: list[str] = []      # ids of its ready replicas, in record order
        self.starting = 0               # placed or starting: capacity on its way
        self.last_used = last_used      # its scale's, moved on by its replicas' use this pass
        self.grown = 0.0                # request-seconds in flight on its replicas since the last pass
        self.span = span                # seconds since the last pass's counters; None: no two readings

    def concurrency(self) -> tuple[float, float] | None:
        return (self.grown, self.span) if self.span is not None else None


# A model with no record (never written to: signal() only reads a tally's lists).
_NO_RECORDS = _Tally(None, None)


class _InFlight(Mapping[str, int]):
    """The usage snapshot's in-flight count per replica id, read in place (absent: 0 in flight).

    What `autoscale.signal` reads for a model's ready ids. One view for the
    whole pass instead of a dict per model of every id it keeps: issue 19's
    fleet built 1,001 of them over 20,000 replicas a pass, and with the
    routers' counters `signal` reads none of them.
    """

    __slots__ = ("_usage",)

    def __init__(self, usage: UsageSnapshot):
        self._usage = usage

    def __getitem__(self, rid: str) -> int:
        return self._usage.get(rid, UNUSED)[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._usage)

    def __len__(self) -> int:
        return len(self._usage)


class Reconciler:
    def __init__(self, live: Live, inventory: Inventory, desired: DesiredStore, *,
                 endpoints: EndpointSink | None = None, usage: UsageSource | None = None,
                 load: LoadSource | None = None, concurrency: ConcurrencySource | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 settle: float = SETTLE, drain_grace: float = DRAIN_GRACE, replace_after: float = REPLACE_AFTER,
                 on_change: Callable[[], None] = lambda: None, move_every: float = MOVE_EVERY):
        self.live, self.inventory, self.desired = live, inventory, desired
        self._sinks: list[EndpointSink] = [endpoints] if endpoints else []
        self.usage = usage
        # The engines' gauges for autoscaling on waiting or KV-cache use; read once a pass.
        self.load = load
        self._loads: Mapping[str, LoadReading] = {}
        # The routers' in-flight counters (request-seconds per replica), read once a pass and
        # differenced with the last pass's: the time-averaged concurrency the autoscaler scales on.
        self.concurrency = concurrency
        self._busy: tuple[float, Mapping[str, float]] | None = None      # (when, counters): this pass's
        self._busy_before: tuple[float, Mapping[str, float]] | None = None   # and the last pass's
        self._clock, self._wall = clock, wall_clock
        self.settle, self.drain_grace, self.replace_after = settle, drain_grace, replace_after
        self.started = clock()
        self.settled = settle <= 0
        self._first_pass: float | None = None      # when the first pass ran (see EARLIEST_END)
        # What changed since it was last looked at (Records, Replica._watch; issue 19):
        # records, for the endpoints; nodes, for their desired lists; nodes, for their merge.
        self._dirty: set[str] = set()
        self._dirty_nodes: set[str] = set()
        self._unmerged: set[str] = set()
        self.replicas = Records(self._changed)
        # Each node's desired list as its records make it (see _publish), non-empty ones only.
        self._node_specs: dict[str, tuple[ReplicaSpec, ...]] = {}
        # Replicas given up on (their node was lost too long), by id, with that
        # node: if it comes back still running them they may be adopted again
        # (`_adopt`), by that node only.
        self._forgotten: dict[str, str] = {}
        # Adoptions refused, each said once (adoption.py); and the models that
        # adopted a replica since the last plan, whose surplus, if any, is
        # trimmed keeping the elder (_trim_returned).
        self._refusals = Refusals(self.event)
        self._adopted_models: set[str] = set()
        # (replica id, node) pairs already said to be claimed by a second node.
        self._double_claims: set[tuple[str, str]] = set()
        self._scale: dict[str, _ModelScale] = {}
        self.unplaceable: dict[str, str] = {}
        # What the router is told beside the endpoints (see `modelstates`).
        self.model_states: tuple[ModelState, ...] = ()
        self._pushed_states: tuple = ()
        # The same, whole: `unplaceable_detail[model].permanent` says whether
        # waiting can help (the router answers at once when it cannot).
        self.unplaceable_detail: dict[str, Unplaceable] = {}
        # Back to the best profile: when each model last started a move, and
        # which fallback each surge replica is to replace (new id -> old id).
        self.move_every = move_every
        self._moved: dict[str, float] = {}
        self._moving: dict[str, str] = {}
        self.events: collections.deque[Event] = collections.deque(maxlen=EVENTS)
        self.endpoints: tuple[Endpoint, ...] = ()
        self.endpoints_version = 0
        # What _publish last handed out (see there): node -> (desired version, specs);
        # replica id -> (url, catalog version, Endpoint); the ready ones in record order.
        self._handed: dict[str, tuple[int, tuple[ReplicaSpec, ...]]] = {}
        self._endpoint_cache: dict[str, tuple[str, tuple[int, float], Endpoint]] = {}
        self._ranks_of: tuple[str | None, Mapping[tuple[str, str], tuple[int, float]]] = (None, {})
        # The ready endpoints as last published: by id, and the same sorted by id (what
        # `endpoints` is a copy of); and what a record's Endpoint depends on beyond the
        # record: the catalog's ranks and the reachable nodes (a change redoes every record).
        self._ready: dict[str, Endpoint] = {}
        self._ordered: list[Endpoint] = []
        self._ready_basis: tuple[Mapping, frozenset[str]] | None = None
        self._on_change = on_change
        self._cordoned: set[str] = set()
        self._expected: tuple[str | None, Mapping[tuple[str, str], str]] = (None, {})
        # Placement's NodeView per node, with what it was built from (see _placement_input).
        self._views: dict[str, tuple[tuple, NodeView]] = {}
        # The last call of place(): (catalog, views, running, wanted, movable, plan) -- see _plan.
        self._last_plan: tuple[Catalog, list[NodeView], list[Running], dict[str, int], set[str], Any] | None = None
        # What place() may reuse from one call to the next where the input is the same (per node, per model):
        # a pass where few replicas changed costs what changed, not the fleet.
        self._placement_memo = Memo()
        # Per node: the reported replicas mapping last merged and its records then (see _merge_reports).
        self._merged: dict[str, tuple[Mapping[str, ReportedReplica], list[tuple[Replica, ReplicaState]]]] = {}
        self.passes = 0
        # Passes that raised (a bug: no catalog the rules accept should make one
        # raise), and the last one; `degraded` until a pass completes again.
        # Set by `run` through `pass_failed`; status and /metrics show them.
        self.failures = 0
        self.degraded = False
        self.last_failure: dict[str, Any] | None = None
        # Told how long each pass took (seconds); the control API's metrics set it.
        self.on_pass: Callable[[float], None] = lambda seconds: None
        # Status rows kept between reads, rebuilt where a record changed (issue 19); the
        # models' rows likewise, by what each shows (model name -> (key, row)).
        self._status_rows = StatusRows(_is_fallback)
        self._model_rows: dict[str, tuple[tuple, ModelStatus]] = {}

    def add_sink(self, sink: EndpointSink) -> None:
        self._sinks.append(sink)
        sink.set_endpoints(self.endpoints)
        if isinstance(sink, ModelStateSink):
            sink.set_model_states(self.model_states)

    # --- inputs -------------------------------------------------------------

    def wake(self, model: str) -> None:
        """The router has a request for `model` and no ready replica: want one now.

        Idempotent: however often it is called, the model wants one replica,
        and placement starts one. The caller wakes the loop for a prompt pass.
        """
        catalog = self.live.current
        resolved = catalog.resolve(model)
        if resolved is None:
            return
        scale = self._scale.setdefault(resolved.name, _ModelScale())
        scale.woken = self._clock()

    def stop_node(self, node: str) -> None:
        """Stop everything on `node` now and place nothing new there (serve's shutdown of its local agent).

        Call with the loop stopped (serve does): a pass after this would count
        the stopping replicas as missing and place them again elsewhere --
        on the way out, for the next start to adopt as drift. It publishes
        itself: the node's empty list, and the endpoints without its replicas.
        """
        self._cordoned.add(node)
        for rec in self.replicas.values():
            if rec.node == node and rec.state != ReplicaState.STOPPING:
                rec.state, rec.drain_reason = ReplicaState.STOPPING, "controller shutting down"
        self.desired.set(node, ())
        self.event("node-stopping", f"stopping every replica on {node}")
        self._publish(self.live.current)

    def event(self, kind: str, message: str) -> None:
        self.events.append(Event(self._wall(), kind, message))
        log.info("%s: %s", kind, message, extra={"event": kind})     # `event` is a key in JSON logs

    # --- the pass -----------------------------------------------------------

    def reconcile_once(self) -> None:
        started = time.perf_counter()       # real time spent, not the injected clock: it is a cost
        now = self._clock()
        catalog = self.live.current
        self.passes += 1
        try:
            for node in self.inventory.check():
                self.event("node-lost", f"node {node.name} missed its reports; its replicas leave the router")
            self._merge_reports(catalog, now)
            self._handle_lost_nodes(now)
            if self._first_pass is None:
                self._first_pass = now
            if not self.settled:
                nodes = list(self.inventory.nodes())
                heard_twice = (nodes and all(n.reports >= 2 for n in nodes)
                               and now - self._first_pass >= EARLIEST_END * self.inventory.unreachable_after)
                if now - self.started >= self.settle or heard_twice:
                    self.settled = True
                    self.event("settled", f"settling window over: adopted {sum(r.adopted for r in self.replicas.values())} replicas")
            if self.settled:
                usage = dict(self.usage.usage_snapshot()) if self.usage else {}
                self._loads = dict(self.load.load_snapshot()) if self.load else {}
                self._busy_before = self._busy
                self._busy = (now, dict(self.concurrency.inflight_seconds())) if self.concurrency else None
                self._plan(catalog, now, usage)
                self._drain(now, usage)
        finally:
            # Even when planning raised (a bug), what runs is still published:
            # the router keeps every ready replica and agents their lists, so a
            # broken pass stalls changes but never takes traffic away.
            self._publish(catalog)
        self.degraded = False
        self.on_pass(time.perf_counter() - started)

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

    def _changed(self, rid: str, node: str) -> None:
        """Records: the record `rid` on `node` came, went, or changed a field in _PUBLISHED."""
        self._dirty.add(rid)
        self._dirty_nodes.add(node)
        self._unmerged.add(node)

    def _merge_reports(self, catalog: Catalog, now: float) -> None:
        # --- issue 19: only nodes whose report or records changed -----------------
        # Merging a node is a function of its report (a new mapping with every
        # report that changed) and of its records and their states: a node
        # whose report is the very one merged last pass, whose records are the
        # same objects in the same states, and whose every reported replica had
        # its record here (nothing to adopt, no claim by another node, which
        # depend on more than this node) would come out of a merge as it went
        # in. Those are skipped: most of a fleet on most passes.
        # Which records changed is kept as it happens (Records, `_unmerged`): a node
        # none of whose records came, went or changed state since its last merge
        # needs no list of them built to find that out (issue 19).
        merged, unmerged = self._merged, self._unmerged
        for node in self.inventory.nodes():
            if not node.reachable:
                continue
            kept = merged.get(node.name)
            if kept is not None and kept[0] is node.replicas and node.name not in unmerged:
                if CHECK_INCREMENTAL and kept[1] != [(rec, rec.state) for _, rec in self.replicas.of(node.name)]:
                    raise IncrementalMismatch(f"{node.name}'s records changed unseen; its merge was skipped")
                if self.desired.get(node.name) is None and self.settled:
                    self.desired.set(node.name, ())
                continue
            mine = self.replicas.of(node.name)
            owned = True
            for rep in node.replicas.values():
                rec = self.replicas.get(rep.id)
                if rec is not None and rec.node != node.name:
                    self._claimed_twice(rec, node.name)
                    owned = False
                    continue
                if rec is None:
                    owned = False
                    rec = self._adopt(catalog, node, rep, now)
                    if rec is None:
                        continue
                rec.reported, rec.seen = rep, True
                if rec.state == ReplicaState.LOST:
                    rec.returned = True
                if rec.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING):
                    if rec.state != rep.state and rep.state in (ReplicaState.READY, ReplicaState.FAILED):
                        detail = f": {rep.reason}" if rep.state == ReplicaState.FAILED and rep.reason else ""
                        self.event(f"replica-{rep.state}", f"{rec.spec.id} ({rec.spec.model}/{rec.spec.profile} on {node.name}){detail}")
                    rec.state = rep.state if rep.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED) else rec.state
                    if rec.state != ReplicaState.READY:
                        rec.ready_since = None
                    elif rec.ready_since is None:
                        rec.ready_since = now
                        if not rec.adopted and not rec.timed:
                            self._timed_cold_start(rec, now)
            # A replica the agent no longer lists: once it had listed it, or once
            # we told it to stop, absence means the engine is gone.
            for rid, rec in mine:
                if rid in node.replicas or self.replicas.get(rid) is not rec:
                    continue
                if rec.state == ReplicaState.STOPPING or (rec.seen and rec.state != ReplicaState.PENDING):
                    if rec.state != ReplicaState.STOPPING:
                        self.event("replica-gone", f"{rid} ({rec.spec.model}) is no longer reported by {node.name}")
                    else:
                        self.event("replica-stopped", f"{rid} ({rec.spec.model}) stopped on {node.name}")
                    del self.replicas[rid]
            if owned:
                # Its records as the next pass's by_node lists them: the ones left, in record order.
                merged[node.name] = (node.replicas, [(rec, rec.state) for rid, rec in mine
                                                     if self.replicas.get(rid) is rec])
            else:
                merged.pop(node.name, None)
            self._refusals.say(node.name)
            # Its own writes in this merge are what it merged, not news for the next one.
            unmerged.discard(node.name)
            if self.desired.get(node.name) is None and self.settled:
                self.desired.set(node.name, ())
        if len(merged) > len(self.inventory):
            for name in [n for n in merged if self.inventory.get(n) is None]:
                del merged[name]

    def _timed_cold_start(self, rec: Replica, now: float) -> None:
        """A replica we placed is ready for the first time: its placement-to-ready time joins its model's.

        A mean over the last few (each new one weighs half), so one slow start
        (a cold page cache, a busy node) moves it but does not own it. Only
        replicas this controller placed: an adopted one's placement is unknown.
        """
        rec.timed = True
        scale = self._scale.setdefault(rec.spec.model, _ModelScale())
        took = max(0.0, now - rec.created)
        scale.cold_start = took if scale.cold_start <= 0 else (scale.cold_start + took) / 2

    def _claimed_twice(self, rec: Replica, other: str) -> None:
        # A replica id is handed to one node once and never reused, so another
        # node reporting it is a copied state directory or a second agent: the
        # record stays with the node it was adopted on or placed on, and the
        # claim is said once (not per pass) in the events.
        if (rec.spec.id, other) not in self._double_claims:
            self._double_claims.add((rec.spec.id, other))
            self.event("replica-conflict", f"{rec.spec.id} is reported by node {other} too, but runs on "
                       f"{rec.node}; not adopted twice (is a state directory shared or copied?)")

    def _adopt(self, catalog: Catalog, node: Node, rep: ReportedReplica, now: float) -> Replica | None:
        """A replica an agent runs that we have no record of: keep it if the catalog still has a place for it,
        and the node may add it (adoption.py: after the window only what returns; within it, only what fits)."""
        returned = self._forgotten.get(rep.id) == node.name
        if self.settled and not returned:
            self._refusals.refuse(rep, node.name, "the settling window is over and this controller did not place it there")
            return None
        model = catalog.resolve(rep.model)
        profile = _profile(model, rep.profile)
        if model is None or model.name != rep.model or profile is None:
            return None  # not desired: absent from the node's list, so its agent stops it
        spec = rep.spec
        if spec is None:
            return None
        why = adoption_problem(node, profile, spec, rep, (r.spec for _, r in self.replicas.of(node.name)))
        if why is not None:
            self._refusals.refuse(rep, node.name, why)
            return None
        if returned:
            # Given up while its node was lost, and back: a healthy engine of
            # the current spec is worth more than a new start (its model may
            # have found no room elsewhere). Anything else is left to stop.
            if rep.state not in (ReplicaState.READY, ReplicaState.STARTING) or \
                    spec.spec_hash != self._expected_hashes(catalog).get((model.name, rep.profile)):
                return None
            self._forgotten.pop(rep.id, None)
        self._adopted_models.add(model.name)
        rec = Replica(spec=spec, node=node.name, created=now, state=rep.state, reported=rep, adopted=True, seen=True,
                      returned=returned, ready_since=now if rep.state == ReplicaState.READY else None)
        self.replicas[rep.id] = rec
        # An adopted replica counts as used now, so a scale-to-zero model found
        # running after a restart gets its full idle timeout, not an instant stop.
        scale = self._scale.setdefault(model.name, _ModelScale())
        scale.last_used = max(scale.last_used or now, now)
        self.event("replica-readopted" if returned else "replica-adopted",
                   f"{rep.id} ({rep.model}/{rep.profile} on {node.name}, {rep.state})")
        return rec

    def _handle_lost_nodes(self, now: float) -> None:
        lost = [n for n in self.inventory.nodes() if not n.reachable]
        if not lost:
            return
        serving = {rec.spec.model for rec in self.replicas.values() if rec.state == ReplicaState.READY
                   and (node := self.inventory.get(rec.node)) is not None and node.reachable}
        # Through the per-node index, not every record for every lost node: a
        # rack of 1,000 nodes lost at once over 20,000 records was 2*10^7
        # steps in one pass (issue 19).
        for node in lost:
            for rid, rec in self.replicas.of(node.name):
                if self.replicas.get(rid) is not rec:
                    continue
                if rec.state != ReplicaState.LOST:
                    rec.state, rec.ready_since = ReplicaState.LOST, None
                waited = now - node.unreachable_since if node.unreachable_since is not None else 0.0
                # See REPLACE_AFTER: a model still served elsewhere waits it out; one left
                # with nothing ready is replaced at the node timeout.
                if waited >= self.replace_after or rec.spec.model not in serving:
                    del self.replicas[rid]
                    self._forgotten[rid] = node.name
                    why = "no other replica serves it" if waited < self.replace_after else \
                        f"unreachable for {waited:.0f} s"
                    self.event("replica-replaced", f"{rid} ({rec.spec.model}) on lost node {node.name} given up "
                               f"({why}); placing a replacement where there is room")
            # Its desired list is left as it was: if the node comes back, the
            # pass that merges its report adopts what is still wanted and then
            # publishes the list; until then it keeps running what it runs.

    def _wanted(self, catalog: Catalog, now: float, usage: UsageSnapshot) -> dict[str, int]:
        # Every pass, for every model: issue 19's fleet (5,000 nodes, 20,000 replicas, 1,001
        # models) spent ~50 ms of a ~115 ms steady pass here when the records were grouped,
        # then each model's filtered, summed and listed in a comprehension apiece, and its
        # policy, scale state and concurrency ids built anew. Now one walk of the records in
        # their own order sums every model's (`_tally`); the decisions are the same.
        tallies = self._tally(now, usage)
        inflight_by = _InFlight(usage)    # read in place: `signal` looks up only the ready ids
        scales = self._scale
        wanted = {}
        for model in catalog.models:
            scale = scales.get(model.name)
            if scale is None:
                scale = scales[model.name] = _ModelScale(wanted=model.replicas.min)
            tally = tallies.get(model.name)
            if tally is None:
                tally = _NO_RECORDS     # nothing ready: `signal` reads neither load nor concurrency
            else:
                scale.last_used = tally.last_used
            used = scale.last_used
            if scale.woken is not None and (used is None or scale.woken > used):
                used = scale.woken
            idle = model.idle_timeout is not None and (used is None or now - used >= model.idle_timeout)
            target = max(scale.wanted, model.replicas.min)
            why = "idle"
            # --- autoscaling (issue 17): the policy in llmgwctl.reconciler.autoscale ---
            # The catalog's block is frozen: the one the policy was resolved from resolves to it again.
            policy = scale.policy
            if policy is None or scale.policy_of is not model.autoscale:
                policy = model.autoscale.policy()
                if scale.policy != policy:
                    scale.autoscaler.reset()     # a history gathered under another target means nothing now
                    scale.policy = policy
                scale.policy_of = model.autoscale
            if idle:
                target = model.replicas.min
                scale.autoscaler.reset()
            else:
                sig = signal(policy.metric, tally.ready, tally.starting, inflight_by, self._loads, tally.concurrency())
                # A scale-to-zero model in use keeps one replica: only its idle timeout takes it to zero.
                low = max(model.replicas.min, 1 if used is not None else 0)
                decision = scale.autoscaler.decide(policy, now, min(target, model.replicas.max), sig,
                                                   low, model.replicas.max, cold_start=scale.cold_start)
                scale.load, scale.needed = decision.load, decision.needed
                if decision.reason:
                    target, why = decision.wanted, decision.reason
            # --- end autoscaling ---
            if model.replicas.min == 0 and used is not None and not idle:
                target = max(target, 1)
            if model.replicas.min == 0 and used is None:
                target = 0
            target = max(model.replicas.min, min(model.replicas.max, target))
            if target != scale.wanted:
                if target < scale.wanted:
                    self.event("scale-down", f"{model.name}: {scale.wanted} -> {target} replicas ({why})")
                else:
                    self.event("scale-up", f"{model.name}: {scale.wanted} -> {target} replicas"
                               + (f" ({why})" if why != "idle" else ""))
            scale.wanted = target
            wanted[model.name] = target
        if len(scales) > len(wanted):       # every model of the catalog has one: only then is one stale
            for name in [n for n in scales if catalog.resolve(n) is None]:
                del scales[name]
        return wanted

    def _tally(self, now: float, usage: UsageSnapshot) -> dict[str, _Tally]:
        """Every model's records summed in one walk of them: by model name, for `_wanted`.

        In the records' own order, not model by model: at 20,000 records the
        lookups in the usage and counter snapshots stay near in memory, and
        the walk took half the time of a model-by-model one (issue 19).
        Draining and stopping replicas count only towards the concurrency:
        their requests are load the model still serves, but they are no
        capacity and their use does not keep the model awake.
        """
        # The members once, as locals: reading `ReplicaState.READY` costs ~75 ns on Python 3.11,
        # three times over 20,000 records a pass.
        ready_state, gone, coming = ReplicaState.READY, _GONE, _COMING
        scales = self._scale
        tallies: dict[str, _Tally] = {}
        counters = self._counters(now)
        span = counters[2] if counters is not None else None
        # The counters all as they were (no request in flight anywhere since the last pass):
        # nothing grew, and one comparison of the two snapshots says so without two lookups a record.
        busy_now = busy_before = None
        if counters is not None and counters[0] != counters[1]:
            busy_now, busy_before = counters[0].get, counters[1].get
        usage_get = usage.get
        for rec in self.replicas.values():
            spec = rec.spec
            tally = tallies.get(spec.model)
            if tally is None:
                scale = scales.get(spec.model)
                tally = tallies[spec.model] = _Tally(scale.last_used if scale is not None else None, span)
            rid = spec.id
            if busy_now is not None and busy_before is not None:
                # A replica new since the last pass starts from its first reading, and a counter
                # that went back (its router restarted, or listed it anew) adds nothing this pass.
                busy = busy_now(rid)
                if busy is not None:
                    before = busy_before(rid, busy)
                    if busy > before:
                        tally.grown += busy - before
            state = rec.state
            if state == ready_state:        # most are: asked first
                tally.ready.append(rid)
            elif state in coming:
                tally.starting += 1
            elif state in gone:
                continue
            use = usage_get(rid)
            if use is not None:
                last, n = use
                if last is not None and (not tally.last_used or last > tally.last_used):
                    tally.last_used = last      # max(last_used or last, last), as ever, without the call
                if n:
                    tally.last_used = now
        return tallies

    def _counters(self, now: float) -> tuple[Mapping[str, float], Mapping[str, float], float] | None:
        """(this pass's in-flight counters, the last pass's, seconds between them); None without two readings.

        Differenced per replica in `_tally`: request-seconds in flight since
        the last pass over those seconds is the time-averaged concurrency.
        """
        if self._busy is None or self._busy_before is None:
            return None
        (_, counters), (then, before) = self._busy, self._busy_before
        if now <= then:
            return None
        return counters, before, now - then

    def _plan(self, catalog: Catalog, now: float, usage: UsageSnapshot) -> None:
        wanted = self._wanted(catalog, now, usage)
        self._trim_returned(catalog, wanted, now)
        running, views = self._placement_input(catalog)
        # Moves back to the best profile are rate-limited per model (MOVE_EVERY).
        movable = {m.name for m in catalog.models if now - self._moved.get(m.name, -self.move_every) >= self.move_every}
        # Placement is a pure function: handed the very input of the last call
        # (the kept NodeViews and Runnings, see _placement_input), it would
        # answer the same plan, so that plan is taken again -- a pass that
        # changes nothing places nothing at no cost (issue 19: 35-70 ms of a
        # pass at 20,000 replicas). Views are compared by identity: their
        # equality leaves out memory and engine reasons, which placement reads.
        last = self._last_plan
        if (last is not None and last[0] is catalog and last[3] == wanted and last[4] == movable
                and last[2] == running and len(last[1]) == len(views)
                and all(a is b for a, b in zip(last[1], views))):
            plan = last[5]
        else:
            plan = place(catalog, views, running, wanted, movable=movable, memo=self._placement_memo)
            self._last_plan = (catalog, views, running, dict(wanted), set(movable), plan)
        moved_by = {old: new for new, old in self._moving.items()}
        for stop in plan.stop:
            rec = self.replicas.get(stop.replica_id)
            if rec is not None and rec.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING):
                reason = stop.reason
                new = moved_by.get(stop.replica_id)
                if new is not None and new in self.replicas:
                    reason = f"moved back to profile {self.replicas[new].spec.profile}: {new} is ready"
                rec.state, rec.drain_since, rec.drain_reason = ReplicaState.DRAINING, now, reason
                if stop.preempted_by:
                    self.event("replica-preempted", f"{rec.spec.id} ({rec.spec.model}/{rec.spec.profile} on {rec.node}) "
                                                    f"{reason}")
                else:
                    self.event("replica-draining", f"{rec.spec.id} ({rec.spec.model} on {rec.node}): {reason}")
        gpus_of = {n.name: n.memory for n in views}
        for a in plan.start:
            model = catalog.resolve(a.model)
            profile = _profile(model, a.profile)
            # place() starts only a model it took from this catalog, with one of that model's profiles.
            assert model is not None and profile is not None
            rid = _new_id(model.name)
            share = _memory_share(profile.gpu_memory_mib, gpus_of.get(a.node, {}), a.gpu_indices)
            spec = ReplicaSpec.for_profile(rid, model, profile, catalog.engines[profile.engine], a.gpu_indices,
                                           gpu_memory_share=share)
            self.replicas[rid] = Replica(spec=spec, node=a.node, created=now)
            where = f"{a.node} GPUs {list(a.gpu_indices) or 'none'}"
            if share is not None:
                where += f" ({share:.0%} of their memory each)"
            if a.replaces is not None:
                self._moved[model.name] = now
                self._moving[rid] = a.replaces
                self.event("replica-moving", f"{rid} ({model.name}/{profile.name}) on {where}: replaces fallback "
                                             f"{a.replaces} once ready")
            else:
                self.event("replica-placed", f"{rid} ({model.name}/{profile.name}) on {where}")
        # A surge that finished (its fallback is gone) or was given up (it is gone) is forgotten.
        self._moving = {new: old for new, old in self._moving.items() if new in self.replicas and old in self.replicas
                        and self.replicas[old].state not in (ReplicaState.DRAINING, ReplicaState.STOPPING)}
        detail = {u.model: u for u in plan.unplaceable}
        for name, u in detail.items():
            if self.unplaceable.get(name) != u.reason:
                self.event("unplaceable", f"{name}{' (permanent)' if u.permanent else ''}: {u.reason}")
        self.unplaceable = {name: u.reason for name, u in detail.items()}
        self.unplaceable_detail = detail
        self._derive_model_states(catalog)

    def _derive_model_states(self, catalog: Catalog) -> None:
        """After the plan is applied: which models are starting, which cannot be placed (pushed in `_publish`)."""
        live: dict[str, set[ReplicaState]] = collections.defaultdict(set)
        # Node by node: one inventory lookup per node, not one per record (12 -> 6 ms at 20,000).
        for name, mine in self.replicas.on_node.items():
            node = self.inventory.get(name)
            if node is None or not node.reachable:
                continue
            for rec in mine.values():
                if rec.state not in _GONE:
                    live[rec.spec.model].add(rec.state)
        self.model_states = model_states(catalog, live, self.unplaceable_detail, self.inventory.nodes())

    def _trim_returned(self, catalog: Catalog, wanted: Mapping[str, int], now: float) -> None:
        """A node came back with replicas replaced meanwhile, or adoption left a model more than it wants:
        keep `wanted` of the model, drain the rest.

        Placement would stop a surplus too, but by its own order (newest id
        first, and ids are random -- or, for an adopted replica, chosen by
        whoever reported it); here the order is the one that costs clients
        least: ready before not ready, the best profile, then ready longest --
        the replacement that served through the outage before the replica that
        just reappeared. "Ready since" is this controller's own clock (an
        adopted replica is ready from its adoption), never a node's word, so
        among adopted replicas the one adopted first is kept over a newcomer,
        whatever ids it reports (adoption.py). Nothing is stopped where nothing
        is surplus: a returning engine that had nowhere else to go just stays.
        """
        returning = {rec.spec.model for rec in self.replicas.values() if rec.returned}
        models = returning | self._adopted_models
        self._adopted_models = set()
        if not models:
            return
        expected = self._expected_hashes(catalog)
        for name in models:
            recs = [r for r in self.replicas.values() if r.spec.model == name]
            for rec in recs:
                rec.returned = False
            model = catalog.resolve(name)
            if model is None or model.name != name:
                continue        # left the catalog: placement stops it as an orphan
            current = [r for r in recs if r.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING, ReplicaState.LOST)
                       and r.spec_hash == expected.get((name, r.spec.profile))]
            surplus = len(current) - wanted.get(name, model.replicas.min)
            if surplus <= 0:
                continue
            rank = {p.name: i for i, p in enumerate(model.ranked())}
            keep_first = sorted(current, key=lambda r: (r.state != ReplicaState.READY, rank.get(r.spec.profile, len(rank)),
                                                        r.ready_since if r.ready_since is not None else float("inf"),
                                                        r.created))
            for rec in keep_first[len(current) - surplus:]:
                rec.state, rec.drain_since = ReplicaState.DRAINING, now
                rec.drain_reason = (f"surplus once its node came back ({wanted.get(name)} wanted)" if name in returning
                                    else f"surplus of what was adopted ({wanted.get(name)} wanted)")
                self.event("replica-draining", f"{rec.spec.id} ({name} on {rec.node}): {rec.drain_reason}")

    def _placement_input(self, catalog: Catalog) -> tuple[list[Running], list[NodeView]]:
        # --- issue 19: rebuilt only where it changed ------------------------------
        # Placement reads a Running per record and a NodeView per node every
        # pass; building 20,000 and 5,000 frozen dataclasses was most of a
        # pass at fleet size (144 of 195 ms). Each is kept with exactly what it
        # was built from -- a record's state and whether its spec is current, a
        # node's reported pools, GPUs and engines (new objects with every
        # report that changed), reachability, cordon and the catalog -- and
        # built again only when one of those differs, so a kept one is the one
        # a rebuild would give. The lists stay in record and inventory order.
        expected = self._expected_hashes(catalog)
        running: list[Running] = []
        for rec in self.replicas.values():
            current = rec.spec_hash == expected.get((rec.spec.model, rec.spec.profile))
            kept = rec.placed_as
            if kept is None or kept[0] is not rec.state or kept[1] != current:
                kept = rec.placed_as = (rec.state, current, Running(
                    replica_id=rec.spec.id, model=rec.spec.model, profile=rec.spec.profile,
                    node=rec.node, gpu_indices=rec.spec.gpu_indices, current=current,
                    ready=rec.state == ReplicaState.READY, failed=rec.state == ReplicaState.FAILED,
                    # Draining or stopping: still holding its GPUs (or its share of
                    # their memory) until its engine is gone, but no longer counted
                    # toward what the model wants, and its room counts as coming free.
                    leaving=rec.state in (ReplicaState.DRAINING, ReplicaState.STOPPING),
                    memory_mib=rec.spec.gpu_memory_mib))
            running.append(kept[2])
        views = []
        kept_views = self._views
        for node in self.inventory.nodes():
            if not node.reachable:
                running.extend(self._given_up_on(node, expected))
            cpu = node.last_report.cpu if node.last_report is not None else None
            key = (node.pools, node.gpus, node.engines, node.reachable, node.name in self._cordoned, cpu)
            kept_view = kept_views.get(node.name)
            if kept_view is None or kept_view[0] != key:
                kept_view = kept_views[node.name] = (key, NodeView(
                    name=node.name, pools=node.pools,
                    gpus=tuple(g.index for g in node.gpus),
                    memory={g.index: (g.memory_mib, g.free_mib) for g in node.gpus},
                    # Only what the node's agent says it runs: a catalog-defined engine
                    # runs where a node's operator allowed it (llmgwctl agent
                    # --allow-engine), which the agent reports from its start; a node
                    # that does not name it does not run it (placement's reasons say so).
                    engines=node.available_engines,
                    schedulable=node.reachable and node.name not in self._cordoned,
                    unavailable={name: why for name, (ok, why) in node.engines.items() if not ok},
                    cpu_replicas=cpu.max_replicas if cpu is not None else None,
                ))
            views.append(kept_view[1])
        if len(kept_views) > len(self.inventory):
            # A node the inventory forgot; rare, so swept only when the count says so.
            for name in [n for n in kept_views if self.inventory.get(n) is None]:
                del kept_views[name]
        return running, views

    def _given_up_on(self, node: Node, expected: Mapping[tuple[str, str], str]) -> Iterator[Running]:
        """The replicas an unreachable node last reported that were given up (`_handle_lost_nodes`), as lost.

        Their records are gone, so placement places replacements for them; it
        is told they exist (`Running.lost`) so those replacements go only where
        there is room: a model with replicas on a lost node never preempts
        (the node may come back with them), and they hold the node's GPUs,
        which nobody can free. Replicas of a lost node still waiting out
        REPLACE_AFTER keep their records and count as they are (not lost to
        placement): that wait is what spares a flapping node a reshuffle.
        """
        for rid, rep in node.replicas.items():
            if rid in self._forgotten and rid not in self.replicas:
                yield Running(replica_id=rid, model=rep.model, profile=rep.profile, node=node.name,
                              gpu_indices=rep.gpu_indices, lost=True,
                              current=rep.spec_hash == expected.get((rep.model, rep.profile)),
                              memory_mib=rep.spec.gpu_memory_mib if rep.spec is not None else 0)

    def _ranks(self, catalog: Catalog) -> Mapping[tuple[str, str], tuple[int, float]]:
        """(model, profile) -> the profile's (priority, weight), what an Endpoint takes from the catalog; once per catalog."""
        if self._ranks_of[0] != catalog.version:
            self._ranks_of = (catalog.version, {(m.name, p.name): (p.priority, p.weight)
                                                for m in catalog.models for p in m.profiles})
        return self._ranks_of[1]

    def _expected_hashes(self, catalog: Catalog) -> Mapping[tuple[str, str], str]:
        """(model, profile) -> the spec hash a current replica of it has; computed once per catalog."""
        if self._expected[0] != catalog.version:
            hashes = {(m.name, p.name): ReplicaSpec.for_profile("", m, p, catalog.engines[p.engine]).spec_hash
                      for m in catalog.models for p in m.profiles}
            self._expected = (catalog.version, hashes)
        return self._expected[1]

    def _drain(self, now: float, usage: UsageSnapshot) -> None:
        for rec in self.replicas.values():
            if rec.state != ReplicaState.DRAINING:
                continue
            _, inflight = usage.get(rec.spec.id, UNUSED)
            # Only _plan and _trim_returned make a replica DRAINING, and both set drain_since
            # (an agent cannot report DRAINING: it is not in AGENT_STATES, so adoption never brings it).
            assert rec.drain_since is not None
            if inflight == 0 or now - rec.drain_since >= self.drain_grace:
                rec.state = ReplicaState.STOPPING
                why = "drained" if inflight == 0 else f"drain grace over with {inflight} in flight"
                self.event("replica-stopping", f"{rec.spec.id} ({rec.spec.model} on {rec.node}): {why}")

    # --- outputs ------------------------------------------------------------

    def _publish(self, catalog: Catalog) -> None:
        # --- issue 19: publishing costs in proportion to what changed -------------
        # Every pass ends here, most with nothing new: each node's list and the
        # endpoint list are compared with what was last handed out by the
        # identity of their (immutable) specs and Endpoints -- a C-level tuple
        # compare -- and only a changed one is re-sorted, re-fingerprinted and
        # handed on. At 5,000 nodes and 20,000 replicas the old way (every list
        # sorted and fingerprinted, every Endpoint rebuilt and repr'd) was most
        # of a pass.
        # The routers first, then the agents (issue 19): a pass that stops
        # replicas withdraws them from the endpoints and from their nodes'
        # lists at once, and whoever is woken first is answered first -- the
        # routers' watches before the agents' long-polls, so traffic leaves a
        # replica before its engine is told to stop, and 50 routers are not
        # answered after a thousand agents when a rollout turns replicas ready.
        endpoints = self._ready_endpoints(catalog)
        states = self.model_states
        if states != self._pushed_states:
            # Before the endpoints: a router woken by either then sees both as they are.
            self._pushed_states = states
            for sink in self._sinks:
                if isinstance(sink, ModelStateSink):
                    sink.set_model_states(states)
            self._on_change()
        if endpoints is not None:
            self.endpoints, changed = endpoints
            self.endpoints_version += 1
            for sink in self._sinks:
                if isinstance(sink, EndpointChangeSink):
                    sink.change_endpoints(self.endpoints, changed)
                else:
                    sink.set_endpoints(self.endpoints)
            self._on_change()
        # Each node's list from its records, again only for nodes whose records changed.
        per_node = self._node_specs
        for name in self._dirty_nodes:
            mine = self.replicas.on_node.get(name)
            specs = tuple(rec.spec for rec in mine.values() if rec.state != ReplicaState.STOPPING) if mine else ()
            if specs:
                per_node[name] = specs
            else:
                per_node.pop(name, None)
        self._dirty_nodes.clear()
        if CHECK_INCREMENTAL:
            walked: dict[str, list[ReplicaSpec]] = collections.defaultdict(list)
            for rec in self.replicas.values():
                if rec.state != ReplicaState.STOPPING:
                    walked[rec.node].append(rec.spec)
            if {n: tuple(v) for n, v in walked.items()} != per_node:
                raise IncrementalMismatch("the kept desired lists differ from the records'")
        handed = self._handed
        for node in self.inventory.nodes():
            # Until settled, only nodes whose replicas were adopted get a list:
            # an agent takes its first answer as the whole truth.
            if node.reachable and (self.settled or node.name in per_node):
                specs = per_node.get(node.name, ())
                held = self.desired.get(node.name)
                last = handed.get(node.name)
                if held is not None and last is not None and last[0] == held[0] and (
                        last[1] is specs or last[1] == specs):
                    continue        # the same spec objects as the list the store holds: unchanged
                # A list the agents long-poll; not the routers' watch, which
                # carries no desired lists (bumping it woke every router for a
                # change none of them reads).
                self.desired.set(node.name, specs)
                handed[node.name] = (self.desired.get(node.name)[0], specs)  # type: ignore[index]

    def _ready_endpoints(self, catalog: Catalog) -> tuple[tuple[Endpoint, ...], dict[str, Endpoint | None]] | None:
        """The ready endpoints sorted by replica id, and what changed since the last publish (id ->
        its Endpoint, or None if it left); None when nothing did.

        Only records changed since the last publish are looked at (`_dirty`,
        kept by Records): a rollout's pass changes a few dozen of 20,000, and
        walking them all, then sorting and comparing the whole list, was ~15 ms
        a pass in process and about three times that in serve (issue 19). All of
        them are looked at when what an Endpoint takes from outside its record
        changed: the catalog's ranks, or which nodes are reachable.

        One Endpoint per replica is built once and kept with its URL and its
        profile's priority and weight (the rest comes from the spec, which
        never changes), and rebuilt when one of those three differs: a catalog
        swap that leaves a profile's priority and weight alone changes nothing.
        """
        ranks = self._ranks(catalog)
        # Once per node, not per record: the nodes whose replicas may serve.
        reachable = frozenset(node.name for node in self.inventory.nodes() if node.reachable)
        dirty = self._dirty
        first = self._ready_basis is None       # the first pass publishes a list, if an empty one
        if first or self._ready_basis[0] is not ranks or self._ready_basis[1] != reachable:  # type: ignore[index]
            dirty.update(self.replicas)
            dirty.update(self._ready)
            self._ready_basis = (ranks, reachable)
        changed: dict[str, Endpoint | None] = {}
        ready, ordered, cache = self._ready, self._ordered, self._endpoint_cache
        for rid in sorted(dirty):       # in id order, the list's: a sink sees changes as a new list would give them
            rec = self.replicas.get(rid)
            ep = self._endpoint_of(rec, ranks, reachable) if rec is not None else None
            if rec is None:
                cache.pop(rid, None)
            old = ready.get(rid)
            if ep is None:
                if old is not None:
                    del ready[rid]
                    del ordered[self._position(old)]
                    changed[rid] = None
            elif old is None:
                ready[rid] = ep
                bisect.insort(ordered, ep, key=_replica_id)
                changed[rid] = ep
            elif old is not ep and old != ep:
                ready[rid] = ep
                ordered[self._position(old)] = ep
                changed[rid] = ep
        dirty.clear()
        if CHECK_INCREMENTAL:
            self._check_ready(ranks, reachable)
        if not changed and not first:
            return None
        return tuple(ordered), changed

    def _endpoint_of(self, rec: Replica, ranks: Mapping[tuple[str, str], tuple[int, float]],
                     reachable: frozenset[str]) -> Endpoint | None:
        """The record's Endpoint if it may take traffic (ready, on a reachable node, with a URL); else None."""
        if rec.state is not ReplicaState.READY or rec.node not in reachable:
            return None
        url = rec.url
        if not url:
            return None
        spec = rec.spec
        rank = ranks.get((spec.model, spec.profile), (0, 1.0))
        hit = self._endpoint_cache.get(spec.id)
        if hit is None or hit[0] != url or hit[1] != rank:
            hit = self._endpoint_cache[spec.id] = (url, rank, Endpoint(
                replica_id=spec.id, model=spec.model, profile=spec.profile, engine=spec.engine,
                url=url, priority=rank[0], weight=rank[1], metrics_path=spec.metrics))
        return hit[2]

    def _position(self, ep: Endpoint) -> int:
        at = bisect.bisect_left(self._ordered, ep.replica_id, key=_replica_id)
        assert self._ordered[at] is ep, f"the sorted endpoints lost {ep.replica_id}"
        return at

    def _check_ready(self, ranks: Mapping[tuple[str, str], tuple[int, float]], reachable: frozenset[str]) -> None:
        """CHECK_INCREMENTAL: the kept list must be the one a walk of every record gives."""
        whole = sorted((ep for rec in self.replicas.values() if (ep := self._endpoint_of(rec, ranks, reachable))),
                       key=_replica_id)
        if whole != self._ordered:
            kept = {e.replica_id for e in self._ordered}
            walked = {e.replica_id for e in whole}
            raise IncrementalMismatch(f"kept endpoints differ from every record's: only kept {sorted(kept - walked)[:5]}, "
                                 f"only walked {sorted(walked - kept)[:5]}")

    def preview(self, catalog: Catalog) -> dict:
        """What swapping in `catalog` would do to replicas, without doing it (for `catalog apply`)."""
        wanted = {}
        for model in catalog.models:
            scale = self._scale.get(model.name)
            current = scale.wanted if scale is not None else model.replicas.min
            wanted[model.name] = max(model.replicas.min, min(model.replicas.max, current))
        running, views = self._placement_input(catalog)
        plan = place(catalog, views, running, wanted)
        by_id = {r.replica_id: r for r in running}
        stale = [r for r in running if not r.current and not r.leaving and (m := catalog.resolve(r.model)) is not None
                 and m.name == r.model and _profile(m, r.profile) is not None]
        return {
            "start": [{"model": a.model, "profile": a.profile, "node": a.node, "gpus": list(a.gpu_indices)} for a in plan.start],
            "stop": [{"id": s.replica_id, "model": by_id[s.replica_id].model if s.replica_id in by_id else "",
                      "reason": s.reason} for s in plan.stop],
            "replace": [{"id": r.replica_id, "model": r.model, "profile": r.profile, "node": r.node} for r in stale],
            "unplaceable": {u.model: u.reason for u in plan.unplaceable},
        }

    # --- for status -----------------------------------------------------------

    def fleet_status(self, usage: UsageSnapshot | None = None) -> FleetStatus:
        """What the reconciler wants and what runs, typed: the control API's JSON and its metrics read this.

        Rows come from `_status_rows`, rebuilt only where a record or node changed
        since the last read; ages and usage are read now (see contracts.status).
        """
        catalog = self.live.current
        now = self._clock()
        rows = self._status_rows
        rows.update(self.replicas, self.inventory.nodes(), catalog, self.inventory.conflict)
        models = []
        kept = self._model_rows
        for model in catalog.models:
            ready, count = rows.counts.get(model.name, (0, 0))
            scale = self._scale.get(model.name)
            detail = self.unplaceable_detail.get(model.name)
            # The row of the last read while nothing it shows moved: no new record per model per read.
            key = (model, scale.wanted if scale else model.replicas.min, ready, count,
                   self.unplaceable.get(model.name), bool(getattr(detail, "permanent", False)),
                   scale.load if scale else None, scale.needed if scale else None)
            hit = kept.get(model.name)
            if hit is None or hit[0] != key:
                hit = kept[model.name] = (key, ModelStatus(
                    name=model.name, aliases=tuple(model.aliases), min=model.replicas.min, max=model.replicas.max,
                    desired=key[1], ready=ready, replicas=count, unplaceable=key[4], priority=model.priority,
                    unplaceable_permanent=key[5], metric=model.autoscale.metric,
                    target=model.autoscale.policy().target, load=key[6], needed=key[7]))
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

    def status(self, usage: UsageSnapshot | None = None) -> dict:
        """`fleet_status` as the status JSON."""
        return self.fleet_status(usage).to_dict()


def _profile(model: Model | None, name: str) -> Profile | None:
    if model is None:
        return None
    return next((p for p in model.profiles if p.name == name), None)


def _is_fallback(model: Model | None, profile: str) -> bool:
    """Whether `profile` ranks below the model's best (a strictly lower priority than its first-ranked)."""
    if model is None or not model.profiles:
        return False
    mine = _profile(model, profile)
    return mine is not None and mine.priority < model.ranked()[0].priority


def _memory_share(need_mib: int | None, memory: Mapping[int, tuple[int, int]], indices) -> float | None:
    """A profile's need as a fraction of its GPUs' memory (the smallest of them); None for whole GPUs."""
    if not need_mib or not indices:
        return None
    totals = [memory.get(i, (0, 0))[0] for i in indices]
    if min(totals) <= 0:
        return None                 # placement never shares a GPU of unknown memory
    return min(1.0, need_mib / min(totals))


def _new_id(model: str) -> str:
    # Chosen once by the controller and never reused: a short model slug for
    # people reading logs, and random bits so a restarted controller (which
    # keeps no database) cannot collide with an id it handed out before.
    slug = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-")[:24] or "replica"
    return f"{slug}-{uuid.uuid4().hex[:8]}"
