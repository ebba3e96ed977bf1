"""Prometheus metrics for the router and the control plane, every name under `llmgw_`.

Two registries, one per HTTP face, so each `/metrics` shows what that face
owns: `RouterMetrics` (the router's port) and `ControlMetrics` (the control
API). Both include the process collector (CPU, memory, open fds).

Router (hot path first):

    llmgw_router_requests_total{model,endpoint,code}          counter; code is the status the client got,
                                                              499 when it left mid-stream (nginx's convention)
    llmgw_router_key_requests_total{key,code}                 counter, per API key *name* (only with --api-keys)
    llmgw_router_key_tokens_total{key,direction="in|out"}     counter, the same per key
    llmgw_router_request_duration_seconds{model}              histogram, arrival to last byte sent
    llmgw_router_time_to_first_byte_seconds{model}            histogram, arrival to first body byte sent
    llmgw_router_overhead_seconds                             histogram, time in the router excluding upstream
                                                              (also the `x-llmgw-overhead-ms` response header)
    llmgw_router_tokens_total{model,direction="in|out"}       counter, from the engine's `usage` when it sends one
    llmgw_router_inflight_requests{model,endpoint}            gauge (read at scrape)
    llmgw_router_ready_endpoints{model}                       gauge (read at scrape)
    llmgw_router_endpoint_metrics_age_seconds{endpoint}       gauge, age of the last load reading (+Inf: none yet)
    llmgw_router_endpoint_running_requests{endpoint}          gauge, the engine's running count in that reading
    llmgw_router_endpoint_waiting_requests{endpoint}          gauge, the engine's queue in that reading
    llmgw_router_endpoint_kv_cache_usage_ratio{endpoint}      gauge, 0-1, when the engine reports its KV cache
                                                              (the last three: what the balancer weighs, absent
                                                              until a first reading)
    llmgw_router_cold_queue_length{model}                     gauge (read at scrape)
    llmgw_router_cold_wait_seconds{model,outcome}             histogram, time a request waited for a replica
    llmgw_router_catalog_info{version}                        gauge, 1
    llmgw_router_connections_refused_total{reason}            counter, connections closed by the input limits
    llmgw_router_api_keys_reloads_total{result}               counter, applied | rejected
    llmgw_router_stream_continuations_total{model,outcome}    counter, cut streams of models with continuation
                                                              on: resumed | failed | ineligible
    llmgw_watcher_degraded{watcher="catalog|api-keys|endpoints"}  gauge, 1 while that file or directory is not
                                                              followed or its last state was not usable
    llmgw_watcher_failures_total{watcher}                     counter, problems since start, each once
                                                              (both also on the control API's /metrics)
    llmgw_router_endpoint_info{endpoint,model,profile,replica,url}  gauge, 1 per endpoint in the list: which
                                                              replica holds a slot now (join on `endpoint`)
    llmgw_router_engine_refusals_total{reason}                counter, engine answers or /metrics pages refused
                                                              for breaking a bound (answer_too_large,
                                                              headers_too_large, redirect, metrics_too_large,
                                                              metrics_redirect, metrics_interim)
    llmgw_router_endpoint_ejected{endpoint,reason}            gauge, 1 per endpoint kept out of picks for a
                                                              cause (router/ejection.py), reason as above
                                                              or no_answer (missed polls, router/outlier.py)
    llmgw_router_endpoint_ejections_total{reason}             counter, ejections since start, by the same reason
    llmgw_build_info{version,python}                          gauge, 1 (on both /metrics)

Control plane (all read at scrape from `Controller.state()`, a typed
`contracts.ControlStatus`, except the pass duration and the API's request counter):

    llmgw_catalog_swaps_total, llmgw_catalog_rejections_total,
    llmgw_catalog_watcher_failures_total                      counters
    llmgw_catalog_info{version}, llmgw_catalog_directory_valid, llmgw_catalog_models
    llmgw_reconcile_pass_duration_seconds                     histogram
    llmgw_reconcile_passes_total, llmgw_reconcile_failures_total   counters
    llmgw_loop_degraded{loop="catalog-watcher|reconciler"}    gauge, 1 while that loop's last pass failed
    llmgw_watcher_degraded{watcher}, llmgw_watcher_failures_total{watcher}   as on the router, one per
                                                              followed file or directory (status' `watchers`)
    llmgw_replicas{model,state}                               gauge, every state of every catalog model (0 included)
    llmgw_nodes{state}                                        gauge, ready | unreachable
    llmgw_gpus{pool,state="used|free|unreachable"}            gauge; a node in two pools counts in both, no pool is "none"
    llmgw_node_last_report_age_seconds{node}                  gauge
    llmgw_control_requests_total{route,code}                  counter, route is the URL template

Labels are bounded and stable: `model` is a catalog model's canonical name
(never the client's string: a request for an unknown name counts under
model=""); `endpoint` is a *slot*, `MODEL/PROFILE/N`, N the lowest index no
other endpoint of that model and profile holds (`EndpointSlots`). Replica ids
are never reused, so labelling by them would start new series on every
restart or replacement and grow without end; a replacement takes the slot its
predecessor left, so its counters continue the same series, and there are
never more slots than a profile's peak replicas. Which replica holds a slot
now is `llmgw_router_endpoint_info`, one series per live endpoint. `key` is an
API key's *name* from the key file (never the secret), so it is bounded by
that file; a name that leaves the file takes its series with it. No request
ids or client addresses.

No `_created` series: prometheus_client adds one per counter and histogram
child by default, which doubles the series count and which no query here
uses (`disable_created_metrics` below, process-wide, as both registries want).

Hot-path cost: the router asks for an `EndpointMetrics` once per request (a
dict lookup) and calls `done()`, which increments a pre-bound counter child and
observes three pre-bound histogram children; no label dict is built per
request. Those children are `_Count` / `_Hist` below, not prometheus_client's:
the router updates and scrapes them only on its event loop thread, so they
need no lock, and an observation is a bisect and two additions (about 0.3 us)
where prometheus_client's takes a lock per bucket and sum (1-3 us, three of
them per request). Everything that is a level (in flight, queue length,
staleness) is read from the router's own state when scraped and costs
requests nothing. Rare events (cold waits, refused connections, key reloads)
use prometheus_client directly.

It must not change what it observes, and it knows only the narrow read-only
views handed to it (`RouterProbe`, a callable returning a `ControlStatus`).
"""
from __future__ import annotations

import math
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString as _untyped_go_string

from .. import __version__
from ..contracts import ControlStatus, ReplicaState, WatcherStatus

# See the module docstring: no query reads _created, and it doubles the series.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated


def _go_string(value: float) -> str:
    """prometheus_client's sample formatting (unannotated there), so the hand-written families match its own."""
    return str(_untyped_go_string(value))  # type: ignore[no-untyped-call]

__all__ = ["CONTENT_TYPE_LATEST", "ControlMetrics", "EndpointMetrics", "EndpointSlots", "RouterMetrics",
           "RouterProbe", "render"]

# Request duration: from a cached embedding (a few ms) to a long generation
# (minutes); past 300 s only the count matters.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Router overhead: the target is 250 us of CPU per request, so the buckets are
# fine around it; 50 ms and up means the loop was blocked, not the router slow.
OVERHEAD_BUCKETS = (50e-6, 100e-6, 150e-6, 200e-6, 250e-6, 300e-6, 400e-6, 500e-6, 750e-6,
                    1e-3, 2e-3, 5e-3, 10e-3, 50e-3)
# Cold waits: a fake engine is up in under a second, vLLM loading a 70B model
# takes minutes; the router's cold timeout defaults to 120 s.
COLD_WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Reconcile passes: well under a millisecond for a small fleet, tens of ms at
# thousands of nodes (bench/placement.py); a second means something is wrong.
PASS_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

class _BuildInfo:
    """`llmgw_build_info{version,python} 1`: which release a target runs, joinable onto any of its series."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        info = GaugeMetricFamily("llmgw_build_info", "The llmgw release and Python this process runs.",
                                 labels=("version", "python"))
        info.add_metric((__version__, platform.python_version()), 1)
        return [info]


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


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format (serve with CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)


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


class _Count:
    """A counter child updated only on the event loop thread."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _Hist:
    """A histogram child updated only on the event loop thread: counts per bucket (last: +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, Prometheus' "le" bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    """Children of one loop-local metric by label values; exported by `_LocalCollector` at scrape time."""

    def __init__(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None):
        self.name, self.help, self.labelnames, self.buckets = name, help_, labels, buckets
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = _Hist(self.buckets) if self.buckets is not None else _Count()
        return child

    def remove(self, *values: str) -> None:
        self.children.pop(values, None)

    def collect(self) -> Metric:
        if self.buckets is None:
            counter = CounterMetricFamily(self.name, self.help, labels=self.labelnames)
            for values, child in list(self.children.items()):
                counter.add_metric(values, child.value)
            return counter
        fam = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        for values, child in list(self.children.items()):
            cumulative: list[tuple[str, float]] = []
            total = 0
            for bound, n in zip(self.buckets, child.counts):
                total += n
                cumulative.append((_le(bound), total))
            total += child.counts[-1]
            cumulative.append(("+Inf", total))
            fam.add_metric(values, cumulative, child.sum)
        return fam


def _label(value: str) -> str:
    """A label value escaped as the text format wants (backslash, newline, double quote)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, help_: str, samples: Iterable[str]) -> bytes:
    """One gauge family in the text format: HELP, TYPE, then `name` + each `{labels} value`."""
    return "".join((f"# HELP {name} {help_}\n# TYPE {name} gauge\n",
                    *(f"{name}{sample}\n" for sample in samples))).encode()


def _le(bound: float) -> str:
    return repr(float(bound))


def _watcher_metrics(rows: Iterable[WatcherStatus]) -> list[Metric]:
    """The two watcher families, from status rows: what an alert on a file nobody can read fires on."""
    degraded = GaugeMetricFamily("llmgw_watcher_degraded", "1 while a followed file or directory is not followed, "
                                 "or its last state was not usable (the last good one stays in force).",
                                 labels=("watcher",))
    failures = CounterMetricFamily("llmgw_watcher_failures", "Problems with a followed file or directory since "
                                   "start, each counted once however long it lasts.", labels=("watcher",))
    for row in rows:
        degraded.add_metric((row.name,), 1 if row.degraded else 0)
        failures.add_metric((row.name,), row.failures)
    return [degraded, failures]


class _Watchers:
    """The router's followed files (its key file, a static endpoint file, its catalog directory), read at scrape."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], Mapping[str, Any]]] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        if not self.sources:
            return []
        return _watcher_metrics(WatcherStatus(**source()) for source in self.sources)


class _LocalCollector:
    def __init__(self, families: list[_Family]):
        self.families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return [f.collect() for f in self.families]


class _ModelMetrics:
    __slots__ = ("duration", "ttfb", "tokens_in", "tokens_out")

    def __init__(self, m: RouterMetrics, model: str):
        self.duration = m.duration.labels(model)
        self.ttfb = m.ttfb.labels(model)
        self.tokens_in = m.tokens.labels(model, "in")
        self.tokens_out = m.tokens.labels(model, "out")


class EndpointMetrics:
    """Pre-bound children for one (model, endpoint): what a request served there records.

    `done` is the whole per-request cost of metrics, so the observations are
    written out rather than calls to `_Hist.observe`: it runs once per request.
    """

    __slots__ = ("_counter", "_model", "_endpoint", "_codes", "_duration", "_ttfb", "_in", "_out", "_overhead")

    def __init__(self, metrics: RouterMetrics, model: str, endpoint: str):
        self._counter = metrics.requests
        self._model, self._endpoint = model, endpoint
        self._codes: dict[int, Any] = {}
        m = metrics.model(model)
        self._duration, self._ttfb, self._in, self._out = m.duration, m.ttfb, m.tokens_in, m.tokens_out
        self._overhead = metrics.overhead

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


class RouterMetrics:
    """The router's registry. `endpoint(model, replica_id)` on the hot path; `set_endpoints(eps)` when the list changes."""

    def __init__(self, probe: RouterProbe | None = None, *, process: bool = True):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.slots = EndpointSlots()
        self.requests = _Family("llmgw_router_requests", "Requests answered by the router, by model, endpoint "
                                "(empty when none was chosen) and HTTP status.", ("model", "endpoint", "code"))
        self.duration = _Family("llmgw_router_request_duration_seconds", "Arrival to last byte sent.",
                                ("model",), DURATION_BUCKETS)
        self.ttfb = _Family("llmgw_router_time_to_first_byte_seconds", "Arrival to the first body byte sent "
                            "(a stream's first chunk).", ("model",), DURATION_BUCKETS)
        overhead = _Family("llmgw_router_overhead_seconds", "Time spent in the router itself, upstream "
                           "time excluded (up to the response headers).", (), OVERHEAD_BUCKETS)
        self.overhead = overhead.labels()
        self.tokens = _Family("llmgw_router_tokens", "Tokens the engines reported in `usage`, in (prompt) and "
                              "out (completion).", ("model", "direction"))
        # Per API key name: what a team used, for chargeback and for seeing which key a burst came from.
        self.key_requests = _Family("llmgw_router_key_requests", "Requests by API key name (with --api-keys) and "
                                    "HTTP status.", ("key", "code"))
        self.key_tokens = _Family("llmgw_router_key_tokens", "Tokens the engines reported, by API key name, in "
                                  "(prompt) and out (completion).", ("key", "direction"))
        r.register(_LocalCollector([self.requests, self.duration, self.ttfb, overhead, self.tokens,
                                    self.key_requests, self.key_tokens]))
        self.cold_wait = Histogram("llmgw_router_cold_wait_seconds", "Time requests waited for a cold model's "
                                   "first replica, or for one to come back when every replica refused.",
                                   ("model", "outcome"), buckets=COLD_WAIT_BUCKETS, registry=r)
        self.refused = Counter("llmgw_router_connections_refused", "Connections closed by the router's input "
                               "limits.", ("reason",), registry=r)
        self.key_reloads = Counter("llmgw_router_api_keys_reloads", "API key file reloads.", ("result",), registry=r)
        self.continuations = Counter("llmgw_router_stream_continuations", "Streams cut by their engine, of models "
                                     "with continuation on: resumed on another replica, failed (none could take "
                                     "it), or ineligible (the request or the stream may not be continued).",
                                     ("model", "outcome"), registry=r)
        self._watchers = _Watchers()
        r.register(self._watchers)
        self.engine_refusals = Counter("llmgw_router_engine_refusals", "Engine answers and /metrics pages refused "
                                       "for breaking a bound the router holds engines to.", ("reason",), registry=r)
        # Counted as well as gauged: an ejection shorter than a scrape interval
        # shows only here, and an engine that keeps wedging shows as a rate.
        self.endpoint_ejections = Counter("llmgw_router_endpoint_ejections", "Endpoints ejected from picks, by "
                                          "reason (router/ejection.py).", ("reason",), registry=r)
        self._models: dict[str, _ModelMetrics] = {}
        self._endpoints: dict[tuple[str, str], EndpointMetrics] = {}
        self._unrouted: dict[tuple[str, int], Any] = {}
        if probe is not None:
            r.register(_RouterCollector(probe, self.slots.label))
        r.register(_BuildInfo())
        if process:
            ProcessCollector(registry=r)

    def follow(self, status: Callable[[], Mapping[str, Any]]) -> None:
        """Show a followed file's state (`status()`: a WatcherStatus's fields) as the llmgw_watcher_* families."""
        self._watchers.sources.append(status)

    def model(self, model: str) -> _ModelMetrics:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _ModelMetrics(self, model)
        return m

    def endpoint(self, model: str, replica_id: str) -> EndpointMetrics:
        key = (model, replica_id)
        em = self._endpoints.get(key)
        if em is None:
            em = EndpointMetrics(self, model, self.slots.label(replica_id))
            if self.slots.current(replica_id):
                # Kept only for endpoints in the list: one that left is
                # finishing its last requests and is not asked for again.
                self._endpoints[key] = em
        return em

    def key_used(self, name: str, code: int, usage: tuple[int, int] | None) -> None:
        """One request made with the key named `name`: its status and tokens. Only with keys on."""
        self.key_requests.labels(name, str(code)).inc()
        if usage is not None:
            self.key_tokens.labels(name, "in").inc(usage[0])
            self.key_tokens.labels(name, "out").inc(usage[1])

    def retain_keys(self, names: Iterable[str]) -> None:
        """Drop the series of key names no longer in the key file (a revoked key's usage stops growing)."""
        keep = set(names)
        for family in (self.key_requests, self.key_tokens):
            for values in [v for v in family.children if v[0] not in keep]:
                family.remove(*values)

    def unrouted(self, model: str, code: int) -> None:
        """A request answered before any endpoint was chosen (4xx, no replica, queue full); model may be ""."""
        key = (model, code)
        child = self._unrouted.get(key)
        if child is None:
            child = self._unrouted[key] = self.requests.labels(model, "", str(code))
        child.inc()

    def change_endpoints(self, added: Iterable[Any], removed: Iterable[str]) -> None:
        """The endpoint list changed by these: newcomers get their slots, the pre-bound children of those gone are forgotten.

        The series stay: the slot an endpoint left is the one its replacement
        takes, and its counters go on from where they were (bounded by the
        profile's peak replica count; see the module docstring).
        """
        removed = list(removed)
        self.slots.change(added, removed)
        gone = set(removed)
        for key in [k for k in self._endpoints if k[1] in gone]:
            del self._endpoints[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RouterCollector:
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


class ControlMetrics:
    """The control API's registry: `observe_pass(seconds)` from the reconciler, the rest read from `status()`."""

    def __init__(self, status: Callable[[], ControlStatus] | None = None, *, process: bool = True):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.passes = Histogram("llmgw_reconcile_pass_duration_seconds", "Wall time of one reconcile pass.",
                                buckets=PASS_BUCKETS, registry=r)
        self.requests = Counter("llmgw_control_requests", "Control API requests by route template and status.",
                                ("route", "code"), registry=r)
        self._fleet = _ControlCollector(status) if status is not None else None
        if self._fleet is not None:
            r.register(self._fleet)
        r.register(_BuildInfo())
        if process:
            ProcessCollector(registry=r)

    def observe_pass(self, seconds: float) -> None:
        self.passes.observe(seconds)

    def render(self) -> bytes:
        page = generate_latest(self.registry)
        # The per-model and per-node families, from the status the collector read in this scrape.
        return page + self._fleet.fleet_text() if self._fleet is not None else page


class _ControlCollector:
    def __init__(self, status: Callable[[], ControlStatus]):
        self.status = status
        # The tallies of the last scrape and the row tuples they were made from:
        # the reconciler hands out the same tuple while no row changed, so a
        # scrape at fleet size (tens of thousands of replicas) walks them only after a change.
        self._replica_tally: tuple[tuple[Any, ...], tuple[str, ...], bytes] = ((), (), b"")
        self._node_tally: tuple[tuple[Any, ...], dict[str, int], dict[tuple[str, str], int]] = ((), {}, {})
        self._last: ControlStatus | None = None

    def _replica_text(self, fleet: Any) -> bytes:
        rows, models, text = self._replica_tally
        names = tuple(m.name for m in fleet.models)
        if rows is fleet.replicas and models == names:
            return text
        # Every state of every catalog model, 0 included: a dashboard's "failed"
        # panel must show 0, not "no data", while nothing has failed.
        tally = {(name, st.value): 0 for name in names for st in ReplicaState}
        for rep in fleet.replicas:
            key = (rep.model, rep.state.value)
            tally[key] = tally.get(key, 0) + 1
        text = _family("llmgw_replicas", "Replicas by model and state.",
                       (f'{{model="{_label(model)}",state="{state}"}} {_go_string(n)}'
                        for (model, state), n in sorted(tally.items())))
        self._replica_tally = (fleet.replicas, names, text)
        return text

    def fleet_text(self) -> bytes:
        """The families with a series per catalog model or per node, written here rather than by
        prometheus_client, whose cost per sample made these families most of a scrape at fleet
        size (thousands of nodes and models); per replica state they are kept until a row changes."""
        s = self._last
        if s is None:
            return b""
        fleet = s.fleet
        ages = _family("llmgw_node_last_report_age_seconds", "Seconds since the node's agent last reported.",
                       (f'{{node="{_label(node.name)}"}} {_go_string(fleet.last_seen_seconds(node))}'
                        for node in fleet.nodes))
        return self._replica_text(fleet) + ages

    def _node_counts(self, fleet: Any) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        rows, by_state, gpus = self._node_tally
        if rows is fleet.nodes:
            return by_state, gpus
        by_state, gpus = {"ready": 0, "unreachable": 0}, {}
        for node in fleet.nodes:
            by_state[node.state] = by_state.get(node.state, 0) + 1
            # An unreachable node's GPUs are neither usable nor known to be busy.
            split = ((("used", node.gpus_used), ("free", node.gpus - node.gpus_used)) if node.reachable
                     else (("unreachable", node.gpus),))
            for pool in node.pools or ("none",):
                for state, n in split:
                    gpus[(pool, state)] = gpus.get((pool, state), 0) + n
        self._node_tally = (fleet.nodes, by_state, gpus)
        return by_state, gpus

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self._last = self.status()
        cat, fleet = s.catalog, s.fleet
        yield CounterMetricFamily("llmgw_catalog_swaps", "Catalogs swapped in since start.", value=cat.swaps)
        yield CounterMetricFamily("llmgw_catalog_rejections", "Catalog directory states rejected since start.",
                                  value=cat.rejections)
        # A reload that raised what no rule expected: the watcher went on from
        # the catalog in force, and this is how an alert learns of it.
        yield CounterMetricFamily("llmgw_catalog_watcher_failures", "Catalog reloads that failed unexpectedly since start.",
                                  value=cat.failures)
        info = GaugeMetricFamily("llmgw_catalog_info", "The catalog in force.", labels=("version",))
        info.add_metric((cat.version,), 1)
        yield info
        yield GaugeMetricFamily("llmgw_catalog_directory_valid", "0 while the directory holds a rejected edit.",
                                value=1 if cat.directory_valid else 0)
        yield GaugeMetricFamily("llmgw_catalog_models", "Models in the catalog in force.", value=cat.models)
        yield CounterMetricFamily("llmgw_reconcile_passes", "Reconcile passes since start.", value=fleet.passes)
        # A pass that raised: the loop went on from the records it left; no
        # catalog the rules accept should ever do this, so an alert fires on any.
        yield CounterMetricFamily("llmgw_reconcile_failures", "Reconcile passes that raised since start.",
                                  value=fleet.failures)
        degraded = GaugeMetricFamily("llmgw_loop_degraded", "1 while a supervised loop's last pass failed.",
                                     labels=("loop",))
        degraded.add_metric(("catalog-watcher",), 1 if cat.degraded else 0)
        degraded.add_metric(("reconciler",), 1 if fleet.degraded else 0)
        yield degraded
        if s.watchers:
            yield from _watcher_metrics(s.watchers)
        nodes = GaugeMetricFamily("llmgw_nodes", "Nodes by state.", labels=("state",))
        by_state, gpus = self._node_counts(fleet)
        for state, n in sorted(by_state.items()):
            nodes.add_metric((state,), n)
        yield nodes
        # llmgw_replicas and llmgw_node_last_report_age_seconds: render() adds them (`fleet_text`).
        g = GaugeMetricFamily("llmgw_gpus", "GPUs per pool, used by replicas or free.", labels=("pool", "state"))
        for (pool, state), n in sorted(gpus.items()):
            g.add_metric((pool, state), n)
        yield g
