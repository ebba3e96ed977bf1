"""The agent's report: who a node is, what it has, and every replica it runs.

Built by the agent (`llmgwctl.agent.core.Agent.report`) and parsed by the
inventory, both through this module, so the two ends cannot disagree about a
field. The wire form is `schemas/api/agent-report.schema.json`; the control
API checks the schema first, and `from_dict` is the second line for what a
schema cannot say (a state the agent may not report) and for callers that
skip the API (the tests, `serve`'s in-process agent through the same route).

    AgentReport                          node; instance_id, boot_id, previous_instance_id (who speaks for it)
     ├ gpus: Gpu...                      index, uuid, name, memory (total, free)
     ├ cpu: CpuCapacity                  cores, memory, how many CPU replicas it takes
     ├ engines: {name: EngineAvailability}   (available, reason with the fix)
     └ replicas: ReportedReplica...      id, spec hash, state, port, pid, ... and its whole ReplicaSpec
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from .adapters import AdapterStatus, adapter_statuses
from .errors import ReportError
from .spec import ReplicaSpec
from .states import AGENT_STATES, ReplicaState

# Log lines kept per replica in a report: what `llmgwctl status` shows of a
# crash; more would make every heartbeat of a crash-looping node heavy.
LAST_LOG_LINES = 20
# What the report schema bounds a reason and a log line to (its descriptions
# say why): cut here when the report is built, so an engine's long error
# text never makes a node's whole report refused.
MAX_REASON = 4096
MAX_LOG_LINE = 16384


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of a node, as nvidia-smi (or a simulated --gpus SPEC) describes it."""

    index: int              # nvidia-smi's index, which is PCI bus order (the agent sets CUDA_DEVICE_ORDER to match)
    uuid: str = ""
    name: str = ""
    memory_mib: int = 0     # total; 0: unknown (the schema allows null)
    # Free right now, as the driver counts it (what every process on the GPU,
    # ours or not, leaves). None: unknown -- an agent from before this field,
    # or a simulated GPU, which nothing else uses: placement then takes the total.
    memory_free_mib: int | None = None

    @property
    def free_mib(self) -> int:
        """Free memory for placement: the reported figure, else the total."""
        return self.memory_mib if self.memory_free_mib is None else min(self.memory_free_mib, self.memory_mib)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "uuid": self.uuid, "name": self.name, "memory_mib": self.memory_mib}
        if self.memory_free_mib is not None:
            # Only when known, so a report reads the same to a controller from before the field.
            out["memory_free_mib"] = self.memory_free_mib
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Gpu:
        free = d.get("memory_free_mib")
        return cls(index=int(d["index"]), uuid=str(d.get("uuid") or ""), name=str(d.get("name") or ""),
                   memory_mib=int(d.get("memory_mib") or 0), memory_free_mib=None if free is None else max(0, int(free)))


# Bounds on what a node may say of its CPU side (the schema repeats them): a
# node claims capacity only on itself, but a bound keeps every sum exact and
# a typo from looking like a plan. 65,536 cores and 2^32 MiB (4 PiB) are past
# any machine; MAX_CPU_REPLICAS is placement's cap on replicas per node.
MAX_CORES = 65_536
MAX_MEMORY_MIB = 1 << 32
MAX_CPU_REPLICAS = 1000


@dataclass(frozen=True, slots=True)
class CpuCapacity:
    """What a node offers replicas that use no GPU: its cores, its memory, and how many such replicas it takes.

    `max_replicas` is the agent's to decide (its operator's --max-cpu-replicas,
    else a default from its cores, memory and port range: see
    llmgwctl.agent.capacity); placement puts no more CPU replicas there.
    """

    cores: int
    memory_mib: int
    max_replicas: int

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "memory_mib": self.memory_mib, "max_replicas": self.max_replicas}

    @classmethod
    def from_dict(cls, d: Any) -> CpuCapacity:
        if not isinstance(d, Mapping):
            raise ReportError(f"report field 'cpu' must be an object, got {type(d).__name__}")
        out = []
        for key, high in (("cores", MAX_CORES), ("memory_mib", MAX_MEMORY_MIB), ("max_replicas", MAX_CPU_REPLICAS)):
            value = d.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ReportError(f"report field cpu.{key}: expected an integer from 0 to {high}, got {value!r}")
            out.append(value)
        return cls(*out)


class EngineAvailability(NamedTuple):
    """Whether a node can run an engine; if not, why and how to fix it. A tuple, so `ok, why = ...` reads it."""

    available: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReportedReplica:
    """One replica as its agent last described it."""

    id: str
    spec_hash: str
    model: str
    profile: str
    engine: str
    gpu_indices: tuple[int, ...]
    state: ReplicaState             # one of AGENT_STATES
    url: str | None = None
    port: int | None = None
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    reason: str = ""
    last_log: tuple[str, ...] = ()
    # The whole spec, so a restarted controller adopts by desiring exactly it;
    # None when the agent sent none (or one this controller cannot read).
    spec: ReplicaSpec | None = field(default=None, compare=False)
    # Its LoRA adapters as the agent last saw them on the engine (contracts.adapters).
    adapters: tuple[AdapterStatus, ...] = ()

    def loaded(self) -> frozenset[str]:
        """The adapters the engine serves now."""
        return frozenset(a.name for a in self.adapters if a.state == "loaded")

    def to_dict(self) -> dict[str, Any]:
        out = self._to_dict()
        if self.adapters:
            # Only when there are: a report reads the same to a controller from before the field.
            out["adapters"] = [a.to_dict() for a in self.adapters]
        return out

    def _to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "spec_hash": self.spec_hash, "model": self.model, "profile": self.profile,
            "engine": self.engine, "gpu_indices": list(self.gpu_indices), "port": self.port, "pid": self.pid,
            "state": self.state.value, "restarts": self.restarts, "last_exit": self.last_exit,
            "last_log": [line[:MAX_LOG_LINE] for line in self.last_log[-LAST_LOG_LINES:]], "url": self.url,
            "reason": self.reason[:MAX_REASON],
            "spec": self.spec.to_dict() if self.spec is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReportedReplica:
        """ReportError naming the replica and the field when it breaks the protocol."""
        rid = d.get("id") if isinstance(d, Mapping) else None
        if not isinstance(rid, str) or not rid:
            raise ReportError(f"replica {d!r}: id must be a non-empty string")
        try:
            state = ReplicaState(d.get("state", ReplicaState.STARTING.value))
        except ValueError:
            state = None
        if state is None or state not in AGENT_STATES:
            allowed = ", ".join(sorted(s.value for s in AGENT_STATES))
            raise ReportError(f"replica {rid}: state {d.get('state')!r} is not one an agent reports ({allowed})")
        try:
            return cls(
                id=rid, spec_hash=str(d.get("spec_hash", "")), model=str(d.get("model", "")),
                profile=str(d.get("profile", "")), engine=str(d.get("engine", "")),
                gpu_indices=tuple(int(i) for i in d.get("gpu_indices") or ()), state=state,
                url=_opt_str(d.get("url")), port=_opt_int(d.get("port")), pid=_opt_int(d.get("pid")),
                restarts=int(d.get("restarts") or 0), last_exit=_opt_int(d.get("last_exit")),
                reason=str(d.get("reason") or ""),
                last_log=tuple(str(x) for x in (d.get("last_log") or ())[-LAST_LOG_LINES:]),
                spec=_spec(d.get("spec")),
                adapters=adapter_statuses(d.get("adapters")),
            )
        except (TypeError, ValueError) as exc:
            raise ReportError(f"replica {rid}: {exc}") from None


@dataclass(frozen=True, slots=True)
class AgentReport:
    """Everything an agent knows about its node, sent on every change and as a heartbeat."""

    node: str
    # Identity (see inventory.Inventory._claim): which agent process speaks for
    # the node (new on every agent start), on which machine boot (the kernel's
    # boot id), succeeding which process (the instance that last used its state
    # directory). All "" when unknown: an agent older than instance ids sent only
    # a boot_id, new on every agent start, which from_dict takes as its instance.
    instance_id: str = ""
    boot_id: str = ""
    previous_instance_id: str = ""
    agent_version: str = ""
    advertise_host: str = ""        # where this node's engines are reached
    pools: tuple[str, ...] = ()
    engines: Mapping[str, EngineAvailability] = field(default_factory=lambda: MappingProxyType({}))
    gpus: tuple[Gpu, ...] = ()
    replicas: tuple[ReportedReplica, ...] = ()
    # None: the agent did not say (one from before the field, a simulator):
    # placement then bounds its CPU replicas only by the per-node cap.
    cpu: CpuCapacity | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self._to_dict()
        if self.cpu is not None:
            # Only when known, so a report reads the same to a controller from before the field.
            out["cpu"] = self.cpu.to_dict()
        return out

    def _to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node, "instance_id": self.instance_id, "boot_id": self.boot_id,
            "previous_instance_id": self.previous_instance_id, "agent_version": self.agent_version,
            "pools": list(self.pools),
            "engines": {name: {"available": e.available, "reason": e.reason[:MAX_REASON]}
                        for name, e in sorted(self.engines.items())},
            "gpus": [g.to_dict() for g in self.gpus],
            "replicas": [r.to_dict() for r in self.replicas],
            "advertise_host": self.advertise_host,
        }

    @classmethod
    def from_dict(cls, body: Any, *, node: str | None = None) -> AgentReport:
        """Parse a report; with `node`, it must be that node's (the URL it was sent to).

        ReportError with what is wrong. A report without "node" is taken as
        the URL's node: the URL is what the agent authenticated for.
        """
        if not isinstance(body, Mapping):
            raise ReportError("report must be a JSON object")
        name = body.get("node", node)
        if node is not None and name != node:
            raise ReportError(f"report for node {name!r} sent to node {node!r}")
        if not isinstance(name, str) or not name:
            raise ReportError("report must name its node")
        replicas = tuple(ReportedReplica.from_dict(x) for x in _list(body, "replicas"))
        ids = [r.id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ReportError(f"report lists replica {next(i for i in ids if ids.count(i) > 1)!r} twice")
        try:
            engines = body.get("engines") or {}
            if not isinstance(engines, Mapping):
                raise TypeError("engines must be an object")
            return cls(
                node=name, instance_id=_instance(body), boot_id=str(body.get("boot_id") or ""),
                previous_instance_id=str(body.get("previous_instance_id") or ""),
                agent_version=str(body.get("agent_version") or ""),
                advertise_host=str(body.get("advertise_host") or ""),
                pools=tuple(str(p) for p in _list(body, "pools")),
                engines=MappingProxyType({str(k): EngineAvailability(bool(v.get("available")), str(v.get("reason") or ""))
                                          for k, v in engines.items()}),
                gpus=tuple(Gpu.from_dict(g) for g in _list(body, "gpus")),
                replicas=replicas,
                cpu=None if body.get("cpu") is None else CpuCapacity.from_dict(body["cpu"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReportError(f"malformed report: {exc!r}") from None


def _instance(body: Mapping[str, Any]) -> str:
    """The agent process a report comes from.

    Agents before instance_id sent a `boot_id` that was new on every agent
    start, which is what an instance id is, so theirs stands in for it (and
    such an agent never sends a previous_instance_id, so it cannot pass for
    the successor of another).
    """
    return str(body.get("instance_id") or body.get("boot_id") or "")


def _list(body: Mapping[str, Any], key: str) -> list[Any]:
    value = body.get(key) or []
    if not isinstance(value, (list, tuple)):
        raise ReportError(f"report field {key!r} must be a list, got {type(value).__name__}")
    return list(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _spec(raw: Any) -> ReplicaSpec | None:
    # Lenient on purpose: a spec this controller cannot read only means the
    # replica is not adopted (its agent stops it once the list arrives); failing
    # the whole report would make the node look silent and its replicas lost.
    if not isinstance(raw, Mapping) or not raw:
        return None
    try:
        return ReplicaSpec.from_dict(raw)
    except (KeyError, TypeError, ValueError):
        return None
