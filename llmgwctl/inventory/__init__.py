"""The inventory: which nodes exist, what they have, and what they say they run.

Owns the controller's picture of the fleet, fed only by agent reports: each
node's pools, GPUs, the engines its agent can run, the replicas it reports, and
when it last reported. A node that misses reports becomes `unreachable`.

It also holds which agent process speaks for each node (see `Inventory.report`
and `ConflictError`): one at a time, so two agents started with the same
`--node` cannot both be given the node's replicas.

It must not know about catalogs, placement or the router; it is plain state
with an injected clock, so heartbeat timeouts are tested without sleeping.
What a report holds, and how it is parsed, is the contract's
(`llmgwctl.contracts.AgentReport`); this keeps the latest one per node.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..contracts import UNBOUNDED, AgentReport, EngineAvailability, Gpu, NodeClaims, ReportedReplica, ReportError

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
    # The agent process that speaks for this node (its report's instance_id)
    # and the last other one refused, for status.
    instance_id: str = ""
    conflict: Refusal | None = None
    # Bumped by every report that says something the last one did not (or
    # brings the node back): a heartbeat repeating the last report leaves it
    # as it was, so the controller wakes the reconciler only when this moves
    # (otherwise, at 1,000 nodes, every heartbeat would wake a pass over the fleet).
    revision: int = 0
    last_report: AgentReport | None = field(default=None, repr=False)
    # What the token of its last report lets it claim, and what that report
    # claimed beyond it (dropped, one line each: shown in its status row).
    claims: NodeClaims = UNBOUNDED
    refused: tuple[str, ...] = ()

    _available: tuple[Any, frozenset[str]] = field(default=(None, frozenset()), init=False, repr=False, compare=False)

    @property
    def available_engines(self) -> frozenset[str]:
        # Read for every node on every pass (placement's input); worked out again
        # only when a report replaced the engines mapping.
        if self._available[0] is not self.engines:
            self._available = (self.engines, frozenset(n for n, (ok, _) in self.engines.items() if ok))
        return self._available[1]

    def overdue(self, now: float, after: float) -> bool:
        """Reachable, but silent for longer than `after`: the next pass marks it unreachable."""
        return self.reachable and now - self.last_seen > after


@dataclass(frozen=True, slots=True)
class Refusal:
    """The last agent process refused a node (for `llmgwctl status` and for one event per claimant)."""

    instance: str
    message: str
    at: float


class ConflictError(ReportError):
    """A second agent process claims a node another one speaks for; the agent gets a 409 with this text.

    A ReportError, because it refuses the report; raised here, not in the
    contract, because whether a report may speak for its node depends on the
    reports before it. Retrying helps once the node's agent is gone: the claim
    is taken over when the node is unreachable (its agent stopped reporting).
    """

    def __init__(self, message: str, node: str, instance: str, first: bool):
        super().__init__(message)
        self.node, self.instance = node, instance
        self.first = first          # the first refusal of this instance: worth an event


class Inventory:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, unreachable_after: float = UNREACHABLE_AFTER):
        self._clock = clock
        self.unreachable_after = unreachable_after
        self._nodes: dict[str, Node] = {}

    def report(self, node_name: str, body: Mapping[str, Any] | AgentReport,
               claims: NodeClaims = UNBOUNDED) -> tuple[Node, bool]:
        """Take one agent report (parsed here when given as JSON; ReportError if it breaks the protocol).

        Only what `claims` allows is kept (`NodeClaims.bound`: pools and GPUs
        beyond them are dropped, and said in `node.refused`). Returns the node
        and whether it came back from unreachable; `node.revision` moves when
        the report (as kept) differs from the node's last one.
        """
        report = body if isinstance(body, AgentReport) else AgentReport.from_dict(body, node=node_name)
        if report.node != node_name:
            raise ReportError(f"report for node {report.node!r} sent to node {node_name!r}")
        report, refused = claims.bound(report)
        now = self._clock()
        node = self._nodes.get(node_name)
        if node is None:
            node = self._nodes[node_name] = Node(node_name, first_seen=now)
        self._claim(node, report, now)
        came_back = not node.reachable
        if report != node.last_report or refused != node.refused or claims != node.claims:
            node.claims, node.refused = claims, refused
            # Compared whole: the contract's records are frozen dataclasses, and
            # an agent builds the same report for the same state (sorted replicas,
            # sorted engines), so equal means nothing changed on the node.
            node.last_report = report
            node.instance_id = report.instance_id
            node.boot_id = report.boot_id
            # New objects only when the report changed: the reconciler keeps what
            # it derived from a node (its merge, placement's view of it) while
            # these are the same objects, so a heartbeat costs it nothing.
            node.pools, node.gpus = frozenset(report.pools), report.gpus
            node.engines = report.engines
            node.replicas = {r.id: r for r in report.replicas}
            node.advertise_host = report.advertise_host
            node.revision += 1
        elif came_back:
            node.revision += 1
        node.last_seen = now
        node.reports += 1
        node.reachable, node.unreachable_since = True, None
        return node, came_back

    def heartbeat(self, node_name: str) -> bool:
        """The node's agent sent its last report again, unchanged: only when it was heard moves.

        False when that is not enough -- a node not known, or one already past
        its timeout (a report then brings it back, which is news) -- and the
        caller takes the report whole instead.
        """
        node = self._nodes.get(node_name)
        now = self._clock()
        if node is None or node.last_report is None or not self._reachable_now(node, now):
            return False
        node.last_seen = now
        node.reports += 1
        return True

    def _claim(self, node: Node, report: AgentReport, now: float) -> None:
        """ConflictError unless the agent process that sent `report` may speak for `node` now.

        The one that holds it may; so may any once the node is unreachable (its
        agent stopped reporting: crashed, stopped, or its machine is gone); and
        so may the holder's own successor -- an agent restarted on the same
        machine before the node timed out -- which proves it is one by sending
        the holder's instance id, read from the state directory the holder
        wrote (`previous_instance_id`), and the same machine boot id. Two
        agents cannot share a state directory at once (the agent locks it), so
        a live holder is never displaced by a second agent.
        """
        holder, instance = node.instance_id, report.instance_id
        # Nothing to compare when either side has no instance: a report built
        # without one (an old agent's boot_id already stands in for it, see
        # contracts.report), or the node's first report.
        if not holder or not instance or instance == holder:
            return
        if (not self._reachable_now(node, now)
                or (report.previous_instance_id == holder and report.boot_id and report.boot_id == node.boot_id)):
            node.conflict = None      # taken over: whatever was refused before is this agent now
            return
        # One event per claimant, not one per heartbeat it keeps trying.
        last = node.conflict
        first = last is None or last.instance != instance or now - last.at > self.unreachable_after
        message = (f"node {node.name!r} already has a running agent (instance {holder[:12]}, last report "
                   f"{now - node.last_seen:.1f}s ago); this agent (instance {instance[:12]}) is refused until "
                   f"that one stops reporting for {self.unreachable_after:.0f}s. Two agents with the same "
                   "--node would run the same replicas twice: give each machine its own --node")
        node.conflict = Refusal(instance, message, now)
        raise ConflictError(message, node.name, instance, first)

    def conflict(self, node: Node) -> str | None:
        """What was last refused for `node`, while the refused agent is still trying; else None."""
        if node.conflict is None or self._clock() - node.conflict.at > self.unreachable_after:
            return None
        return node.conflict.message

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
            if node.overdue(now, self.unreachable_after):
                node.reachable, node.unreachable_since = False, now
                lost.append(node)
        return lost

    def overdue(self) -> bool:
        """Whether `check()` would mark a node unreachable now: a cheap look, marking nothing."""
        now = self._clock()
        return any(node.overdue(now, self.unreachable_after) for node in self._nodes.values())

    def revoke(self, name: str) -> bool:
        """The node's token was revoked: unreachable now, as if it had missed its reports (True if it was reachable).

        Its agent's reports are refused from here on, so it stays so; the
        next pass takes its replicas out of the router and replaces them.
        """
        node = self._nodes.get(name)
        if node is None or not node.reachable:
            return False
        node.reachable, node.unreachable_since = False, self._clock()
        node.revision += 1
        return True

    def forget(self, name: str) -> None:
        self._nodes.pop(name, None)

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def nodes(self) -> Iterable[Node]:
        return self._nodes.values()

    def __len__(self) -> int:
        return len(self._nodes)
