"""The inventory: which nodes exist, what they have, and what they say they run.

Owns the controller's picture of the fleet, fed only by agent reports: each
node's pools, GPUs, the engines its agent can run, the replicas it reports, and
when it last reported. A node that misses reports becomes `unreachable`.

It must not know about catalogs, placement or the router; it is plain state
with an injected clock, so heartbeat timeouts are tested without sleeping.
What a report holds, and how it is parsed, is the contract's
(`llmgwctl.contracts.AgentReport`); this keeps the latest one per node.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..contracts import AgentReport, EngineAvailability, Gpu, ReportedReplica, ReportError

# Agents report every 5 s (agent.controller.HEARTBEAT). Three missed reports
# make a node unreachable: one late report on a busy machine is not a failure,
# and 15 s is still short enough that clients stop being sent to a dead node
# before most of them time out.
UNREACHABLE_AFTER = 15.0


@dataclass
class Node:
    name: str
    boot_id: str = ""
    pools: frozenset[str] = frozenset()
    gpus: tuple[Gpu, ...] = ()
    engines: Mapping[str, EngineAvailability] = field(default_factory=dict)
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


class Inventory:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, unreachable_after: float = UNREACHABLE_AFTER):
        self._clock = clock
        self.unreachable_after = unreachable_after
        self._nodes: dict[str, Node] = {}

    def report(self, node_name: str, body: Mapping[str, Any] | AgentReport) -> tuple[Node, bool]:
        """Take one agent report (parsed here when given as JSON; ReportError if it breaks the protocol).

        Returns the node and whether it came back from unreachable.
        """
        report = body if isinstance(body, AgentReport) else AgentReport.from_dict(body, node=node_name)
        if report.node != node_name:
            raise ReportError(f"report for node {report.node!r} sent to node {node_name!r}")
        now = self._clock()
        node = self._nodes.get(node_name)
        if node is None:
            node = self._nodes[node_name] = Node(node_name, first_seen=now)
        came_back = not node.reachable
        node.boot_id = report.boot_id
        node.pools, node.gpus = frozenset(report.pools), report.gpus
        node.engines = report.engines
        node.replicas = {r.id: r for r in report.replicas}
        node.advertise_host = report.advertise_host
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
