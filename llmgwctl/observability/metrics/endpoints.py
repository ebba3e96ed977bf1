"""Metrics per endpoint: stable `endpoint` labels, what a request served there records, and the gauges read from the router's state at scrape.

Labels are bounded and stable: `model` is a catalog model's canonical name
(never the client's string: a request for an unknown name counts under
model=""); `endpoint` is a *slot*, `MODEL/PROFILE/N`, N the lowest index no
other endpoint of that model and profile holds (`EndpointSlots`). Replica ids
are never reused, so labelling by them would start new series on every
restart or replacement and grow without end; a replacement takes the slot its
predecessor left, so its counters continue the same series, and there are
never more slots than a profile's peak replicas. Which replica holds a slot
now is `llmgw_router_endpoint_info`, one series per live endpoint.

Hot-path cost: the router asks for an `EndpointMetrics` once per request (a
dict lookup) and calls `done()`, which increments a pre-bound counter child and
observes three pre-bound histogram children (kit.py's `Count` / `Hist`); no
label dict is built per request. Everything that is a level (in flight,
staleness, what the engine's last load reading said, ejections) is read from
the router's own state when scraped (`ProbeCollector`, through the read-only
`RouterProbe`) and costs requests nothing.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from .kit import Count, Family, Hist


class EndpointSlots:
    """Stable `endpoint` label values: `MODEL/PROFILE/N` per endpoint, N the lowest free index.

    An endpoint keeps its slot while it stays in the list; one that joins takes
    the lowest index of its model and profile that no endpoint in the list
    holds -- so a replica restarted or replaced under a new id takes the slot
    its predecessor left, and dashboards see one series go on.
    """

    # Slots of endpoints that left, remembered for requests still finishing
    # there (a replica leaves the list first and drains after); a few hundred
    # covers any drain, and the bound keeps replica churn from growing it.
    _GONE_KEPT = 512

    def __init__(self) -> None:
        self._by_id: dict[str, str] = {}
        self._gone: dict[str, str] = {}

    def change(self, added: Iterable[Any], removed: Iterable[str]) -> None:
        """The list changed by these (objects with replica_id, model, profile; ids): slots for the
        newcomers of `added`, in its order, the removed ids' slots freed -- free for a newcomer of
        the same change."""
        for rid in removed:
            slot = self._by_id.pop(rid, None)
            if slot is not None:
                self._gone[rid] = slot
        newcomers = [ep for ep in added if ep.replica_id not in self._by_id]
        if newcomers:
            taken = set(self._by_id.values())
            # Where each model/profile's search for a free index goes on from: slots are only
            # taken within one call, so the lowest free index never goes below the last one
            # handed out. Searching from 0 for each newcomer was quadratic in a model's
            # replicas: a rollout of 1,000 while the 1,000 it replaces still hold 0-999 is
            # ~1.5 million probes in one publishing pass.
            next_free: dict[tuple[str, str], int] = {}
            for ep in newcomers:
                group = (ep.model, ep.profile)
                n = next_free.get(group, 0)
                while f"{ep.model}/{ep.profile}/{n}" in taken:
                    n += 1
                slot = f"{ep.model}/{ep.profile}/{n}"
                self._by_id[ep.replica_id] = slot
                taken.add(slot)
                next_free[group] = n + 1
        while len(self._gone) > self._GONE_KEPT:
            del self._gone[next(iter(self._gone))]

    def current(self, replica_id: str) -> bool:
        return replica_id in self._by_id

    def label(self, replica_id: str) -> str:
        """The slot `replica_id` holds, or held when it left; the id itself for one never in the list."""
        slot = self._by_id.get(replica_id)
        if slot is None:
            slot = self._gone.get(replica_id, replica_id)
        return slot


@dataclass(frozen=True, slots=True)
class RouterProbe:
    """Read-only views of the router's own state, called at scrape time only.

    states(): objects with replica_id, endpoint.model, inflight and load_at
              (the balancer's EndpointState);
    waiting(): {model: requests waiting for a cold start};
    catalog(): (version, model names);
    ejected(): {replica id: the code it is ejected for} (router/ejection.py).
    """

    states: Callable[[], Iterable[Any]]
    waiting: Callable[[], Mapping[str, int]]
    catalog: Callable[[], tuple[str, Iterable[str]]]
    clock: Callable[[], float] = time.monotonic
    ejected: Callable[[], Mapping[str, str]] = dict


class ModelMetrics:
    """Pre-bound children for one model, shared by its endpoints' `EndpointMetrics`."""

    __slots__ = ("duration", "ttfb", "tokens_in", "tokens_out")

    def __init__(self, duration: Family, ttfb: Family, tokens: Family, model: str):
        self.duration: Hist = duration.labels(model)
        self.ttfb: Hist = ttfb.labels(model)
        self.tokens_in: Count = tokens.labels(model, "in")
        self.tokens_out: Count = tokens.labels(model, "out")


class EndpointMetrics:
    """Pre-bound children for one (model, endpoint): what a request served there records.

    `done` is the whole per-request cost of metrics, so the observations are
    written out rather than calls to `Hist.observe`: it runs once per request.
    """

    __slots__ = ("_counter", "_model", "_endpoint", "_codes", "_duration", "_ttfb", "_in", "_out", "_overhead")

    def __init__(self, requests: Family, model: ModelMetrics, overhead: Hist, model_name: str, endpoint: str):
        self._counter = requests
        self._model, self._endpoint = model_name, endpoint
        self._codes: dict[int, Any] = {}
        self._duration, self._ttfb, self._in, self._out = model.duration, model.ttfb, model.tokens_in, model.tokens_out
        self._overhead = overhead

    def done(self, code: int, duration: float, ttfb: float, overhead: float,
             usage: tuple[int, int] | None = None) -> None:
        child = self._codes.get(code)
        if child is None:
            child = self._codes[code] = self._counter.labels(self._model, self._endpoint, str(code))
        child.value += 1
        h = self._duration
        h.counts[bisect_left(h.bounds, duration)] += 1
        h.sum += duration
        h = self._ttfb
        h.counts[bisect_left(h.bounds, ttfb)] += 1
        h.sum += ttfb
        h = self._overhead
        h.counts[bisect_left(h.bounds, overhead)] += 1
        h.sum += overhead
        if usage is not None:
            self._in.value += usage[0]
            self._out.value += usage[1]

    def codes(self) -> tuple[str, ...]:
        return tuple(str(c) for c in self._codes)


class ProbeCollector:
    def __init__(self, probe: RouterProbe, slot: Callable[[str], str]):
        self.probe = probe
        self.slot = slot

    def describe(self) -> list[Metric]:
        return []       # names are known only at collect time; nothing to check at register

    def collect(self) -> Iterable[Metric]:
        p = self.probe
        now = p.clock()
        inflight = GaugeMetricFamily("llmgw_router_inflight_requests", "Requests in flight per endpoint.",
                                     labels=("model", "endpoint"))
        age = GaugeMetricFamily("llmgw_router_endpoint_metrics_age_seconds", "Seconds since the endpoint's last "
                                "successful /metrics poll (+Inf: none yet).", labels=("endpoint",))
        # The reading the balancer holds, as it holds it: an operator (and the
        # real-engine tests) can see what a pick was weighed by.
        running = GaugeMetricFamily("llmgw_router_endpoint_running_requests", "Requests running on the endpoint's "
                                    "engine, as its last load reading said.", labels=("endpoint",))
        queued = GaugeMetricFamily("llmgw_router_endpoint_waiting_requests", "Requests waiting in the endpoint's "
                                   "engine, as its last load reading said.", labels=("endpoint",))
        kv = GaugeMetricFamily("llmgw_router_endpoint_kv_cache_usage_ratio", "Share of the endpoint's KV cache in "
                               "use, as its last load reading said (absent if the engine does not report it).",
                               labels=("endpoint",))
        endpoint_info = GaugeMetricFamily("llmgw_router_endpoint_info", "The replica holding an endpoint slot now "
                                          "(1 per endpoint in the list).",
                                          labels=("endpoint", "model", "profile", "replica", "url"))
        ejected = GaugeMetricFamily("llmgw_router_endpoint_ejected", "Endpoints kept out of picks for a cause, "
                                    "by what the engine did (1 while it lasts).", labels=("endpoint", "reason"))
        for rid, code in p.ejected().items():
            ejected.add_metric((self.slot(rid), code), 1)
        ready: dict[str, int] = {}
        for st in p.states():
            ep = st.endpoint
            model, slot = ep.model, self.slot(st.replica_id)
            endpoint_info.add_metric((slot, model, ep.profile, st.replica_id, ep.url), 1)
            inflight.add_metric((model, slot), st.inflight)
            if ep.metrics_path is not None:
                age.add_metric((slot,), now - st.load_at if math.isfinite(st.load_at) else math.inf)
            if st.load is not None:
                running.add_metric((slot,), st.load.running)
                queued.add_metric((slot,), st.load.waiting)
                if st.load.kv_cache is not None:
                    kv.add_metric((slot,), st.load.kv_cache)
            ready[model] = ready.get(model, 0) + 1
        version, models = p.catalog()
        ready_g = GaugeMetricFamily("llmgw_router_ready_endpoints", "Ready endpoints per model.", labels=("model",))
        queue = GaugeMetricFamily("llmgw_router_cold_queue_length", "Requests waiting for a cold model.",
                                  labels=("model",))
        waiting = p.waiting()
        for name in models:
            ready_g.add_metric((name,), ready.get(name, 0))
            queue.add_metric((name,), waiting.get(name, 0))
        info = GaugeMetricFamily("llmgw_router_catalog_info", "The catalog version the router resolves against.",
                                 labels=("version",))
        info.add_metric((version,), 1)
        return [inflight, age, running, queued, kv, endpoint_info, ejected, ready_g, queue, info]
