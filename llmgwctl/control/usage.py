"""Where the reconciler reads router usage: the in-process router plus every standalone router's reports.

The reconciler needs, per replica, when it was last used (idle scale-down),
how many requests are in flight on it (drain, autoscaling) and its engine's
load gauges (autoscaling; `load_snapshot`). With `llmgwctl serve` alone
that is the in-process router's snapshot; standalone routers
(`llmgwctl router --controller`) POST theirs every few seconds
(`llmgwctl.router.watch.UsageReporter`), and this board merges them: the
latest use wins, in-flight counts add up.

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

    def report(self, body: Any) -> None:
        """Take one standalone router's report (see llmgwctl.contracts.usage); UsageError if malformed."""
        report = body if isinstance(body, UsageReport) else UsageReport.from_dict(body)
        now = self._clock()
        self._remote[report.router] = (now, report.version, report.snapshot(now))
        self._loads[report.router] = report.loads()

    def routers(self) -> int:
        return len(self._fresh())

    def _fresh(self):
        now = self._clock()
        for router in [r for r, (at, _, _) in self._remote.items() if now - at > self.stale_after]:
            del self._remote[router]
            self._loads.pop(router, None)
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
