"""The inventory: which nodes exist, what they have, and what they say they run.

Owns the controller's picture of the fleet, fed only by agent reports: each
node's pools, GPUs, the engines its agent can run, the replicas it reports, and
when it last reported. A node that misses reports becomes `unreachable`.

It also holds which agent process speaks for each node (see `Inventory.report`
and `ConflictError`): one at a time, so two agents started with the same
`--node` cannot both be given the node's replicas.

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
    # The agent process that speaks for this node (its report's instance_id)
    # and the last other one refused, for status: (instance, message, when).
    instance_id: str = ""
    conflict: tuple[str, str, float] | None = None

    @property
    def available_engines(self) -> frozenset[str]:
        return frozenset(n for n, (ok, _) in self.engines.items() if ok)


class ReportError(ValueError):
    """A report that does not follow the agent protocol; the agent gets a 400 with this text."""


class ConflictError(ReportError):
    """A second agent process claims a node another one speaks for; the agent gets a 409 with this text.

    Retrying helps once the node's agent is gone: the claim is taken over when
    the node is unreachable (its agent stopped reporting).
    """

    def __init__(self, message: str, node: "Node", instance: str, first: bool):
        super().__init__(message)
        self.node, self.instance = node, instance
        self.first = first          # the first refusal of this instance: worth an event


def instance_of(body: Mapping[str, Any]) -> str:
    """The agent process a report comes from.

    Agents before instance_id sent a `boot_id` that was new on every agent
    start, which is what an instance id is, so theirs stands in for it.
    """
    return str(body.get("instance_id") or body.get("boot_id") or "")


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
        instance = instance_of(body)
        self._claim(node, instance, body, now)
        came_back = not node.reachable
        node.instance_id = instance
        node.boot_id = str(body.get("boot_id") or "")
        node.pools, node.gpus, node.engines, node.replicas = pools, gpus, engines, replicas
        node.advertise_host = str(body.get("advertise_host") or "")
        node.last_seen = now
        node.reports += 1
        node.reachable, node.unreachable_since = True, None
        return node, came_back

    def _claim(self, node: Node, instance: str, body: Mapping[str, Any], now: float) -> None:
        """ConflictError unless the agent process `instance` may speak for `node` now.

        The one that holds it may; so may any once the node is unreachable (its
        agent stopped reporting: crashed, stopped, or its machine is gone); and
        so may the holder's own successor -- an agent restarted on the same
        machine before the node timed out -- which proves it is one by sending
        the holder's instance id, read from the state directory the holder
        wrote (`previous_instance_id`), and the same machine boot id. Two
        agents cannot share a state directory at once (the agent locks it), so
        a live holder is never displaced by a second agent.
        """
        holder = node.instance_id
        if not holder or not instance or instance == holder:
            return
        boot = str(body.get("boot_id") or "")
        if (not self._reachable_now(node, now)
                or (body.get("previous_instance_id") == holder and boot and boot == node.boot_id)):
            node.conflict = None      # taken over: whatever was refused before is this agent now
            return
        # One event per claimant, not one per heartbeat it keeps trying.
        last = node.conflict
        first = last is None or last[0] != instance or now - last[2] > self.unreachable_after
        message = (f"node {node.name!r} already has a running agent (instance {holder[:12]}, last report "
                   f"{now - node.last_seen:.1f}s ago); this agent (instance {instance[:12]}) is refused until "
                   f"that one stops reporting for {self.unreachable_after:.0f}s. Two agents with the same "
                   "--node would run the same replicas twice: give each machine its own --node")
        node.conflict = (instance, message, now)
        raise ConflictError(message, node, instance, first)

    def conflict(self, node: Node) -> str | None:
        """What was last refused for `node`, while the refused agent is still trying; else None."""
        if node.conflict is None or self._clock() - node.conflict[2] > self.unreachable_after:
            return None
        return node.conflict[1]

    def _reachable_now(self, node: Node, now: float) -> bool:
        # Not only the flag check() sets once a pass: a holder silent for the
        # timeout has lost its claim even if no pass has run since.
        return node.reachable and now - node.last_seen <= self.unreachable_after

    def holder(self, name: str) -> str | None:
        """The instance id of the agent process speaking for node `name`, None if none (or unreachable)."""
        node = self._nodes.get(name)
        if node is None or not node.instance_id or not self._reachable_now(node, self._clock()):
            return None
        return node.instance_id

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
