"""Cordon, drain and uncordon: the operator taking a node out of placement, and its replicas off it.

`Maintenance` owns which nodes the operator holds (`holds`) and what that
means for a pass:

- A **cordoned** node is not schedulable (PlacementInput.cordoned): nothing
  new lands there, what runs keeps running and counting.
- A **draining** node is cordoned, and its replicas are *leaving* for
  placement (PlacementInput.draining) while they still serve: they no longer
  count toward what their model wants, so placement surges replacements onto
  other nodes as it places any missing replica. A replica of the node is
  taken out of the router (DRAINING, then stopped by `Planner.drain` once the
  router reports no request in flight on it, or after the drain grace) only
  when its model has enough ready replicas elsewhere to take its traffic, or
  when no replacement is coming (there is no room for one: the operator asked
  for the node, and waiting would not make room), or when `surge_wait` is
  over (a replacement that never comes ready must not hold the maintenance
  forever). Capacity is kept where the fleet has room for it.
- A draining node with none of our replicas left is **drained**.
- **Uncordon** makes the node placeable again; its replicas come back by
  ordinary placement. A replica already taken out of the router keeps
  stopping (putting it back while its engine is being stopped is a race);
  one not yet taken out counts again, and any surplus that leaves is
  scaled down as usual.

It must not know files or HTTP: the control plane keeps the holds across a
restart (control.maintenance) and gives them back with `restore`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..contracts import ReplicaState, Scheduling
from .records import Records, Replica, is_worker

# How long a drain waits for a replacement to become ready before taking the
# node's replica out anyway: a large model's cold start (its weights read and
# loaded) takes minutes, so ten of them; past that the replacement is likely
# crash-looping, and the operator's maintenance should not wait on it.
SURGE_WAIT = 600.0

_LEAVING = (ReplicaState.DRAINING, ReplicaState.STOPPING)
_COMING = (ReplicaState.PENDING, ReplicaState.STARTING)


@dataclass(frozen=True, slots=True)
class Hold:
    """What the operator asked of one node: cordoned, and drained when `drain`."""

    drain: bool = False
    # When the drain was asked, on the reconciler's clock (surge_wait is counted from it).
    since: float = 0.0


class Maintenance:
    """The operator's holds on nodes, and the drain's progress, one pass at a time (`step`)."""

    def __init__(self, records: Records, cordoned: set[str], draining: set[str],
                 event: Callable[[str, str], None], *, surge_wait: float = SURGE_WAIT):
        self.records = records
        # PlacementInput's own sets, kept equal to the holds: what placement reads.
        self._cordoned, self._draining = cordoned, draining
        self._event = event
        self.surge_wait = surge_wait
        self.holds: dict[str, Hold] = {}
        self._drained: set[str] = set()     # draining nodes already said to be drained (one event each)

    # --- the operator's verbs (each idempotent; True when it changed something) ---

    def cordon(self, node: str) -> bool:
        if node in self.holds:
            return False
        self._hold(node, Hold())
        self._event("node-cordoned", f"node {node} is cordoned: nothing new is placed there")
        return True

    def drain(self, node: str, now: float) -> bool:
        held = self.holds.get(node)
        if held is not None and held.drain:
            return False
        self._hold(node, Hold(drain=True, since=now))
        self._event("node-draining", f"node {node} is draining: its replicas are replaced elsewhere, then stopped")
        return True

    def uncordon(self, node: str) -> bool:
        if self.holds.pop(node, None) is None:
            return False
        self._cordoned.discard(node)
        self._draining.discard(node)
        self._drained.discard(node)
        self._event("node-uncordoned", f"node {node} is schedulable again")
        return True

    def restore(self, holds: Mapping[str, bool], now: float) -> None:
        """Holds kept across a restart (node -> drain); a drain's surge wait starts again from `now`."""
        for node, drain in holds.items():
            self._hold(node, Hold(drain=drain, since=now))

    def _hold(self, node: str, hold: Hold) -> None:
        self.holds[node] = hold
        self._cordoned.add(node)
        if hold.drain:
            self._draining.add(node)

    # --- what callers read ------------------------------------------------------

    def state(self, node: str) -> Scheduling:
        held = self.holds.get(node)
        if held is None:
            return Scheduling.SCHEDULABLE
        if not held.drain:
            return Scheduling.CORDONED
        return Scheduling.DRAINED if not self.records.on_node.get(node) else Scheduling.DRAINING

    def waiting(self) -> bool:
        """Whether a draining node still has a replica in the router: a pass is due though nothing woke it."""
        return any(rec.state not in _LEAVING for node in self._draining for _, rec in self.records.of(node))

    # --- the pass ---------------------------------------------------------------------

    def step(self, wanted: Mapping[str, int], now: float) -> None:
        """Take out of the router the draining nodes' replicas whose traffic can go elsewhere (see the docstring).

        Run after placement in the same pass, so a replacement placed this
        pass already counts as coming.
        """
        if not self._draining:
            return
        for node in sorted(self._draining):
            held = [rec for _, rec in self.records.of(node) if rec.state not in _LEAVING]
            if not held:
                if node not in self._drained:
                    self._drained.add(node)
                    self._event("node-drained", f"node {node} is drained: none of its replicas is left")
                continue
            self._drained.discard(node)
            late = now - self.holds[node].since >= self.surge_wait
            by_model: dict[str, list[Replica]] = {}
            for rec in held:
                by_model.setdefault(rec.spec.model, []).append(rec)
            for model, mine in by_model.items():
                for rec in self._releasable(model, mine, wanted.get(model, 0), late):
                    rec.state, rec.drain_since = ReplicaState.DRAINING, now
                    rec.drain_reason = f"node {node} is draining"
                    self._event("replica-draining", f"{rec.spec.id} ({rec.spec.model} on {node}): node {node} "
                                                    "is draining")

    def _spans_draining(self, group: str) -> bool:
        return any(m.node in self._draining for m in self.records.members(group))

    def _releasable(self, model: str, mine: list[Replica], wanted: int, late: bool) -> Iterable[Replica]:
        """Which of `model`'s replicas on a draining node may leave the router now."""
        # Not serving: nothing to keep for their traffic.
        serving = [rec for rec in mine if rec.state == ReplicaState.READY]
        yield from (rec for rec in mine if rec.state != ReplicaState.READY)
        if not serving:
            return
        ready = coming = 0
        for rec in self.records.values():
            if rec.spec.model != model or rec.node in self._draining or is_worker(rec.spec):
                continue        # a group counts once, as its head
            if rec.spec.group is not None and self._spans_draining(rec.spec.group.group):
                continue        # a group with a member on a draining node is leaving too
            ready += rec.state == ReplicaState.READY
            coming += rec.state in _COMING
        if late or coming == 0:
            yield from serving
            return
        # Keep as many serving as the model wants, counting the replacements ready elsewhere.
        spare = ready + len(serving) - wanted
        yield from serving[:max(0, spare)]


def holds_of(maintenance: Maintenance) -> dict[str, bool]:
    """The holds as the control plane keeps them: node -> drain."""
    return {node: hold.drain for node, hold in sorted(maintenance.holds.items())}
