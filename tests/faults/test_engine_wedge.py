"""An engine that stops answering (SIGSTOP; a hung GPU looks the same) leaves the routing within seconds.

Its socket stays open -- the kernel accepts connections for a stopped
process -- so nothing is refused and nothing is retried: before, every
request picked for it hung until its client gave up, for as long as it was
wedged. Now the router's polls of its /metrics go unanswered, it is ejected
with the reason in status and /metrics, every request sent after that goes
to the other replica, and it comes back when it answers again.
"""
import os
import signal
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.fleet import wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def _row(fleet, rid):
    (row,) = [r for r in fleet.replicas("talk") if r["id"] == rid]
    return row


def _out_of_routing(fleet, rid):
    """Why status says `rid` is out of routing: the router's ejection, or its agent's not-ready; "" if not."""
    row = _row(fleet, rid)
    if row["router"] and "no answer to" in row["router"]:
        return row["router"]
    if row["state"] != "ready" and "health" in (row["reason"] or ""):
        return row["reason"]
    return ""


def _ejected_samples(router):
    text = requests.get(router + "/metrics", timeout=5).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("llmgw_router_endpoint_ejected", "llmgw_router_endpoint_ejections_total")
            and s.labels.get("reason") == "no_answer"]


def _ask(fleet):
    resp = fleet.chat("talk", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-llmgw-replica"]


@pytest.mark.parametrize("who", ["router", "agent"])
def test_a_wedged_engine_leaves_the_routing_says_why_and_comes_back(fleet, figure, who):
    """`router`: the router's ejection takes it out first. `agent`: with the router's ejection off
    (--eject-after 0), its agent's probes alone report it not ready and the controller withdraws it."""
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller(*(["--eject-after", "0"] if who == "agent" else []))
    fleet.start_agent("n1", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready")
    victim = fleet.ready("talk")[0]
    rid = victim["id"]
    wait_until(lambda: rid in {_ask(fleet) for _ in range(10)}, "the victim serving before it wedges")

    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wedged_at = time.monotonic()
        why = wait_until(lambda: _out_of_routing(fleet, rid), "status to show the wedged replica out of routing")
        out_after = time.monotonic() - wedged_at
        served = [_ask(fleet) for _ in range(20)]       # each bounded by its 10 s timeout; all must succeed
        assert rid not in served, served
        metrics = _ejected_samples(fleet.router)
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    resumed_at = time.monotonic()
    wait_until(lambda: rid in {_ask(fleet) for _ in range(10)}, "the replica back in routing after SIGCONT",
               every=0.5)
    back_after = time.monotonic() - resumed_at
    figure(f"out of routing {out_after:.1f} s after SIGSTOP ({why!r}); 20 requests after that all served "
           f"elsewhere; back {back_after:.1f} s after SIGCONT")
    if who == "agent":
        assert why.startswith("unhealthy: no answer to 3 health probes"), why
        assert metrics == []
    else:
        assert "no answer to" in why, why
        if "ejected by the router" in why:      # else its agent was quicker, on a loaded machine
            assert {s.name for s in metrics} == {"llmgw_router_endpoint_ejected",
                                                 "llmgw_router_endpoint_ejections_total"}
    assert wait_until(lambda: _row(fleet, rid)["state"] == "ready" and not _row(fleet, rid)["router"],
                      "status to show it ready and held against nothing")
