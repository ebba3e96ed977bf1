"""One model's replicas sorted into what they mean for a pass (rules 2-5 of `place`), and the memo that keeps them.

A `Tally` is what a model's own replicas say on their own: which are current,
stale, lost or orphaned, which surplus ones to stop and which stale ones are
done being replaced, how many are missing, and which one rule 8 would move;
a group spanning nodes is one replica in it, stood for by one `Running`
under the group's id (`gang.one_per_group`), and a node it is on is in
the spread once per member there. A
`Share` is the tally plus what one pass does for the model (the only part
that changes). `Memo` keeps the tallies (and each node's `fleet.Held`) from
one call of place() to the next. `stop_order` and `id_key` are the one order
in which a model's replicas go, shared with preemption.
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .fleet import Fleet, Held
from .gang import one_per_group
from .model import Running, Stop, serving

if TYPE_CHECKING:
    from ..catalog import Model

SCALED_DOWN = "scaled down"
REPLACED = "replaced: profile changed"


class Memo:
    """What one call of place() built that a later call reuses where its inputs are the same: never an answer.

    A rollout at fleet size calls place() on every pass with nearly the same
    input (a few dozen of 20,000 replicas changed state); rebuilding every
    node's free GPUs and every model's tally from all of them was most of
    the call, and a large share of the pass. Two kinds of piece are
    kept, each with exactly the input it was built from, and reused only
    when that input compares equal (the same objects, in the reconciler):

    - per node, a `fleet.Held`: from the node's GPU indices and the replicas
      on it, in input order;
    - per model, a `Tally` (rules 2-5 for that model alone): from the Model
      object itself, its wanted count, the replicas naming it in input order,
      and the names of the nodes (a replica on an unknown node counts as lost).

    Everything else -- the picks, preemption, the reasons -- is done afresh,
    so a plan never depends on what a memo holds, only its cost does. Pieces
    are immutable once built; each call replaces the memo's contents with the
    pieces of its own input, so it holds one input's worth and no more. Not
    for sharing between threads: calls with one memo must not overlap.
    """

    __slots__ = ("held", "tallies", "names")

    def __init__(self) -> None:
        self.held: dict[str, Held] = {}
        self.tallies: dict[str, Tally] = {}
        self.names: tuple[str, ...] = ()


class Tally:
    """One model's replicas sorted into what they mean for a pass, and what follows from them alone (rules 2-5).

    Built from `model`, `want` and `replicas` (every replica naming the model,
    in input order) and the fleet's node names, and never changed after:
    place() reuses it while those are the same (see `Memo`).
    """

    __slots__ = ("model", "want", "replicas", "ranked", "rank", "current", "stale", "lost", "orphans", "stops",
                 "spread", "missing", "worst")

    def __init__(self, model: Model, want: int, replicas: Sequence[Running], fleet: Fleet):
        self.model, self.want, self.replicas = model, want, replicas
        self.ranked = model.ranked()                             # sorted once per model, not per replica
        self.rank = rank = {p.name: i for i, p in enumerate(self.ranked)}   # 0 = best
        current: list[Running] = []
        stale: list[Running] = []
        self.orphans: tuple[Running, ...] = ()                   # their profile left the model (rule 2)
        self.lost = 0
        # A group (a profile spanning nodes) is one replica: one Running stands for it here (see `gang`).
        members: Mapping[str, tuple[Running, ...]] = {}
        counted: Sequence[Running] = replicas
        if any(r.group is not None for r in replicas):
            counted, members = one_per_group(replicas, {p.name: p.nodes for p in model.profiles}, fleet.nodes)
        for replica in counted:
            if replica.leaving:
                continue
            if replica.profile not in rank:
                self.orphans += (replica,)
            elif replica.lost or replica.node not in fleet:
                # Left in keep: its node is not reporting, so there is nobody to
                # stop it; if the node comes back, it counts again and any surplus
                # is scaled down then.
                self.lost += 1
            elif replica.current:
                current.append(replica)
            else:
                stale.append(replica)
        stops: list[Stop] = []
        if len(current) > want:
            surplus = surplus_of(current, rank, want)
            stops.extend(Stop(r.replica_id, SCALED_DOWN) for r in surplus)
            gone = {r.replica_id for r in surplus}
            current = [r for r in current if r.replica_id not in gone]
        every_serving = all(map(serving, current))
        if stale and sum(map(serving, current)) >= want:
            stops.extend(Stop(r.replica_id, REPLACED) for r in stale)
            stale = []
        self.current, self.stale, self.stops = tuple(current), tuple(stale), tuple(stops)
        self.spread: dict[str, int] = {}                         # node -> current replicas there
        for r in current:
            self.spread[r.node] = self.spread.get(r.node, 0) + 1
        for r in current if members else ():
            for m in members[r.replica_id][1:] if r.group is not None else ():
                self.spread[m.node] = self.spread.get(m.node, 0) + 1    # a group is on each member's node
        self.missing = max(0, want - len(current))
        # The replica rule 8 would move: the model has nothing stale, all of it
        # serves, and its worst replica runs a profile of lower priority than
        # its best (whether it is also short is known only after filling).
        # None: rule 8 has nothing to do for it this pass.
        self.worst: Running | None = None
        if current and not stale and every_serving:
            worst = max(current, key=lambda r: (rank[r.profile], id_key(r.replica_id)))
            if self.ranked[0].priority != self.ranked[rank[worst.profile]].priority:
                self.worst = worst


class Share:
    """One model in this pass: its tally, and what the pass does for it (the only part that changes)."""

    __slots__ = ("model", "ranked", "rank", "current", "stale", "lost", "spread", "placed", "missing", "next_profile",
                 "want", "note", "worst")

    def __init__(self, tally: Tally):
        self.model, self.ranked, self.rank = tally.model, tally.ranked, tally.rank
        self.current, self.stale, self.lost = tally.current, tally.stale, tally.lost
        self.want, self.worst = tally.want, tally.worst
        # Node -> the model's replicas there, which picks for it add to: a copy
        # where this pass may pick for it (short, or rule 8 may move it), as
        # the tally may serve the next pass; elsewhere the tally's own, only read.
        self.spread: dict[str, int] = \
            defaultdict(int, tally.spread) if tally.missing or tally.worst is not None else tally.spread
        self.placed = 0
        self.missing = tally.missing
        # Profiles that found no room stay full for the rest of the pass (nothing
        # is freed), so later replicas of this model start at the first that may fit.
        self.next_profile = 0
        self.note = ""                                           # said before the reason when preempting



def surplus_of(current: Sequence[Running], rank: Mapping[str, int], want: int) -> list[Running]:
    """The replicas to stop when there are more than `want`, in stop order (rule 4)."""
    order = stop_order(current, rank)
    up = sum(map(serving, current))
    out = []
    for r in order[:len(current) - want]:
        if serving(r) and up - 1 < want and any(
                not serving(o) and rank[o.profile] < rank[r.profile] for o in current):
            # A better-ranked replica is still starting: this one serves until
            # it is ready, so a move to a better profile never drops capacity.
            break
        up -= serving(r)
        out.append(r)
    return out


def stop_order(replicas: Sequence[Running], rank: Mapping[str, int]) -> list[Running]:
    """Which replicas go first: lowest-priority profile, then not ready, then newest id."""
    newest_first = sorted(replicas, key=lambda r: id_key(r.replica_id), reverse=True)
    return sorted(newest_first, key=lambda r: (-rank[r.profile], serving(r)))


_DIGITS = re.compile(r"(\d+)")


# Memoised: a pass over a full fleet orders tens of thousands of replicas
# several ways, and splitting their ids was most of a preemption pass. Ids are
# never reused and the key is a pure function of the id, so a bounded cache
# (a big fleet's replicas, twice over) changes nothing but the time.
@functools.lru_cache(maxsize=1 << 17)
def id_key(replica_id: str) -> tuple[str | int, ...]:
    # Numbers inside ids compare as numbers, so r-10 is newer than r-9.
    parts = _DIGITS.split(replica_id)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))
