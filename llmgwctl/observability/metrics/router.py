"""The router's registry: what its port's /metrics shows.

    llmgw_router_requests_total{model,endpoint,code}          counter; code is the status the client got,
                                                              499 when it left mid-stream (nginx's convention)
    llmgw_router_key_requests_total{key,code}                 counter, per API key *name* (only with --api-keys)
    llmgw_router_key_tokens_total{key,direction="in|out"}     counter, the same per key
    llmgw_router_request_duration_seconds{model}              histogram, arrival to last byte sent
    llmgw_router_time_to_first_byte_seconds{model}            histogram, arrival to first body byte sent
    llmgw_router_overhead_seconds                             histogram, time in the router excluding upstream
                                                              (also the `x-llmgw-overhead-ms` response header)
    llmgw_router_tokens_total{model,direction="in|out"}       counter, from the engine's `usage` when it sends one
    llmgw_router_cold_wait_seconds{model,outcome}             histogram, time a request waited for a replica
    llmgw_router_connections_refused_total{reason}            counter, connections closed by the input limits
    llmgw_router_api_keys_reloads_total{result}               counter, applied | rejected
    llmgw_router_stream_continuations_total{model,outcome}    counter, cut streams of models with continuation
                                                              on: resumed | failed | ineligible
    llmgw_router_fallbacks_total{model,fallback,reason}        counter, requests a fallback model answered for
                                                              `model` (router/fallback.py): unplaceable | down |
                                                              saturated
    llmgw_router_retries_total{model,reason}                  counter, requests sent to another replica after an
                                                              attempt failed before its first byte: unreached |
                                                              headers_cut | timed_out | refused (502/503)
    llmgw_router_engine_refusals_total{reason}                counter, engine answers or /metrics pages refused
                                                              for breaking a bound (answer_too_large,
                                                              headers_too_large, redirect, metrics_too_large,
                                                              metrics_redirect, metrics_interim)
    llmgw_router_endpoint_ejections_total{reason}             counter, ejections since start, by the reason
                                                              llmgw_router_endpoint_ejected gives
    llmgw_router_response_affinity_total{outcome}             counter, requests naming a stored response
                                                              (previous_response_id, /v1/responses/ID):
                                                              routed | not_found | replica_gone |
                                                              model_mismatch | unreachable; and unread,
                                                              a Responses answer whose id was not read
    llmgw_router_responses_kept                               gauge, response ids whose replica the router
                                                              remembers (router/responses.py)
    llmgw_watcher_degraded{watcher="catalog|api-keys|endpoints"}  gauge, 1 while that file or directory is not
                                                              followed or its last state was not usable
    llmgw_watcher_failures_total{watcher}                     counter, problems since start, each once
                                                              (both also on the control API's /metrics)
    llmgw_build_info{version,python}                          gauge, 1 (on both /metrics)

and, read from the router's state at scrape (endpoints.py, where they are listed):
llmgw_router_inflight_requests, llmgw_router_ready_endpoints,
llmgw_router_endpoint_{metrics_age_seconds,running_requests,waiting_requests,kv_cache_usage_ratio},
llmgw_router_cold_queue_length, llmgw_router_catalog_info, llmgw_router_endpoint_info and
llmgw_router_endpoint_ejected.

`model` is the model that answered (a fallback's, when one did), or a
LoRA adapter's own name, apart from its base's: the catalog bounds both.
`key` is an API key's *name* from the key file (never the secret), so it is
bounded by that file; a name that leaves the file takes its series with it.
No request ids or client addresses. The per-request families are kit.py's
loop-local ones; rare events (cold waits, refused connections, key reloads)
use prometheus_client directly.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from .endpoints import EndpointMetrics, EndpointSlots, ModelMetrics, ProbeCollector, RouterProbe
from .kit import BuildInfo, Family, Hist, LocalCollector, Watchers

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


class RouterMetrics:
    """The router's registry. `endpoint(model, replica_id)` on the hot path; `set_endpoints(eps)` when the list changes."""

    def __init__(self, probe: RouterProbe | None = None, *, process: bool = True):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.slots = EndpointSlots()
        self.requests = Family("llmgw_router_requests", "Requests answered by the router, by model, endpoint "
                                "(empty when none was chosen) and HTTP status.", ("model", "endpoint", "code"))
        self.duration = Family("llmgw_router_request_duration_seconds", "Arrival to last byte sent.",
                                ("model",), DURATION_BUCKETS)
        self.ttfb = Family("llmgw_router_time_to_first_byte_seconds", "Arrival to the first body byte sent "
                            "(a stream's first chunk).", ("model",), DURATION_BUCKETS)
        overhead = Family("llmgw_router_overhead_seconds", "Time spent in the router itself, upstream "
                           "time excluded (up to the response headers).", (), OVERHEAD_BUCKETS)
        self.overhead: Hist = overhead.labels()
        self.tokens = Family("llmgw_router_tokens", "Tokens the engines reported in `usage`, in (prompt) and "
                              "out (completion).", ("model", "direction"))
        # Per API key name: what a team used, for chargeback and for seeing which key a burst came from.
        self.key_requests = Family("llmgw_router_key_requests", "Requests by API key name (with --api-keys) and "
                                    "HTTP status.", ("key", "code"))
        self.key_tokens = Family("llmgw_router_key_tokens", "Tokens the engines reported, by API key name, in "
                                  "(prompt) and out (completion).", ("key", "direction"))
        r.register(LocalCollector([self.requests, self.duration, self.ttfb, overhead, self.tokens,
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
        self.fallbacks = Counter("llmgw_router_fallbacks", "Requests answered by a fallback model because the "
                                 "model asked for had no replica that could: unplaceable, down (none ready) or "
                                 "saturated (every ready one full).", ("model", "fallback", "reason"), registry=r)
        self.retries = Counter("llmgw_router_retries", "Requests sent again to another replica after an attempt "
                               "failed before any byte of its answer (router/retry.py), by what failed: unreached, "
                               "headers_cut, timed_out, refused (an answer of 502 or 503).", ("model", "reason"),
                               registry=r)
        self.response_affinity = Counter("llmgw_router_response_affinity", "Requests naming a stored response "
                                         "(previous_response_id, /v1/responses/ID), by outcome (router/affinity.py); "
                                         "unread: a Responses answer whose id could not be read.", ("outcome",),
                                         registry=r)
        # Its value is read at scrape from the store (the router sets the function).
        self.responses_kept = Gauge("llmgw_router_responses_kept", "Response ids whose replica the router "
                                    "remembers.", registry=r)
        self._watchers = Watchers()
        r.register(self._watchers)
        self.engine_refusals = Counter("llmgw_router_engine_refusals", "Engine answers and /metrics pages refused "
                                       "for breaking a bound the router holds engines to.", ("reason",), registry=r)
        # Counted as well as gauged: an ejection shorter than a scrape interval
        # shows only here, and an engine that keeps wedging shows as a rate.
        self.endpoint_ejections = Counter("llmgw_router_endpoint_ejections", "Endpoints ejected from picks, by "
                                          "reason (router/ejection.py).", ("reason",), registry=r)
        self._models: dict[str, ModelMetrics] = {}
        self._endpoints: dict[tuple[str, str], EndpointMetrics] = {}
        self._unrouted: dict[tuple[str, int], Any] = {}
        if probe is not None:
            r.register(ProbeCollector(probe, self.slots.label))
        r.register(BuildInfo())
        if process:
            ProcessCollector(registry=r)

    def follow(self, status: Callable[[], Mapping[str, Any]]) -> None:
        """Show a followed file's state (`status()`: a WatcherStatus's fields) as the llmgw_watcher_* families."""
        self._watchers.sources.append(status)

    def model(self, model: str) -> ModelMetrics:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(self.duration, self.ttfb, self.tokens, model)
        return m

    def endpoint(self, model: str, replica_id: str) -> EndpointMetrics:
        key = (model, replica_id)
        em = self._endpoints.get(key)
        if em is None:
            em = EndpointMetrics(self.requests, self.model(model), self.overhead, model, self.slots.label(replica_id))
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
