"""`place()`: wanted replica counts + inventory + existing replicas -> a plan of starts and stops.

The rules, in the order one pass applies them:

1. Every existing replica keeps its GPUs for the whole pass, whatever its
   state (starting, ready, failed, stale, being stopped now): an engine holds
   its devices until it is gone, so room freed by a stop is used by the *next*
   pass. Running replicas are never moved.
2. Orphans are stopped: a replica whose model left the catalog, or whose
   profile no longer exists in its model.
3. A model's *current* replicas (spec hash matches, node reporting) count
   toward `wanted`. Failed ones count too: the agent restarts them with
   backoff, and placing a second copy of a crash-looping engine would only
   double the crash loop; the reconciler surfaces the failure instead. Stale
   replicas (profile changed) and lost ones (node not reporting) don't count.
4. Too many current replicas: stop the surplus, lowest-priority profile first,
   then not-ready before ready, then newest (highest id) first.
5. Stale replicas are replaced surge-first: new current replicas are placed
   beside them while there is room, and the stale ones are stopped only once
   `wanted` current replicas are ready. When there is no room for a new one,
   one stale replica whose GPUs would make room is stopped (stop-then-start),
   but only while every current replica is ready, so one model never has an
   old replica going down while a new one is still coming up.
6. Missing replicas are placed round-robin across models (every short model
   gets its next replica before any gets two more), each on its best profile
   that fits: see `Fleet.pick` for spread, best-fit and ties.
   A node takes at most MAX_REPLICAS_PER_NODE replicas whatever their GPUs
   (see `fleet`), so GPU-less profiles cannot pile without end on a few nodes.
7. A replica that fits nowhere is reported once in `unplaceable`, with why.

Applying a plan with no stops and placing again gives an empty plan. A plan
with stops can lead to one more step (room freed by a stop is used next pass).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Mapping, Sequence

from ..catalog import Catalog, Model
from .fleet import Fleet
from .model import Assignment, NodeView, Plan, Running, Stop, Unplaceable
from .reasons import Explainer

SCALED_DOWN = "scaled down"
MODEL_LEFT = "model left the catalog"
REPLACED = "replaced: profile changed"
REPLACED_NO_ROOM = "replaced: profile changed (no room to start the new one first)"


class _Share:
    """One model's replicas, sorted into what they mean for this pass."""

    __slots__ = ("model", "ranked", "rank", "current", "stale", "spread", "placed", "missing", "next_profile")

    def __init__(self, model: Model):
        self.model = model
        self.ranked = model.ranked()                             # sorted once per pass, not per replica
        self.rank = {p.name: i for i, p in enumerate(self.ranked)}   # 0 = best
        self.current: list[Running] = []
        self.stale: list[Running] = []
        self.spread: dict[str, int] = defaultdict(int)          # node -> current replicas there
        self.placed = 0
        self.missing = 0
        # Profiles that found no room stay full for the rest of the pass (nothing
        # is freed), so later replicas of this model start at the first that may fit.
        self.next_profile = 0


def place(catalog: Catalog, nodes: Sequence[NodeView], running: Sequence[Running],
          wanted: Mapping[str, int]) -> Plan:
    """The starts and stops that bring every catalog model to its wanted replica count.

    `wanted` maps a model name to how many current replicas it should have; a
    model not in it wants `replicas.min`. ValueError for input that cannot be
    right (a wanted model not in the catalog, a negative count, a replica id or
    node name given twice) rather than a plan built on it.
    """
    shares = {m.name: _Share(m) for m in catalog.models}
    _check(wanted, shares)
    fleet = Fleet(nodes)
    stops: list[Stop] = []
    seen: set[str] = set()
    for replica in running:
        if replica.replica_id in seen:
            raise ValueError(f"replica {replica.replica_id!r} appears twice in the replicas given to placement")
        seen.add(replica.replica_id)
        fleet.occupy(replica.node, replica.gpu_indices)
        share = shares.get(replica.model)
        if share is None:
            stops.append(Stop(replica.replica_id, MODEL_LEFT))
        elif replica.profile not in share.rank:
            stops.append(Stop(replica.replica_id, f"profile {replica.profile} left model {replica.model}"))
        elif replica.lost or replica.node not in fleet:
            # Left in keep: its node is not reporting, so there is nobody to
            # stop it; if the node comes back, it counts again and any surplus
            # is scaled down then.
            pass
        elif replica.current:
            share.current.append(replica)
        else:
            share.stale.append(replica)

    for share in shares.values():
        want = wanted.get(share.model.name, share.model.replicas.min)
        current = share.current
        if len(current) > want:
            order = _stop_order(current, share.rank)
            stops.extend(Stop(r.replica_id, SCALED_DOWN) for r in order[:len(current) - want])
            current = share.current = order[len(current) - want:]
        if share.stale and sum(map(_serving, current)) >= want:
            stops.extend(Stop(r.replica_id, REPLACED) for r in share.stale)
            share.stale = []
        for r in current:
            share.spread[r.node] += 1
        share.missing = max(0, want - len(current))

    starts = _fill(shares, fleet)

    unplaceable: list[Unplaceable] = []
    explain = Explainer(fleet)
    for share in shares.values():
        if not share.missing:
            continue
        stop = _make_room(share, fleet)
        if stop is not None:
            stops.append(stop)
        reason = explain.why(share.model)
        # One value repeated, not one built per replica: a catalog at its bounds
        # can be 100,000 replicas short, and this runs on every pass.
        unplaceable.extend([Unplaceable(share.model.name, reason)] * share.missing)

    stopped = {s.replica_id for s in stops}
    return Plan(start=tuple(starts), stop=tuple(stops),
                keep=tuple(r.replica_id for r in running if r.replica_id not in stopped),
                unplaceable=tuple(unplaceable))


def _check(wanted: Mapping[str, int], shares: Mapping[str, _Share]) -> None:
    unknown = sorted(name for name in wanted if name not in shares)
    if unknown:
        raise ValueError(f"wanted names models the catalog does not have: {', '.join(unknown)}")
    negative = sorted(f"{name}={n}" for name, n in wanted.items() if n < 0)
    if negative:
        raise ValueError(f"wanted replica counts must be 0 or more: {', '.join(negative)}")


def _fill(shares: Mapping[str, _Share], fleet: Fleet) -> list[Assignment]:
    """Place missing replicas round-robin: one per short model per round, catalog order within a round."""
    starts: list[Assignment] = []
    short = [s for s in shares.values() if s.missing]
    while short:
        still_short = []
        for share in short:
            if _place_one(share, fleet, starts):
                share.missing -= 1
                if share.missing:
                    still_short.append(share)
            # else: nothing fits now and nothing will this pass; share.missing is reported
        short = still_short
    return starts


def _place_one(share: _Share, fleet: Fleet, starts: list[Assignment]) -> bool:
    ranked = share.ranked
    while share.next_profile < len(ranked):
        profile = ranked[share.next_profile]
        node = fleet.pick(profile.pool, profile.engine, profile.gpus, share.spread)
        if node is not None:
            starts.append(Assignment(share.model.name, profile.name, node, fleet.take(node, profile.gpus)))
            share.spread[node] += 1
            share.placed += 1
            return True
        share.next_profile += 1
    return False


def _make_room(share: _Share, fleet: Fleet) -> Stop | None:
    """Stop-then-start: one stale replica whose GPUs would let a new replica fit, or None.

    Only while every current replica is ready and none was placed this pass,
    so a model never has an old replica stopping while a new one is still
    starting (or crash-looping). If no stale replica's room would help (its
    node lacks the pool or engine, or too few GPUs even freed), stopping it
    would only lose capacity, so none is stopped.

    Placement keeps no memory between passes, so nothing reserves the freed
    room for this model: a short model earlier in the next pass's round can
    take it, and this model may then stop its next stale replica before the
    first is replaced. Rare (it needs two short models competing for the same
    GPUs), and the catalog order decides who gets room first.
    """
    if not share.stale or share.placed or not all(map(_serving, share.current)):
        return None
    ranked = share.ranked
    for replica in _stop_order(share.stale, share.rank):
        freed = fleet.free_count(replica.node) + len(replica.gpu_indices) if replica.node in fleet else -1
        if any(freed >= p.gpus and fleet.can_host(replica.node, p.pool, p.engine) for p in ranked):
            return Stop(replica.replica_id, REPLACED_NO_ROOM)
    return None


def _stop_order(replicas: list[Running], rank: Mapping[str, int]) -> list[Running]:
    """Which replicas go first: lowest-priority profile, then not ready, then newest id."""
    newest_first = sorted(replicas, key=lambda r: _id_key(r.replica_id), reverse=True)
    return sorted(newest_first, key=lambda r: (-rank[r.profile], _serving(r)))


def _serving(replica: Running) -> bool:
    # A report may say ready and failed at once (it crashed after passing its
    # health check); it is not serving, so it counts as not ready.
    return replica.ready and not replica.failed


def _id_key(replica_id: str) -> tuple:
    # Numbers inside ids compare as numbers, so r-10 is newer than r-9.
    parts = re.split(r"(\d+)", replica_id)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))
