"""Whether a replica a node reports, and this controller has no record of, may be adopted.

The controller keeps no database: after a restart, what runs is what agents
report, and adopting it is what spares the fleet a restart of every engine.
But a report is a node's word, and a node holds one node token, not the
fleet: one compromised GPU machine must stay one machine. So:

- After the settling window, a node may add only a replica this controller
  gave up on while the same node was lost, and that came back with it
  (`Adoption.forgotten`). Anything else it reports is not adopted: it is
  not in the node's desired list, so a genuine agent stops it, as it stops an
  orphan, and it never reaches the router. A node that reports late after a
  controller restart loses its engines this way (their models are placed
  again where there is room); the window is long enough for every live
  agent to report (reconciler.SETTLE), and a later report cannot be told
  from a forged one.
- Within the window, a replica is adopted only where it could have been
  placed: its spec is the replica it reports, its profile's pool is one the
  node may claim (`inventory.Node.pools`, already cut to what its token
  allows), and its GPUs are the node's, as many as its spec takes, and
  not held whole by a replica adopted or placed before it.
- A surplus left by adoption is trimmed by `Adoption.trim`, not
  by placement's newest-id-first order (a reported id is the node's choice):
  ready first, the best profile, then ready longest by this controller's
  clock -- an adopted replica is ready from when it was adopted -- so a
  newcomer never displaces a replica adopted before it, whatever its id or
  the times it reports. After the window nothing new is adopted at all, so
  nothing can displace a replica this controller placed.

`adoption_problem` and `Refusals` are pure functions of what they are given,
so they are tested without a fleet. `Adoption` is the part of a pass that
applies them: it merges each node's report into the records (adopting,
refusing, noting what is gone), gives up on the replicas of lost nodes, and
trims what adoption or a node's return left surplus; it owns what that takes
(the replicas given up on, the merges it may skip, the claims said once).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..catalog import Catalog, Profile
from ..contracts import ReplicaSpec, ReplicaState, ReportedReplica
from ..inventory import Inventory, Node
from .desired import DesiredStore
from .placement_input import SpecHashes, profile_of
from .records import Records, Replica, is_worker
from .scaling import Scaling

_LEAVING = (ReplicaState.DRAINING, ReplicaState.STOPPING)
# What a report may move a record to; PENDING and the rest are the controller's own.
_REPORTED = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED)


def adoption_problem(node: Node, profile: Profile, spec: ReplicaSpec, rep: ReportedReplica,
                     held: Iterable[ReplicaSpec]) -> str | None:
    """Why `rep` (with its whole `spec`) cannot be adopted on `node` beside the replicas `held` there; None: it can."""
    if spec.id != rep.id or spec.model != rep.model or spec.profile != rep.profile:
        return f"its spec is of {spec.id} ({spec.model}/{spec.profile}), not of the replica reported"
    if profile.pool is not None and profile.pool not in node.pools:
        allowed = ", ".join(sorted(node.pools)) or "none"
        return f"its profile's pool {profile.pool!r} is not one node {node.name} may claim (it holds {allowed})"
    indices = spec.gpu_indices
    # The spec's own count, not the profile's: a replica of a profile whose GPU
    # count changed since is adopted and then replaced like any stale one.
    if len(indices) != spec.gpus or len(set(indices)) != len(indices):
        return f"it holds GPUs {list(indices)}; its spec takes {spec.gpus} distinct GPUs"
    memory = {g.index: g.memory_mib for g in node.gpus}
    missing = [i for i in indices if i not in memory]
    if missing:
        return f"GPUs {missing} are not GPUs node {node.name} may claim"
    shared = {i: spec.gpu_memory_mib for i in indices}
    for other in held:
        for i in set(other.gpu_indices) & shared.keys():
            if not spec.gpu_memory_mib or not other.gpu_memory_mib:
                return f"GPU {i} of node {node.name} is held by {other.id}"
            shared[i] += other.gpu_memory_mib
    over = [i for i, need in shared.items() if spec.gpu_memory_mib and need > memory[i]]
    if over:
        return f"GPUs {over} of node {node.name} do not have the memory for it beside the replicas sharing them"
    return None


# Refusals remembered so each is said once: a few thousand (replica, node)
# pairs, then forgotten all at once -- a node may report any ids it likes.
REMEMBERED = 10_000


class Refusals:
    """Adoptions refused, said once per replica and node and in one event per node and merge.

    A node reporting thousands of replicas it may not add gets one line, not
    thousands that push every other event out of status.
    """

    def __init__(self, event: Callable[[str, str], None]):
        self._event = event
        self._said: set[tuple[str, str]] = set()
        self._pending: list[str] = []

    def refuse(self, rep: ReportedReplica, node: str, why: str) -> None:
        if (rep.id, node) in self._said:
            return
        if len(self._said) >= REMEMBERED:
            self._said.clear()
        self._said.add((rep.id, node))
        self._pending.append(f"{rep.id[:100]} ({rep.model[:100]}/{rep.profile[:100]}, {rep.state}): {why}")

    def say(self, node: str) -> None:
        """The merge of `node` is over: one event for what it refused, if anything."""
        if not self._pending:
            return
        first, more = self._pending[0], len(self._pending) - 1
        self._pending.clear()
        self._event("replica-refused", f"node {node} reports {more + 1} replica{'s' if more else ''} it may not add "
                    "(not adopted, no traffic; its agent is told to stop them): " + first
                    + (f"; and {more} more" if more else ""))


class Adoption:
    """The records as the agents' reports make them: merged, adopted, given up on, trimmed."""

    def __init__(self, records: Records, inventory: Inventory, desired: DesiredStore, scaling: Scaling,
                 expected: SpecHashes, event: Callable[[str, str], None], *,
                 replace_after: float):
        self.records, self.inventory, self.desired, self.scaling = records, inventory, desired, scaling
        self._expected, self._event = expected, event
        self.replace_after = replace_after
        # Replicas given up on (their node was lost too long), by id, with that
        # node: if it comes back still running them they may be adopted again
        # (`adopt`), by that node only.
        self.forgotten: dict[str, str] = {}
        # Adoptions refused, each said once; and the models that adopted a
        # replica since the last plan, whose surplus, if any, is trimmed
        # keeping the elder (`trim`).
        self.refusals = Refusals(event)
        self.adopted_models: set[str] = set()
        # (replica id, node) pairs already said to be claimed by a second node.
        self._double_claims: set[tuple[str, str]] = set()
        # Per node: the reported replicas mapping last merged and its records then (see `merge`).
        self.merged: dict[str, tuple[Mapping[str, ReportedReplica], list[tuple[Replica, ReplicaState]]]] = {}
        # Nodes being drained (the reconciler hands in PlacementInput.draining): their replicas are on
        # their way out, so `trim` never keeps one over a replacement elsewhere.
        self.draining: set[str] = set()

    def merge(self, catalog: Catalog, now: float, settled: bool) -> None:
        """Every reachable node's report into the records, skipping the nodes whose merge would change nothing.

        Merging a node is a function of its report (a new mapping with every
        report that changed) and of its records and their states: a node
        whose report is the very one merged last pass, whose records are the
        same objects in the same states, and whose every reported replica had
        its record here (nothing to adopt, no claim by another node, which
        depend on more than this node) would come out of a merge as it went
        in. Those are skipped: most of a fleet on most passes. Which records
        changed is kept as it happens (`Records.unmerged`), so a skipped node
        needs no list of its records built to find that out.
        """
        merged, unmerged = self.merged, self.records.unmerged
        for node in self.inventory.nodes():
            if not node.reachable:
                continue
            kept = merged.get(node.name)
            if kept is None or kept[0] is not node.replicas or node.name in unmerged:
                self._merge_node(catalog, node, now, settled)
            if self.desired.get(node.name) is None and settled:
                self.desired.set(node.name, ())
        if len(merged) > len(self.inventory):
            for name in [n for n in merged if self.inventory.get(n) is None]:
                del merged[name]

    def skippable(self) -> Iterable[tuple[str, list[tuple[Replica, ReplicaState]]]]:
        """The nodes the next merge would skip, with their records as last merged (for the incremental check)."""
        for node in self.inventory.nodes():
            kept = self.merged.get(node.name)
            if node.reachable and kept is not None and kept[0] is node.replicas and node.name not in self.records.unmerged:
                yield node.name, kept[1]

    def _merge_node(self, catalog: Catalog, node: Node, now: float, settled: bool) -> None:
        records = self.records
        mine = records.of(node.name)
        owned = True
        for rep in node.replicas.values():
            rec = records.get(rep.id)
            if rec is not None and rec.node != node.name:
                self._claimed_twice(rec, node.name)
                owned = False
                continue
            if rec is None:
                owned = False
                rec = self.adopt(catalog, node, rep, now, settled)
                if rec is None:
                    continue
            self._take_report(rec, rep, node.name, now)
        # A replica the agent no longer lists: once it had listed it, or once
        # we told it to stop, absence means the engine is gone.
        for rid, rec in mine:
            if rid in node.replicas or records.get(rid) is not rec:
                continue
            if rec.state == ReplicaState.STOPPING or (rec.seen and rec.state != ReplicaState.PENDING):
                if rec.state != ReplicaState.STOPPING:
                    self._event("replica-gone", f"{rid} ({rec.spec.model}) is no longer reported by {node.name}")
                else:
                    self._event("replica-stopped", f"{rid} ({rec.spec.model}) stopped on {node.name}")
                del records[rid]
        if owned:
            # Its records as the next pass's by_node lists them: the ones left, in record order.
            self.merged[node.name] = (node.replicas, [(rec, rec.state) for rid, rec in mine
                                                      if records.get(rid) is rec])
        else:
            self.merged.pop(node.name, None)
        self.refusals.say(node.name)
        # Its own writes in this merge are what it merged, not news for the next one.
        records.unmerged.discard(node.name)

    def _take_report(self, rec: Replica, rep: ReportedReplica, node: str, now: float) -> None:
        """What the agent says of one of its replicas, into its record (a leaving one keeps its state)."""
        rec.reported, rec.seen = rep, True
        if rec.state == ReplicaState.LOST:
            rec.returned = True
        if rec.state in _LEAVING:
            return
        if rec.state != rep.state and rep.state in (ReplicaState.READY, ReplicaState.FAILED):
            detail = f": {rep.reason}" if rep.state == ReplicaState.FAILED and rep.reason else ""
            self._event(f"replica-{rep.state}", f"{rec.spec.id} ({rec.spec.model}/{rec.spec.profile} on {node}){detail}")
        rec.state = rep.state if rep.state in _REPORTED else rec.state
        if rec.state != ReplicaState.READY:
            rec.ready_since = None
        elif rec.ready_since is None:
            rec.ready_since = now
            if not rec.adopted and not rec.timed:
                self.scaling.timed_cold_start(rec, now)

    def _claimed_twice(self, rec: Replica, other: str) -> None:
        # A replica id is handed to one node once and never reused, so another
        # node reporting it is a copied state directory or a second agent: the
        # record stays with the node it was adopted on or placed on, and the
        # claim is said once (not per pass) in the events.
        if (rec.spec.id, other) not in self._double_claims:
            self._double_claims.add((rec.spec.id, other))
            self._event("replica-conflict", f"{rec.spec.id} is reported by node {other} too, but runs on "
                        f"{rec.node}; not adopted twice (is a state directory shared or copied?)")

    def adopt(self, catalog: Catalog, node: Node, rep: ReportedReplica, now: float, settled: bool) -> Replica | None:
        """A replica an agent runs that we have no record of: keep it if the catalog still has a place for it,
        and the node may add it (after the window only what returns; within it, only what fits)."""
        returned = self.forgotten.get(rep.id) == node.name
        if settled and not returned:
            self.refusals.refuse(rep, node.name, "the settling window is over and this controller did not place it there")
            return None
        model = catalog.resolve(rep.model)
        profile = profile_of(model, rep.profile)
        if model is None or model.name != rep.model or profile is None:
            return None  # not desired: absent from the node's list, so its agent stops it
        spec = rep.spec
        if spec is None:
            return None
        why = adoption_problem(node, profile, spec, rep, (r.spec for _, r in self.records.of(node.name)))
        if why is not None:
            self.refusals.refuse(rep, node.name, why)
            return None
        if returned:
            # Given up while its node was lost, and back: a healthy engine of
            # the current spec is worth more than a new start (its model may
            # have found no room elsewhere). Anything else is left to stop.
            if rep.state not in (ReplicaState.READY, ReplicaState.STARTING) or \
                    spec.spec_hash != self._expected(catalog).get((model.name, rep.profile)):
                return None
            self.forgotten.pop(rep.id, None)
        self.adopted_models.add(model.name)
        rec = Replica(spec=spec, node=node.name, created=now, state=rep.state, reported=rep, adopted=True, seen=True,
                      returned=returned, ready_since=now if rep.state == ReplicaState.READY else None)
        self.records[rep.id] = rec
        self.scaling.used(model.name, now)
        self._event("replica-readopted" if returned else "replica-adopted",
                    f"{rep.id} ({rep.model}/{rep.profile} on {node.name}, {rep.state})")
        return rec

    def lost_nodes(self, now: float) -> None:
        """The replicas of unreachable nodes are lost; those waited out (or whose model nothing else serves) given up."""
        lost = [n for n in self.inventory.nodes() if not n.reachable]
        if not lost:
            return
        records = self.records
        serving = {rec.spec.model for rec in records.values() if rec.state == ReplicaState.READY
                   and (node := self.inventory.get(rec.node)) is not None and node.reachable}
        # Through the per-node index, not every record for every lost node: a
        # rack lost at once would otherwise cost nodes times records.
        for node in lost:
            for rid, rec in records.of(node.name):
                if records.get(rid) is not rec:
                    continue
                if rec.state != ReplicaState.LOST:
                    rec.state, rec.ready_since = ReplicaState.LOST, None
                waited = now - node.unreachable_since if node.unreachable_since is not None else 0.0
                # See reconciler.REPLACE_AFTER: a model still served elsewhere waits it out; one left
                # with nothing ready is replaced at the node timeout.
                if waited >= self.replace_after or rec.spec.model not in serving:
                    del records[rid]
                    self.forgotten[rid] = node.name
                    why = "no other replica serves it" if waited < self.replace_after else \
                        f"unreachable for {waited:.0f} s"
                    self._event("replica-replaced", f"{rid} ({rec.spec.model}) on lost node {node.name} given up "
                                f"({why}); placing a replacement where there is room")
            # Its desired list is left as it was: if the node comes back, the
            # pass that merges its report adopts what is still wanted and then
            # publishes the list; until then it keeps running what it runs.

    def trim(self, catalog: Catalog, wanted: Mapping[str, int], now: float) -> None:
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
        whatever ids it reports. Nothing is stopped where nothing is surplus:
        a returning engine that had nowhere else to go just stays.
        """
        records = self.records
        returning = {rec.spec.model for rec in records.values() if rec.returned}
        models = returning | self.adopted_models
        self.adopted_models = set()
        if not models:
            return
        expected = self._expected(catalog)
        for name in models:
            recs = [r for r in records.values() if r.spec.model == name]
            for rec in recs:
                rec.returned = False
            # A group counts once, as its head; its workers follow it (groups.py).
            recs = [r for r in recs if not is_worker(r.spec)]
            model = catalog.resolve(name)
            if model is None or model.name != name:
                continue        # left the catalog: placement stops it as an orphan
            current = [r for r in recs if r.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING, ReplicaState.LOST)
                       and r.spec_hash == expected.get((name, r.spec.profile)) and r.node not in self.draining]
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
                self._event("replica-draining", f"{rec.spec.id} ({name} on {rec.node}): {rec.drain_reason}")
