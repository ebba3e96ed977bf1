"""`place()`: wanted replica counts + inventory + existing replicas -> a plan of starts and stops.

The rules, in the order one pass applies them:

1. Every existing replica keeps its GPUs (or its share of their memory) for
   the whole pass, whatever its state (starting, ready, failed, stale, being
   stopped now, leaving): an engine holds its devices until it is gone, so
   room freed by a stop is used by the *next* pass. Running replicas are
   never moved in place.
2. Orphans are stopped: a replica whose model left the catalog, or whose
   profile no longer exists in its model.
3. A model's *current* replicas (spec hash matches, node reporting) count
   toward `wanted`. Failed ones count too: the agent restarts them with
   backoff, and placing a second copy of a crash-looping engine would only
   double the crash loop; the reconciler surfaces the failure instead. Stale
   replicas (profile changed), lost ones (node not reporting) and leaving
   ones (already draining) don't count.
4. Too many current replicas: stop the surplus, lowest-priority profile first,
   then not-ready before ready, then newest (highest id) first -- except that
   a serving replica is not stopped while a replica on a better profile is
   still starting and the model would be left with fewer serving than it
   wants (that is how a move back to the best profile finishes: rule 8).
5. Stale replicas are replaced surge-first: new current replicas are placed
   beside them while there is room, and the stale ones are stopped only once
   `wanted` current replicas are ready. When there is no room for a new one,
   one stale replica whose GPUs would make room is stopped (stop-then-start),
   but only while every current replica is ready, so one model never has an
   old replica going down while a new one is still coming up. A stale
   replica preemption took (rule 7) is not stopped again, nor is its room
   counted for its own model.
6. Missing replicas are placed by model priority, highest first; within one
   priority round-robin across models in catalog order (every short model gets
   its next replica before any gets two more), each on its best profile that
   fits: see `Fleet.pick` for spread, best-fit and ties.
   A node takes at most MAX_REPLICAS_PER_NODE replicas whatever their GPUs,
   and at most the CPU capacity its agent reports (`NodeView.cpu_replicas`)
   of replicas with no GPU (see `fleet`), so GPU-less profiles cannot pile
   without end on a few nodes. Only GPU profiles preempt (rule 7): a CPU
   slot is not worth a lower-priority model's replica.
7. Preemption: a model still short of its *minimum* (not of a scale-up) may
   stop replicas of models with a strictly lower priority, on one node where
   that makes one replica of it fit (see `_Preemption`). Equal priorities
   never preempt. Room already coming free (replicas leaving) is counted
   first, so a preemptor waits for its victims to drain instead of choosing
   more; and since higher priorities fill first (rule 6), the freed room goes
   to the preemptor, not back to its victims.
8. Back to the best profile: a model with everything it wants, all serving,
   that runs a replica on a fallback (not its best-ranked profile) gets one
   replica on a better profile if one fits now (a surge; rule 4 stops the
   fallback once that one is ready). One per model per pass, and only for
   models the caller lists in `movable` (the reconciler rate-limits moves).
   Surges come after everything short has been placed and never preempt.
9. A replica that fits nowhere is reported once in `unplaceable`, with why,
   and whether it is permanent (see `Unplaceable.permanent`).

Applying a plan with no stops and placing again gives an empty plan. A plan
with stops can lead to one more step (room freed by a stop is used next pass).
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Container, Mapping, Sequence

from ..catalog import Catalog, Model, Profile
from .fleet import Fleet, Held
from .model import Assignment, NodeView, Plan, Running, Stop, Unplaceable, serving
from .reasons import Explainer

SCALED_DOWN = "scaled down"
MODEL_LEFT = "model left the catalog"
REPLACED = "replaced: profile changed"
REPLACED_NO_ROOM = "replaced: profile changed (no room to start the new one first)"


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
    - per model, a `_Tally` (rules 2-5 for that model alone): from the Model
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
        self.tallies: dict[str, _Tally] = {}
        self.names: tuple[str, ...] = ()


class _Tally:
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
        for replica in replicas:
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
            surplus = _surplus(current, rank, want)
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
        self.missing = max(0, want - len(current))
        # The replica rule 8 would move: the model has nothing stale, all of it
        # serves, and its worst replica runs a profile of lower priority than
        # its best (whether it is also short is known only after filling).
        # None: rule 8 has nothing to do for it this pass.
        self.worst: Running | None = None
        if current and not stale and every_serving:
            worst = max(current, key=lambda r: (rank[r.profile], _id_key(r.replica_id)))
            if self.ranked[0].priority != self.ranked[rank[worst.profile]].priority:
                self.worst = worst


class _Share:
    """One model in this pass: its tally, and what the pass does for it (the only part that changes)."""

    __slots__ = ("model", "ranked", "rank", "current", "stale", "lost", "spread", "placed", "missing", "next_profile",
                 "want", "note", "worst")

    def __init__(self, tally: _Tally):
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


def place(catalog: Catalog, nodes: Sequence[NodeView], running: Sequence[Running],
          wanted: Mapping[str, int], movable: Container[str] | None = None, memo: Memo | None = None) -> Plan:
    """The starts and stops that bring every catalog model to its wanted replica count.

    `wanted` maps a model name to how many current replicas it should have; a
    model not in it wants `replicas.min`. `movable` names the models that may
    be moved back to their best profile this pass (None: all). `memo`, kept
    by the caller from one call to the next, makes a call whose input is
    mostly the last one's cheap; the plan is the same without it. ValueError
    for input that cannot be right (a wanted model not in the catalog, a
    negative count, a replica id or node name given twice) rather than a plan
    built on it.
    """
    if memo is None:
        memo = Memo()                   # one path: a fresh memo is what no memo means
    models = {m.name: m for m in catalog.models}
    _check(wanted, models)
    ids = [r.replica_id for r in running]
    by_node: dict[str, list[Running]] = defaultdict(list)
    by_model: dict[str, list[Running]] = defaultdict(list)
    for replica in running:
        by_node[replica.node].append(replica)
        by_model[replica.model].append(replica)
    fleet = Fleet(nodes, _held(nodes, by_node, memo))
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for rid in ids:
            if rid in seen:
                raise ValueError(f"replica {rid!r} appears twice in the replicas given to placement")
            seen.add(rid)

    names = tuple(fleet.nodes)
    tallies = memo.tallies if names == memo.names else {}
    memo.tallies, memo.names = {}, names
    shares: dict[str, _Share] = {}
    for name, model in models.items():
        want = wanted.get(name, model.replicas.min)
        replicas = by_model.get(name, ())      # this call's own list, the tally's from here on
        tally = tallies.get(name)
        if tally is None or tally.model is not model or tally.want != want or tally.replicas != replicas:
            tally = _Tally(model, want, replicas, fleet)
        memo.tallies[name] = tally
        shares[name] = _Share(tally)

    # Orphans (rule 2) are stopped in input order, before anything else.
    orphaned = {r.replica_id: MODEL_LEFT for name, group in by_model.items() if name not in models
                for r in group if not r.leaving}
    for tally in memo.tallies.values():
        for r in tally.orphans:
            orphaned[r.replica_id] = f"profile {r.profile} left model {r.model}"
    stops = [Stop(rid, orphaned[rid]) for rid in ids if rid in orphaned] if orphaned else []
    for tally in memo.tallies.values():
        stops.extend(tally.stops)

    # Highest priority first; sorted() is stable, so equal priorities keep the catalog order.
    tiers = sorted(shares.values(), key=lambda s: -s.model.priority)
    starts = _fill(tiers, fleet)

    priorities = {m.name: m.priority for m in catalog.models}
    preemption = None
    lowest = min(priorities.values(), default=0)
    for share in tiers:
        if not share.missing or share.model.priority <= lowest:
            continue
        short = _short_of_min(share)
        if not short:
            continue
        if preemption is None:
            preemption = _Preemption(fleet, running, shares, stops)
        stops.extend(preemption.make_room(share, short))

    starts.extend(_back_to_best(tiers, fleet, movable))

    unplaceable: list[Unplaceable] = []
    explain = Explainer(fleet, running, priorities, starts, engines=catalog.engines)
    going = {s.replica_id for s in stops}        # of stale ones, only victims of preemption are in it
    for share in shares.values():
        if not share.missing:
            continue
        stop = _make_room(share, fleet, going)
        if stop is not None:
            stops.append(stop)
        reason, permanent = explain.why(share.model)
        if share.note:
            reason, permanent = f"{share.note}; {reason}", False
        # One value repeated, not one built per replica: a catalog at its bounds
        # can be 100,000 replicas short, and this runs on every pass.
        unplaceable.extend([Unplaceable(share.model.name, reason, permanent)] * share.missing)

    stopped = {s.replica_id for s in stops}
    keep = tuple(rid for rid in ids if rid not in stopped) if stopped else tuple(ids)
    return Plan(start=tuple(starts), stop=tuple(stops), keep=keep, unplaceable=tuple(unplaceable))


def _held(nodes: Sequence[NodeView], by_node: Mapping[str, Sequence[Running]], memo: Memo) -> dict[str, Held]:
    """What the existing replicas hold on each node: the memo's `Held` where its input is the same.

    The lists of `by_node` are this call's own and become the `Held`s' (never changed after).
    A node running nothing has one too: its free GPUs sorted once, not on every pass.
    """
    kept, memo.held = memo.held, {}
    for node in nodes:
        replicas = by_node.get(node.name, ())
        held = kept.get(node.name)
        if held is None or held.gpus != node.gpus or held.replicas != replicas:
            held = Held(node.gpus, replicas)
        memo.held[node.name] = held
    return memo.held


def _check(wanted: Mapping[str, int], shares: Container[str]) -> None:
    unknown = sorted(name for name in wanted if name not in shares)
    if unknown:
        raise ValueError(f"wanted names models the catalog does not have: {', '.join(unknown)}")
    negative = sorted(f"{name}={n}" for name, n in wanted.items() if n < 0)
    if negative:
        raise ValueError(f"wanted replica counts must be 0 or more: {', '.join(negative)}")


def _surplus(current: Sequence[Running], rank: Mapping[str, int], want: int) -> list[Running]:
    """The replicas to stop when there are more than `want`, in stop order (rule 4)."""
    order = _stop_order(current, rank)
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


def _fill(tiers: Sequence[_Share], fleet: Fleet) -> list[Assignment]:
    """Place missing replicas: priority by priority, round-robin within one (catalog order within a round)."""
    starts: list[Assignment] = []
    i = 0
    while i < len(tiers):
        j = i
        while j < len(tiers) and tiers[j].model.priority == tiers[i].model.priority:
            j += 1
        short = [s for s in tiers[i:j] if s.missing]
        while short:
            still_short = []
            for share in short:
                if _place_one(share, fleet, starts):
                    share.missing -= 1
                    if share.missing:
                        still_short.append(share)
                # else: nothing fits now and nothing will this pass; share.missing is reported
            short = still_short
        i = j
    return starts


def _place_one(share: _Share, fleet: Fleet, starts: list[Assignment]) -> bool:
    ranked = share.ranked
    while share.next_profile < len(ranked):
        profile = ranked[share.next_profile]
        memory = profile.gpu_memory_mib or 0
        node = fleet.pick(profile.pool, profile.engine, profile.gpus, share.spread, memory)
        if node is not None:
            starts.append(Assignment(share.model.name, profile.name, node, fleet.take(node, profile.gpus, memory)))
            share.spread[node] += 1
            share.placed += 1
            return True
        share.next_profile += 1
    return False


def _short_of_min(share: _Share) -> int:
    """Replicas of its minimum the model still lacks after filling: what it may preempt for, and only that.

    Not while it rolls out a profile change (its stale replicas serve, and
    rule 5 replaces them) nor while some of its replicas are on a lost node
    (the node may come back with them; replacing them is the lost-node path's
    business, which waits for room rather than making it).
    """
    if share.stale or share.lost:
        return 0
    protected = min(share.want, share.model.replicas.min)
    return min(share.missing, max(0, protected - len(share.current) - share.placed))


class _NodeRoom:
    """One node's GPUs as preemption sees them: who holds what, and what would be free without some of them.

    Built only for nodes preemption looks at. `held` maps a GPU index to the
    existing replicas on it (replica id -> MiB declared, 0 for a whole GPU);
    `fixed_*` is what this pass took for its starts and for the preemptors it
    already promised room to, which nothing frees. `replicas` are the node's
    victim candidates in victim order, less those already given up.
    """

    __slots__ = ("gpus", "memory", "held", "fixed_whole", "fixed_mib", "foreign", "replicas")

    def __init__(self, fleet: Fleet, name: str, existing: Sequence[Running], candidates: list[Running]):
        node = fleet.nodes[name]
        self.gpus = tuple(node.gpus)
        self.memory = node.memory
        self.replicas = candidates
        self.held: dict[int, dict[str, int]] = defaultdict(dict)
        for r in existing:
            for i in r.gpu_indices:
                self.held[i][r.replica_id] = r.memory_mib
        base_whole, base_needs = fleet.base_whole.get(name, set()), fleet.base_needs.get(name, {})
        needs = fleet.needs.get(name, {})
        self.fixed_whole = set(fleet.whole.get(name, ())) - base_whole
        self.fixed_mib = {i: needs.get(i, 0) - base_needs.get(i, 0) for i in self.gpus}
        # Memory something outside llmgw holds, as far as the report tells:
        # used minus what our replicas there declared. Where a serving replica
        # holds a GPU whole, all of its used memory may be that replica's, so 0;
        # where the one holding it whole is still starting, it may not have
        # allocated yet (as in `fleet`), so what is used is someone else's --
        # counting it as freeable would preempt for room that does not come.
        self.foreign = {}
        serving_whole = {i for r in existing if not r.memory_mib and serving(r) for i in r.gpu_indices}
        pending = fleet.pending.get(name, {})
        for i in self.gpus:
            total, free = self.memory.get(i, (0, 0))
            # Allocated by our replicas: what they declared, less what is not yet seen allocated
            # (pending also holds this pass's starts, which are in fixed_mib instead).
            allocated = base_needs.get(i, 0) - (pending.get(i, 0) - self.fixed_mib[i])
            self.foreign[i] = 0 if i in serving_whole else max(0, total - free - allocated)

    def fits(self, gpus: int, memory_mib: int, gone: set[str]) -> list[int] | None:
        """The GPUs one replica (`gpus` of them, `memory_mib` each or whole) gets once `gone` have left, or None."""
        usable = []
        for i in self.gpus:
            if i in self.fixed_whole:
                continue
            holders = [m for rid, m in self.held.get(i, {}).items() if rid not in gone]
            if 0 in holders:
                continue                    # held whole by one that stays
            if not memory_mib:
                if not holders and not self.fixed_mib[i]:
                    usable.append((0, i))
                continue
            total = self.memory.get(i, (0, 0))[0]
            budget = total - sum(holders) - self.fixed_mib[i] - self.foreign[i]
            if total > 0 and budget >= memory_mib:
                usable.append((budget, i))
        if len(usable) < gpus:
            return None
        return sorted(i for _, i in sorted(usable)[:gpus])

    def claim(self, indices: list[int], memory_mib: int, gone: set[str]) -> None:
        for holders in self.held.values():
            for rid in gone:
                holders.pop(rid, None)
        self.replicas = [r for r in self.replicas if r.replica_id not in gone]
        for i in indices:
            if memory_mib:
                self.fixed_mib[i] += memory_mib
            else:
                self.fixed_whole.add(i)


class _Preemption:
    """Choosing victims for models short of their minimum, for one pass (rule 7).

    Victims are ordered once: replicas already leaving first (their room is
    coming free at no cost), then by their model's priority, lowest first;
    within it replicas above their own model's minimum before the ones its
    minimum needs, not serving before serving, newest first. A victim may be
    taken below its own model's minimum: priority says the higher model's
    minimum matters more, and otherwise a fleet filled by low-priority
    minimums could never make room. A preemptor replica goes, profile by
    profile best first, through that order and stops at the first node where
    freeing that node's eligible replicas, in order, makes it fit; the fewest
    of them that still make it fit are stopped. A node found short for a
    profile shape stays short for the pass (room only shrinks), so each shape
    walks the order once.
    """

    def __init__(self, fleet: Fleet, running: Sequence[Running], shares: Mapping[str, _Share], stops: list[Stop]):
        self.fleet, self.shares = fleet, shares
        stopping = {s.replica_id for s in stops}
        self.leaving = {r.replica_id for r in running if r.leaving or r.replica_id in stopping}
        self.existing: dict[str, list[Running]] = defaultdict(list)
        for r in running:
            if r.node in fleet:
                self.existing[r.node].append(r)
        above_min: set[str] = set()
        for share in shares.values():
            order = _stop_order(share.current, share.rank)
            above_min.update(r.replica_id for r in order[:max(0, len(order) - share.model.replicas.min)])
        self.priority = {r.replica_id: shares[r.model].model.priority if r.model in shares else -(1 << 62)
                         for r in running}
        # Lost replicas hold their GPUs (nobody can stop them), so they are never victims.
        order = [r for r in running if r.node in fleet and not r.lost]
        order.sort(key=lambda r: _id_key(r.replica_id), reverse=True)   # once per replica, then stable sorts
        order.sort(key=lambda r: (r.replica_id not in self.leaving, self.priority[r.replica_id],
                                  r.replica_id not in above_min, serving(r)))
        self.order = order
        self.by_node: dict[str, list[Running]] = defaultdict(list)
        for r in order:
            self.by_node[r.node].append(r)
        self.rooms: dict[str, _NodeRoom] = {}
        self.short_nodes: dict[tuple, set[str]] = defaultdict(set)
        self.cursor: dict[tuple, int] = defaultdict(int)

    def make_room(self, share: _Share, short: int) -> list[Stop]:
        stops: list[Stop] = []
        notes: list[str] = []
        for _ in range(short):
            found = None
            for profile in share.ranked:
                if profile.gpus:
                    found = self._victims_for(share.model.priority, profile)
                    if found is not None:
                        break
            if found is None:
                break
            node, (fresh, victims) = found
            self.leaving.update(v.replica_id for v in fresh)
            p = share.model.priority
            for v in fresh:
                stops.append(Stop(v.replica_id, f"preempted by {share.model.name} (priority {p}) to place its "
                                                f"minimum of {share.model.replicas.min}", preempted_by=share.model.name))
            names = _names(self.shares, victims or fresh)
            notes.append(f"preempting {names} on {node}" if fresh else f"waiting for {names} to leave {node}")
        if notes:
            share.note = "; ".join(dict.fromkeys(notes)) + " (it starts once they are gone)"
        return stops

    def _victims_for(self, p: int, profile: Profile) -> tuple[str, tuple[list[Running], list[Running]]] | None:
        memory = profile.gpu_memory_mib or 0
        shape = (profile.pool, profile.engine, profile.gpus, memory, p)
        short_nodes = self.short_nodes[shape]
        i = self.cursor[shape]
        order = self.order
        while i < len(order):
            candidate = order[i]
            node = candidate.node
            if candidate.replica_id not in self.leaving and self.priority[candidate.replica_id] >= p:
                break                       # by priority from here on: nothing further is eligible
            if node not in short_nodes:
                if self.fleet.can_host(node, profile.pool, profile.engine):
                    chosen = self._on_node(node, profile.gpus, memory, p)
                    if chosen is not None:
                        self.cursor[shape] = i      # this node may fit another one
                        return node, chosen
                short_nodes.add(node)
            i += 1
        self.cursor[shape] = i
        return None

    def _on_node(self, name: str, gpus: int, memory: int, p: int) -> tuple[list[Running], list[Running]] | None:
        """(the replicas to stop, the replicas it waits for: those and any leaving ones on its GPUs), or None."""
        room = self.rooms.get(name)
        if room is None:
            room = self.rooms[name] = _NodeRoom(self.fleet, name, self.existing[name], self.by_node[name])
        eligible = [r for r in room.replicas if r.replica_id in self.leaving or self.priority[r.replica_id] < p]
        gone = {r.replica_id for r in eligible if r.replica_id in self.leaving}
        if room.fits(gpus, memory, {r.replica_id for r in eligible}) is None:
            return None                     # not even with every eligible replica gone: the common case, ruled out at once
        chosen: list[Running] = []
        indices = room.fits(gpus, memory, gone)
        for r in eligible:
            if indices is not None:
                break
            if r.replica_id not in gone:
                gone.add(r.replica_id)
                chosen.append(r)
                indices = room.fits(gpus, memory, gone)
        if indices is None:
            return None
        # The fewest that still make it fit: drop, last chosen first, any it can do without.
        for r in reversed(list(chosen)):
            if room.fits(gpus, memory, gone - {r.replica_id}) is not None:
                gone.discard(r.replica_id)
                chosen.remove(r)
        indices = room.fits(gpus, memory, gone)
        assert indices is not None          # `gone` still holds every replica the last fit needed gone
        room.claim(indices, memory, gone)
        # What it waits for: the replicas on the GPUs it gets (leaving ones included).
        needed = set(indices)
        waits = [r for r in eligible if r.replica_id in gone and needed & set(r.gpu_indices)]
        return chosen, waits


def _names(shares: Mapping[str, _Share], victims: list[Running]) -> str:
    by_model: dict[str, list[str]] = {}
    for v in victims:
        by_model.setdefault(v.model, []).append(v.replica_id)
    parts = []
    for model, ids in by_model.items():
        share = shares.get(model)
        prio = f"priority {share.model.priority}, " if share is not None else ""
        parts.append(f"{model} ({prio}{', '.join(ids)})")
    return ", ".join(parts)


def _back_to_best(tiers: Sequence[_Share], fleet: Fleet, movable: Container[str] | None) -> list[Assignment]:
    """Rule 8: one surge replica on a better profile for each model running a fallback, where one fits now."""
    starts = []
    for share in tiers:
        if movable is not None and share.model.name not in movable:
            continue
        worst = share.worst             # None: nothing to move (see _Tally)
        if share.missing or worst is None:
            continue
        worst_rank = share.rank[worst.profile]
        for profile in share.ranked[:worst_rank]:
            if profile.priority == share.ranked[worst_rank].priority:
                break                       # equal priority is not better, only written earlier
            memory = profile.gpu_memory_mib or 0
            node = fleet.pick(profile.pool, profile.engine, profile.gpus, share.spread, memory)
            if node is not None:
                starts.append(Assignment(share.model.name, profile.name, node,
                                         fleet.take(node, profile.gpus, memory), replaces=worst.replica_id))
                share.spread[node] += 1
                break
    return starts


def _make_room(share: _Share, fleet: Fleet, going: Container[str]) -> Stop | None:
    """Stop-then-start: one stale replica whose GPUs would let a new replica fit, or None.

    A stale replica in `going` (preemption took it for a higher-priority
    model) is already going, and its room is promised to that model, so it is
    neither stopped a second time nor counted as room for this one.

    Only while every current replica is ready and none was placed this pass,
    so a model never has an old replica stopping while a new one is still
    starting (or crash-looping). If no stale replica's room would help (its
    node lacks the pool or engine, or too few GPUs even freed), stopping it
    would only lose capacity, so none is stopped.

    Placement keeps no memory between passes, so nothing reserves the freed
    room for this model: a short model earlier in the next pass's round can
    take it, and this model may then stop its next stale replica before the
    first is replaced. Rare (it needs two short models competing for the same
    GPUs), and the priority and catalog order decide who gets room first.
    """
    if not share.stale or share.placed or not all(map(serving, share.current)):
        return None
    ranked = share.ranked
    for replica in _stop_order(share.stale, share.rank):
        if replica.replica_id in going:
            continue
        freed = fleet.free_count(replica.node) + len(replica.gpu_indices) if replica.node in fleet else -1
        if any(freed >= p.gpus and fleet.can_host(replica.node, p.pool, p.engine) for p in ranked):
            return Stop(replica.replica_id, REPLACED_NO_ROOM)
    return None


def _stop_order(replicas: Sequence[Running], rank: Mapping[str, int]) -> list[Running]:
    """Which replicas go first: lowest-priority profile, then not ready, then newest id."""
    newest_first = sorted(replicas, key=lambda r: _id_key(r.replica_id), reverse=True)
    return sorted(newest_first, key=lambda r: (-rank[r.profile], serving(r)))


_DIGITS = re.compile(r"(\d+)")


# Memoised: a pass over a full fleet orders tens of thousands of replicas
# several ways, and splitting their ids was most of a preemption pass. Ids are
# never reused and the key is a pure function of the id, so a bounded cache
# (a big fleet's replicas, twice over) changes nothing but the time.
@functools.lru_cache(maxsize=1 << 17)
def _id_key(replica_id: str) -> tuple:
    # Numbers inside ids compare as numbers, so r-10 is newer than r-9.
    parts = _DIGITS.split(replica_id)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


