"""The router's usage, per replica: when it was last used and how many requests are in flight on it.

The reconciler reads it once a pass (idle scale-down, drain) from a
`UsageSource`: the in-process router, or the controller's board that merges
what standalone routers report. A standalone router sends it as a
`UsageReport` every few seconds:

    POST {controller}/api/v1/usage
    {"router": "<id, new per process>", "version": 42,          # the watch version this router has applied
     "replicas": {"r-7": {"idle_seconds": 3.2, "inflight": 1}}}  # idle_seconds null: never used

Idle seconds, not a timestamp, travel on the wire: the two processes' monotonic
clocks share no origin, so each side converts with its own clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Protocol

from .errors import UsageError


class Usage(NamedTuple):
    """One replica's usage on the reader's monotonic clock. A tuple, so `last, n = usage` reads it."""

    last_used: float | None     # None: no request has been sent to it yet
    inflight: int = 0


# A replica absent from a snapshot has never been used and has nothing in flight.
UNUSED = Usage(None, 0)

UsageSnapshot = Mapping[str, Usage]


class UsageSource(Protocol):
    """Where the router's usage is read, once a pass: the reconciler depends on this, not on the router,
    so the in-process router, the standalone routers' board and a test's dict all fit."""

    def usage_snapshot(self) -> UsageSnapshot: ...


class ReportedUsage(NamedTuple):
    """One replica in a standalone router's report: seconds since its last use (None: never), in flight."""

    idle_seconds: float | None
    inflight: int = 0


@dataclass(frozen=True, slots=True)
class UsageReport:
    """A standalone router's usage, as it POSTs it to the controller."""

    router: str                 # new per router process: a restarted router is a new reporter
    version: int                # the watch version the router had applied when it measured this
    replicas: Mapping[str, ReportedUsage] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, router: str, version: int, snapshot: UsageSnapshot, now: float) -> "UsageReport":
        """The report of a snapshot taken on a clock that reads `now`."""
        return cls(router, version, MappingProxyType({
            rid: ReportedUsage(None if last is None else round(now - last, 3), inflight)
            for rid, (last, inflight) in snapshot.items()}))

    def snapshot(self, now: float) -> dict[str, Usage]:
        """The report on the receiver's clock, which reads `now`."""
        return {rid: Usage(None if r.idle_seconds is None else now - r.idle_seconds, r.inflight)
                for rid, r in self.replicas.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"router": self.router, "version": self.version,
                "replicas": {rid: {"idle_seconds": r.idle_seconds, "inflight": r.inflight}
                             for rid, r in self.replicas.items()}}

    @classmethod
    def from_dict(cls, body: Any) -> "UsageReport":
        """UsageError saying what was expected when `body` is not a usage report."""
        if (not isinstance(body, Mapping) or not isinstance(body.get("router"), str)
                or not isinstance(body.get("replicas"), Mapping)):
            raise UsageError('expected {"router": ID, "version": N, "replicas": {REPLICA: {"idle_seconds", "inflight"}}}')
        replicas = {}
        try:
            for rid, entry in body["replicas"].items():
                idle = entry.get("idle_seconds")
                inflight = int(entry.get("inflight") or 0)
                if inflight < 0 or (idle is not None and float(idle) < 0):
                    raise ValueError(f"{rid}: negative idle_seconds or inflight")
                replicas[str(rid)] = ReportedUsage(None if idle is None else float(idle), inflight)
            version = int(body.get("version") or 0)
        except (AttributeError, TypeError, ValueError) as exc:
            raise UsageError(f"bad usage entry: {exc}") from None
        return cls(body["router"], version, MappingProxyType(replicas))
