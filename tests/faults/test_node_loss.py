"""Node loss without churn (issue 15): an agent killed with SIGKILL, its engines still up, then started again.

- A model left with no ready replica is replaced at the node timeout, where
  there is room -- not after --replace-after (here 10 minutes, so the old
  code never replaces it within the test).
- When the agent comes back, a healthy engine that is still wanted is adopted
  again, not killed and started anew; where the replacement made it surplus,
  the one that served through the outage is kept and the returning one is
  stopped.
- While a model has nowhere to go it fails fast with Retry-After (the node may
  come back), instead of holding requests for the cold timeout.
"""
import time

import requests

from tests.e2e.fleet import alive, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: solo
    profiles: [{name: l4, engine: fake, gpus: 1}]
  - name: filler
    profiles: [{name: l4, engine: fake, gpus: 1}]
"""
ONE_MODEL = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: solo
    profiles: [{name: l4, engine: fake, gpus: 1}]
"""


def events(fleet) -> list[str]:
    return [e["kind"] for e in fleet.status()["events"]]


def reachable(fleet, node: str) -> bool:
    return {n["name"]: n["state"] for n in fleet.status()["nodes"]}[node] == "ready"


def test_an_engine_with_nowhere_else_to_go_is_adopted_again_not_restarted(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    # Given up after 2 s either way (the old code's grace is 2 s here too).
    fleet.start_controller("--node-timeout", "2", "--replace-after", "2")
    fleet.start_agent("n1", "1xL4-24GB")
    fleet.start_agent("n2", "1xL4-24GB")
    wait_until(lambda: fleet.ready("solo") and fleet.ready("filler"), "both models ready")
    (solo,) = fleet.ready("solo")
    (filler,) = fleet.ready("filler")
    lost = solo["node"]
    fleet.kill_agent(lost)
    killed = time.monotonic()
    wait_until(lambda: "replica-replaced" in events(fleet), "the lost replica given up", timeout=30)
    # Nowhere to go (the other node's one GPU is taken): an answer at once, with Retry-After.
    resp = fleet.chat("solo", timeout=30)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_unplaceable", resp.text
    assert int(resp.headers["Retry-After"]) > 0
    fleet.restart_agent(lost)
    wait_until(lambda: fleet.ready("solo"), "solo ready again")
    back = time.monotonic() - killed
    (again,) = fleet.ready("solo")
    figure(f"agent killed and back in {back:.1f} s; solo kept {again['id'] == solo['id']}, "
           f"engine pid kept {again['pid'] == solo['pid']}, restarts {again['restarts']}")
    assert (again["id"], again["pid"], again["node"], again["restarts"]) == \
        (solo["id"], solo["pid"], solo["node"], 0), "the healthy engine was killed and started anew"
    assert alive(solo["pid"])
    assert [r["id"] for r in fleet.replicas("filler")] == [filler["id"]], "the other model was disturbed"
    assert events(fleet).count("replica-placed") == 2
    assert fleet.chat("solo").status_code == 200


def test_a_lone_replica_is_replaced_at_the_node_timeout_and_the_returning_one_is_the_surplus(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(ONE_MODEL)
    # The grace is 10 minutes: only the "nothing else serves it" rule replaces within the test.
    fleet.start_controller("--node-timeout", "2", "--replace-after", "600")
    fleet.start_agent("n1", "1xL4-24GB")
    fleet.start_agent("n2", "1xL4-24GB")
    wait_until(lambda: fleet.ready("solo"), "solo ready")
    (old,) = fleet.ready("solo")
    lost = old["node"]
    fleet.kill_agent(lost)
    killed = time.monotonic()
    wait_until(lambda: [r for r in fleet.ready("solo") if r["node"] != lost], "a replacement ready on the other node")
    replaced = time.monotonic() - killed
    (new,) = [r for r in fleet.ready("solo") if r["node"] != lost]
    assert fleet.chat("solo").status_code == 200
    fleet.restart_agent(lost)
    wait_until(lambda: reachable(fleet, lost), "the node back")
    wait_until(lambda: not alive(old["pid"]), "the surplus (returning) engine stopped")
    wait_until(lambda: [r["id"] for r in fleet.replicas("solo")] == [new["id"]], "only the replacement left")
    (kept,) = fleet.replicas("solo")
    figure(f"lone replica replaced {replaced:.1f} s after its agent was killed (node timeout 2 s, grace 600 s); "
           f"the returning engine was the one stopped")
    assert (kept["pid"], kept["state"], kept["restarts"]) == (new["pid"], "ready", 0)
    assert requests.get(fleet.control + "/api/v1/watch/endpoints", params={"timeout": 0},
                        timeout=5).json()["endpoints"][0]["replica_id"] == new["id"]
