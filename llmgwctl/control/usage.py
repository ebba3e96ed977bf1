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
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ..contracts import LoadReading, Usage, UsageReport, UsageSnapshot, UsageSource

# A router's report is trusted for three of its 2 s intervals: one late report
# is noise; a router silent for longer is gone, and so are its requests.
STALE_AFTER = 6.0


class UsageBoard:
    """A UsageSource itself: the reconciler reads the merged snapshot as if it were one router's."""

    def __init__(self, local: UsageSource | None = None, *, version: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic, stale_after: float = STALE_AFTER):
        self.local = local
        self._version = version
        self._clock = clock
        self.stale_after = stale_after
        # router id -> (received at, the watch version it had applied, its usage on our clock)
        self._remote: dict[str, tuple[float, int, dict[str, Usage]]] = {}
        # router id -> the engine readings its last report carried
        self._loads: dict[str, dict[str, LoadReading]] = {}
        # router id -> (received at, its in-flight counters or, from an old router, samples): the last report's
        self._counted: dict[str, tuple[float, dict[str, tuple[float | None, int]]]] = {}
        # replica id -> request-seconds in flight on it through standalone routers, as the board added them up
        self._busy: dict[str, float] = {}
        # A local source without counters (a test's dict): its samples integrated on each read; the last read
        self._local_busy: dict[str, float] = {}
        self._local_read: tuple[float, dict[str, int]] | None = None

    def report(self, body: Any) -> None:
        """Take one standalone router's report (see llmgwctl.contracts.usage); UsageError if malformed."""
        report = body if isinstance(body, UsageReport) else UsageReport.from_dict(body)
        now = self._clock()
        self._remote[report.router] = (now, report.version, report.snapshot(now))
        self._loads[report.router] = report.loads()
        self._count(report, now)

    def _count(self, report: UsageReport, now: float) -> None:
        """Add what each replica's in-flight counter grew by since this router's last report (see the docstring)."""
        last = self._counted.get(report.router)
        if last is not None:
            then, before = last
            for rid, r in report.replicas.items():
                prev = before.get(rid)
                if r.inflight_seconds is not None:
                    grown = r.inflight_seconds - prev[0] if prev is not None and prev[0] is not None else 0.0
                else:
                    grown = r.inflight * (now - then)     # an old router: its sample, held over the interval
                if grown > 0:
                    self._busy[rid] = self._busy.get(rid, 0.0) + grown
        self._counted[report.router] = (now, {rid: (r.inflight_seconds, r.inflight)
                                              for rid, r in report.replicas.items()})

    def routers(self) -> int:
        return len(self._fresh())

    def _fresh(self):
        now = self._clock()
        for router in [r for r, (at, _, _) in self._remote.items() if now - at > self.stale_after]:
            del self._remote[router]
            self._loads.pop(router, None)
            self._counted.pop(router, None)
        return self._remote.values()

    def usage_snapshot(self) -> UsageSnapshot:
        # The local router's values are Usages already (the UsageSource contract): taken as they
        # are. Made again, one per replica, they were 20,000 objects per read at fleet size, alive
        # through the read, which the collector promoted until a full collection -- a pause of
        # ~0.4 s at a serve-sized heap -- came every dozen status reads (issue 19).
        merged: dict[str, Usage] = dict(self.local.usage_snapshot()) if self.local else {}
        current = self._version()
        for _, version, replicas in self._fresh():
            lagging = version < current
            for rid, (last, inflight) in replicas.items():
                if lagging:
                    inflight = max(inflight, 1)
                old_last, old_inflight = merged.get(rid, (None, 0))
                newest = last if old_last is None else (old_last if last is None else max(old_last, last))
                merged[rid] = Usage(newest, old_inflight + inflight)
        return merged

    def load_snapshot(self) -> dict[str, LoadReading]:
        """Engine readings per replica: the in-process router's, then each fresh standalone router's.

        Every router polls the same engine, so any fresh reading of a replica
        is as good as another: the first one found is kept, the in-process
        router's first (it was read this pass, the reports up to 2 s ago).
        """
        local = getattr(self.local, "load_snapshot", None)
        merged: dict[str, LoadReading] = dict(local()) if local is not None else {}
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
        for rid in listed | self._busy.keys():
            merged[rid] = merged.get(rid, 0.0) + self._busy.get(rid, 0.0)
        return merged

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
