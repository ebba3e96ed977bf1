"""Per LoRA adapter, the requests in flight that named it, integrated over time: what spreads an adapter.

The balancer counts in flight per replica, whatever model name a request
used; an adapter's spread over its base's replicas follows the adapter's own
requests (llmgwctl.reconciler.adapters), wherever they ran. So the request
path tells this counter when an attempt for an adapter starts and ends, and
it keeps, per adapter name, the count now and that count integrated over
time (request-seconds, only ever growing: contracts.usage's
`inflight_seconds`, per adapter). Readers difference two readings; nothing
here resets.

It must not know the catalog: names are what the request path hands it (an
adapter's name, resolved by intake). `retain` drops the names the catalog no
longer has, once nothing of theirs is in flight, so the counters stay bounded
by the adapters catalogs have named.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class AdapterLoad:
    """Per adapter name: [in flight now, request-seconds up to `at`, at]. Mutated only on the event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._counts: dict[str, list[float]] = {}

    def started(self, name: str) -> None:
        self._step(name, +1)

    def finished(self, name: str) -> None:
        self._step(name, -1)

    def _step(self, name: str, by: int) -> None:
        now = self._clock()
        entry = self._counts.get(name)
        if entry is None:
            entry = self._counts[name] = [0, 0.0, now]
        entry[1] += entry[0] * (now - entry[2])
        entry[2] = now
        entry[0] += by

    def inflight_seconds(self) -> dict[str, float]:
        """{adapter name: its requests in flight integrated over time, up to now} (an AdapterLoadSource's)."""
        now = self._clock()
        return {name: busy + n * (now - at) for name, (n, busy, at) in self._counts.items()}

    def inflight(self, name: str) -> int:
        entry = self._counts.get(name)
        return int(entry[0]) if entry is not None else 0

    def retain(self, names: Iterable[str]) -> None:
        """Forget the adapters not in `names` that have nothing in flight (a catalog swap dropped them)."""
        keep = set(names)
        for name in [n for n, entry in self._counts.items() if n not in keep and entry[0] <= 0]:
            del self._counts[name]
