"""The control API's /metrics and the JSON event log, from a real controller, agent and fake engines."""
from __future__ import annotations

import json
import os

import pytest
import requests

from tests.e2e.fleet import Fleet, wait_until

from .scrape import delta, key, scrape

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: obs-a
    profiles: [{name: l4, engine: fake, pool: l4, gpus: 1}]
"""

TWO = CATALOG + """\
  - name: obs-b
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("obs-fleet"))
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller("--log-format", "json")
        fleet.start_agent("obs-n1", "2xL4-24GB", "l4")
        yield fleet
    finally:
        fleet.close_waiting()


def write(fleet, text: str) -> None:
    # As an editor or `catalog apply` writes: a new file renamed over the old, one event.
    tmp = fleet.catalogs / ".models.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, fleet.catalogs / "models.yaml")


def test_fleet_state_and_passes_on_control_metrics(fleet):
    wait_until(lambda: fleet.ready("obs-a"), "obs-a ready")
    page = scrape(fleet.control + "/metrics")
    assert page[key("llmgw_replicas", model="obs-a", state="ready")] == 1
    assert page[key("llmgw_replicas", model="obs-a", state="failed")] == 0
    assert page[key("llmgw_nodes", state="ready")] == 1
    assert page[key("llmgw_nodes", state="unreachable")] == 0
    assert page[key("llmgw_gpus", pool="l4", state="used")] == 1
    assert page[key("llmgw_gpus", pool="l4", state="free")] == 1
    version = fleet.status()["catalog"]["version"]
    assert page[key("llmgw_catalog_info", version=version)] == 1
    assert page[key("llmgw_catalog_directory_valid")] == 1
    passes = page[key("llmgw_reconcile_pass_duration_seconds_count")]
    assert passes >= 1 and passes == page[key("llmgw_reconcile_passes_total")]
    wait_until(lambda: scrape(fleet.control + "/metrics")[key("llmgw_reconcile_pass_duration_seconds_count")]
               > passes, "another reconcile pass")
    assert page[key("llmgw_node_last_report_age_seconds", node="obs-n1")] >= 0


def test_catalog_swaps_and_rejections_count_and_log_as_json_events(fleet):
    before = scrape(fleet.control + "/metrics")
    write(fleet, TWO)
    wait_until(lambda: delta(before, scrape(fleet.control + "/metrics"), "llmgw_catalog_swaps_total") == 1,
               "the swap to count")
    write(fleet, TWO.replace("engine: fake, gpus: 0", "engine: nope, gpus: 0"))
    # One rename can reach the watcher as two batches, each validated (and
    # rejected) again: at least one.
    wait_until(lambda: delta(before, scrape(fleet.control + "/metrics"), "llmgw_catalog_rejections_total") >= 1,
               "the rejection to count")
    after = scrape(fleet.control + "/metrics")
    assert after[key("llmgw_catalog_directory_valid")] == 0
    assert after[key("llmgw_replicas", model="obs-b", state="ready")] in (0, 1)    # a series per catalog model

    events = [json.loads(line) for line in fleet.log("controller").splitlines() if line.startswith("{")]
    swapped = [e for e in events if e.get("event") == "catalog-swapped" and e["logger"] == "llmgw.catalog"]
    rejected = [e for e in events if e.get("event") == "catalog-rejected"]
    assert len(swapped) == 1 and "obs-b" in swapped[0]["msg"]          # the diff summary names the new model
    assert rejected and all("'nope' is not one of" in e["msg"] for e in rejected)    # with the errors
    assert rejected[0]["level"] == "warning" and rejected[0]["ts"].endswith("Z")
    kinds = {e.get("event") for e in events}
    assert {"replica-placed", "replica-ready"} <= kinds


def test_control_api_counts_its_own_requests(fleet):
    before = scrape(fleet.control + "/metrics")
    for _ in range(3):
        assert requests.get(fleet.control + "/api/v1/status", timeout=10).status_code == 200
    after = scrape(fleet.control + "/metrics")
    assert delta(before, after, "llmgw_control_requests_total", route="/api/v1/status", code="200") == 3


def test_control_metrics_carry_build_info_and_no_created_series(fleet):
    import platform

    from llmgwctl import __version__
    text = requests.get(fleet.control + "/metrics", timeout=10).text
    page = scrape(fleet.control + "/metrics")
    assert page[key("llmgw_build_info", version=__version__, python=platform.python_version())] == 1
    # Counters and histograms alike: prometheus_client's _created series are off.
    assert "llmgw_control_requests_total" in text and "_created" not in text
