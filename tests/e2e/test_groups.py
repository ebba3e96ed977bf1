"""Issue 32 end to end: models larger than one node, as gangs of fake-engine members on four agents.

A controller and four agents on loopback, each a "node" with two simulated
GPUs. In order, on one fleet: a 2-node model placed on two nodes (ranks 0
and 1) and answered through its head; a 3-node model whose member's node is
killed (agent and engine) is stopped whole and placed again, with no request
answered by what is left of the old group; a model that needs more nodes than
the fleet has starts nothing and says why; and a controller SIGKILLed and
started again adopts the running groups with no restart.

The fake engine plays members the way vLLM's multi-node launch behaves: the
head answers /health only once every worker joined its rendezvous, and dies
when one leaves; a worker serves no HTTP and exits when its head goes.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest
import requests

from .fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: big
    profiles: [{name: gang, engine: fake, pool: gpu, gpus: 1, nodes: 2, parallel: pipeline}]
  - name: wide
    profiles: [{name: gang, engine: fake, pool: gpu, gpus: 1, nodes: 3, parallel: tensor}]
  - name: vast
    profiles: [{name: gang, engine: fake, pool: gpu, gpus: 1, nodes: 5}]
"""
NODES = ("n1", "n2", "n3", "n4")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("groups"))
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    try:
        fleet.start_controller()
        for node in NODES:
            fleet.start_agent(node, "2xL4-24GB", "gpu")
        yield fleet
    finally:
        fleet.close_checked()


SIZE = {"big": 2, "wide": 3}


def group_row(fleet, model):
    """The model's one group, when every member is there and ready; else None."""
    rows = [r for r in fleet.replicas(model) if r["state"] == "ready"
            and len(r.get("members", ())) == SIZE[model] and all(m["state"] == "ready" for m in r["members"])]
    return rows[0] if len(rows) == 1 else None


def test_a_two_node_model_runs_on_two_nodes_and_is_answered_through_its_head(fleet):
    row = wait_until(lambda: group_row(fleet, "big"), "big's group of two ready", timeout=60)
    members = row["members"]
    assert [m["rank"] for m in members] == [0, 1] and len({m["node"] for m in members}) == 2
    assert members[0]["id"] == row["id"] and members[1]["id"] == f"{row['id']}-r1"
    assert all(len(m["gpus"]) == 1 and m["pid"] for m in members)
    # One replica: one row, one endpoint, counted once.
    assert [r["id"] for r in fleet.replicas("big")] == [row["id"]]
    model = next(m for m in fleet.status()["models"] if m["name"] == "big")
    assert (model["ready"], model["replicas"]) == (1, 1)
    r = fleet.chat("big")
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == row["id"], "the head is the group's endpoint"
    print(f"big: head {row['id']} on {members[0]['node']}, worker on {members[1]['node']}")


def test_not_enough_nodes_starts_nothing_and_says_why(fleet):
    model = wait_until(lambda: (m := next(m for m in fleet.status()["models"] if m["name"] == "vast"))
                       ["unplaceable"] and m, "vast said to be unplaceable")
    assert "5 nodes" in model["unplaceable"] or "nodes" in model["unplaceable"], model["unplaceable"]
    assert fleet.replicas("vast") == []
    print(f"vast: {model['unplaceable']}")


def test_a_members_node_killed_stops_the_whole_group_and_it_is_placed_again(fleet):
    old = wait_until(lambda: group_row(fleet, "wide"), "wide's group of three ready", timeout=60)
    victim = old["members"][2]
    node = victim["node"]
    answered_by: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                r = fleet.chat("wide", timeout=30)
                if r.status_code == 200:
                    answered_by.append(r.headers.get("x-llmgw-replica", ""))
            except requests.RequestException:
                pass

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        wait_until(lambda: len(answered_by) >= 3, "wide answering before the kill", timeout=30)
        # The node dies: its agent and its engine together.
        fleet.kill_agent(node)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = len(answered_by)
        new = wait_until(lambda: (g := group_row(fleet, "wide")) and g["id"] != old["id"] and g,
                         "wide placed again as a new group of three", timeout=90)
        wait_until(lambda: answered_by[-1:] == [new["id"]], "wide answered by its new group", timeout=30)
    finally:
        stop.set()
        sender.join(timeout=40)
    assert node not in {m["node"] for m in new["members"]}
    assert len({m["node"] for m in new["members"]}) == 3
    # Nothing answered as a half group: after the kill, the old head answers
    # only until its rendezvous broke (the fake head dies with a member, as a
    # real engine does), then only the new group does.
    after = answered_by[killed_at:]
    assert set(after) <= {old["id"], new["id"]}
    assert after[after.index(new["id"]):].count(old["id"]) == 0
    events = [e for e in fleet.status()["events"] if e["kind"] == "group-failed"]
    assert any(old["id"] in e["message"] for e in events), events
    # The old group's other members are gone from their nodes too.
    assert not any(r["id"] == old["id"] for r in fleet.replicas("wide"))
    print(f"wide: {old['id']} lost {victim['id']} on {node}; {len(after)} answers after the kill, "
          f"{after.count(old['id'])} by the old head (before it died), the rest by {new['id']}")
    fleet.restart_agent(node)


def test_a_restarted_controller_adopts_the_running_groups_without_restarting_them(fleet):
    before = {m: wait_until(lambda m=m: group_row(fleet, m), f"{m} ready", timeout=90) for m in ("big", "wide")}
    fleet.kill_controller(signal.SIGKILL)
    fleet.start_controller(keep_ports=True)
    for model, row in before.items():
        after = wait_until(lambda m=model: (g := group_row(fleet, m)) and g["adopted"] and g,
                           f"{model} adopted again", timeout=60)
        assert after["id"] == row["id"] and after["restarts"] == 0
        assert [(m["id"], m["pid"], m["restarts"]) for m in after["members"]] == \
            [(m["id"], m["pid"], 0) for m in row["members"]]
    r = fleet.chat("big")
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == before["big"]["id"]
