"""Preemption (rule 7 of `place`): stopping lower-priority replicas so a model short of its minimum fits.

`short_of_min` says how many replicas a model may preempt for; one
`Preemption` per pass chooses the victims, node by node (`_NodeRoom` is one
node's GPUs as it sees them), and says in the model's note what it waits for.
A group spanning nodes (`gang`) may be a victim, whole: a stop names its id,
and every member's GPUs, on every member's node, count as coming free. A
group with a lost member is never one (that member's GPUs do not come free).
A group short of its minimum preempts too, on N distinct nodes or none
(`Preemption._group_victims_for`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from ..catalog import Profile
from .fleet import Fleet
from .model import Running, Stop, serving
from .tally import Share, id_key, stop_order

# What a preemptor replica needs, as the walk over victims keys it: pool,
# engine, GPUs, MiB per GPU (0: whole GPUs), and the preemptor's priority.
_Shape = tuple[str | None, str, int, int, int]


def short_of_min(share: Share) -> int:
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


class Preemption:
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

    def __init__(self, fleet: Fleet, running: Sequence[Running], shares: Mapping[str, Share], stops: list[Stop]):
        self.fleet, self.shares = fleet, shares
        stopping = {s.replica_id for s in stops}
        self.leaving = {r.replica_id for r in running if r.leaving or r.replica_id in stopping}
        self.existing: dict[str, list[Running]] = defaultdict(list)
        # A group (see `gang`) goes whole: stopping it (by its id) frees every member's
        # GPUs on every member's node, and one member leaving is the group leaving.
        self.members: dict[str, list[Running]] = defaultdict(list)
        for r in running:
            if r.node in fleet:
                self.existing[r.node].append(r)
            if r.group is not None:
                self.members[r.group].append(r)
        unstoppable: set[str] = set()
        for group, members in self.members.items():
            if group in stopping or any(m.replica_id in self.leaving for m in members):
                self.leaving.update(m.replica_id for m in members)
            if any(m.lost or m.node not in fleet for m in members):
                unstoppable.add(group)      # a lost member holds its GPUs whatever the others do
        above_min: set[str] = set()
        for share in shares.values():
            order = stop_order(share.current, share.rank)
            above_min.update(r.replica_id for r in order[:max(0, len(order) - share.model.replicas.min)])
        if self.members:                    # a group's members are above its model's minimum if the group is
            above_min.update(m.replica_id for group, ms in self.members.items() if group in above_min for m in ms)
        self.priority = {r.replica_id: shares[r.model].model.priority if r.model in shares else -(1 << 62)
                         for r in running}
        # Lost replicas hold their GPUs (nobody can stop them), so they are never victims.
        order = [r for r in running if r.node in fleet and not r.lost]
        if unstoppable:
            order = [r for r in order if r.group not in unstoppable]
        order.sort(key=lambda r: id_key(r.replica_id), reverse=True)   # once per replica, then stable sorts
        order.sort(key=lambda r: (r.replica_id not in self.leaving, self.priority[r.replica_id],
                                  r.replica_id not in above_min, serving(r)))
        self.order = order
        self.by_node: dict[str, list[Running]] = defaultdict(list)
        for r in order:
            self.by_node[r.node].append(r)
        self.rooms: dict[str, _NodeRoom] = {}
        self.short_nodes: dict[_Shape, set[str]] = defaultdict(set)
        self.cursor: dict[_Shape, int] = defaultdict(int)
        self.promised: set[str] = set()     # nodes whose free room a group preempting was promised
        # GPUs taken from the fleet for groups preempting, per node: free once the plan is applied
        # (nothing starts there this pass), which is what the reasons should say.
        self.reserved: dict[str, int] = {}

    def make_room(self, share: Share, short: int) -> list[Stop]:
        stops: list[Stop] = []
        notes: list[str] = []
        p = share.model.priority
        for _ in range(short):
            found = None
            for profile in share.ranked:
                if not profile.gpus:
                    continue
                found = self._victims_for(p, profile) if profile.nodes == 1 else self._group_victims_for(p, profile)
                if found is not None:
                    break
            if found is None:
                break
            for node, (fresh, victims) in found:
                for rid in dict.fromkeys(_stopped(v) for v in fresh):
                    stops.append(Stop(rid, f"preempted by {share.model.name} (priority {p}) to place its "
                                           f"minimum of {share.model.replicas.min}", preempted_by=share.model.name))
                names = _names(self.shares, victims or fresh)
                notes.append(f"preempting {names} on {node}" if fresh else f"waiting for {names} to leave {node}")
        if notes:
            share.note = "; ".join(dict.fromkeys(notes)) + " (it starts once they are gone)"
        return stops

    def _going(self, fresh: list[Running]) -> None:
        """`fresh` are stopped: they, and every member of a group among them, count as leaving from now on."""
        self.leaving.update(v.replica_id for v in fresh)
        for v in fresh:
            if v.group is not None:     # its other members' room is coming free too
                self.leaving.update(m.replica_id for m in self.members[v.group])

    def _room(self, name: str) -> _NodeRoom:
        room = self.rooms.get(name)
        if room is None:
            room = self.rooms[name] = _NodeRoom(self.fleet, name, self.existing[name], self.by_node[name])
        return room

    def _group_victims_for(self, p: int, profile: Profile) -> list[tuple[str, tuple[list[Running], list[Running]]]] | None:
        """Room for one group on `profile.nodes` distinct nodes, or None, and then nothing is stopped or promised.

        Nodes with the room free now come first (taken for the group for the
        rest of the pass, so nothing else placed or preempting counts them);
        then nodes in victim order
        where stopping eligible replicas makes it fit, each as one preemptor
        on one node would have it. Every node is checked before any victim is
        chosen, so a group short of one node stops nobody.
        """
        fleet, gpus, need = self.fleet, profile.gpus, profile.nodes
        # Best-fit, then the name, as `Fleet.pick` would choose them: not the inventory's order.
        free = [name for _, name in sorted(
            (fleet.free_count(name), name) for name in fleet.in_pool(profile.pool)
            if name not in self.promised and fleet.free_count(name) >= gpus and fleet.slots[name] > 0
            and fleet.can_host(name, profile.pool, profile.engine)
            and (name not in self.rooms or self.rooms[name].fits(gpus, 0, set()) is not None))][:need]
        seen = set(free)
        freeing: list[str] = []
        for candidate in self.order:
            if len(free) + len(freeing) >= need:
                break
            if candidate.replica_id not in self.leaving and self.priority[candidate.replica_id] >= p:
                break                       # by priority from here on: nothing further is eligible
            name = candidate.node
            if name in seen or name in self.promised:
                continue
            seen.add(name)
            if fleet.can_host(name, profile.pool, profile.engine):
                room = self._room(name)
                eligible = {r.replica_id for r in room.replicas
                            if r.replica_id in self.leaving or self.priority[r.replica_id] < p}
                if room.fits(gpus, 0, eligible) is not None:
                    freeing.append(name)
        if len(free) + len(freeing) < need:
            return None
        for name in free:
            room = self._room(name)
            indices = room.fits(gpus, 0, set())
            assert indices is not None      # checked above, and nothing claimed there since
            room.claim(indices, 0, set())
            self._keep(name, indices)
        found = []
        for name in freeing:
            chosen = self._on_node(name, gpus, 0, p)
            assert chosen is not None       # it fits with every eligible replica gone, and _on_node may stop them all
            fresh, waits, indices = chosen
            self._going(fresh)
            self._keep(name, indices)
            found.append((name, (fresh, waits)))
        return found

    def _keep(self, name: str, indices: list[int]) -> None:
        """Keep a preemptor's room on `name` for it: its GPUs free now are taken from the fleet for the rest of the pass.

        Not only claimed here: else a surge later in the pass (rule 8) takes
        them, the preemptor preempts that surge next pass, the next surge
        takes the room it freed, and the two chase each other for ever (the
        gang property test found it, for groups and one-node preemptors alike).
        """
        self.promised.add(name)
        free = set(self.fleet.free[name])
        now = [i for i in indices if i in free]
        if now:
            self.fleet.take(name, len(now), indices=now)
            self.reserved[name] = self.reserved.get(name, 0) + len(now)

    def _victims_for(self, p: int, profile: Profile) -> list[tuple[str, tuple[list[Running], list[Running]]]] | None:
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
                        self._going(chosen[0])
                        if not memory:              # a shared GPU's free part is not one to take whole
                            self._keep(node, chosen[2])
                        return [(node, chosen[:2])]
                short_nodes.add(node)
            i += 1
        self.cursor[shape] = i
        return None

    def _on_node(self, name: str, gpus: int, memory: int, p: int
                 ) -> tuple[list[Running], list[Running], list[int]] | None:
        """(the replicas to stop, the replicas it waits for: those and any leaving ones on its GPUs, the GPUs it gets), or None."""
        room = self._room(name)
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
        return chosen, waits, indices


def _names(shares: Mapping[str, Share], victims: list[Running]) -> str:
    by_model: dict[str, list[str]] = {}
    for v in victims:
        by_model.setdefault(v.model, []).append(_stopped(v))
    parts = []
    for model, ids in by_model.items():
        ids = list(dict.fromkeys(ids))
        share = shares.get(model)
        prio = f"priority {share.model.priority}, " if share is not None else ""
        parts.append(f"{model} ({prio}{', '.join(ids)})")
    return ", ".join(parts)


def _stopped(victim: Running) -> str:
    """The id a stop of `victim` names: a group member's is its group's (the reconciler stops every member)."""
    return victim.replica_id if victim.group is None else victim.group
