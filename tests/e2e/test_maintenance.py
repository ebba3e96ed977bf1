"""Cordon, drain and uncordon end to end: a real controller, two real agents on simulated L4s, fake engines.

In order, on one fleet: a cordoned node gets nothing from a scale-up and an
uncordoned one is placeable again (through `llmgwctl cordon|uncordon`); a
drain starts the replacement on the other node and has it ready before the
drained replica stops, while requests sent all through it get no error; the
holds outlive a controller restart; an unknown node is 404, and another
site's page, or a body that is not JSON, cannot cordon anything.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import requests

from .fleet import Fleet, wait_until

HEAD = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n"


def chat_model(replicas: int) -> str:
    # A prefill time, so requests are in flight when a replica leaves the router;
    # a start-up delay, so "ready before the old one stops" is a real wait.
    return (f"  - name: chat\n    replicas: {replicas}\n"
            "    profiles: [{name: gpu, engine: fake, pool: gpu, gpus: 1, "
            "args: [--ttft, '0.2', --startup-delay, '1']}]\n")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("maintenance"))
    (fleet.catalogs / "models.yaml").write_text(HEAD + chat_model(1))
    try:
        fleet.start_controller("--state-dir", str(fleet.root / "state-controller"))
        fleet.start_agent("n1", "2xL4-24GB", "gpu")
        fleet.start_agent("n2", "2xL4-24GB", "gpu")
        wait_until(lambda: len(fleet.ready("chat")) == 1 and len(fleet.status()["nodes"]) == 2, "chat ready")
        yield fleet
    finally:
        fleet.close_checked()


def llmgwctl(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgwctl", *args, "--controller", fleet.control],
                          capture_output=True, text=True, timeout=120, env=fleet.environ)


def scheduling(fleet: Fleet) -> dict[str, str]:
    return {n["name"]: n["scheduling"] for n in fleet.status()["nodes"]}


def where(fleet: Fleet, state: str = "ready") -> list[str]:
    return sorted(r["node"] for r in fleet.replicas("chat", state))


def scale(fleet: Fleet, replicas: int) -> None:
    (fleet.catalogs / "models.yaml").write_text(HEAD + chat_model(replicas))


def test_a_cordoned_node_gets_nothing_from_a_scale_up_and_is_placeable_again_once_uncordoned(fleet):
    (home,) = where(fleet)
    other = "n2" if home == "n1" else "n1"
    out = llmgwctl(fleet, "cordon", other)
    assert out.returncode == 0, out.stderr
    assert f"node/{other} cordoned" in out.stdout and "cordoned" in out.stdout
    assert scheduling(fleet)[other] == "cordoned"
    table = llmgwctl(fleet, "status")
    assert table.returncode == 0 and "SCHEDULING" in table.stdout, table.stderr
    assert any(line.split()[:3] == [other, "ready", "cordoned"] for line in table.stdout.splitlines()), table.stdout
    again = llmgwctl(fleet, "cordon", other)
    assert again.returncode == 0 and "already cordoned" in again.stdout
    # Spread would put the second replica on the empty node; cordoned, it goes beside the first.
    scale(fleet, 2)
    wait_until(lambda: where(fleet) == [home, home], "the scale-up placed on the schedulable node only")
    assert "node-cordoned" in [e["kind"] for e in fleet.status()["events"]]
    out = llmgwctl(fleet, "uncordon", other)
    assert out.returncode == 0 and f"node/{other} uncordoned" in out.stdout, out.stderr
    assert scheduling(fleet)[other] == "schedulable"
    scale(fleet, 3)
    wait_until(lambda: where(fleet) == sorted([home, home, other]), "the uncordoned node placeable again")
    scale(fleet, 1)
    wait_until(lambda: len(fleet.replicas("chat")) == 1 and len(where(fleet)) == 1, "back to one replica")


def test_drain_has_the_replacement_ready_first_and_requests_during_it_get_no_error(fleet):
    (old,) = fleet.ready("chat")
    node, other = old["node"], "n2" if old["node"] == "n1" else "n1"
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                resp = fleet.chat("chat", timeout=30)
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code}: {resp.text[:200]}")
                else:
                    answered[0] += 1
            except requests.RequestException as exc:
                errors.append(repr(exc))

    # What the fleet looked like while the drain ran: whenever the old replica
    # was out of the router, a replacement was serving on the other node.
    seen: list[tuple[str | None, list[str]]] = []

    def observe() -> None:
        while not stop.is_set():
            try:
                reps = fleet.replicas("chat")
            except requests.RequestException:
                continue
            mine = next((r["state"] for r in reps if r["id"] == old["id"]), None)
            seen.append((mine, sorted(r["node"] for r in reps if r["state"] == "ready" and r["id"] != old["id"])))
            time.sleep(0.05)

    workers = [threading.Thread(target=traffic) for _ in range(3)] + [threading.Thread(target=observe)]
    for t in workers:
        t.start()
    try:
        wait_until(lambda: answered[0] >= 3, "traffic flowing before the drain")
        out = llmgwctl(fleet, "drain", node, "--wait", "--timeout", "90")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"node/{node} drained" in out.stdout
        wait_until(lambda: where(fleet) == [other], "the replacement serving on the other node")
        time.sleep(1)       # traffic on the replacement alone for a moment
    finally:
        stop.set()
        for t in workers:
            t.join(timeout=60)
    assert errors == [], f"requests failed during the drain: {errors[:5]}"
    gone = [other_ready for state, other_ready in seen if state != "ready"]
    assert gone and all(other in ready for ready in gone), \
        f"the drained replica was out of the router while nothing served elsewhere: {seen}"
    assert scheduling(fleet)[node] == "drained"
    kinds = [e["kind"] for e in fleet.status()["events"]]
    assert "node-draining" in kinds and "node-drained" in kinds
    doc = requests.get(f"{fleet.control}/api/v1/nodes/{node}", timeout=10).json()
    assert doc == {"node": node, "scheduling": "drained", "reachable": True, "replicas": []}


def test_holds_outlive_a_controller_restart(fleet):
    before = scheduling(fleet)
    drained = next(n for n, s in before.items() if s == "drained")
    fleet.kill_controller()
    fleet.start_controller("--state-dir", str(fleet.root / "state-controller"), keep_ports=True)
    wait_until(lambda: scheduling(fleet) == before, "the drained node still drained after the restart")
    # A scale-up after the restart still keeps off it.
    scale(fleet, 2)
    wait_until(lambda: len(where(fleet)) == 2, "two replicas")
    assert drained not in where(fleet)
    out = llmgwctl(fleet, "uncordon", drained)
    assert out.returncode == 0, out.stderr
    assert scheduling(fleet)[drained] == "schedulable"
    state = json.loads((fleet.root / "state-controller" / "controller" / "node-holds.json").read_text())
    assert state["nodes"] == {}


def test_an_unknown_node_is_404_and_other_sites_cannot_cordon(fleet):
    resp = requests.post(f"{fleet.control}/api/v1/nodes/nowhere/cordon", json={}, timeout=10)
    assert resp.status_code == 404 and "no node 'nowhere'" in resp.json()["error"]["message"]
    assert requests.get(f"{fleet.control}/api/v1/nodes/nowhere", timeout=10).status_code == 404
    out = llmgwctl(fleet, "drain", "nowhere")
    assert out.returncode == 1 and "no node 'nowhere'" in out.stderr and "HTTP 404" in out.stderr
    # Another site's page in the operator's browser: refused before anything is read.
    evil = requests.post(f"{fleet.control}/api/v1/nodes/n1/cordon", json={}, timeout=10,
                         headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"})
    assert evil.status_code == 403
    # A form post (what a page may send without a preflight) is not JSON: 415.
    form = requests.post(f"{fleet.control}/api/v1/nodes/n1/cordon", data="x=1", timeout=10,
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    bad = requests.post(f"{fleet.control}/api/v1/nodes/n1/cordon", data="[1]", timeout=10,
                        headers={"Content-Type": "application/json"})
    assert bad.status_code == 400
    assert scheduling(fleet) == {"n1": "schedulable", "n2": "schedulable"}, "nothing was cordoned"
