"""Whether a replica a node reports, and this controller has no record of, may be adopted.

The controller keeps no database: after a restart, what runs is what agents
report, and adopting it is what spares the fleet a restart of every engine.
But a report is a node's word, and a node holds one node token, not the
fleet: one compromised GPU machine must stay one machine. So:

- After the settling window, a node may add only a replica this controller
  gave up on while the same node was lost, and that came back with it
  (`Reconciler._forgotten`). Anything else it reports is not adopted: it is
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
- A surplus left by adoption is trimmed by `Reconciler._trim_returned`, not
  by placement's newest-id-first order (a reported id is the node's choice):
  ready first, the best profile, then ready longest by this controller's
  clock -- an adopted replica is ready from when it was adopted -- so a
  newcomer never displaces a replica adopted before it, whatever its id or
  the times it reports. After the window nothing new is adopted at all, so
  nothing can displace a replica this controller placed.

Pure functions of what they are given, so they are tested without a fleet.
"""
from __future__ import annotations

from typing import Callable, Iterable

from ..catalog import Profile
from ..contracts import ReplicaSpec, ReportedReplica
from ..inventory import Node


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
