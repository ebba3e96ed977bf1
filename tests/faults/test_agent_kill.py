"""Scenario 3: the node agent killed with SIGKILL and started again.

Engines run in their own process groups, so they keep serving while their
agent is gone; the restarted agent adopts them from its state directory
instead of starting new ones, and the controller goes on seeing the very same
replicas (ids, processes, no restart counted).
"""
import time

from tests.e2e.fleet import wait_until

from .load import SteadyLoad, summary

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0}]
  - name: gpu-talk
    profiles: [{name: l4, engine: fake, gpus: 1}]
"""


def snapshot(fleet) -> dict:
    return {r["id"]: (r["node"], r["pid"], r["url"], tuple(r["gpus"]), r["state"], r["restarts"]) for r in fleet.replicas()}


def node_reports(fleet) -> int:
    return {n["name"]: n["reports"] for n in fleet.status()["nodes"]}["n1"]


def test_agent_sigkill_and_restart_keeps_engines_serving_and_the_same_replicas(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    # A node is unreachable after 10 s of silence here (15 s by default): the
    # agent's restart must be shorter than that, as an operator's would be.
    fleet.start_controller("--node-timeout", "10", "--replace-after", "20")
    fleet.start_agent("n1", "2xL4-24GB")
    wait_until(lambda: len(fleet.ready("talk")) == 2 and fleet.ready("gpu-talk"), "every replica ready")
    before = snapshot(fleet)

    with SteadyLoad(fleet.router, ["talk", "gpu-talk"], workers=3) as load:
        load.wait_for(10)
        started = time.monotonic()
        fleet.kill_agent("n1")
        load.wait_for(20)   # engines answer with nobody watching them
        fleet.restart_agent("n1")
        # The new agent found its engines in its state directory...
        wait_until(lambda: fleet.log("agent-n1").count(": adopted pid ") == len(before), "the agent adopting its engines")
        # ...and the controller has heard it twice since (its reports, not the old agent's last ones).
        reports = node_reports(fleet)
        wait_until(lambda: node_reports(fleet) >= reports + 2, "two reports of the restarted agent")
        wait_until(lambda: snapshot(fleet) == before, "the controller seeing the same replicas")
        recovered = time.monotonic() - started
        load.wait_for(10)
    after = load.since(started)
    kinds = [e["kind"] for e in fleet.status()["events"]]
    figure(f"agent down and back in {recovered:.1f} s under load; {summary(after)}; "
           f"engine restarts {sum(r['restarts'] for r in fleet.replicas())}; replicas placed anew {kinds.count('replica-placed') - 3}")
    assert load.failures() == [], load.failures()[:5]
    assert snapshot(fleet) == before
    assert all(r["restarts"] == 0 for r in fleet.replicas())
    assert kinds.count("replica-placed") == 3 and "replica-gone" not in kinds and "node-lost" not in kinds
