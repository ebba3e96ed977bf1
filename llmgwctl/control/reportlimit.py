"""How often a node's *changed* reports are taken: a token bucket per node.

A heartbeat (the node's last report again, byte for byte) costs a digest and
is never limited. A changed report costs its parse, its schema and URL checks
and a reconcile pass over the node, in proportion to its size; one node token
posting changed reports as fast as connections allow took the loop from
everyone (chat, `/healthz`, the other nodes). So each changed report takes
tokens from its node's bucket -- one, plus one per REPORT_BYTES_PER_TOKEN of
body -- and one that finds the bucket short is answered 429 with
`Retry-After` before it is parsed. A real agent sends a changed report per
state change, coalescing changes that happen while one is in flight, so its
rate is a few a second at a rollout's peak; it backs off on 429 and sends its
state as it is then, so nothing it says is lost, only later.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

# A burst of 20 changed reports: an agent starting with a full node reports
# each replica's start and its ready, a few at a time, within seconds.
BURST = 20.0
# Refilled at 4 a second: twice the state changes a node makes in a rollout of
# its replicas, and few enough that one node cannot take a noticeable share of
# the controller's loop with large reports.
RATE = 4.0
# A report this big costs one token more per this many bytes: a 4 MiB report
# (the most the control API takes) costs 17, a node's usual few KB cost 1.
REPORT_BYTES_PER_TOKEN = 256 * 1024
# Buckets kept: one per node that reported; beyond this the full ones (nodes
# that have not sent a changed report for BURST / RATE seconds) are dropped,
# so names a client makes up cannot grow the map without end.
MAX_BUCKETS = 100_000


class ReportLimiter:
    def __init__(self, burst: float = BURST, rate: float = RATE, *, clock: Callable[[], float] = time.monotonic):
        self.burst, self.rate = burst, rate
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}       # node -> (tokens, when)
        self.refused = 0

    @staticmethod
    def cost(size: int) -> float:
        return 1.0 + size // REPORT_BYTES_PER_TOKEN

    def take(self, node: str, size: int) -> float | None:
        """Take a changed report's tokens from `node`'s bucket: None if taken, else seconds until it would be."""
        if self.rate <= 0:
            return None
        now = self._clock()
        tokens, then = self._buckets.get(node, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        need = min(self.cost(size), self.burst)     # a report as big as the burst still goes through, at its pace
        if tokens < need:
            self._buckets[node] = (tokens, now)
            self.refused += 1
            return (need - tokens) / self.rate
        if len(self._buckets) >= MAX_BUCKETS and node not in self._buckets:
            self._sweep(now)
        self._buckets[node] = (tokens - need, now)
        return None

    def _sweep(self, now: float) -> None:
        full = [n for n, (tokens, then) in self._buckets.items() if tokens + (now - then) * self.rate >= self.burst]
        for name in full:
            del self._buckets[name]


def retry_after(seconds: float) -> str:
    """`Retry-After` is whole seconds: rounded up, and at least 1."""
    return str(max(1, math.ceil(seconds)))
