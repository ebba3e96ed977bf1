"""What the control plane says about itself: the catalog in force, models, replicas, nodes, recent events.

Built once per read by the controller (`Controller.state()`, from the
reconciler's `fleet_status()` and the catalog watcher), then either turned into
the JSON of `GET /api/v1/status` (`to_dict`, which `llmgwctl status` and
scripts read) or read as typed fields by the control metrics collector. One
record for both, so the metrics and the status page cannot disagree.

    ControlStatus
     ├ catalog: CatalogStatus        version, models, swaps, rejections, directory_valid, last rejection
     ├ routers                       standalone routers reporting usage
     ├ log_streams                   engine logs being relayed to `llmgwctl logs`
     └ fleet: FleetStatus            settled, passes, failed passes (the loop degraded, and why)
        ├ models: ModelStatus...     min, max, desired, ready, priority, why unplaceable (and if for good),
        │                            load against target
        ├ replicas: ReplicaStatus... state, node, GPUs, url, in flight, idle, last exit and last log lines,
        │                            on a fallback profile
        ├ nodes: NodeStatus...       reachable, pools, GPUs (each with memory and whether used), engines
        │                            (missing ones with why), conflict
        └ events: Event...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .states import ReplicaState


@dataclass(frozen=True, slots=True)
class Event:
    """Something the reconciler did or saw, kept for `status` (and logged with its kind as `event`)."""

    at: float                       # wall clock, for people
    kind: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "message": self.message}


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    aliases: tuple[str, ...]
    min: int
    max: int
    desired: int
    ready: int
    replicas: int
    unplaceable: str | None = None  # why no replica can be placed now; None: it can
    # The autoscaler's view (issue 17): its metric and target per replica, the
    # load it last measured (None: no reading yet) and the count that load needs.
    metric: str = "inflight"
    target: float | None = None
    load: float | None = None
    needed: int | None = None
    # True: it can never be placed on this fleet as it is (placement's Unplaceable.permanent).
    unplaceable_permanent: bool = False
    priority: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "aliases": list(self.aliases), "min": self.min, "max": self.max,
                "desired": self.desired, "ready": self.ready, "replicas": self.replicas,
                "priority": self.priority, "unplaceable": self.unplaceable,
                "unplaceable_permanent": self.unplaceable_permanent,
                "autoscale": {"metric": self.metric, "target": self.target, "load": self.load, "needed": self.needed}}


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    id: str
    model: str
    profile: str
    engine: str
    node: str
    gpus: tuple[int, ...]
    state: ReplicaState
    url: str | None
    pid: int | None
    restarts: int
    last_exit: int | None
    adopted: bool
    inflight: int
    idle_seconds: float | None      # None: never used
    reason: str
    spec_hash: str
    # The engine's last log lines as its agent read them when it last exited
    # (contracts.report.LAST_LOG_LINES at most): why it failed, without a login
    # to the node. Empty while it never exited.
    last_log: tuple[str, ...] = ()
    # Runs a profile below its model's best (a fallback); placement moves it
    # back by surge when the better profile fits.
    fallback: bool = False
    # Seconds since the controller placed it, while it is pending or starting:
    # how long a load has taken so far (engines report no progress of their
    # own; a vLLM load of a 70B model is minutes, and this tells a slow load
    # from a hung one at a glance). None in every other state.
    starting_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "profile": self.profile, "engine": self.engine,
                "node": self.node, "gpus": list(self.gpus), "state": self.state.value, "url": self.url,
                "pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit, "adopted": self.adopted,
                "inflight": self.inflight, "idle_seconds": self.idle_seconds, "reason": self.reason,
                "spec_hash": self.spec_hash, "last_log": list(self.last_log), "fallback": self.fallback,
                "starting_seconds": self.starting_seconds}


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU of a node as status shows it: what it is and whether a replica holds it."""

    index: int
    name: str
    memory_mib: int                 # 0: unknown
    used_by: str | None = None      # the replica holding it; None: free

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "memory_mib": self.memory_mib, "used_by": self.used_by}


@dataclass(frozen=True, slots=True)
class NodeStatus:
    name: str
    reachable: bool
    pools: tuple[str, ...]
    gpus: int
    gpus_used: int
    gpu_models: tuple[str, ...]
    engines: tuple[str, ...]        # the engines it can run
    engines_missing: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))   # engine -> why not
    last_seen_seconds: float = 0.0
    reports: int = 0
    # Why a second agent process claiming this node is being refused, while it
    # keeps trying; None when no other agent claims it (see inventory.ConflictError).
    conflict: str | None = None
    gpu_list: tuple[GpuStatus, ...] = ()

    @property
    def state(self) -> str:
        return "ready" if self.reachable else "unreachable"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "pools": list(self.pools), "gpus": self.gpus,
                "gpus_used": self.gpus_used, "gpu_models": list(self.gpu_models), "engines": list(self.engines),
                "engines_missing": dict(self.engines_missing), "last_seen_seconds": self.last_seen_seconds,
                "reports": self.reports, "conflict": self.conflict,
                "gpu_list": [g.to_dict() for g in self.gpu_list]}


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """The reconciler's part: what it wants and what runs."""

    settled: bool
    passes: int
    models: tuple[ModelStatus, ...] = ()
    replicas: tuple[ReplicaStatus, ...] = ()
    nodes: tuple[NodeStatus, ...] = ()
    events: tuple[Event, ...] = ()
    # Passes that raised since start; `degraded` while the last one did (the
    # loop goes on, from the records that pass left). `last_failure`: at, what, error.
    failures: int = 0
    degraded: bool = False
    last_failure: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"settled": self.settled, "passes": self.passes, "models": [m.to_dict() for m in self.models],
                "replicas": [r.to_dict() for r in self.replicas], "nodes": [n.to_dict() for n in self.nodes],
                "events": [e.to_dict() for e in self.events],
                # Like the catalog part's `watcher`, `failures`, `last_failure`: which loop is degraded and why.
                "reconciler": {"loop": "degraded" if self.degraded else "ok", "failures": self.failures,
                               "last_failure": dict(self.last_failure) if self.last_failure is not None else None}}


@dataclass(frozen=True, slots=True)
class CatalogStatus:
    """The catalog watcher's part: the catalog in force and what happened to the directory."""

    directory: str
    version: str
    models: int
    swapped_at: float | None
    swaps: int
    rejections: int
    directory_valid: bool           # False while the directory holds an edit that was rejected
    last_rejection: Mapping[str, Any] | None = None   # the rejection's own JSON (catalog.watcher.Rejection)
    # Reloads that raised what no rule expected; `degraded` while the last one did.
    # The catalog in force is then still the last good one.
    failures: int = 0
    degraded: bool = False
    last_failure: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "version": self.version, "models": self.models,
                "swapped_at": self.swapped_at, "swaps": self.swaps, "rejections": self.rejections,
                "directory_valid": self.directory_valid,
                "last_rejection": dict(self.last_rejection) if self.last_rejection is not None else None,
                "watcher": "degraded" if self.degraded else "ok", "failures": self.failures,
                "last_failure": dict(self.last_failure) if self.last_failure is not None else None}


@dataclass(frozen=True, slots=True)
class ControlStatus:
    """`GET /api/v1/status`: the catalog, the standalone routers, and the fleet, in one JSON object."""

    catalog: CatalogStatus
    routers: int
    fleet: FleetStatus
    log_streams: int = 0            # `llmgwctl logs` streams being relayed from agents now

    def to_dict(self) -> dict[str, Any]:
        return {"catalog": self.catalog.to_dict(), "routers": self.routers, "log_streams": self.log_streams,
                **self.fleet.to_dict()}
