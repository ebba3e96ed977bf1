"""Scenario 5: an agent that stops answering (SIGSTOP: the process is there, silent).

Its engines are still up, but nothing watches them any more, so the
controller must stop trusting them: after the node timeout they leave the
router, and replacements start on another node (at once for a model nothing
else serves, after the replace grace for one still served elsewhere). When
the agent is continued (SIGCONT) its engines are surplus to the replacements
that served meanwhile, and it is told to stop them: no duplicate survives, in
the status or as a process.
"""
import signal
import time

import requests

from tests.e2e.fleet import alive, wait_until

from .load import SteadyLoad, summary

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: solo
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
WANTED = {"solo": 1, "talk": 2}
NODE_TIMEOUT, REPLACE_AFTER = 2, 4


def routed(fleet) -> set[str]:
    return {e["replica_id"] for e in requests.get(fleet.control + "/api/v1/watch/endpoints", params={"timeout": 0},
                                                  timeout=5).json()["endpoints"]}


def test_silent_agent_loses_its_replicas_to_another_node_and_leaves_no_duplicate(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    fleet.start_controller("--node-timeout", str(NODE_TIMEOUT), "--replace-after", str(REPLACE_AFTER))
    fleet.start_agent("n1", "none")
    fleet.start_agent("n2", "none")
    wait_until(lambda: len(fleet.ready("talk")) == 2 and fleet.ready("solo"), "every replica ready")
    (solo,) = fleet.ready("solo")
    lost, other = solo["node"], {"n1": "n2", "n2": "n1"}[solo["node"]]
    victims = {r["id"]: r["pid"] for r in fleet.replicas() if r["node"] == lost}

    with SteadyLoad(fleet.router, ["solo", "talk"], workers=3) as load:
        load.wait_for(10)
        fleet.agents[lost].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: not routed(fleet) & victims.keys(), "the silent node's replicas out of the router",
                       timeout=NODE_TIMEOUT + 30, every=0.05)
            left_router = time.monotonic() - stopped
            wait_until(lambda: all(len([r for r in fleet.ready(m) if r["node"] != lost]) == n for m, n in WANTED.items()),
                       "replacements ready on the other node", timeout=REPLACE_AFTER + 60)
            replaced = time.monotonic() - stopped
            load.wait_for(10)
        finally:
            fleet.agents[lost].send_signal(signal.SIGCONT)
        wait_until(lambda: {n["name"]: n["state"] for n in fleet.status()["nodes"]}[lost] == "ready", "the node back")
        wait_until(lambda: not any(alive(pid) for pid in victims.values()), "the given-up engines stopped")
        # An engine gone is in the status once its agent has reported the exit and a pass has
        # merged it: a read right after the process died could still list it as stopping (CI).
        wait_until(lambda: not victims.keys() & {r["id"] for r in fleet.replicas()},
                   "the given-up replicas out of the status")
        load.wait_for(10)
    replicas = fleet.replicas()
    counts = {m: len([r for r in replicas if r["model"] == m]) for m in WANTED}
    figure(f"{len(victims)} replicas left the router {left_router:.1f} s after the agent went silent "
           f"(node timeout {NODE_TIMEOUT} s), replaced on {other} after {replaced:.1f} s (grace {REPLACE_AFTER} s); "
           f"after SIGCONT {sum(counts.values())} replicas for {sum(WANTED.values())} wanted; {summary(load.outcomes)}")
    assert counts == WANTED, replicas
    assert all(r["node"] == other and r["state"] == "ready" and alive(r["pid"]) for r in replicas if r["model"] == "solo")
    assert not victims.keys() & {r["id"] for r in replicas}
    assert load.failures() == [], load.failures()[:5]
