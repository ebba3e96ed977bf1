"""What a member of a replica spanning nodes changes for the agent: workers serve nothing, heads' ports are taken.

A member's spec carries its `GroupSlot` (contracts.group). The head (rank 0)
is a replica like any other: a port of this agent's, probed over HTTP,
reported with its URL. A worker (rank > 0) serves no API: it gets no port,
is reported with no URL (nothing routes to it) and is never probed over
HTTP -- not its health, not its /metrics: a request to a port of a
multi-node engine that is not its API (its rendezvous) is known to crash
vLLM's multi-node start-up, and a worker has no other. It is ready once its
process has run `WORKER_SETTLE` seconds, failed when it exits, restarted
with back-off like any replica; whether the group formed is the head's
health to say (its API serves only with every rank joined).

The controller chose each head's rendezvous port (and data parallel's RPC
port) on the head's node before any member started, so no engine this agent
starts may be given one of them: `group_ports` are held from port picking.

It knows no engine and no HTTP: it reads specs and the agent's records.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..contracts import ReplicaSpec
from .replica import Replica

# How long a worker's process must run before it counts as ready: an engine
# started wrong (an argument it refuses, a model it cannot read, a head that
# refuses it) exits within its first seconds; past them it has joined its
# head or is waiting for it, and the head's health says which.
WORKER_SETTLE = 5.0


def serves_api(spec: ReplicaSpec) -> bool:
    """Whether the replica has an API of its own: every replica but a group's worker."""
    return spec.group is None or spec.group.head


def settling(r: Replica, now: float, settle: float = WORKER_SETTLE) -> str:
    """"" once a worker's process has run `settle` seconds (it is ready), else why it is not ready yet."""
    ran = now - r.started_at
    if ran >= settle:
        return ""
    assert r.spec.group is not None
    return (f"worker rank {r.spec.group.rank} of group {r.spec.group.group}: ready once it has run "
            f"{settle:g} s ({ran:.0f} s so far)")


def group_ports(specs: Iterable[ReplicaSpec]) -> set[int]:
    """The rendezvous and RPC ports the groups of `specs` use, held from every engine's port picking.

    A worker's slot names its head's ports, which are on another node: held
    here too, which costs a port or two of the range and spares knowing
    which address is this node's.
    """
    held: set[int] = set()
    for spec in specs:
        if spec.group is not None:
            held.update(p for p in (spec.group.port, spec.group.rpc_port) if p)
    return held
