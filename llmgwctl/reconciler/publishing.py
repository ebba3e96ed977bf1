"""What a pass hands out: the ready endpoints and the model states to the routers, each node's desired list to its agent.

Publishing costs in proportion to what changed. Every pass ends here, most
with nothing new: each node's list and the endpoint list are compared with
what was last handed out by the identity of their (immutable) specs and
Endpoints -- a C-level tuple compare -- and only a changed one is re-sorted
and handed on. Which records changed is what `Records` noted
(`changed_ids`, `changed_nodes`).

The routers first, then the agents: a pass that stops replicas withdraws
them from the endpoints and from their nodes' lists at once, and whoever is
woken first is answered first -- the routers' watches before the agents'
long-polls, so traffic leaves a replica before its engine is told to stop,
and many routers are not answered after a thousand agents when a rollout
turns replicas ready.
"""
from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Mapping
from operator import attrgetter
from types import MappingProxyType

from ..catalog import Catalog
from ..contracts import Endpoint, ModelState, ReplicaSpec, ReplicaState, ReportedReplica, RouterSink
from ..inventory import Inventory
from ..placement import Unplaceable
from .desired import DesiredStore
from .modelstates import model_states
from .records import Records, Replica, is_worker
from .scaling import GONE

replica_id = attrgetter("replica_id")


def _serving(spec: ReplicaSpec, reported: ReportedReplica | None) -> tuple[frozenset[str], Mapping[str, int]]:
    """The adapters placed on `spec` that its agent reports loaded, and the engine's numbers of those it gave one."""
    if not spec.adapters or reported is None or not reported.adapters:
        return frozenset(), {}
    loaded = reported.loaded()
    served = frozenset(a.name for a in spec.adapters if a.name in loaded)
    return served, {a.name: a.engine_id for a in reported.adapters if a.name in served and a.engine_id is not None}
Ranks = Mapping[tuple[str, str], tuple[int, float]]


class Publisher:
    """The endpoints, model states and desired lists as last handed out, and the sinks they go to."""

    def __init__(self, records: Records, inventory: Inventory, desired: DesiredStore, *,
                 on_change: Callable[[], None] = lambda: None, whole: Callable[[Replica], bool] = lambda head: True):
        self.records, self.inventory, self.desired = records, inventory, desired
        # Whether a group's head may take traffic: every member ready (groups.GroupKeeper.whole).
        self.whole = whole
        self.sinks: list[RouterSink] = []
        self._on_change = on_change
        self.endpoints: tuple[Endpoint, ...] = ()
        self.endpoints_version = 0
        # What the router is told beside the endpoints (see `modelstates`).
        self.model_states: tuple[ModelState, ...] = ()
        self._pushed_states: tuple[ModelState, ...] = ()
        # Each node's desired list as its records make it, non-empty ones only;
        # and what was last handed out: node -> (desired version, specs).
        self.node_specs: dict[str, tuple[ReplicaSpec, ...]] = {}
        self._handed: dict[str, tuple[int, tuple[ReplicaSpec, ...]]] = {}
        # Replica id -> (url, (priority, weight), Endpoint): one Endpoint per replica, rebuilt when one differs.
        self._endpoint_cache: dict[str, tuple[str, tuple[int, float], Endpoint]] = {}
        self._ranks_of: tuple[str | None, Ranks] = (None, {})
        # The ready endpoints as last published: by id, and the same sorted by id (what
        # `endpoints` is a copy of); and what a record's Endpoint depends on beyond the
        # record: the catalog's ranks and the reachable nodes (a change redoes every record).
        self._ready: dict[str, Endpoint] = {}
        self.ordered: list[Endpoint] = []
        self.basis: tuple[Ranks, frozenset[str]] | None = None
        # Publishes completed (the incremental check compares only what a whole publish kept).
        self.published = 0

    def add_sink(self, sink: RouterSink) -> None:
        """Tell `sink` what was last handed out, then every change. The catalog is not the publisher's
        to push: the controller tells its router of a swap before any pass can act on it."""
        self.sinks.append(sink)
        sink.set_endpoints(self.endpoints)
        sink.set_model_states(self.model_states)

    def derive_model_states(self, catalog: Catalog, unplaceable: Mapping[str, Unplaceable]) -> None:
        """After the plan is applied: which models are starting, which cannot be placed (pushed in `publish`)."""
        live: dict[str, set[ReplicaState]] = collections.defaultdict(set)
        # Node by node: one inventory lookup per node, not one per record.
        for name, mine in self.records.on_node.items():
            node = self.inventory.get(name)
            if node is None or not node.reachable:
                continue
            for rec in mine.values():
                if rec.state not in GONE and not is_worker(rec.spec):
                    live[rec.spec.model].add(rec.state)
        self.model_states = model_states(catalog, live, unplaceable, self.inventory.nodes())

    def publish(self, catalog: Catalog, settled: bool) -> None:
        endpoints = self._ready_endpoints(catalog)
        states = self.model_states
        if states != self._pushed_states:
            # Before the endpoints: a router woken by either then sees both as they are.
            self._pushed_states = states
            for sink in self.sinks:
                sink.set_model_states(states)
            self._on_change()
        if endpoints is not None:
            self.endpoints, changed = endpoints
            self.endpoints_version += 1
            for sink in self.sinks:
                # What changed, not the list: a rollout's pass changes a few dozen of thousands.
                sink.change_endpoints(self.endpoints, changed)
            self._on_change()
        self._desired_lists(settled)
        self.published += 1

    def _desired_lists(self, settled: bool) -> None:
        # Each node's list from its records, only for nodes whose records changed.
        per_node, records = self.node_specs, self.records
        for name in records.changed_nodes:
            mine = records.on_node.get(name)
            specs = tuple(rec.spec for rec in mine.values() if rec.state != ReplicaState.STOPPING) if mine else ()
            if specs:
                per_node[name] = specs
            else:
                per_node.pop(name, None)
        records.changed_nodes.clear()
        handed = self._handed
        for node in self.inventory.nodes():
            # Until settled, only nodes whose replicas were adopted get a list:
            # an agent takes its first answer as the whole truth.
            if node.reachable and (settled or node.name in per_node):
                specs = per_node.get(node.name, ())
                held = self.desired.get(node.name)
                last = handed.get(node.name)
                if held is not None and last is not None and last[0] == held[0] and (
                        last[1] is specs or last[1] == specs):
                    continue        # the same spec objects as the list the store holds: unchanged
                # A list the agents long-poll; not the routers' watch, which
                # carries no desired lists (bumping it would wake every router
                # for a change none of them reads).
                self.desired.set(node.name, specs)
                handed[node.name] = (self.desired.get(node.name)[0], specs)  # type: ignore[index]

    def ranks(self, catalog: Catalog) -> Ranks:
        """(model, profile) -> the profile's (priority, weight), what an Endpoint takes from the catalog; once per catalog."""
        if self._ranks_of[0] != catalog.version:
            self._ranks_of = (catalog.version, {(m.name, p.name): (p.priority, p.weight)
                                                for m in catalog.models for p in m.profiles})
        return self._ranks_of[1]

    def _ready_endpoints(self, catalog: Catalog) -> tuple[tuple[Endpoint, ...], dict[str, Endpoint | None]] | None:
        """The ready endpoints sorted by replica id, and what changed since the last publish (id ->
        its Endpoint, or None if it left); None when nothing did.

        Only records changed since the last publish are looked at
        (`Records.changed_ids`): a rollout's pass changes a few dozen of
        thousands. All of them are looked at when what an Endpoint takes from
        outside its record changed: the catalog's ranks, or which nodes are
        reachable.

        One Endpoint per replica is built once and kept with its URL and its
        profile's priority and weight (the rest comes from the spec, which
        never changes), and rebuilt when one of those three differs: a catalog
        swap that leaves a profile's priority and weight alone changes nothing.
        """
        ranks = self.ranks(catalog)
        # Once per node, not per record: the nodes whose replicas may serve.
        reachable = frozenset(node.name for node in self.inventory.nodes() if node.reachable)
        records = self.records
        dirty = records.changed_ids
        first = self.basis is None       # the first pass publishes a list, if an empty one
        if first or self.basis[0] is not ranks or self.basis[1] != reachable:  # type: ignore[index]
            dirty.update(records)
            dirty.update(self._ready)
            self.basis = (ranks, reachable)
        changed: dict[str, Endpoint | None] = {}
        ready, ordered, cache = self._ready, self.ordered, self._endpoint_cache
        for rid in sorted(dirty):       # in id order, the list's: a sink sees changes as a new list would give them
            rec = records.get(rid)
            ep = self.endpoint_of(rec, ranks, reachable) if rec is not None else None
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
                bisect.insort(ordered, ep, key=replica_id)
                changed[rid] = ep
            elif old is not ep and old != ep:
                ready[rid] = ep
                ordered[self._position(old)] = ep
                changed[rid] = ep
        dirty.clear()
        if not changed and not first:
            return None
        return tuple(ordered), changed

    def endpoint_of(self, rec: Replica, ranks: Ranks, reachable: frozenset[str]) -> Endpoint | None:
        """The record's Endpoint if it may take traffic (ready, on a reachable node, with a URL); else None."""
        if rec.state is not ReplicaState.READY or rec.node not in reachable:
            return None
        url = rec.url
        if not url:
            return None
        spec = rec.spec
        if spec.group is not None and (spec.group.rank or not self.whole(rec)):
            return None     # a worker serves nothing; a head only while its whole group is ready
        rank = ranks.get((spec.model, spec.profile), (0, 1.0))
        # An adapter is served here when it is placed here and the agent says
        # the engine holds it: placed-only is still loading; loaded-only is
        # being unloaded, and leaves the router first.
        adapters, ids = _serving(spec, rec.reported)
        hit = self._endpoint_cache.get(spec.id)
        if hit is None or hit[0] != url or hit[1] != rank or hit[2].adapters != adapters or hit[2].adapter_ids != ids:
            hit = self._endpoint_cache[spec.id] = (url, rank, Endpoint(
                replica_id=spec.id, model=spec.model, profile=spec.profile, engine=spec.engine,
                url=url, priority=rank[0], weight=rank[1], metrics_path=spec.metrics, adapters=adapters,
                adapter_ids=MappingProxyType(ids)))
        return hit[2]

    def _position(self, ep: Endpoint) -> int:
        at = bisect.bisect_left(self.ordered, ep.replica_id, key=replica_id)
        assert self.ordered[at] is ep, f"the sorted endpoints lost {ep.replica_id}"
        return at
