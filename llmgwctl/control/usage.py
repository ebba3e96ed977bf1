"""Where the reconciler reads router usage: the in-process router plus every standalone router's reports.

The reconciler needs, per replica, when it was last used (idle scale-down),
how many requests are in flight on it (drain, autoscaling) and its engine's
load gauges (autoscaling; `load_snapshot`). With `llmgwctl serve` alone
that is the in-process router's snapshot; standalone routers
(`llmgwctl router --controller`) POST theirs every few seconds
(`llmgwctl.router.watch.UsageReporter`), and this board merges them: the
latest use wins, in-flight counts add up.

In-flight counters (`inflight_seconds`, the autoscaler's time-averaged
concurrency) add up the same way, but a sum of counters jumps whenever a
router appears or goes silent; so the board keeps one counter per replica
of its own and adds to it, on each report, only what the router's counter
grew by since its last report. A router from before the counter reports only
`inflight` samples: the board integrates those (the sample times the time
since that router's last report), so its traffic still counts.

A standalone router that has not yet applied the newest endpoint list may
still send requests to a replica the controller just withdrew; until it
catches up, every replica it reports counts as busy, so a drain never ends on
its stale "nothing in flight".

A router's word is checked against the engine's. A router holds the agent
token, not the operator's: its reports may keep a model awake and a drain
waiting, but they cannot scale a model past what its traffic shows. What the
controller can check is the engine itself: the in-process router reads every
replica's engine gauges (`load_snapshot`), and every request any router has
on a replica is one the engine is running or queueing. So, when the board
has that local reading:

- what all standalone routers together claim in flight on a replica counts
  up to the engine's running + waiting, less what the in-process router has
  on it itself, plus IN_TRANSIT; their in-flight counters grow by at most
  that many request-seconds a second (a token bucket per replica holding at
  most BURST seconds of it, shared by every router id, so posting under many
  ids buys nothing);
- a replica the controller has no fresh reading of (its engine serves no
  metrics, or has not answered them lately, or it is draining and no longer
  polled) counts as busy at most (UNREAD_INFLIGHT): enough for the drain and
  the idle timer, never a load to scale on;
- the engine gauges a standalone router relays are not used: the controller
  reads the same engines itself;
- replicas the controller does not know (`known`) are dropped from a report,
  and at most MAX_ROUTERS router ids are heard at once.

Per LoRA adapter, the routers' in-flight counters (`adapter_inflight_seconds`,
what an adapter's spread follows) are added up the same way: the board keeps
one counter per adapter and adds what each router's grew by. Only adapter
names the catalog has count (`known_adapter`): a router cannot make the
controller hold names of its own. And a router's adapter requests are among
its requests: what its adapters' counters grew by in one report counts up to
what its replicas' counters grew by in it, which are checked as above. An
adapter's claims spread it only over replicas the base runs already, at
most its catalog `max`.

A board without a local reading (a test's source, a controller without an
in-process router) cannot check and takes reports as they are, within the
contract's bounds (llmgwctl.contracts.usage).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, ValuesView
from types import MappingProxyType
from typing import Any

from ..contracts import LoadReading, Usage, UsageReport, UsageSnapshot, UsageSource
from ..contracts.usage import UNUSED
from .errors import ControlError

# A router's report is trusted for three of its 2 s intervals: one late report
# is noise; a router silent for longer is gone, and so are its requests.
STALE_AFTER = 6.0
# Requests a router may have on a replica beyond what its engine was last seen
# holding: one sent and not yet counted by the engine, or finished there and
# still streaming its last bytes, while the engine's reading is a poll old.
# It also keeps a replica a router is using "busy" whatever the reading says.
IN_TRANSIT = 1
# What standalone routers' claims on a replica count for when its engine cannot
# be read: "busy" -- its drain waits and it is in use -- and no more.
UNREAD_INFLIGHT = 1
# Seconds of a replica's ceiling its routers' counters may report at once: one
# report interval of theirs (2 s), so a report that carries two seconds of
# traffic counts whole, and a burst of claims is worth at most that.
BURST = 2.0
# Standalone routers heard at once: a fleet runs a few to a few dozen; each
# one's last report is kept, so the count bounds that memory.
MAX_ROUTERS = 256


class TooManyRouters(ControlError):
    """A report from a new router id while MAX_ROUTERS are already reporting (answered 429)."""


class UsageBoard:
    """A UsageSource itself: the reconciler reads the merged snapshot as if it were one router's."""

    def __init__(self, local: UsageSource | None = None, *, version: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic, stale_after: float = STALE_AFTER,
                 known: Callable[[str], bool] | None = None, max_routers: int = MAX_ROUTERS,
                 known_adapter: Callable[[str], bool] | None = None):
        self.local = local
        self._version = version
        self._clock = clock
        self.stale_after = stale_after
        self._known = known             # None: every replica id is taken (a board in a test)
        self.max_routers = max_routers
        # The in-process router's engine readings: what routers' claims are checked against (module docstring).
        self._readings: Callable[[], Mapping[str, LoadReading]] | None = getattr(local, "load_snapshot", None)
        # router id -> (received at, the watch version it had applied, its usage on our clock)
        self._remote: dict[str, tuple[float, int, dict[str, Usage]]] = {}
        # router id -> the engine readings its last report carried
        self._loads: dict[str, dict[str, LoadReading]] = {}
        # router id -> (received at, its in-flight counters or, from an old router, samples): the last report's
        self._counted: dict[str, tuple[float, dict[str, tuple[float | None, int]]]] = {}
        # replica id -> request-seconds in flight on it through standalone routers, as the board added them up
        self._busy: dict[str, float] = {}
        # replica id -> what of `_busy` was looked at, what of it counts (checked against its ceiling), and
        # its token bucket (when it was last filled, the request-seconds left in it)
        self._seen: dict[str, float] = {}
        self._shown: dict[str, float] = {}
        self._credit: dict[str, tuple[float, float]] = {}
        # A local source without counters (a test's dict): its samples integrated on each read; the last read
        self._local_busy: dict[str, float] = {}
        self._local_read: tuple[float, dict[str, int]] | None = None
        # Per adapter: None takes no router's names (a board in a test takes what the local router counts)
        self._known_adapter = known_adapter
        # router id -> its adapters' counters in its last report; adapter name -> what the board added up
        self._adapter_counted: dict[str, dict[str, float]] = {}
        self._adapter_busy: dict[str, float] = {}

    def report(self, body: Any) -> None:
        """Take one standalone router's report (see llmgwctl.contracts.usage); UsageError if malformed."""
        report = body if isinstance(body, UsageReport) else UsageReport.from_dict(body)
        if report.router not in self._remote and len(self._fresh()) >= self.max_routers:
            raise TooManyRouters(f"{self.max_routers} standalone routers are reporting already; a router id is "
                                 "heard again once one of them has been silent for "
                                 f"{self.stale_after:g} s")
        known = self._known
        if known is not None and not all(known(rid) for rid in report.replicas):
            # A replica given up or stopped that a router still lists is no news; one never placed is no
            # replica. Neither is counted, nor kept.
            report = dataclasses.replace(report, replicas=MappingProxyType(
                {rid: r for rid, r in report.replicas.items() if known(rid)}))
        now = self._clock()
        self._remote[report.router] = (now, report.version, report.snapshot(now))
        self._loads[report.router] = report.loads()
        self._count(report, now)

    def _count(self, report: UsageReport, now: float) -> None:
        """Add what each replica's in-flight counter grew by since this router's last report (see the docstring)."""
        last = self._counted.get(report.router)
        total = 0.0         # what this router's replicas' counters grew by: its adapters' growth is part of it
        if last is not None:
            then, before = last
            for rid, r in report.replicas.items():
                prev = before.get(rid)
                if r.inflight_seconds is not None:
                    grown = r.inflight_seconds - prev[0] if prev is not None and prev[0] is not None else 0.0
                else:
                    grown = r.inflight * (now - then)     # an old router: its sample, held over the interval
                if grown > 0:
                    if rid not in self._busy:
                        # Its bucket fills from when the growth began: this router's last report.
                        self._credit.setdefault(rid, (then, 0.0))
                    self._busy[rid] = self._busy.get(rid, 0.0) + grown
                    total += grown
        self._counted[report.router] = (now, {rid: (r.inflight_seconds, r.inflight)
                                              for rid, r in report.replicas.items()})
        self._count_adapters(report, total if last is not None else 0.0)

    def _count_adapters(self, report: UsageReport, total: float) -> None:
        """Add what each known adapter's counter grew by since this router's last report, all of them
        together at most `total`, what its replicas' counters grew by (see the module docstring)."""
        known = self._known_adapter
        if known is None:
            return
        counters = {name: b for name, b in report.adapters.items() if known(name)}
        before = self._adapter_counted.get(report.router)
        self._adapter_counted[report.router] = counters
        if before is None:
            return
        grown = {name: b - before[name] for name, b in counters.items() if name in before and b > before[name]}
        claimed = sum(grown.values())
        scale = 1.0 if claimed <= total else (total / claimed if claimed > 0 else 0.0)
        for name, g in grown.items():
            self._adapter_busy[name] = self._adapter_busy.get(name, 0.0) + g * scale

    def routers(self) -> int:
        return len(self._fresh())

    def _fresh(self) -> ValuesView[tuple[float, int, dict[str, Usage]]]:

        now = self._clock()
        for router in [r for r, (at, _, _) in self._remote.items() if now - at > self.stale_after]:
            del self._remote[router]
            self._loads.pop(router, None)
            self._counted.pop(router, None)
            self._adapter_counted.pop(router, None)
        return self._remote.values()

    def usage_snapshot(self) -> UsageSnapshot:
        # The local router's values are Usages already (the UsageSource contract): taken as they
        # are. Made again, one per replica, they were 20,000 objects per read at fleet size, alive
        # through the read, which the collector promoted until a full collection -- a long
        # pause at a serve-sized heap -- came every dozen status reads.
        local: UsageSnapshot = self.local.usage_snapshot() if self.local else {}
        merged: dict[str, Usage] = dict(local)
        current = self._version()
        remote: dict[str, Usage] = {}
        for _, version, replicas in self._fresh():
            lagging = version < current
            for rid, (last, inflight) in replicas.items():
                if lagging:
                    inflight = max(inflight, 1)
                old_last, old_inflight = remote.get(rid, UNUSED)
                newest = last if old_last is None else (old_last if last is None else max(old_last, last))
                remote[rid] = Usage(newest, old_inflight + inflight)
        ceiling = self._ceiling(local) if remote else None
        for rid, (last, inflight) in remote.items():
            if ceiling is not None and inflight > 1:
                inflight = min(inflight, max(1, math.floor(ceiling(rid))))
            old_last, old_inflight = merged.get(rid, UNUSED)
            newest = last if old_last is None else (old_last if last is None else max(old_last, last))
            merged[rid] = Usage(newest, old_inflight + inflight)
        return merged

    def _ceiling(self, local: UsageSnapshot | None = None) -> Callable[[str], float] | None:
        """Per replica, the most the standalone routers together may have in flight on it; None: unchecked.

        See the module docstring: the engine's running + waiting, less the in-process router's own,
        plus IN_TRANSIT; UNREAD_INFLIGHT for a replica the in-process router has no fresh reading of.
        """
        if self._readings is None:
            return None
        readings = self._readings()
        if local is None:
            local = self.local.usage_snapshot() if self.local else {}

        def ceiling(rid: str) -> float:
            reading = readings.get(rid)
            if reading is None:
                return UNREAD_INFLIGHT
            mine = local.get(rid, UNUSED)[1]
            return max(0.0, reading.running + reading.waiting - mine) + IN_TRANSIT
        return ceiling

    def load_snapshot(self) -> dict[str, LoadReading]:
        """Engine readings per replica: the in-process router's, then each fresh standalone router's.

        Every router polls the same engine. With an in-process router, its own
        readings are the ones taken (it read them this pass, and they are the
        controller's own); without one, the first fresh reading a standalone
        router reported of a replica is kept.
        """
        if self._readings is not None:
            # The controller reads every engine itself: a standalone router's relayed gauges add
            # nothing it could check (module docstring), and a reading only it has is not taken.
            self._fresh()
            return dict(self._readings())
        merged: dict[str, LoadReading] = {}
        self._fresh()
        for loads in self._loads.values():
            for rid, reading in loads.items():
                merged.setdefault(rid, reading)
        return merged

    def endpoint_problems(self) -> dict[str, str]:
        """{replica id: what the in-process router holds against its engine now} (see Router.endpoint_problems).

        Only the in-process router's: a standalone router's ejections show on
        its own /metrics (`llmgw_router_endpoint_ejected`), not in its usage reports.
        """
        local = getattr(self.local, "endpoint_problems", None)
        return dict(local()) if local is not None else {}

    def inflight_seconds(self) -> dict[str, float]:
        """Per replica, request-seconds in flight through every router: the in-process router's counter plus
        the board's own for standalone routers (a ConcurrencySource; see the module docstring).

        Only replicas some router still lists are kept; one that comes back
        starts from zero again, which a reader differencing its readings
        takes as a counter reset, not as negative load.
        """
        local = getattr(self.local, "inflight_seconds", None)
        if local is not None:
            merged: dict[str, float] = dict(local())
        else:
            merged = self._integrate_local()
        self._fresh()
        listed = {rid for _, readings in self._counted.values() for rid in readings}
        for rid in [r for r in self._busy if r not in listed and r not in merged]:
            del self._busy[rid]
            self._seen.pop(rid, None)
            self._shown.pop(rid, None)
            self._credit.pop(rid, None)
        self._take_claims()
        for rid in listed | self._busy.keys():
            merged[rid] = merged.get(rid, 0.0) + self._shown.get(rid, 0.0)
        return merged

    def adapter_inflight_seconds(self) -> dict[str, float]:
        """Per adapter name, request-seconds in flight through every router: the in-process router's
        counter plus the board's own for standalone routers (an AdapterLoadSource; module docstring).
        Only the catalog's adapters: a name it dropped is forgotten (and starts from zero if it returns,
        which a reader takes as a counter reset)."""
        local = getattr(self.local, "adapter_inflight_seconds", None)
        merged: dict[str, float] = dict(local()) if local is not None else {}
        known = self._known_adapter
        if known is not None:
            for name in [n for n in self._adapter_busy if not known(n)]:
                del self._adapter_busy[name]
            merged = {name: b for name, b in merged.items() if known(name)}
        for name, b in self._adapter_busy.items():
            merged[name] = merged.get(name, 0.0) + b
        return merged

    def _take_claims(self) -> None:
        """Move what routers' counters grew by since the last read into what counts, each replica's
        capped by its token bucket: its ceiling's request-seconds a second, at most BURST seconds saved."""
        ceiling: Callable[[str], float] | None = None     # read once, at the first replica that grew
        now = self._clock()
        for rid, claimed in self._busy.items():
            seen = self._seen.get(rid, 0.0)
            if claimed == seen:
                continue        # nothing new: its bucket is filled when something is (capped at BURST then)
            self._seen[rid] = claimed
            pending = claimed - seen
            if self._readings is not None:
                if ceiling is None:
                    ceiling = self._ceiling()
                assert ceiling is not None
                rate = ceiling(rid)
                at, credit = self._credit.get(rid, (now, 0.0))
                credit = min(credit + rate * max(0.0, now - at), rate * BURST)
                pending = min(pending, credit)
                self._credit[rid] = (now, credit - pending)
            self._shown[rid] = self._shown.get(rid, 0.0) + pending

    def _integrate_local(self) -> dict[str, float]:
        """A local source with no counters of its own: its in-flight samples held since the last read."""
        if self.local is None:
            return {}
        now = self._clock()
        samples = {rid: u[1] for rid, u in self.local.usage_snapshot().items()}
        if self._local_read is not None:
            then, before = self._local_read
            for rid, n in before.items():
                if n:
                    self._local_busy[rid] = self._local_busy.get(rid, 0.0) + n * (now - then)
        self._local_read = (now, samples)
        self._local_busy = {rid: b for rid, b in self._local_busy.items() if rid in samples}
        return {rid: self._local_busy.get(rid, 0.0) for rid in samples}
