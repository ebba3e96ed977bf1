"""Reading a /metrics page the way Prometheus does, for assertions on how counters moved."""
from __future__ import annotations

import math

import requests
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, frozenset]


def scrape(url: str, headers: dict | None = None) -> dict[Sample, float]:
    """{(sample name, frozenset of label pairs): value} from `url` (a /metrics URL)."""
    resp = requests.get(url, headers=headers or {}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def key(name: str, **labels: str) -> Sample:
    return (name, frozenset(labels.items()))


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    k = key(name, **labels)
    return after.get(k, 0.0) - before.get(k, 0.0)


def finite(value: float) -> bool:
    return not math.isinf(value) and not math.isnan(value)
