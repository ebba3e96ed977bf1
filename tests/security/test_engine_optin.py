"""Catalog-defined engines run only where a node's operator allows them.

Before this, the README's first command took a catalog through the control
API whose `engines:` entry ran `sh -c ...` and a model using it, and the
local agent ran that command within seconds: write access to the catalog
(or a page that reached the control API) was a shell on every node. Now a
node runs the built-in engines and only the catalog engines its operator
allowed (`--allow-engine NAME=PROGRAM`); placement puts no replica of another
anywhere, status says which option would allow it, and an agent told to run
one anyway (a forged desired list) refuses it with the reason.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from llmgwctl.contracts import ReplicaSpec
from tests.agent.harness import AgentProcess, kill_engines_under, replicas_by_id
from tests.controlplane import ControlPlaneThread
from tests.e2e.fleet import Fleet, wait_until

BASE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: optin-base
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""
# What an attacker applies: an engine whose command is a shell running theirs.
EVIL = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: optin-evil
    profiles: [{name: cpu, engine: shelly, gpus: 0}]
engines:
  shelly:
    command: ["sh", "-c", "touch %s; exec sleep 300"]
"""
# Long enough for the apply to be swapped in, placed and (before) launched
# several times over: the local agent reports every second or so.
NEVER_WINDOW = 10.0


@pytest.fixture
def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    (fleet.catalogs / "base.yaml").write_text(BASE)
    try:
        yield fleet
    finally:
        fleet.close_waiting()


def apply_evil(fleet: Fleet, marker: Path) -> dict:
    resp = requests.post(fleet.control + "/api/v1/catalog", timeout=30,
                         json={"filename": "evil.yaml", "content": EVIL % marker})
    assert resp.status_code == 200, resp.text       # a catalog may define engines: apply takes it
    return resp.json()


def evil_model(fleet: Fleet) -> dict | None:
    return next((m for m in fleet.status()["models"] if m["name"] == "optin-evil"), None)


def test_a_catalog_engine_does_not_run_on_a_node_that_did_not_allow_it(fleet, tmp_path):
    marker = tmp_path / "MARKER"
    fleet.start_serve()
    wait_until(lambda: fleet.ready("optin-base"), "the built-in fake model ready")
    answer = apply_evil(fleet, marker)
    # The apply's answer already says the engine will run nowhere, and why.
    assert "no node allows catalog engine 'shelly'" in answer["replicas"]["unplaceable"]["optin-evil"]

    model = wait_until(lambda: (m := evil_model(fleet)) and m["unplaceable"] and m, "optin-evil unplaceable")
    assert "no node allows catalog engine 'shelly'" in model["unplaceable"]
    assert "llmgwctl agent --allow-engine shelly=sh" in model["unplaceable"]
    assert model["unplaceable_permanent"] is True

    end = time.monotonic() + NEVER_WINDOW
    while time.monotonic() < end:
        assert not marker.exists(), "the catalog's command ran on the node"
        assert requests.get(fleet.control + "/healthz", timeout=5).ok
        time.sleep(0.2)
    assert fleet.replicas("optin-evil") == []
    node = fleet.status()["nodes"][0]
    assert "shelly" not in node["engines"]
    # The built-in engine's model kept serving through it.
    assert fleet.chat("optin-base").status_code == 200


def test_the_same_catalog_engine_runs_where_its_program_is_allowed(fleet, tmp_path):
    marker = tmp_path / "MARKER"
    fleet.start_serve("--allow-engine", "shelly=sh")
    wait_until(lambda: fleet.status()["nodes"] and "shelly" in fleet.status()["nodes"][0]["engines"],
               "the local agent to report shelly as allowed")
    apply_evil(fleet, marker)
    wait_until(marker.exists, "the allowed engine's command to run")


def test_an_allowed_name_cannot_be_pointed_at_another_program(fleet, tmp_path):
    # The operator allowed `shelly` as `true`; the catalog says it runs `sh`.
    marker = tmp_path / "MARKER"
    fleet.start_serve("--allow-engine", "shelly=true")
    apply_evil(fleet, marker)
    replica = wait_until(lambda: (r := fleet.replicas("optin-evil", "failed")) and r[0], "the replica refused")
    assert "refused" in replica["reason"] and "only as true" in replica["reason"]
    assert not marker.exists()


def test_an_agent_refuses_a_forged_desired_replica_of_an_engine_it_does_not_allow(tmp_path):
    """A controller (or whoever forges its answers) asks for a catalog engine this node never allowed."""
    marker = tmp_path / "FORGED"
    catalogs = tmp_path / "catalogs"
    catalogs.mkdir()
    state_dir = tmp_path / "state"
    controller = ControlPlaneThread(catalogs, hold=3.0)
    agent = AgentProcess(["--controller", controller.url, "--node", "n1", "--gpus", "none",
                          "--state-dir", str(state_dir), "--heartbeat", "0.5"], tmp_path / "agent.log")
    try:
        wait_until(controller.latest, "a first report")
        forged = ReplicaSpec(id="forged-1", model="m", profile="cpu", engine="shelly", source="m", gpus=0,
                             command=("sh", "-c", f"touch {marker}; exec sleep 300"))
        # A built-in name with a command attached runs the built-in driver, never the command.
        disguised = ReplicaSpec(id="forged-2", model="m", profile="cpu", engine="fake", source="m", gpus=0,
                                command=("sh", "-c", f"touch {marker}; exec sleep 300"))
        controller.set_desired("n1", [forged, disguised])
        report = wait_until(lambda: (r := controller.latest()) and replicas_by_id(r).get("forged-1", {}).get("state")
                            == "failed" and replicas_by_id(r).get("forged-2", {}).get("state") == "ready" and r,
                            "the forged replica refused and the built-in one ready")
        refused = replicas_by_id(report)["forged-1"]
        assert refused["pid"] is None
        assert "refused" in refused["reason"] and "not allowed on this node" in refused["reason"]
        assert "--allow-engine shelly=sh" in refused["reason"]
        assert "shelly" not in report["engines"]
        assert not marker.exists()
    finally:
        agent.stop()
        controller.close()
        kill_engines_under(state_dir)
