"""The inventory: which nodes exist, what they have, and what they say they run.

Owns the controller's picture of the fleet, fed only by agent reports: each
node's pools, GPUs, the engines its agent can run, the replicas it reports, and
when it last reported. A node that misses reports becomes `unreachable`.

It must not know about catalogs, placement or the router; it is plain state
with an injected clock, so heartbeat timeouts are tested without sleeping.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

# Agents report every 5 s (agent.controller.HEARTBEAT). Three missed reports
# make a node unreachable: one late report on a busy machine is not a failure,
# and 15 s is still short enough that clients stop being sent to a dead node
# before most of them time out.
UNREACHABLE_AFTER = 15.0


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str = ""
    name: str = ""
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class ReportedReplica:
    """One replica as its agent last described it."""

    id: str
    spec_hash: str
    model: str
    profile: str
    engine: str
    gpu_indices: tuple[int, ...]
    state: str                      # starting | ready | failed | stopping
    url: str | None = None
    port: int | None = None
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    reason: str = ""
    last_log: tuple[str, ...] = ()
    spec: Mapping[str, Any] | None = field(default=None, compare=False)   # ReplicaSpec.to_dict(), for adoption

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ReportedReplica":
        return cls(
            id=str(d["id"]), spec_hash=str(d.get("spec_hash", "")), model=str(d.get("model", "")),
            profile=str(d.get("profile", "")), engine=str(d.get("engine", "")),
            gpu_indices=tuple(int(i) for i in d.get("gpu_indices") or ()), state=str(d.get("state", "starting")),
            url=d.get("url"), port=d.get("port"), pid=d.get("pid"), restarts=int(d.get("restarts") or 0),
            last_exit=d.get("last_exit"), reason=str(d.get("reason") or ""),
            last_log=tuple(str(x) for x in (d.get("last_log") or ())[-20:]),
            spec=d.get("spec") if isinstance(d.get("spec"), Mapping) else None,
        )


@dataclass
class Node:
    name: str
    boot_id: str = ""
    pools: frozenset[str] = frozenset()
    gpus: tuple[Gpu, ...] = ()
    engines: Mapping[str, tuple[bool, str]] = field(default_factory=dict)
    replicas: Mapping[str, ReportedReplica] = field(default_factory=dict)
    advertise_host: str = ""
    first_seen: float = 0.0
    last_seen: float = 0.0
    reports: int = 0
    reachable: bool = True
    unreachable_since: float | None = None

    @property
    def available_engines(self) -> frozenset[str]:
        return frozenset(n for n, (ok, _) in self.engines.items() if ok)


class ReportError(ValueError):
    """A report that does not follow the agent protocol; the agent gets a 400 with this text."""


class Inventory:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, unreachable_after: float = UNREACHABLE_AFTER):
        self._clock = clock
        self.unreachable_after = unreachable_after
        self._nodes: dict[str, Node] = {}

    def report(self, node_name: str, body: Mapping[str, Any]) -> tuple[Node, bool]:
        """Take one agent report. Returns the node and whether it came back from unreachable."""
        if not isinstance(body, Mapping):
            raise ReportError("report must be a JSON object")
        if body.get("node", node_name) != node_name:
            raise ReportError(f"report for node {body.get('node')!r} sent to node {node_name!r}")
        try:
            gpus = tuple(Gpu(int(g["index"]), str(g.get("uuid", "")), str(g.get("name", "")),
                             int(g.get("memory_mib") or 0)) for g in body.get("gpus") or ())
            replicas = {r.id: r for r in (ReportedReplica.from_dict(x) for x in body.get("replicas") or ())}
            engines = {str(k): (bool(v.get("available")), str(v.get("reason") or ""))
                       for k, v in (body.get("engines") or {}).items()}
            pools = frozenset(str(p) for p in body.get("pools") or ())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReportError(f"malformed report: {exc!r}") from None
        now = self._clock()
        node = self._nodes.get(node_name)
        if node is None:
            node = self._nodes[node_name] = Node(node_name, first_seen=now)
        came_back = not node.reachable
        node.boot_id = str(body.get("boot_id") or "")
        node.pools, node.gpus, node.engines, node.replicas = pools, gpus, engines, replicas
        node.advertise_host = str(body.get("advertise_host") or "")
        node.last_seen = now
        node.reports += 1
        node.reachable, node.unreachable_since = True, None
        return node, came_back

    def check(self) -> list[Node]:
        """Mark nodes that missed their reports unreachable; returns the ones that just became so."""
        now = self._clock()
        lost = []
        for node in self._nodes.values():
            if node.reachable and now - node.last_seen > self.unreachable_after:
                node.reachable, node.unreachable_since = False, now
                lost.append(node)
        return lost

    def forget(self, name: str) -> None:
        self._nodes.pop(name, None)

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def nodes(self) -> Iterable[Node]:
        return self._nodes.values()

    def __len__(self) -> int:
        return len(self._nodes)
