"""Contracts: the values that cross pieces, each with one type in one module.

Owns what more than one piece reads or writes -- a replica's state, the spec
an agent runs, the report an agent sends, the usage a router reports, an
endpoint the router is told about, an engine's load, the status the control
API answers -- so two spellings of one contract cannot drift. Each record is
built and parsed here (`to_dict` / `from_dict`), and the wire forms stay what
the agent protocol and the control API have always sent.

    states     ReplicaState, the one enum of a replica's life
    adapters   AdapterSpec (controller -> agent), AdapterStatus (agent -> controller), AdapterSpread (status): LoRA adapters
    spec       ReplicaSpec (controller -> agent), LoadReading (engine -> router)
    group      GroupSlot (controller -> agent, in a spec): a member's place in a replica spanning nodes
    endpoint   Endpoint (reconciler / static file / watch -> router)
    modelstate ModelState, ModelCondition (reconciler / watch -> router: starting, or cannot be placed and why)
    sink       RouterSink, what every source of endpoints, model states and catalogs pushes a router
    claims     NodeClaims (node token -> inventory: what a node may claim)
    report     AgentReport, ReportedReplica, Gpu, CpuCapacity, EngineAvailability (agent -> inventory)
    usage      Usage, UsageSource, LoadSource, ConcurrencySource, AdapterLoadSource, UsageReport (router -> reconciler)
    requestlog RequestRecord, RequestSink (router -> the controller's request log and traffic history)
    status     ControlStatus and its parts (controller -> control API, metrics, `llmgwctl status`)
    errors     ContractError and its children: a payload that breaks a contract

It imports nothing of ours but `llmgwctl.catalog`, and nothing that is slow to
import (no aiohttp): the reconciler, the agent and the router all load it.
"""
from __future__ import annotations

from .adapters import ADAPTER_STATES, AdapterSpec, AdapterSpread, AdapterStatus
from .claims import UNBOUNDED, NodeClaims
from .endpoint import Endpoint
from .errors import ContractError, EndpointError, ModelStateError, ReportError, UsageError
from .group import GroupSlot
from .modelstate import ModelCondition, ModelState
from .report import AgentReport, CpuCapacity, EngineAvailability, Gpu, ReportedReplica
from .requestlog import RequestRecord, RequestSink
from .scheduling import Scheduling
from .sink import RouterSink
from .spec import LoadReading, ReplicaSpec
from .states import AGENT_STATES, ReplicaState
from .status import (
                     CatalogStatus,
                     ControlStatus,
                     Event,
                     FleetStatus,
                     GpuStatus,
                     ModelStatus,
                     NodeStatus,
                     ReplicaStatus,
                     WatcherStatus,
)
from .usage import AdapterLoadSource, ConcurrencySource, LoadSource, Usage, UsageReport, UsageSnapshot, UsageSource

__all__ = [
    "ADAPTER_STATES", "AdapterSpec", "AdapterSpread", "AdapterStatus",
    "AGENT_STATES", "AdapterLoadSource", "AgentReport", "CatalogStatus", "ConcurrencySource", "ContractError", "ControlStatus", "Endpoint", "EndpointError",
    "CpuCapacity", "EngineAvailability", "Event", "FleetStatus", "Gpu", "GroupSlot", "GpuStatus", "LoadReading", "LoadSource", "ModelCondition", "ModelState",
    "ModelStateError", "ModelStatus", "NodeClaims", "NodeStatus", "UNBOUNDED",
    "ReplicaSpec", "ReplicaState", "RequestRecord", "RequestSink", "ReplicaStatus", "ReportError", "ReportedReplica", "RouterSink", "Scheduling", "Usage", "UsageError",
    "UsageReport", "UsageSnapshot", "UsageSource", "WatcherStatus",
]
