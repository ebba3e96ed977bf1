"""Issue 13: whatever JSON a client POSTs to the control API, the answer is a 4xx or a success, never a 5xx.

A real `llmgwctl serve` (no local agent) on loopback gets hypothesis's JSON
documents -- non-finite numbers (`NaN`, `Infinity`: what `idle_timeout: .nan`
reached the API as), lone surrogates, documents of the right shape with
fields of every wrong type -- on the catalog apply route (dry run, so
nothing is written) and the agent report route.
"""
from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.e2e.fleet import wait_until

EXAMPLES = 150

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""

text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), text)
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(text, inner, max_size=4)), max_leaves=16)
# A catalog document that parses as YAML, with values of every kind where numbers go.
catalog_yaml = st.fixed_dictionaries({"replicas": value, "idle_timeout": value, "weight": value}).map(
    lambda d: CATALOG.replace("    profiles:", "".join(f"    {k}: {json.dumps(v)}\n" for k, v in d.items())
                              + "    profiles:"))
apply_body = st.one_of(value, st.fixed_dictionaries({"filename": st.one_of(st.just("x.yaml"), value),
                                                     "content": st.one_of(catalog_yaml, value)}))
report_body = st.one_of(value, st.fixed_dictionaries(
    {"node": st.one_of(st.just("n1"), value)},
    optional={"boot_id": value, "pools": value, "engines": value, "gpus": value, "replicas": value,
              "host": value}))


def _controller(fleet):
    if not getattr(fleet, "_started_for_properties", False):
        (fleet.catalogs / "models.yaml").write_text(CATALOG)
        fleet.start_controller()
        wait_until(lambda: requests.get(fleet.control + "/healthz", timeout=2).ok, "the control API")
        fleet._started_for_properties = True
    return fleet.control


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=apply_body)
@example(doc={"filename": "x.yaml", "content": CATALOG.replace("    profiles:", "    idle_timeout: .nan\n    profiles:")})
def test_catalog_apply_answers_arbitrary_json_without_a_5xx(fleet, doc):
    control = _controller(fleet)
    resp = requests.post(control + "/api/v1/catalog?dry_run=1", data=json.dumps(doc).encode(), timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (doc, resp.status_code, resp.text[:300])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=report_body)
def test_agent_report_answers_arbitrary_json_without_a_5xx(fleet, doc):
    control = _controller(fleet)
    resp = requests.post(control + "/api/v1/agents/n1/report", data=json.dumps(doc).encode(), timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (doc, resp.status_code, resp.text[:300])
