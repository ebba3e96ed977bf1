"""The data placement reads and returns. Pure values: no I/O, no clocks, no catalog mutation."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class NodeView:
    """What placement needs to know about one node, from the inventory."""

    name: str
    pools: frozenset[str]
    gpus: tuple[int, ...]                 # GPU indices the node has
    engines: frozenset[str]               # engines its agent can run
    schedulable: bool = True              # False while unreachable or draining: nothing new lands here
    # Engines its agent reported it cannot run, each with the agent's reason,
    # which names the fix ("llama-server not found ...; install it with: ...").
    # Only for explaining an unplaceable replica; placement itself reads `engines`.
    unavailable: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    # GPU index -> (total MiB, free MiB) as its agent reported them; a GPU not
    # in it, or with total 0, has unknown memory and is never shared.
    memory: Mapping[int, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    # The most replicas with no GPU (profiles with gpus: 0) it takes, as its
    # agent reported (contracts.CpuCapacity); None: it did not say, and only
    # MAX_REPLICAS_PER_NODE bounds them.
    cpu_replicas: int | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """A replica that exists on a node (any state but gone), as the reconciler knows it."""

    replica_id: str
    model: str
    profile: str
    node: str
    gpu_indices: tuple[int, ...]
    current: bool = True                  # its spec hash still matches what the catalog says for its profile
    ready: bool = False
    failed: bool = False                  # crashed; the agent restarts it with backoff. Still counts toward wanted
    lost: bool = False                    # its node stopped reporting: it no longer counts, so a replacement is placed
    # Being drained or stopped already: it holds its GPUs until it is gone, but
    # counts for nothing and is never stopped again. Preemption counts its room
    # as coming free, which is what keeps it from choosing more victims while
    # the first ones drain.
    leaving: bool = False
    memory_mib: int = 0                   # declared per GPU (a shared GPU); 0: it holds its GPUs whole
    # A member of a replica spanning nodes (a profile with nodes > 1): the
    # group's id (its head's replica id) and this member's rank, 0 for the
    # head. A group counts as one replica of its model, and is stopped whole
    # (a stop names its head); its workers hold their nodes' GPUs as any
    # replica does. None for a replica on one node.
    group: str | None = None
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Assignment:
    """Start one replica of `model` with `profile` on `node`, on these GPUs."""

    model: str
    profile: str
    node: str
    gpu_indices: tuple[int, ...]
    # Set when this start moves the model back to a better profile: the id of
    # the fallback replica it is to replace once it is ready (a surge).
    replaces: str | None = None
    # For a profile spanning nodes: the other members' (node, GPU indices), for
    # ranks 1, 2, ... in order; `node` and `gpu_indices` are the head's (rank 0).
    # All members are placed at once or none is. Empty on one node.
    members: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Stop:
    replica_id: str
    reason: str                           # "model left the catalog", "scaled down", "replaced: profile changed"
    preempted_by: str | None = None       # the higher-priority model this stop makes room for


@dataclass(frozen=True, slots=True)
class Unplaceable:
    model: str
    reason: str                           # a person can act on it: "pool h100: 1 of 8 GPUs free, profile needs 2"
    # True when no profile of the model could ever be placed on this fleet as
    # it is, even with every other replica gone (no node has its pool or
    # engine, the largest node or GPU is too small): only an operator's change
    # to the catalog or the fleet helps, so waiting is pointless. False when
    # it is a matter of room now (GPUs held, nodes unreachable), which can
    # change by itself.
    permanent: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    start: tuple[Assignment, ...] = ()
    stop: tuple[Stop, ...] = ()
    keep: tuple[str, ...] = ()            # replica ids left as they are: every member of a group kept, by its own id
    unplaceable: tuple[Unplaceable, ...] = field(default=())


def serving(replica: Running) -> bool:
    """Whether the replica serves now. A report may say ready and failed at once (it crashed after
    passing its health check); it is not serving, so it counts as not ready."""
    return replica.ready and not replica.failed
