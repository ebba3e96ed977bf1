"""The router's usage, per replica: when it was last used and how many requests are in flight on it.

The reconciler reads it once a pass (idle scale-down, drain) from a
`UsageSource`: the in-process router, or the controller's board that merges
what standalone routers report. A standalone router sends it as a
`UsageReport` every few seconds:

    POST {controller}/api/v1/usage
    {"router": "<id, new per process>", "version": 42,          # the watch version this router has applied
     "replicas": {"r-7": {"idle_seconds": 3.2, "inflight": 1,   # idle_seconds null: never used
                          "inflight_seconds": 812.4,            # optional: the counter below
                          "load": {"running": 3, "waiting": 0, "kv_cache": 0.4}}},   # optional
     "adapters": {"sql-assistant": {"inflight_seconds": 96.1}}}  # optional: per LoRA adapter, below

`load` is the router's latest fresh reading of the replica's engine gauges
(absent: none, or a router older than autoscaling; a controller older than
it ignores the key). The autoscaler reads it through a `LoadSource`.

`inflight_seconds` is the replica's in-flight count integrated over time
since this router first listed it (request-seconds): a counter that only
grows. Two readings of it, differenced and
divided by the time between them, are the mean concurrency in between --
every request counted for as long as it was in flight, where `inflight` is
one sample of a count that jumps with every arrival (Knative's queue-proxy
reports the same average, for the same reason). Absent: a router from
before it; the controller then integrates that router's `inflight` samples
itself (`control.usage.UsageBoard`). A controller from before it ignores
the key. The autoscaler reads it through a `ConcurrencySource`.

`adapters` carries the same counter per LoRA adapter name: request-seconds
in flight of the requests that named the adapter, on whichever replica
served them, since this router first counted it. An adapter's spread over
its base's replicas follows it (llmgwctl.reconciler.adapters), read through
an `AdapterLoadSource`. Absent: a router from before it, whose adapter
traffic then moves no spread; a controller from before it ignores the key.
The controller counts only names its catalog has as adapters, so a router
cannot make it hold names of its own invention (control.usage.UsageBoard).

Idle seconds, not a timestamp, travel on the wire: the two processes' monotonic
clocks share no origin, so each side converts with its own clock.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from .errors import UsageError
from .spec import LoadReading

# The most a gauge may say on the wire: past a million requests or a KV use
# past 1 a reading is broken, and a bound keeps sums over a fleet finite.
MAX_GAUGE = 1e6
# The most a router's in-flight counter may say: MAX_GAUGE requests in flight
# for ten years. A bigger one is broken or hostile, and a bound keeps the
# board's sums and the reconciler's differences finite (1e308 twice is inf,
# and inf - inf a NaN that made every pass raise).
MAX_COUNTER = MAX_GAUGE * 86400 * 3650
# Ids (a router's, a replica's) past this are not ids: the router's own is 12
# hex digits, replica ids a few dozen characters.
MAX_ID = 128
# Replicas in one report: a fleet at the size llmgw is built for runs 20,000
# (bench/fleet.py); past three times that a report is not one router's view.
MAX_REPLICAS = 65536
# Seconds a replica may have been idle on the wire: ten years is "never lately".
MAX_IDLE = 86400.0 * 3650
# Watch versions are milliseconds since an epoch, counted up: an int64 holds them.
MAX_VERSION = 2**63 - 1
# Adapter names in one report: a catalog holds at most 1,000 adapters a model
# (catalog.modelrules.MAX_ADAPTERS); a report naming more than a few
# models' worth is not one router's traffic. A name is the catalog's: at
# most 128 characters.
MAX_ADAPTERS = 16384
MAX_NAME = 128


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


class LoadSource(Protocol):
    """Where the engines' load gauges are read, once a pass: the autoscaler depends on this, not on the
    router's balancer, so the in-process router, the standalone routers' board and a test's dict all fit.
    Only fresh readings: a replica whose engine has not answered lately is absent, not idle."""

    def load_snapshot(self) -> Mapping[str, LoadReading]: ...


class ConcurrencySource(Protocol):
    """Where the routers' in-flight counters are read, once a pass: per replica, its in-flight requests
    integrated over time (request-seconds, only ever growing; see the module docstring). The
    autoscaler depends on this, not on the router, and differences two readings itself, so any
    number of readers (status, the reconciler) read the same counters without resetting them."""

    def inflight_seconds(self) -> Mapping[str, float]: ...


class AdapterLoadSource(Protocol):
    """Where the routers' per-adapter in-flight counters are read, once a pass: per LoRA adapter name,
    request-seconds in flight of the requests that named it (only ever growing; see the module
    docstring). The adapters' placement depends on this, not on the router, and differences two
    readings itself, like the autoscaler its ConcurrencySource."""

    def adapter_inflight_seconds(self) -> Mapping[str, float]: ...


class ReportedUsage(NamedTuple):
    """One replica in a standalone router's report: seconds since its last use (None: never), in flight,
    the router's fresh reading of its engine's gauges (None: none), and its in-flight counter
    (None: a router from before it)."""

    idle_seconds: float | None
    inflight: int = 0
    load: LoadReading | None = None
    inflight_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class UsageReport:
    """A standalone router's usage, as it POSTs it to the controller."""

    router: str                 # new per router process: a restarted router is a new reporter
    version: int                # the watch version the router had applied when it measured this
    replicas: Mapping[str, ReportedUsage] = field(default_factory=lambda: MappingProxyType({}))
    # adapter name -> its in-flight counter (request-seconds); empty from a router from before it
    adapters: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, router: str, version: int, snapshot: UsageSnapshot, now: float,
           loads: Mapping[str, LoadReading] | None = None,
           inflight_seconds: Mapping[str, float] | None = None,
           adapters: Mapping[str, float] | None = None) -> UsageReport:
        """The report of a snapshot (and load readings, in-flight counters, per replica and per
        adapter) taken on a clock that reads `now`."""
        loads, busy = loads or {}, inflight_seconds or {}
        return cls(router, version, MappingProxyType({
            rid: ReportedUsage(None if last is None else round(now - last, 3), inflight, loads.get(rid),
                               None if (b := busy.get(rid)) is None else round(b, 3))
            for rid, (last, inflight) in snapshot.items()}),
            MappingProxyType({name: round(b, 3) for name, b in (adapters or {}).items()}))

    def loads(self) -> dict[str, LoadReading]:
        """The engine readings the report carries, per replica."""
        return {rid: r.load for rid, r in self.replicas.items() if r.load is not None}

    def snapshot(self, now: float) -> dict[str, Usage]:
        """The report on the receiver's clock, which reads `now`."""
        return {rid: Usage(None if r.idle_seconds is None else now - r.idle_seconds, r.inflight)
                for rid, r in self.replicas.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"router": self.router, "version": self.version,
                "replicas": {rid: {"idle_seconds": r.idle_seconds, "inflight": r.inflight}
                             | ({"load": _load_dict(r.load)} if r.load is not None else {})
                             | ({"inflight_seconds": r.inflight_seconds} if r.inflight_seconds is not None else {})
                             for rid, r in self.replicas.items()}} \
            | ({"adapters": {name: {"inflight_seconds": b} for name, b in self.adapters.items()}} if self.adapters else {})

    @classmethod
    def from_dict(cls, body: Any) -> UsageReport:
        """UsageError naming the field and what was expected when `body` is not a usage report."""
        if (not isinstance(body, Mapping) or not isinstance(body.get("router"), str)
                or not isinstance(body.get("replicas"), Mapping)):
            raise UsageError('expected {"router": ID, "version": N, "replicas": {REPLICA: {"idle_seconds", "inflight"}}}')
        router = body["router"]
        if not 0 < len(router) <= MAX_ID or not router.isprintable():
            raise UsageError(f"router: an id of 1 to {MAX_ID} printable characters, not {router[:40]!r}")
        version = body.get("version")
        if version is None:
            version = 0
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
            raise UsageError(f"version: the watch version the router applied, a whole number from 0, "
                             f"not {str(version)[:40]!r}")
        if len(body["replicas"]) > MAX_REPLICAS:
            raise UsageError(f"replicas: at most {MAX_REPLICAS} per report, not {len(body['replicas'])}")
        replicas = {}
        rid = None
        try:
            for rid, entry in body["replicas"].items():
                if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID:
                    raise ValueError(f"a replica id of 1 to {MAX_ID} characters, not {str(rid)[:40]!r}")
                if not isinstance(entry, Mapping):
                    raise ValueError("an object {\"idle_seconds\", \"inflight\"}")
                idle = entry.get("idle_seconds")
                inflight = _inflight_from(entry.get("inflight"))
                if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                                         or not (math.isfinite(idle) and 0 <= idle <= MAX_IDLE)):
                    raise ValueError(f"idle_seconds must be null or seconds from 0 to {MAX_IDLE:.0f}, not {idle!r}")
                replicas[rid] = ReportedUsage(None if idle is None else float(idle), inflight,
                                              _load_from(entry.get("load")),
                                              _counter_from(entry.get("inflight_seconds")))
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:   # OverflowError: float(10**400)
            # The replica's id in every message: a router's report carries thousands.
            where = "" if rid is None or not isinstance(rid, str) else f" for {rid[:40]!r}"
            raise UsageError(f"bad usage entry{where} in replicas: {exc}") from None
        return cls(router, version, MappingProxyType(replicas), MappingProxyType(_adapters_from(body.get("adapters"))))


def _adapters_from(raw: Any) -> dict[str, float]:
    """A report's per-adapter counters; UsageError naming the adapter when they are not
    {NAME: {"inflight_seconds": N}} within the bounds. Absent or null: none."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UsageError('adapters: expected {ADAPTER: {"inflight_seconds": N}}')
    if len(raw) > MAX_ADAPTERS:
        raise UsageError(f"adapters: at most {MAX_ADAPTERS} per report, not {len(raw)}")
    out = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"adapters: a name of 1 to {MAX_NAME} characters, not {str(name)[:40]!r}")
        try:
            if not isinstance(entry, Mapping):
                raise ValueError('an object {"inflight_seconds": N}')
            counter = _counter_from(entry.get("inflight_seconds"))
        except ValueError as exc:
            raise UsageError(f"bad usage entry for adapter {name[:40]!r}: {exc}") from None
        if counter is not None:
            out[name] = counter
    return out


def _inflight_from(raw: Any) -> int:
    """A reported in-flight count; ValueError when it is not a number from 0 to MAX_GAUGE.

    Checked before int(): int(1e400) raises OverflowError, and past MAX_GAUGE a
    count is broken (sums of it overflowed the reconciler's pass).
    """
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and 0 <= raw <= MAX_GAUGE):
        raise ValueError(f"inflight must be a count from 0 to {MAX_GAUGE:.0f}, not {raw!r}")
    return int(raw)


def _counter_from(raw: Any) -> float | None:
    """A reported in-flight counter; ValueError when it is not a finite non-negative number."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and 0 <= raw <= MAX_COUNTER):
        raise ValueError(f"inflight_seconds must be a number from 0 to {MAX_COUNTER:.3g}, not {raw!r}")
    return float(raw)


def _load_dict(load: LoadReading) -> dict[str, Any]:
    return {"running": load.running, "waiting": load.waiting, "kv_cache": load.kv_cache}


def _load_from(raw: Any) -> LoadReading | None:
    """A reported reading; ValueError when it is not finite non-negative gauges within MAX_GAUGE."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError("load must be an object with running, waiting, kv_cache")

    def gauge(key: str) -> float:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"load.{key} must be a number")
        value = float(value)
        if not (math.isfinite(value) and 0 <= value <= (1.0 if key == "kv_cache" else MAX_GAUGE)):
            raise ValueError(f"load.{key} out of range: {value!r}")
        return value

    # kv_cache may be absent or null: an engine without the gauge (llama.cpp).
    return LoadReading(gauge("running"), gauge("waiting"), None if raw.get("kv_cache") is None else gauge("kv_cache"))
