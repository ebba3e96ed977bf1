"""The control API's registry: what its /metrics shows, all read at scrape from `Controller.state()`
(a typed `contracts.ControlStatus`) except the pass duration and the API's request counter.

    llmgw_catalog_swaps_total, llmgw_catalog_rejections_total,
    llmgw_catalog_watcher_failures_total                      counters
    llmgw_catalog_info{version}, llmgw_catalog_directory_valid, llmgw_catalog_models
    llmgw_reconcile_pass_duration_seconds                     histogram
    llmgw_reconcile_passes_total, llmgw_reconcile_failures_total   counters
    llmgw_loop_degraded{loop="catalog-watcher|reconciler"}    gauge, 1 while that loop's last pass failed
    llmgw_watcher_degraded{watcher}, llmgw_watcher_failures_total{watcher}   as on the router, one per
                                                              followed file or directory (status' `watchers`)
    llmgw_replicas{model,state}                               gauge, every state of every catalog model (0 included)
    llmgw_adapter_replicas{model,adapter,state}               gauge, replicas a LoRA adapter is placed on, by its
                                                              state there (loading|loaded|failed|unloading, 0 included)
    llmgw_nodes{state}                                        gauge, ready | unreachable
    llmgw_gpus{pool,state="used|free|unreachable"}            gauge; a node in two pools counts in both, no pool is "none"
    llmgw_node_last_report_age_seconds{node}                  gauge
    llmgw_control_requests_total{route,code}                  counter, route is the URL template
    llmgw_build_info{version,python}                          gauge, 1 (on both /metrics)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ...contracts import ControlStatus, ReplicaState
from ...contracts.adapters import ADAPTER_STATES, LOADED
from .kit import BuildInfo, gauge_text, go_string, label_value, watcher_metrics

# Reconcile passes: well under a millisecond for a small fleet, tens of ms at
# thousands of nodes (bench/placement.py); a second means something is wrong.
PASS_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


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
        r.register(BuildInfo())
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
        text = gauge_text("llmgw_replicas", "Replicas by model and state.",
                       (f'{{model="{label_value(model)}",state="{state}"}} {go_string(n)}'
                        for (model, state), n in sorted(tally.items())))
        adapters: dict[tuple[str, str, str], int] = {}
        for rep in fleet.replicas:
            for a in rep.adapters:
                if (rep.model, a.name, LOADED) not in adapters:
                    adapters.update({(rep.model, a.name, st): 0 for st in ADAPTER_STATES})
                adapters[(rep.model, a.name, a.state)] += 1
        if adapters:
            text += gauge_text("llmgw_adapter_replicas", "Replicas a LoRA adapter is placed on, by its state there.",
                               (f'{{model="{label_value(model)}",adapter="{label_value(adapter)}",state="{state}"}} '
                                f'{go_string(n)}' for (model, adapter, state), n in sorted(adapters.items())))
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
        ages = gauge_text("llmgw_node_last_report_age_seconds", "Seconds since the node's agent last reported.",
                       (f'{{node="{label_value(node.name)}"}} {go_string(fleet.last_seen_seconds(node))}'
                        for node in fleet.nodes))
        return self._replica_text(fleet) + ages + _spread_text(fleet)

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
            yield from watcher_metrics(s.watchers)
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


def _spread_text(fleet: Any) -> bytes:
    """Per adapter whose spread follows its load: the replicas it is placed on, and the load that placed it.
    Only those: a fixed adapter's holders are `llmgw_adapter_replicas` already."""
    rows = [(m.name, a) for m in fleet.models for a in m.adapters
            if a.ceiling is not None and a.floor is not None and a.ceiling > a.floor]
    if not rows:
        return b""
    labels = [(f'{{model="{label_value(model)}",adapter="{label_value(a.name)}"}}', a) for model, a in rows]
    return (gauge_text("llmgw_adapter_spread", "Replicas a LoRA adapter growing with its load is placed on now.",
                       (f"{lab} {go_string(a.holders)}" for lab, a in labels))
            + gauge_text("llmgw_adapter_inflight", "A growing LoRA adapter's time-averaged requests in flight, "
                         "as its spread was last decided on.",
                         (f"{lab} {go_string(a.load)}" for lab, a in labels if a.load is not None)))

