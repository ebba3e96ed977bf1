"""Replicas that span nodes: a group of members lives and dies as one.

A profile with `nodes: N > 1` runs each replica as N members, one per node
(contracts/group.py): the head (rank 0) serves the API and is the group's
one endpoint and one row in status; the workers join its rendezvous. Each
member has its own record (its node's agent runs it and reports it like any
replica), and `Records.groups` indexes them by group. `GroupKeeper` owns what
makes them one replica:

- **Whole or nothing.** The head is routed only while every member is ready
  on a reachable node (`whole`, read by publishing): a half group gets no
  request, whatever its head's API says.
- **One failure is the group's failure** (`step`): a member that failed,
  is gone, or is on a node that stopped reporting takes the group down --
  every member is stopped at once (an engine with a dead rank cannot
  serve, and the agent restarting one member alone would only rejoin a
  rendezvous nobody holds), and its model is placed again after a back-off
  that doubles with each failure in a row (`held`). After the settling
  window, a group missing a member it never had is the same: a restarted
  controller keeps a group only when every member reported.
- **Stopped as one**: a head that is stopped (scale-down, rollout,
  preemption, its model left) takes its workers with it once its requests
  are done; a worker that is drained (its node cordoned for maintenance)
  drains its head.
- **Rendezvous ports** (`ports`): chosen by the controller, before any member
  starts, from GROUP_PORTS on the head's host, none held by another group
  headed there.

It must not know HTTP or processes: it reads and writes records, and is told
each node's advertised host by the inventory.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

from ..backoff import Backoff
from ..contracts import GroupSlot, ReplicaState
from ..inventory import Inventory
from .records import Records, Replica

_LEAVING = (ReplicaState.DRAINING, ReplicaState.STOPPING)
_BROKEN = (ReplicaState.FAILED, ReplicaState.LOST)

# The heads' rendezvous ports: torch.distributed's customary master port and
# the 499 above it. Apart from an agent's engine ports (its --ports, 20000-20999
# by default), so a member's rendezvous never takes a port an agent gives an
# engine, and the agents keep clear of them all the same (agent/ports.py).
GROUP_PORTS = range(29500, 30000)
# A group that failed is placed again after 5 s, then 10, 20 ... up to 5
# minutes while it keeps failing: a rendezvous that cannot form (a firewall
# between two nodes, a member's driver broken) costs every member's GPUs
# each time, so it must not be retried in a tight loop; one that ran an hour
# starts its next failure from the first step again.
BACKOFF_INITIAL = 5.0
BACKOFF_CAP = 300.0
BACKOFF_RESET = 3600.0


class GroupKeeper:
    """The groups' life as one replica: `step` each pass, `whole` for publishing, `held` for placement."""

    def __init__(self, records: Records, inventory: Inventory, event: Callable[[str, str], None],
                 clock: Callable[[], float]):
        self.records, self.inventory, self._event, self._clock = records, inventory, event, clock
        # Per model: the back-off of its failing groups, and until when it holds new ones.
        self._backoff: dict[str, Backoff] = {}
        self._held_until: dict[str, float] = {}
        self._held_for: dict[str, float] = {}     # the back-off each held model waits out
        # Groups stopped for a failure, until their last member is gone: failed
        # once (a member on a lost node is marked lost again on every pass).
        self._failed: set[str] = set()

    def whole(self, head: Replica) -> bool:
        """Whether `head`'s group may take traffic: every member there and ready on a reachable node."""
        slot = head.spec.group
        if slot is None:
            return True
        members = self.records.members(slot.group)
        if len(members) != slot.size:
            return False
        for member in members:
            if member.state is not ReplicaState.READY:
                return False
            if not self._reachable(member.node):
                return False
        return True

    def _reachable(self, node: str) -> bool:
        known = self.inventory.get(node)
        return known is not None and known.reachable

    @property
    def holding(self) -> bool:
        """Whether any model may be held back (`held`): a cheap look for every pass."""
        return bool(self._held_until)

    def backoff_of(self, model: str) -> float:
        """The back-off `model`'s last group failure set (0 if none)."""
        return self._held_for.get(model, 0.0)

    def held(self, model: str, now: float) -> float:
        """Seconds left before `model` may have a new group placed (0: it may now)."""
        until = self._held_until.get(model)
        if until is None:
            return 0.0
        if now >= until:
            del self._held_until[model]
            return 0.0
        return until - now

    def step(self, now: float, settled: bool) -> None:
        """Every group: stopped whole when a member broke, its workers stopped with a head that stops."""
        records = self.records
        if self._failed:
            self._failed &= records.groups.keys()
        if not records.groups:
            return
        for group in list(records.groups):
            members = records.members(group)
            if not members:
                continue
            if group in self._failed:
                # What is left of it goes too: a member whose node comes back
                # still running it (it was lost, not stopping, meanwhile).
                for m in members:
                    if m.state is not ReplicaState.STOPPING and self._reachable(m.node):
                        m.state = ReplicaState.STOPPING
                continue
            slot = members[0].spec.group
            assert slot is not None     # indexed under a group only when its spec has one
            if all(m.state is ReplicaState.STOPPING for m in members):
                continue
            why = self._broken(slot, members, settled)
            if why is not None:
                self._fail(slot, members, why, now)
                continue
            head = records.get(group)
            if head is None:
                continue
            if head.state is ReplicaState.STOPPING:
                for m in members:
                    if m is not head and m.state is not ReplicaState.STOPPING:
                        m.state, m.drain_reason = ReplicaState.STOPPING, f"its group's head {group} stopped"
            elif head.state is not ReplicaState.DRAINING:
                leaving = next((m for m in members if m.state is ReplicaState.DRAINING), None)
                if leaving is not None:
                    head.state, head.drain_since = ReplicaState.DRAINING, now
                    head.drain_reason = f"member {leaving.spec.id} on {leaving.node}: {leaving.drain_reason}"
                    self._event("replica-draining", f"{group} ({head.spec.model}, a group of {slot.size}): "
                                                    f"{head.drain_reason}")
            if head.state is ReplicaState.READY and self.whole(head):
                backoff = self._backoff.get(head.spec.model)
                if backoff is not None and backoff.ready_since is None:
                    backoff.ready()     # serving since now: an hour of it and the next failure starts over

    def _broken(self, slot: GroupSlot, members: list[Replica], settled: bool) -> str | None:
        """Why the group can no longer serve, or None."""
        for m in members:
            if m.state in _BROKEN:
                detail = m.reported.reason if m.reported is not None and m.reported.reason else ""
                what = "failed" if m.state is ReplicaState.FAILED else f"is on node {m.node}, which stopped reporting"
                return f"member {m.spec.id} on {m.node} {what}{': ' + detail if detail else ''}"
        if len(members) < slot.size and settled:
            present = {m.spec.group.rank for m in members if m.spec.group is not None}
            missing = [r for r in range(slot.size) if r not in present]
            return (f"member{'s' if len(missing) > 1 else ''} of rank {', '.join(map(str, missing))} "
                    f"{'are' if len(missing) > 1 else 'is'} gone")
        return None

    def _fail(self, slot: GroupSlot, members: list[Replica], why: str, now: float) -> None:
        model = members[0].spec.model
        self._failed.add(slot.group)
        for m in members:
            if m.state is not ReplicaState.STOPPING:
                m.state, m.drain_reason, m.ready_since = ReplicaState.STOPPING, f"group failed: {why}", None
        backoff = self._backoff.get(model)
        if backoff is None:
            backoff = self._backoff[model] = Backoff(BACKOFF_INITIAL, BACKOFF_CAP, reset_after=BACKOFF_RESET,
                                                     jitter=0.0, clock=self._clock)
        wait = backoff.failure()
        self._held_until[model] = now + wait
        self._held_for[model] = wait
        self._event("group-failed", f"{slot.group} ({model}, a group of {slot.size}): {why}; every member "
                                    f"stopped, placed again in {wait:.0f} s")

    def ports(self, node: str, group: str, count: int) -> tuple[int, ...]:
        """`count` rendezvous ports on `node` for a new group `group`, none held by a group headed on its
        host (several nodes may share one: agents on one machine, each with some of its GPUs)."""
        host = self.host_of(node)
        held: set[int] = set()
        for gid in self.records.groups:
            head = self.records.get(gid)
            slot = head.spec.group if head is not None else None
            if slot is not None and slot.head_host == host:
                held.update((slot.port, slot.rpc_port))
        # From a point the id chooses, so two controllers' (or a restarted
        # one's) groups on one node seldom start at the same port.
        start = zlib.crc32(group.encode()) % len(GROUP_PORTS)
        chosen: list[int] = []
        for i in range(len(GROUP_PORTS)):
            port = GROUP_PORTS[(start + i) % len(GROUP_PORTS)]
            if port not in held:
                chosen.append(port)
                if len(chosen) == count:
                    return tuple(chosen)
        raise RuntimeError(f"node {node}: every rendezvous port of {GROUP_PORTS.start}-{GROUP_PORTS.stop - 1} "
                           "is held by a group headed there")

    def host_of(self, node: str) -> str:
        """Where members reach a head on `node`: the host its agent advertises (its name if none)."""
        known = self.inventory.get(node)
        return (known.advertise_host if known is not None else "") or node
