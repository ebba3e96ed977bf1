"""The data placement reads and returns. Pure values: no I/O, no clocks, no catalog mutation."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


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


@dataclass(frozen=True, slots=True)
class Assignment:
    """Start one replica of `model` with `profile` on `node`, on these GPUs."""

    model: str
    profile: str
    node: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    replica_id: str
    reason: str                           # "model left the catalog", "scaled down", "replaced: profile changed"


@dataclass(frozen=True, slots=True)
class Unplaceable:
    model: str
    reason: str                           # a person can act on it: "pool h100: 1 of 8 GPUs free, profile needs 2"


@dataclass(frozen=True, slots=True)
class Plan:
    start: tuple[Assignment, ...] = ()
    stop: tuple[Stop, ...] = ()
    keep: tuple[str, ...] = ()            # replica ids left as they are
    unplaceable: tuple[Unplaceable, ...] = field(default=())
