"""The pieces both registries are built of: loop-local counters and histograms, hand-written text families, build info and the watcher families.

`Count` / `Hist` are the children of the router's hot-path families, not
prometheus_client's: the router updates and scrapes them only on its event
loop thread, so they need no lock, and an observation is a bisect and two
additions (about 0.3 us) where prometheus_client's takes a lock per bucket
and sum (1-3 us, three of them per request). `Family` holds them by label
values and `LocalCollector` exports them at scrape time.

`gauge_text` writes a gauge family straight in the text format, for the
families with a series per catalog model or per node, where
prometheus_client's cost per sample made them most of a scrape at fleet size.

No `_created` series: prometheus_client adds one per counter and histogram
child by default, which doubles the series count and which no query here
uses (`disable_created_metrics` below, process-wide, as both registries want).
"""
from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString as _untyped_go_string

from ... import __version__
from ...contracts import WatcherStatus

# See the module docstring: no query reads _created, and it doubles the series.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated


def go_string(value: float) -> str:
    """prometheus_client's sample formatting (unannotated there), so the hand-written families match its own."""
    return str(_untyped_go_string(value))  # type: ignore[no-untyped-call]


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format (serve with CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)


class BuildInfo:
    """`llmgw_build_info{version,python} 1`: which release a target runs, joinable onto any of its series."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        info = GaugeMetricFamily("llmgw_build_info", "The llmgw release and Python this process runs.",
                                 labels=("version", "python"))
        info.add_metric((__version__, platform.python_version()), 1)
        return [info]


class Count:
    """A counter child updated only on the event loop thread."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Hist:
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


class Family:
    """Children of one loop-local metric by label values; exported by `LocalCollector` at scrape time."""

    def __init__(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None):
        self.name, self.help, self.labelnames, self.buckets = name, help_, labels, buckets
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = Hist(self.buckets) if self.buckets is not None else Count()
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


def label_value(value: str) -> str:
    """A label value escaped as the text format wants (backslash, newline, double quote)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def gauge_text(name: str, help_: str, samples: Iterable[str]) -> bytes:
    """One gauge family in the text format: HELP, TYPE, then `name` + each `{labels} value`."""
    return "".join((f"# HELP {name} {help_}\n# TYPE {name} gauge\n",
                    *(f"{name}{sample}\n" for sample in samples))).encode()


def _le(bound: float) -> str:
    return repr(float(bound))


def watcher_metrics(rows: Iterable[WatcherStatus]) -> list[Metric]:
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


class Watchers:
    """The router's followed files (its key file, a static endpoint file, its catalog directory), read at scrape."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], Mapping[str, Any]]] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        if not self.sources:
            return []
        return watcher_metrics(WatcherStatus(**source()) for source in self.sources)


class LocalCollector:
    def __init__(self, families: list[Family]):
        self.families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return [f.collect() for f in self.families]
