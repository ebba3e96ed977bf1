"""Every query of the Grafana dashboard and every alert rule names metrics a running llmgw exports.

A real `llmgwctl serve` (fake engine, temporary catalog, free ports) answers a
few requests; its router's and control API's /metrics are scraped, and each
PromQL expression in deploy/ is held against what they list. A metric renamed
in llmgwctl/observability/metrics/ without the dashboard following fails here.
"""
from __future__ import annotations

import json
import re

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.fleet import Fleet, wait_until

from .tools import DEPLOY

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: dash-chat
    aliases: [default]
    profiles: [{name: cpu, engine: fake, gpus: 0}]
    # An adapter, so the adapter families have series (a hub id: the fake loads any).
    adapters: [{name: dash-tenant, source: org/dash-tenant}]
"""

# Series Prometheus makes itself, per scrape target, that no exporter lists.
SYNTHETIC = {"up"}
# The sample names each family type exposes (counters' family name lacks _total).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def exported(url: str) -> set[str]:
    resp = requests.get(url, timeout=10)
    resp.raise_for_status()
    names = set()
    for fam in text_string_to_metric_families(resp.text):
        names.update(fam.name + s for s in SUFFIXES.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana variables allowed) reads."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                        # strings (label values, regexes)
    e = re.sub(r"\{[^}]*\}", "", e)                                     # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                                    # ranges and subqueries
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)   # label lists
    # Grafana's label_values(METRIC, LABEL) and label_values(LABEL): the label is no metric.
    e = re.sub(r"\blabel_values\(([^,()]*),\s*\w+\s*\)", r"(\1)", e)
    e = re.sub(r"\blabel_values\(\s*\w+\s*\)", "", e)
    words = re.finditer(r"(?<![\w.$:])([a-zA-Z_:][\w:]*)(\s*\()?", e)
    return {m.group(1) for m in words if not m.group(2) and m.group(1).lower() not in KEYWORDS}


def test_metric_names_reads_promql_as_prometheus_does():
    # The parser the test below trusts: functions, labels, keywords, numbers and variables are not metrics.
    expr = ('histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{job=~"$job", code=~"5.."}[$__rate_interval])))'
            ' / on (model) group_left(x) sum without (le) (b_total offset 5m) > 1e-9 and c unless '
            'label_values(d{x="y"}, job) or max_over_time(e[5m:1m])')
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d", "e"}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "llmgw-dashboard.json").read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable ${var['name']}", var["query"]["query"] if isinstance(var["query"], dict) else var["query"]))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> set[str]:
    fleet = Fleet(tmp_path_factory.mktemp("deploy-metrics"))
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_serve("--settle", "0")
        wait_until(lambda: fleet.ready("dash-chat"), "dash-chat ready")
        # A plain and a streamed answer, and a refusal: the request families get samples.
        assert fleet.chat("default").status_code == 200
        assert fleet.chat("dash-chat", stream=True, stream_options={"include_usage": True}).status_code == 200
        assert fleet.chat("no-such-model").status_code == 404
        return exported(fleet.router + "/metrics") | exported(fleet.control + "/metrics")
    finally:
        fleet.close()


def test_every_dashboard_and_alert_query_names_only_exported_metrics(names):
    exprs = dashboard_exprs() + alert_exprs()
    assert len(exprs) > 40
    missing = []
    for where, expr in exprs:
        used = metric_names(expr)
        assert used, f"{where} names no metric: {expr}"
        missing += [f"{where}: {n}" for n in sorted(used - names - SYNTHETIC)]
    assert not missing, "not exported by llmgw:\n" + "\n".join(missing)


def test_the_dashboard_shows_every_llmgw_metric(names):
    # The other direction, so a new metric gets a panel (or a reason here).
    shown = set().union(*(metric_names(e) for _, e in dashboard_exprs()))
    families = {n for n in names if n.startswith("llmgw_") and not n.endswith("_created")}
    bare = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in families}
    unshown = sorted(b for b in bare if not any(re.sub(r"_(total|bucket|sum|count)$", "", s) == b for s in shown))
    assert not unshown, f"llmgw metrics with no dashboard panel: {unshown}"
