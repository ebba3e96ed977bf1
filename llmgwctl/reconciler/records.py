"""The controller's records of the replicas it desires (or adopted), and what changed in them.

`Records` holds them by replica id and by node, and notes the id and node of
every record put in, taken out, or written to in a field of PUBLISHED while
in: the parts of a pass read those notes (`changed_ids` for the endpoints,
`changed_nodes` for the desired lists, `unmerged` for the report merge) and
look at what changed instead of at every record. It wraps a dict rather than
being one, so every way to change it -- `update`, `setdefault`, `popitem`
included, which `MutableMapping` builds on `__setitem__`/`__delitem__` --
goes through the notes; reads go straight to the dict, as fast as one.
"""
from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from dataclasses import dataclass, field
from typing import Any

from ..contracts import ReplicaSpec, ReplicaState, ReportedReplica
from ..placement import Running

# The record fields a pass's per-record work reads, beside its node (which
# never changes): what its Endpoint and its node's desired list are made of,
# and what a node's merge compares. A write to one marks the record and its
# node for the next pass. The spec changes only in its adapters (adapters.py),
# never in its hash, id, model or profile.
PUBLISHED = frozenset({"state", "reported", "spec"})


def is_worker(spec: ReplicaSpec) -> bool:
    """Whether `spec` is a worker member of a group spanning nodes: it serves nothing, and counts for
    nothing in its model (its group counts once, as its head)."""
    return spec.group is not None and spec.group.rank != 0


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
    # Placement's view of it, kept with what it was built from: (state, current, on a draining node) -> Running.
    # Its spec and node never change, so those three are all that can make it differ.
    placed_as: tuple[ReplicaState, bool, bool, Running] | None = field(default=None, init=False, repr=False, compare=False)
    # Told this record's id and node when a field in PUBLISHED is written; set by
    # the Records it is in, None outside one.
    _watch: Callable[[str, str], None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: the spec never changes for a record, and every pass compares it.
        self.spec_hash = self.spec.spec_hash

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in PUBLISHED:
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch(self.spec.id, self.node)

    @property
    def url(self) -> str | None:
        return self.reported.url if self.reported else None


class Records(MutableMapping[str, Replica]):
    """The records by replica id (in the order they came), and by node (`on_node`, in the same order).

    What changed since each reader last looked: `changed_ids` (replica ids),
    `changed_nodes` and `unmerged` (node names). Each reader clears its own.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, Replica] = {}
        self.on_node: dict[str, dict[str, Replica]] = {}
        self.changed_ids: set[str] = set()
        self.changed_nodes: set[str] = set()
        self.unmerged: set[str] = set()
        # Members of groups spanning nodes: group id -> {rank: member id}, and
        # a worker's id -> its group's id. A change to a worker is a change to
        # its head's endpoint too (a group serves only while every member is
        # ready), so it is noted under the head's id as well.
        self.groups: dict[str, dict[int, str]] = {}
        self._group_of: dict[str, str] = {}

    def _changed(self, rid: str, node: str) -> None:
        self.changed_ids.add(rid)
        self.changed_nodes.add(node)
        self.unmerged.add(node)
        if self._group_of:
            group = self._group_of.get(rid)
            if group is not None:
                self.changed_ids.add(group)

    def members(self, group: str) -> list[Replica]:
        """The records of `group`'s members there are, by rank (its head first, if it has one)."""
        ranks = self.groups.get(group)
        if not ranks:
            return []
        return [self._by_id[rid] for _, rid in sorted(ranks.items()) if rid in self._by_id]

    # --- reads: the dict's own, for the hot loops of a pass ------------------

    def __getitem__(self, rid: str) -> Replica:
        return self._by_id[rid]

    def get(self, rid: str, default: Any = None) -> Any:
        return self._by_id.get(rid, default)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def keys(self) -> KeysView[str]:
        return self._by_id.keys()

    def values(self) -> ValuesView[Replica]:
        return self._by_id.values()

    def items(self) -> ItemsView[str, Replica]:
        return self._by_id.items()

    def __eq__(self, other: object) -> bool:
        return self._by_id == (other._by_id if isinstance(other, Records) else other)

    __hash__ = None     # type: ignore[assignment]  # mutable, as a dict

    def __repr__(self) -> str:
        return f"Records({self._by_id!r})"

    def of(self, node: str) -> list[tuple[str, Replica]]:
        """`node`'s records as (id, record), in record order: a copy, safe to change the records while walking it."""
        mine = self.on_node.get(node)
        return list(mine.items()) if mine else []

    # --- writes: every one noted ---------------------------------------------

    def __setitem__(self, rid: str, rec: Replica) -> None:
        old = self._by_id.get(rid)
        if old is not None and old is not rec:
            old._watch = None
            if old.node != rec.node:
                self._unindex(rid, old.node)
                self._changed(rid, old.node)
        self._by_id[rid] = rec
        self.on_node.setdefault(rec.node, {})[rid] = rec     # an id kept keeps its place, as in the dict
        slot = rec.spec.group
        if slot is not None:
            self.groups.setdefault(slot.group, {})[slot.rank] = rid
            if slot.rank:
                self._group_of[rid] = slot.group
        rec._watch = self._changed
        self._changed(rid, rec.node)

    def __delitem__(self, rid: str) -> None:
        rec = self._by_id.pop(rid)
        self._unindex(rid, rec.node)
        rec._watch = None
        self._changed(rid, rec.node)
        slot = rec.spec.group
        if slot is not None:
            self._group_of.pop(rid, None)
            ranks = self.groups.get(slot.group)
            if ranks is not None and ranks.get(slot.rank) == rid:
                del ranks[slot.rank]
                if not ranks:
                    del self.groups[slot.group]

    def clear(self) -> None:
        for rid in list(self._by_id):
            del self[rid]

    def _unindex(self, rid: str, node: str) -> None:
        mine = self.on_node[node]
        del mine[rid]
        if not mine:
            del self.on_node[node]
