"""Status rows kept between reads: one `ReplicaStatus` per record and one `NodeStatus` per node, rebuilt
only for what changed since the last read (issue 19).

At 5,000 nodes and 20,000 replicas, building every row (20,000 frozen
records, 40,000 GPU rows) and encoding them again was most of the ~0.9 s a
status read took on the event loop, for every call, `/metrics` scrape and
console push. A row is now built when what it shows changes, which is read
from the record itself on every read -- a tuple compare of a few fields, not
a version someone must remember to bump -- so a change the cache did not
hear of still shows at once. Records are mutated in place by the passes
(state, reported, drain reason), so a row is keyed by the record's identity
and those fields; its spec, node and creation time are the record's for life.

What moves without any record changing -- ages, in-flight counts, heartbeat
counts -- is not in a row: `FleetStatus` carries it per read (see
contracts.status).

It knows the reconciler's records and the inventory's nodes, read-only.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from ..catalog import Catalog, Model
from ..catalog.modelrules import LAUNCH_LORA_REASON
from ..contracts import AdapterStatus, NodeStatus, ReplicaState, ReplicaStatus, Scheduling
from ..contracts.adapters import LOADING, UNLOADING
from ..contracts.group import MemberStatus
from ..contracts.status import GpuStatus, replica_adapters
from ..inventory import Node
from .placement_input import stale_adapters
from .records import Replica, is_worker

# What a replica's row shows that its record may change in place (a pass sets
# them); the rest is the record's for life. A C-level getter: it runs for every
# record on every read.
_ROW_KEY = operator.attrgetter("state", "reported", "adopted", "drain_reason", "spec")
_NO_GPUS: Mapping[int, str] = MappingProxyType({})      # a node none of whose GPUs a replica holds
_STOPPING = (ReplicaState.DRAINING, ReplicaState.STOPPING)
_STARTING = (ReplicaState.PENDING, ReplicaState.STARTING)


class StatusRows:
    """The rows of the last read, and the order they are shown in; `update()` brings them up to date."""

    def __init__(self, is_fallback: Callable[[Model | None, str], bool]):
        self._is_fallback = is_fallback
        self._replicas: dict[str, tuple[Replica, tuple[object, ...], ReplicaStatus]] = {}   # id -> (record, key, row)
        self._nodes: dict[str, tuple[Node, tuple[object, ...], NodeStatus]] = {}
        self._catalog: str | None = None
        self._replica_ids: frozenset[str] = frozenset()
        self._node_names: frozenset[str] = frozenset()
        self._replica_order: list[str] = []         # by (model, id), as status always listed them
        self._node_order: list[str] = []
        self._holders: dict[str, dict[int, str]] = {}
        self.replica_rows: tuple[ReplicaStatus, ...] = ()
        self.node_rows: tuple[NodeStatus, ...] = ()
        self.counts: dict[str, tuple[int, int]] = {}     # model -> (ready, records)
        self.built = 0      # rows built since start: how a test tells a cached read from a rebuilt one

    def update(self, records: Mapping[str, Replica], nodes: Iterable[Node], catalog: Catalog,
               conflict: Callable[[Node], str | None],
               scheduling: Callable[[str], Scheduling] = lambda node: Scheduling.SCHEDULABLE) -> None:
        cache = self._replicas
        changed = False
        if catalog.version != self._catalog:
            cache.clear()       # `fallback` is the catalog's to say
            self._catalog = catalog.version
        key_of = _ROW_KEY
        replaced = False
        for rid, rec in records.items():
            slot = rec.spec.group
            if slot is not None:
                if slot.rank:
                    continue        # a worker: shown in its group's row, the head's
                key = (*key_of(rec), *(key_of(m) for m in self._members_of(records, rec)))
            else:
                key = key_of(rec)
            hit = cache.get(rid)
            if hit is None or hit[0] is not rec or hit[1] != key:
                # Another record under a known id (given up, then adopted again) may sit on other GPUs.
                replaced = replaced or (hit is not None and hit[0] is not rec)
                cache[rid] = (rec, key, self._replica_row(rec, catalog, records))
                changed = True
        membership = replaced or records.keys() != self._replica_ids
        if membership:
            for rid in [r for r in cache if r not in records]:
                del cache[rid]
            self._replica_ids = frozenset(records)
            self._replica_order = sorted((r for r, rec in records.items() if not is_worker(rec.spec)),
                                         key=lambda r: (records[r].spec.model, r))
            # Which replica holds each GPU of each node: ids, nodes and GPUs are a record's for life.
            holders: dict[str, dict[int, str]] = {}
            for rec in records.values():
                for i in rec.spec.gpu_indices:
                    holders.setdefault(rec.node, {})[i] = rec.spec.id
            self._holders = holders
        if changed or membership:
            self.replica_rows = tuple(cache[rid][2] for rid in self._replica_order)
            counts: dict[str, list[int]] = {}
            for row in self.replica_rows:
                c = counts.setdefault(row.model, [0, 0])
                c[0] += row.state == ReplicaState.READY
                c[1] += 1
            self.counts = {m: (ready, n) for m, (ready, n) in counts.items()}
        self._update_nodes(nodes, conflict, scheduling)

    def _update_nodes(self, nodes: Iterable[Node], conflict: Callable[[Node], str | None],
                      scheduling: Callable[[str], Scheduling]) -> None:
        cache, holders = self._nodes, self._holders
        changed = False
        seen = {}
        for node in nodes:
            seen[node.name] = node
            held = holders.get(node.name, _NO_GPUS)
            # The revision moves with every report that says something new (pools, GPUs, engines).
            # (A refusal is shown only while recent: asked of the inventory while there is one.)
            key = (node.revision, node.reachable, conflict(node) if node.conflict is not None else None, held,
                   scheduling(node.name))
            hit = cache.get(node.name)
            if hit is None or hit[0] is not node or hit[1] != key:
                cache[node.name] = (node, key, self._node_row(node, key[2], held, key[4]))
                changed = True
        if seen.keys() != self._node_names:
            for name in [n for n in cache if n not in seen]:
                del cache[name]
            self._node_names = frozenset(seen)
            self._node_order = sorted(seen)
            changed = True
        if changed:
            self.node_rows = tuple(cache[name][2] for name in self._node_order)

    def _replica_row(self, rec: Replica, catalog: Catalog, records: Mapping[str, Replica]) -> ReplicaStatus:
        self.built += 1
        rep = rec.reported
        spec = rec.spec
        return ReplicaStatus(
            id=spec.id, model=spec.model, profile=spec.profile, engine=spec.engine,
            node=rec.node, gpus=spec.gpu_indices, state=rec.state, url=rec.url,
            pid=rep.pid if rep else None, restarts=rep.restarts if rep else 0,
            last_exit=rep.last_exit if rep else None, adopted=rec.adopted,
            reason=rec.drain_reason if rec.state in _STOPPING else (rep.reason if rep else ""),
            spec_hash=rec.spec_hash, last_log=rep.last_log if rep else (),
            fallback=self._is_fallback(catalog.resolve(spec.model), spec.profile),
            starting_since=rec.created if rec.state in _STARTING else None,
            adapters=self._adapters(rec, catalog),
            members=tuple(_member_row(m) for m in self._members_of(records, rec)) if spec.group else ())

    @staticmethod
    def _adapters(rec: Replica, catalog: Catalog) -> tuple[AdapterStatus, ...]:
        """The replica's adapters as reported; for a launch-time engine's, those its replacement changes, saying why."""
        rep, spec = rec.reported, rec.spec
        shown = replica_adapters(spec.adapters, rep.adapters if rep else ())
        lacks, extra = stale_adapters(spec, catalog.resolve(spec.model))
        if not (lacks or extra):
            return shown
        going = set(extra)
        return (*(AdapterStatus(a.name, UNLOADING, LAUNCH_LORA_REASON) if a.name in going else a for a in shown),
                *(AdapterStatus(name, LOADING, LAUNCH_LORA_REASON) for name in lacks if name not in going))

    @staticmethod
    def _members_of(records: Mapping[str, Replica], head: Replica) -> list[Replica]:
        slot = head.spec.group
        assert slot is not None
        found = (records.get(slot.member_id(rank)) for rank in range(slot.size))
        return [m for m in found if m is not None]

    def _node_row(self, node: Node, conflict: str | None, held: Mapping[int, str],
                  scheduling: Scheduling = Scheduling.SCHEDULABLE) -> NodeStatus:
        self.built += 1
        indices = {g.index for g in node.gpus}
        return NodeStatus(
            name=node.name, reachable=node.reachable, pools=tuple(sorted(node.pools)),
            gpus=len(node.gpus), gpus_used=len(held.keys() & indices),
            gpu_models=tuple(sorted({g.name for g in node.gpus if g.name})),
            engines=tuple(sorted(node.available_engines)),
            engines_missing={n: why for n, (ok, why) in sorted(node.engines.items()) if not ok},
            conflict=conflict, refused=node.refused,
            token="legacy" if node.claims.legacy else "", scheduling=scheduling,
            gpu_list=tuple(GpuStatus(g.index, g.name, g.memory_mib, held.get(g.index))
                           for g in sorted(node.gpus, key=lambda g: g.index)))


def _member_row(rec: Replica) -> MemberStatus:
    rep, slot = rec.reported, rec.spec.group
    return MemberStatus(rank=slot.rank if slot is not None else 0, id=rec.spec.id, node=rec.node,
                        gpus=rec.spec.gpu_indices, state=rec.state, pid=rep.pid if rep else None,
                        restarts=rep.restarts if rep else 0,
                        reason=rec.drain_reason if rec.state in _STOPPING else (rep.reason if rep else ""))
