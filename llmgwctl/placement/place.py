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
   that makes one replica of it fit (see `Preemption`). Equal priorities
   never preempt. Room already coming free (replicas leaving) is counted
   first, so a preemptor waits for its victims to drain instead of choosing
   more; and since higher priorities fill first (rule 6), the freed room goes
   to the preemptor, not back to its victims. Whole GPUs already free that a
   preemptor counts on beside its victims' are taken for it for the rest of
   the pass, so a surge (rule 8) cannot take them and be preempted in turn.
8. Back to the best profile: a model with everything it wants, all serving,
   that runs a replica on a fallback (not its best-ranked profile) gets one
   replica on a better profile if one fits now (a surge; rule 4 stops the
   fallback once that one is ready). One per model per pass, and only for
   models the caller lists in `movable` (the reconciler rate-limits moves).
   Surges come after everything short has been placed and never preempt.
9. A replica that fits nowhere is reported once in `unplaceable`, with why,
   and whether it is permanent (see `Unplaceable.permanent`).

A profile spanning nodes (`nodes: N > 1`) runs each replica as a *group*
of N members on N distinct nodes (see `gang`): it is placed all or nothing
(rule 6; rule 8 may move a model back to it), counts as one replica
(rules 3-4), and is stopped whole by its group's id, its head's (rules 2,
4, 5, 7: never a member alone). Every member holds its node's GPUs (rule
1). A group may be a victim of preemption, freeing every member's node;
a group short of its minimum preempts on N distinct nodes at once, each
either free now or made free by victims there, or on none (`Preemption`).
Not built: rule 5's stop-then-start never stops a stale replica to make
room for a group (a stale model whose new profile spans nodes is replaced
surge-first only, once N nodes have room). `Plan.keep` lists every member
of every group kept.

Applying a plan with no stops and placing again gives an empty plan. A plan
with stops can lead to one more step (room freed by a stop is used next pass).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Mapping, Sequence

from ..catalog import Catalog, Profile
from .fleet import Fleet, Held
from .gang import one_per_group, place_group
from .model import Assignment, NodeView, Plan, Running, Stop, Unplaceable, serving
from .preempt import Preemption, short_of_min
from .reasons import Explainer
from .tally import Memo, Share, Tally, stop_order

MODEL_LEFT = "model left the catalog"
REPLACED_NO_ROOM = "replaced: profile changed (no room to start the new one first)"


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
    shares: dict[str, Share] = {}
    for name, model in models.items():
        want = wanted.get(name, model.replicas.min)
        replicas = by_model.get(name, ())      # this call's own list, the tally's from here on
        tally = tallies.get(name)
        if tally is None or tally.model is not model or tally.want != want or tally.replicas != replicas:
            tally = Tally(model, want, replicas, fleet)
        memo.tallies[name] = tally
        shares[name] = Share(tally)

    # Orphans (rule 2) are stopped in input order, before anything else; a group once, by its id.
    orphaned = {r.replica_id: MODEL_LEFT for name, group in by_model.items() if name not in models
                for r in one_per_group(group, {}, fleet.nodes)[0] if not r.leaving}
    for tally in memo.tallies.values():
        for r in tally.orphans:
            orphaned[r.replica_id] = f"profile {r.profile} left model {r.model}"
    stops = [Stop(rid, orphaned[rid]) for rid in dict.fromkeys(
        r.replica_id if r.group is None else r.group for r in running) if rid in orphaned] if orphaned else []
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
        short = short_of_min(share)
        if not short:
            continue
        if preemption is None:
            preemption = Preemption(fleet, running, shares, stops)
        stops.extend(preemption.make_room(share, short))

    starts.extend(_back_to_best(tiers, fleet, movable))

    unplaceable: list[Unplaceable] = []
    explain = Explainer(fleet, running, priorities, starts, engines=catalog.engines,
                        reserved=preemption.reserved if preemption is not None else None)
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

    # Every member of a group kept is in keep; none of a group stopped (its stop names the group).
    stopped = {s.replica_id for s in stops}
    keep = tuple(r.replica_id for r in running if r.replica_id not in stopped and r.group not in stopped) \
        if stopped else tuple(ids)
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




def _fill(tiers: Sequence[Share], fleet: Fleet) -> list[Assignment]:
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


def _place_one(share: Share, fleet: Fleet, starts: list[Assignment]) -> bool:
    ranked = share.ranked
    while share.next_profile < len(ranked):
        start = _start(share, ranked[share.next_profile], fleet)
        if start is not None:
            starts.append(start)
            share.placed += 1
            return True
        share.next_profile += 1
    return False


def _start(share: Share, profile: Profile, fleet: Fleet, replaces: str | None = None) -> Assignment | None:
    """Take room for one replica of `profile` (a group on several nodes: all of it, see `gang`), or None."""
    if profile.nodes != 1:
        return place_group(fleet, share.model.name, profile, share.spread, replaces)
    memory = profile.gpu_memory_mib or 0
    node = fleet.pick(profile.pool, profile.engine, profile.gpus, share.spread, memory)
    if node is None:
        return None
    share.spread[node] += 1
    return Assignment(share.model.name, profile.name, node, fleet.take(node, profile.gpus, memory),
                      replaces=replaces)




def _back_to_best(tiers: Sequence[Share], fleet: Fleet, movable: Container[str] | None) -> list[Assignment]:
    """Rule 8: one surge replica on a better profile for each model running a fallback, where one fits now."""
    starts = []
    for share in tiers:
        if movable is not None and share.model.name not in movable:
            continue
        worst = share.worst             # None: nothing to move (see Tally)
        if share.missing or worst is None:
            continue
        worst_rank = share.rank[worst.profile]
        for profile in share.ranked[:worst_rank]:
            if profile.priority == share.ranked[worst_rank].priority:
                break                       # equal priority is not better, only written earlier
            start = _start(share, profile, fleet, replaces=worst.replica_id)
            if start is not None:
                starts.append(start)
                break
    return starts


def _make_room(share: Share, fleet: Fleet, going: Container[str]) -> Stop | None:
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
    for replica in stop_order(share.stale, share.rank):
        if replica.replica_id in going:
            continue
        freed = fleet.free_count(replica.node) + len(replica.gpu_indices) if replica.node in fleet else -1
        # A group's room is on several nodes at once: not made this way (see the docstring's groups).
        if any(freed >= p.gpus and p.nodes == 1 and fleet.can_host(replica.node, p.pool, p.engine) for p in ranked):
            return Stop(replica.replica_id, REPLACED_NO_ROOM)
    return None
