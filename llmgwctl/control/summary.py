"""What the console's live stream sends: a summary of the status, bounded whatever the fleet's size.

The whole status is ~10 MB at 20,000 replicas; a page updated twice a second
with it would cost the controller a core and the browser more. The summary
keeps what a person reads at a glance and leaves the rest to the paged calls
(`/api/v1/status?model=`, `/api/v1/gpus`):

    {"catalog", "routers", "log_streams", "watchers", "settled", "reconciler",
     "models": [ModelStatus... with "inflight"],            # at most MODEL_ROWS, those needing attention
     "models_total": N,                                     # and those with traffic first
     "counts": {"replicas": {STATE: N}, "nodes": {STATE: N}, "gpus": N, "gpus_used": N},
     "replicas": [ReplicaStatus... at most REPLICA_ROWS],   # the not-ready ones first
     "replicas_total": N,
     "nodes": [NodeStatus... at most NODE_ROWS],            # the unreachable and cordoned first
     "nodes_total": N,
     "events": [the last EVENTS]}

`Summary.key` is equal for two reads when nothing shown changed but ages
(the stream sends only news, as `StatusView.unaged` lets it for the status).
`Summaries` builds them, walking the rows only when the reconciler's rows changed.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeVar

from ..contracts import ControlStatus, NodeStatus, ReplicaState, ReplicaStatus, Scheduling

# Rows of each table the page gets: more than a screen, far less than a fleet.
REPLICA_ROWS, NODE_ROWS = 50, 20
# A failed replica's last log lines, as the summary carries them: its last words, not its log
# (`llmgwctl logs` has that); so 50 failed replicas stay a few KB each.
LOG_LINES, LOG_LINE = 3, 200
# Model rows: a catalog may hold a thousand models (bench/fleet.py's does), ~250 bytes a row.
MODEL_ROWS = 100
EVENTS = 30
_compact = json.JSONEncoder(separators=(",", ":")).encode
T = TypeVar("T")
_READY, _SCHEDULABLE = ReplicaState.READY, Scheduling.SCHEDULABLE


def _first(rows: Iterable[T], wanted: Any, limit: int) -> list[T]:
    """Up to `limit` of `rows`, those for which `wanted(row)` first, each group in order: one walk."""
    picked: list[T] = []
    rest: list[T] = []
    for row in rows:
        if wanted(row):
            picked.append(row)
            if len(picked) >= limit:
                return picked
        elif len(rest) < limit:
            rest.append(row)
    return picked + rest[:limit - len(picked)]


class _Rows(NamedTuple):
    """What a summary takes from one tuple of replica rows and one of node rows (see `Summaries`)."""

    replicas: list[ReplicaStatus]
    states: dict[str, int]
    model_of: dict[str, str]
    nodes: list[NodeStatus]
    node_states: dict[str, int]
    gpus: int
    gpus_used: int


class Summaries:
    """Builds summaries; what it takes from the rows is kept while the reconciler hands out the same rows.

    The reconciler hands out the same tuple of rows while none changed
    (`FleetStatus.replicas`, `.nodes`), so a summary of an unchanged fleet
    walks no row: at 20,000 replicas a walk is tens of milliseconds.
    """

    def __init__(self) -> None:
        self._replicas: tuple[ReplicaStatus, ...] | None = None
        self._nodes: tuple[NodeStatus, ...] | None = None
        self._rows: _Rows | None = None

    def __call__(self, status: ControlStatus) -> Summary:
        fleet = status.fleet
        rows = self._rows
        if rows is None or fleet.replicas is not self._replicas:
            shown = _first(fleet.replicas, lambda r: r.state is not _READY, REPLICA_ROWS)
            states: dict[ReplicaState, int] = {}
            for r in fleet.replicas:
                states[r.state] = states.get(r.state, 0) + 1
            nodes_part = (rows.nodes, rows.node_states, rows.gpus, rows.gpus_used) if rows is not None else ([], {}, 0, 0)
            rows = _Rows(shown, {k.value: v for k, v in states.items()}, {r.id: r.model for r in fleet.replicas},
                         *nodes_part)
            self._replicas = fleet.replicas
        if fleet.nodes is not self._nodes:
            nodes: dict[str, int] = {}
            gpus = used = 0
            for n in fleet.nodes:
                nodes[n.state] = nodes.get(n.state, 0) + 1
                gpus += n.gpus
                used += n.gpus_used
            shown_nodes = _first(fleet.nodes, lambda n: not n.reachable or n.scheduling is not _SCHEDULABLE
                                 or n.conflict, NODE_ROWS)
            rows = rows._replace(nodes=shown_nodes, node_states=nodes, gpus=gpus, gpus_used=used)
            self._nodes = fleet.nodes
        self._rows = rows
        return Summary(status, rows)


class Summary:
    """One summary of a `ControlStatus`: `to_json()` for the stream, `key` to tell news from ageing."""

    def __init__(self, status: ControlStatus, rows: _Rows):
        fleet = status.fleet
        self.status = status
        self._json: bytes | None = None
        self.replicas = rows.replicas
        self.nodes = rows.nodes
        # In flight per model: only the replicas with requests on them are looked up.
        inflight: dict[str, int] = {}
        model_of = rows.model_of
        for rid, (_, n) in fleet.usage.items():
            if n:
                model = model_of.get(rid)
                if model is not None:
                    inflight[model] = inflight.get(model, 0) + n
        self.inflight = inflight
        self.counts = {"replicas": rows.states, "nodes": rows.node_states, "gpus": rows.gpus,
                       "gpus_used": rows.gpus_used}
        # The models needing attention (fewer ready than wanted, or unplaceable) and those with traffic first.
        self.models = _first(fleet.models, lambda m: m.ready < m.desired or m.unplaceable or m.name in inflight,
                             MODEL_ROWS)
        self.events = fleet.events[-EVENTS:]
        shown = {r.id for r in self.replicas}
        self.key = (status.catalog, status.routers, status.log_streams, status.watchers, fleet.settled,
                    fleet.degraded, fleet.failures, tuple(self.models), tuple(sorted(inflight.items())),
                    tuple(sorted(rows.states.items())), tuple(sorted(rows.node_states.items())), tuple(self.replicas),
                    tuple(fleet.inflight(r) for r in self.replicas), tuple(self.nodes), self.events,
                    tuple(sorted((k, v) for k, v in fleet.router.items() if k in shown)))

    def to_dict(self) -> dict[str, Any]:
        s, fleet = self.status, self.status.fleet
        return {
            "catalog": s.catalog.to_dict(), "routers": s.routers, "log_streams": s.log_streams,
            "watchers": [w.to_dict() for w in s.watchers], "settled": fleet.settled,
            "reconciler": {"loop": "degraded" if fleet.degraded else "ok", "failures": fleet.failures,
                           "last_failure": dict(fleet.last_failure) if fleet.last_failure is not None else None},
            "models": [m.to_dict() | {"inflight": self.inflight.get(m.name, 0)} for m in self.models],
            "models_total": len(fleet.models),
            "counts": self.counts,
            "replicas": [_trimmed(r.to_dict(fleet.inflight(r), fleet.idle_seconds(r), fleet.starting_seconds(r),
                                            fleet.router.get(r.id))) for r in self.replicas],
            "replicas_total": len(fleet.replicas),
            "nodes": [n.to_dict(fleet.last_seen_seconds(n), fleet.reports(n)) for n in self.nodes],
            "nodes_total": len(fleet.nodes),
            "events": [e.to_dict() for e in self.events],
        }

    def to_json(self) -> bytes:
        """The summary's JSON, encoded on the first call: every page sent this summary gets the same bytes."""
        if self._json is None:
            self._json = _compact(self.to_dict()).encode()
        return self._json


def _trimmed(row: dict[str, Any]) -> dict[str, Any]:
    log = row.get("last_log")
    if log:
        row["last_log"] = [line[:LOG_LINE] for line in log[-LOG_LINES:]]
    return row
