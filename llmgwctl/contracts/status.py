"""What the control plane says about itself: the catalog in force, models, replicas, nodes, recent events.

Built per read by the controller (`Controller.state()`, from the
reconciler's `fleet_status()` and the catalog watcher), then either turned into
the JSON of `GET /api/v1/status` (`to_json`, the same document as `to_dict`,
which `llmgwctl status` and scripts read) or read as typed fields by the
control metrics collector. One record for both, so the metrics and the status
page cannot disagree.

At fleet size (20,000 replicas, 5,000 nodes) building and encoding every
row per read would hold the event loop for most of a second, per status
call, scrape and console push. So a row record says only what its replica's or node's record
says and is kept by the reconciler until that changes; what moves without a
change -- ages, in-flight counts, a node's report count -- is read per read
into `FleetStatus` (`now`, `usage`, `seen_at`, `reports_of`) and joined in when the JSON is
made. Each row memoizes its own JSON around those values (`fragments()`), so
an unchanged row costs a string join, not a dict and an encode.

    ControlStatus
     ├ catalog: CatalogStatus        version, models, swaps, rejections, directory_valid, last rejection
     ├ watchers: WatcherStatus...    every file and directory followed: in force, or degraded and why
     ├ routers                       standalone routers reporting usage
     ├ log_streams                   engine logs being relayed to `llmgwctl logs`
     └ fleet: FleetStatus            settled, passes, failed passes (the loop degraded, and why)
        ├ models: ModelStatus...     min, max, desired, ready, priority, why unplaceable (and if for good),
        │                            load against target
        ├ replicas: ReplicaStatus... state, node, GPUs, url, in flight, idle, last exit and last log lines,
        │                            on a fallback profile, what the router holds against its engine
        ├ nodes: NodeStatus...       reachable, pools, GPUs (each with memory and whether used), engines
        │                            (missing ones with why), conflict, scheduling (cordon, drain)
        └ events: Event...
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..health import Failure
from .adapters import LOADING, AdapterSpread, AdapterStatus
from .group import MemberStatus
from .scheduling import Scheduling
from .states import ReplicaState
from .usage import UNUSED, Usage

_EMPTY: Mapping[str, Any] = MappingProxyType({})
# Compact, as the console's stream always was: a tenth fewer bytes at fleet size than json.dumps's default.
_compact = json.JSONEncoder(separators=(",", ":")).encode


def _num(value: float | int | None) -> str:
    """A number as json.dumps writes it (float repr; NaN and infinities as it spells them)."""
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return _compact(value)
    return repr(value)


# The last rows tuple seen with no replica pending or starting, and its rows
# joined as `plain` (no use, no load under way): what an idle fleet's read
# reuses. The tuple is held, so its identity cannot be taken by another; the
# reconciler hands out the same tuple while no row changed.
_PLAIN: list[tuple[tuple[ReplicaStatus, ...], str]] = [((), "")]
# A row's last member when no router holds anything against its engine: most rows.
_NO_ROUTER = ',"router":null'


def _plain_rows(rows: tuple[ReplicaStatus, ...]) -> str | None:
    """Every row as its `plain` JSON, joined; None when one is starting (its age moves)."""
    held, text = _PLAIN[0]
    if held is rows:
        return text
    if any(r.starting_since is not None for r in rows):
        return None
    text = ",".join(r.plain() for r in rows)
    _PLAIN[0] = (rows, text)
    return text


def _split(head: dict[str, Any], tail: dict[str, Any]) -> tuple[str, str]:
    """`{head...` and `,tail...` of one object's JSON, for values to go between and after them."""
    a, b = _compact(head), _compact(tail)
    return a[:-1], ("," + b[1:-1]) if len(b) > 2 else ""


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
    # The autoscaler's view: its metric and target per replica, the
    # load it last measured (None: no reading yet) and the count that load needs.
    metric: str = "inflight"
    target: float | None = None
    load: float | None = None
    needed: int | None = None
    # True: it can never be placed on this fleet as it is (placement's Unplaceable.permanent).
    unplaceable_permanent: bool = False
    priority: int = 0
    # The models its requests fall back to, in the order tried (catalog.fallbacks.chains); () when none.
    fallbacks: tuple[str, ...] = ()
    # Its LoRA adapters: how many of its replicas hold each, and why; () when it has none.
    adapters: tuple[AdapterSpread, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "aliases": list(self.aliases), "min": self.min, "max": self.max,
                "desired": self.desired, "ready": self.ready, "replicas": self.replicas,
                "priority": self.priority, "fallbacks": list(self.fallbacks), "unplaceable": self.unplaceable,
                "unplaceable_permanent": self.unplaceable_permanent,
                "autoscale": {"metric": self.metric, "target": self.target, "load": self.load, "needed": self.needed}} \
            | ({"adapters": [a.to_dict() for a in self.adapters]} if self.adapters else {})


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as its record says. In flight, idle and starting ages are `FleetStatus`'s to say
    (`inflight()`, `idle_seconds()`, `starting_seconds()`): they move while the record does not."""

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
    reason: str
    spec_hash: str
    # The engine's last log lines as its agent read them when it last exited
    # (contracts.report.LAST_LOG_LINES at most): why it failed, without a login
    # to the node. Empty while it never exited.
    last_log: tuple[str, ...] = ()
    # Runs a profile below its model's best (a fallback); placement moves it
    # back by surge when the better profile fits.
    fallback: bool = False
    # When the controller placed it (its clock), while it is pending or
    # starting; None in every other state. Status shows the seconds since as
    # `starting_seconds`: how long a load has taken so far (engines report no
    # progress of their own; a vLLM load of a 70B model is minutes, and this
    # tells a slow load from a hung one at a glance).
    starting_since: float | None = None
    # Its LoRA adapters: each one placed here, as its agent last reported it
    # (loading, loaded, failed with the engine's reason), and any unloading.
    adapters: tuple[AdapterStatus, ...] = ()
    # For a replica spanning nodes (this row is its head's): every member, the
    # head first; a group is one row, and its workers have none of their own.
    members: tuple[MemberStatus, ...] = ()
    _json: list[tuple[str, str, str]] = field(default_factory=list, init=False, repr=False, compare=False)

    def fragments(self) -> tuple[str, str, str]:
        """Its JSON as `A inflight B idle_seconds C starting_seconds ,"router": ... }` (built once: the record is immutable)."""
        if not self._json:
            a, c = _split({"id": self.id, "model": self.model, "profile": self.profile, "engine": self.engine,
                           "node": self.node, "gpus": list(self.gpus), "state": self.state.value, "url": self.url,
                           "pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit,
                           "adopted": self.adopted},
                          {"reason": self.reason, "spec_hash": self.spec_hash, "last_log": list(self.last_log),
                           "fallback": self.fallback, "adapters": [a.to_dict() for a in self.adapters],
                           **self._members()})
            self._json.append((a + ',"inflight":', ',"idle_seconds":', c + ',"starting_seconds":'))
        return self._json[0]

    def plain(self) -> str:
        """Its JSON when unused and not starting: in flight 0, both ages null."""
        a, b, c = self.fragments()
        return f"{a}0{b}null{c}null{_NO_ROUTER}}}"

    def to_dict(self, inflight: int = 0, idle_seconds: float | None = None,
                starting_seconds: float | None = None, router: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "profile": self.profile, "engine": self.engine,
                "node": self.node, "gpus": list(self.gpus), "state": self.state.value, "url": self.url,
                "pid": self.pid, "restarts": self.restarts, "last_exit": self.last_exit, "adopted": self.adopted,
                "inflight": inflight, "idle_seconds": idle_seconds, "reason": self.reason,
                "spec_hash": self.spec_hash, "last_log": list(self.last_log), "fallback": self.fallback,
                "adapters": [a.to_dict() for a in self.adapters], **self._members(),
                "starting_seconds": starting_seconds, "router": router}

    def _members(self) -> dict[str, Any]:
        return {"members": [m.to_dict() for m in self.members]} if self.members else {}


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
    """One node as its last report and the replicas placed on it say. When it was last heard and
    how often are `FleetStatus`'s to say (`last_seen_seconds()`, `reports()`): heartbeats move them."""

    name: str
    reachable: bool
    pools: tuple[str, ...]
    gpus: int
    gpus_used: int
    gpu_models: tuple[str, ...]
    engines: tuple[str, ...]        # the engines it can run
    engines_missing: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))   # engine -> why not
    # Why a second agent process claiming this node is being refused, while it
    # keeps trying; None when no other agent claims it (see inventory.ConflictError).
    conflict: str | None = None
    gpu_list: tuple[GpuStatus, ...] = ()
    # What its last report claimed beyond its token (dropped: contracts.claims),
    # and "legacy" when its token is from before claims (llmgwctl token node).
    refused: tuple[str, ...] = ()
    token: str = ""
    # What the operator set (cordon, drain, uncordon): whether placement may use it.
    scheduling: Scheduling = Scheduling.SCHEDULABLE
    _json: list[tuple[str, str, str]] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def state(self) -> str:
        return "ready" if self.reachable else "unreachable"

    def fragments(self) -> tuple[str, str, str]:
        """Its JSON as `A last_seen_seconds B reports C` (built once: the record is immutable)."""
        if not self._json:
            a, c = _split({"name": self.name, "state": self.state, "pools": list(self.pools), "gpus": self.gpus,
                           "gpus_used": self.gpus_used, "gpu_models": list(self.gpu_models),
                           "engines": list(self.engines), "engines_missing": dict(self.engines_missing)},
                          {"conflict": self.conflict, "gpu_list": [g.to_dict() for g in self.gpu_list],
                           "refused": list(self.refused), "token": self.token,
                           "scheduling": self.scheduling.value})
            self._json.append((a + ',"last_seen_seconds":', ',"reports":', c + "}"))
        return self._json[0]

    def to_dict(self, last_seen_seconds: float = 0.0, reports: int = 0) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "pools": list(self.pools), "gpus": self.gpus,
                "gpus_used": self.gpus_used, "gpu_models": list(self.gpu_models), "engines": list(self.engines),
                "engines_missing": dict(self.engines_missing), "last_seen_seconds": last_seen_seconds,
                "reports": reports, "conflict": self.conflict,
                "gpu_list": [g.to_dict() for g in self.gpu_list],
                "refused": list(self.refused), "token": self.token, "scheduling": self.scheduling.value}


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
    # loop goes on, from the records that pass left). `last_failure`: at, what, error (`health.Failure`).
    failures: int = 0
    degraded: bool = False
    last_failure: Mapping[str, Any] | None = None
    # What moves between changes of the rows, read for this status: the
    # reconciler's clock now; usage per replica id (last use on that clock,
    # in flight; absent: unused); per node name, when it was last heard (that
    # clock) and its report count. Two flat maps, not one of pairs: a pair per
    # node per read was 5,000 objects the collector had to promote and walk
    # (at a serve-sized heap each full collection is a pause of 0.3 s or more).
    now: float = 0.0
    usage: Mapping[str, Usage] = field(default_factory=lambda: _EMPTY)
    seen_at: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    reports_of: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    # Per replica id, what the router holds against its engine now: ejected
    # for a cause (what it did, and for how long), or why its /metrics gives
    # no reading (router.ejection, router.poller); absent: nothing. Read per
    # read like usage: an ejection runs out without any record changing.
    router: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    def inflight(self, r: ReplicaStatus) -> int:
        return self.usage.get(r.id, UNUSED)[1]

    def idle_seconds(self, r: ReplicaStatus) -> float | None:
        """Seconds since its last use; None: never used."""
        last = self.usage.get(r.id, UNUSED)[0]
        return round(self.now - last, 1) if last is not None else None

    def starting_seconds(self, r: ReplicaStatus) -> float | None:
        return round(self.now - r.starting_since, 1) if r.starting_since is not None else None

    def last_seen_seconds(self, n: NodeStatus) -> float:
        seen = self.seen_at.get(n.name)
        return round(self.now - seen, 1) if seen is not None else 0.0

    def reports(self, n: NodeStatus) -> int:
        return self.reports_of.get(n.name, 0)

    def only(self, model: str) -> FleetStatus:
        """The part about one model: its row, its replicas, the nodes they run on; events and the rest whole.

        What an operator of a big fleet asks for (`llmgwctl status --model`,
        `GET /api/v1/status?model=`): 20,000 replica rows are no table to read.
        """
        replicas = tuple(r for r in self.replicas if r.model == model)
        on = {r.node for r in replicas}
        return FleetStatus(settled=self.settled, passes=self.passes,
                           models=tuple(m for m in self.models if m.name == model), replicas=replicas,
                           nodes=tuple(n for n in self.nodes if n.name in on), events=self.events,
                           failures=self.failures, degraded=self.degraded, last_failure=self.last_failure,
                           now=self.now, usage=self.usage, seen_at=self.seen_at, reports_of=self.reports_of,
                           router=self.router)

    def _tail(self) -> dict[str, Any]:
        # Like the catalog part's `watcher`, `failures`, `last_failure`: which loop is degraded and why.
        return {"reconciler": {"loop": "degraded" if self.degraded else "ok", "failures": self.failures,
                               "last_failure": dict(self.last_failure) if self.last_failure is not None else None}}

    def to_dict(self) -> dict[str, Any]:
        return {"settled": self.settled, "passes": self.passes, "models": [m.to_dict() for m in self.models],
                "replicas": [r.to_dict(self.inflight(r), self.idle_seconds(r), self.starting_seconds(r),
                                       self.router.get(r.id)) for r in self.replicas],
                "nodes": [n.to_dict(self.last_seen_seconds(n), self.reports(n)) for n in self.nodes],
                "events": [e.to_dict() for e in self.events], **self._tail()}

    def json_parts(self) -> list[str]:
        """`to_dict()`'s members as JSON text, without the braces: each row from its memoized fragments."""
        out = [f'"settled":{_compact(self.settled)},"passes":{self.passes},"models":',
               _compact([m.to_dict() for m in self.models]), ',"replicas":[']
        add = out.append
        usage, now, router = self.usage, self.now, self.router
        if not router and not any(last is not None or inflight for last, inflight in usage.values()):
            plain = _plain_rows(self.replicas)
            if plain is not None:
                add(plain)          # an idle fleet with nothing loading: the rows' join of the last read
        for r in self.replicas if len(out) == 3 else ():
            a, b, c = r.fragments()
            last, inflight = usage.get(r.id, UNUSED)
            held = router.get(r.id) if router else None
            tail = _NO_ROUTER if held is None else ',"router":' + _compact(held)
            if last is None and not inflight and r.starting_since is None:
                add(f"{a}0{b}null{c}null{tail}}}")      # most of a fleet: no use to show and no load under way
                continue
            idle = "null" if last is None else _num(round(now - last, 1))
            starting = "null" if r.starting_since is None else _num(round(now - r.starting_since, 1))
            add(f"{a}{_num(inflight)}{b}{idle}{c}{starting}{tail}}}")
        seen_at, reports_of = self.seen_at, self.reports_of
        nodes = []
        for n in self.nodes:
            a, b, c = n.fragments()
            seen = seen_at.get(n.name, now)
            nodes.append(f"{a}{_num(round(now - seen, 1))}{b}{_num(reports_of.get(n.name, 0))}{c}")
        return [out[0], out[1], out[2], ",".join(out[3:]), '],"nodes":[', ",".join(nodes), '],"events":',
                _compact([e.to_dict() for e in self.events]), "," + _compact(self._tail())[1:-1]]

    def unaged(self) -> tuple[object, ...]:
        """What a person would see change, without what only ages (idle and heartbeat ages, report
        counts, the pass count): equal for two reads means no news for the console's stream."""
        usage = self.usage
        return (self.settled, self.models, self.replicas, self.nodes, self.events, self.failures, self.degraded,
                self.last_failure, tuple(usage.get(r.id, UNUSED)[1] for r in self.replicas),
                tuple(self.starting_seconds(r) for r in self.replicas if r.starting_since is not None),
                tuple(sorted(self.router.items())))


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
    last_failure: Failure | None = None
    # Why the directory cannot be followed now (gone, not a directory), and
    # what it resolves to while it can (a symlink switched to a release).
    problem: str | None = None
    followed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "version": self.version, "models": self.models,
                "swapped_at": self.swapped_at, "swaps": self.swaps, "rejections": self.rejections,
                "directory_valid": self.directory_valid,
                "last_rejection": dict(self.last_rejection) if self.last_rejection is not None else None,
                "watcher": "degraded" if self.degraded or self.problem else "ok", "failures": self.failures,
                "last_failure": dict(self.last_failure) if self.last_failure is not None else None,
                "problem": self.problem, "followed": self.followed}


@dataclass(frozen=True, slots=True)
class WatcherStatus:
    """One followed file or directory (the catalog directory, the API key file): is what it holds in force?

    `state` is "degraded" while it cannot be followed or its last state was
    not usable (`problem` says why, since `since`); what was in force before
    stays in force. `failures` counts problems since start, each once
    however long it lasts; `last_failure` is the last one even once it passed.
    """

    name: str                       # catalog | api-keys | endpoints | node-revocations
    path: str
    state: str = "ok"               # ok | degraded
    problem: str | None = None
    since: float | None = None      # wall-clock time the problem began
    failures: int = 0
    last_failure: Failure | None = None     # {at, what, error}
    applied_at: float | None = None                   # wall-clock time its content last went in force

    @property
    def degraded(self) -> bool:
        return self.state != "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "state": self.state, "problem": self.problem,
                "since": self.since, "failures": self.failures,
                "last_failure": dict(self.last_failure) if self.last_failure is not None else None,
                "applied_at": self.applied_at}


@dataclass(frozen=True, slots=True)
class ControlStatus:
    """`GET /api/v1/status`: the catalog, the standalone routers, and the fleet, in one JSON object."""

    catalog: CatalogStatus
    routers: int
    fleet: FleetStatus
    log_streams: int = 0            # `llmgwctl logs` streams being relayed from agents now
    watchers: tuple[WatcherStatus, ...] = ()    # every file and directory followed, the catalog's first

    def _head(self) -> dict[str, Any]:
        return {"catalog": self.catalog.to_dict(), "routers": self.routers, "log_streams": self.log_streams,
                "watchers": [w.to_dict() for w in self.watchers]}

    def to_dict(self) -> dict[str, Any]:
        return {**self._head(), **self.fleet.to_dict()}

    def only(self, model: str) -> ControlStatus:
        """See `FleetStatus.only`: the catalog part stays whole."""
        return ControlStatus(catalog=self.catalog, routers=self.routers, fleet=self.fleet.only(model),
                             log_streams=self.log_streams, watchers=self.watchers)

    def to_json(self) -> bytes:
        """`to_dict()` as compact JSON (the same document), made from the rows' memoized fragments."""
        head = _compact(self._head())
        return "".join((head[:-1], ",", *self.fleet.json_parts(), "}")).encode()

    def unaged(self) -> tuple[object, ...]:
        """See `FleetStatus.unaged`: equal means nothing a person would see changed."""
        return (self.catalog, self.routers, self.log_streams, self.watchers, self.fleet.unaged())


def replica_adapters(placed: Any, reported: tuple[AdapterStatus, ...]) -> tuple[AdapterStatus, ...]:
    """A replica's adapters for status: each placed one as reported (loading until its agent says), then
    those reported and no longer placed (unloading). `placed` is the spec's AdapterSpecs."""
    said = {a.name: a for a in reported}
    out = [said.get(a.name) or AdapterStatus(a.name, LOADING) for a in placed]
    names = {a.name for a in placed}
    out.extend(a for a in reported if a.name not in names)
    return tuple(out)
